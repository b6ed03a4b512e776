#include "store/checksum.h"

#include <cstring>

namespace fedmesh::store {
namespace {
constexpr uint8_t kBlake2bpChecksum = 1;
}  // namespace

std::vector<uint8_t> checksum_blob(const StoredChecksum& checksum) {
  std::vector<uint8_t> blob;
  if (checksum.kind == crypto::ChunkHash::kBlake2bp) blob.push_back(kBlake2bpChecksum);
  blob.insert(blob.end(), checksum.hash.begin(), checksum.hash.end());
  return blob;
}

std::optional<StoredChecksum> parse_checksum_blob(std::span<const uint8_t> blob) {
  StoredChecksum checksum;
  if (blob.size() == checksum.hash.size() + 1 && blob[0] == kBlake2bpChecksum) {
    checksum.kind = crypto::ChunkHash::kBlake2bp;
    blob = blob.subspan(1);
  } else if (blob.size() != checksum.hash.size()) {
    return std::nullopt;
  }
  std::memcpy(checksum.hash.data(), blob.data(), checksum.hash.size());
  return checksum;
}

}  // namespace fedmesh::store
