#include "store/payload_source.h"

#include <algorithm>

namespace fedmesh::store {

PiecesSource::PiecesSource(std::span<const std::span<const uint8_t>> pieces) : pieces_(pieces) {
  for (const std::span<const uint8_t> piece : pieces) size_ += piece.size();
}

Status PiecesSource::next(size_t bytes, std::vector<std::span<const uint8_t>>& parts) {
  parts.clear();
  while (bytes > 0 && piece_ < pieces_.size()) {
    const std::span<const uint8_t> from = pieces_[piece_].subspan(within_);
    const size_t take = std::min(bytes, from.size());
    if (take > 0) parts.push_back(from.first(take));
    bytes -= take;
    within_ += take;
    if (within_ == pieces_[piece_].size()) ++piece_, within_ = 0;
  }
  return Status::ok();
}

SpillSource::SpillSource(std::span<const uint8_t> prefix, const SpillFile& file)
    : prefix_(prefix.begin(), prefix.end()), file_(file) {}

Status SpillSource::next(size_t bytes, std::vector<std::span<const uint8_t>>& parts) {
  parts.clear();
  bytes = static_cast<size_t>(std::min<uint64_t>(bytes, size() - at_));
  if (at_ < prefix_.size()) {
    const size_t take = std::min<size_t>(bytes, prefix_.size() - at_);
    parts.push_back(std::span<const uint8_t>(prefix_).subspan(at_, take));
    at_ += take;
    bytes -= take;
  }
  if (bytes == 0) return Status::ok();
  if (buffer_.size() < bytes) buffer_.resize(bytes);
  const std::span<uint8_t> out = std::span<uint8_t>(buffer_).first(bytes);
  FEDMESH_RETURN_IF_ERROR(file_.read(at_ - prefix_.size(), out));
  parts.push_back(out);
  at_ += bytes;
  return Status::ok();
}

}  // namespace fedmesh::store
