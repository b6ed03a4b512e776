#include "node/own_update_bytes.h"

#include <cmath>
#include <cstring>
#include <string>

namespace fedmesh::node {

namespace {

constexpr char kOwnMagic[4] = {'F', 'M', 'R', 'O'};

// Appends and reads the little-endian fields of an own update.
struct OwnWriter {
  std::vector<uint8_t>& out;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <class T>
  void put(T value) {
    bytes(&value, sizeof value);
  }
};

struct OwnReader {
  std::span<const uint8_t> in;
  size_t at = 0;
  bool failed = false;
  template <class T>
  T get() {
    T value{};
    if (in.size() - at < sizeof value) {
      failed = true;
      return value;
    }
    std::memcpy(&value, in.data() + at, sizeof value);
    at += sizeof value;
    return value;
  }
  std::vector<uint8_t> bytes(uint64_t n) {
    if (in.size() - at < n) {
      failed = true;
      return {};
    }
    std::vector<uint8_t> out(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    return out;
  }
};

}  // namespace

std::vector<uint8_t> encode_own_update(uint64_t round, std::span<const uint64_t> index, std::span<const float> value) {
  std::vector<uint8_t> out;
  out.reserve(24 + index.size() * 12);
  OwnWriter w{out};
  w.bytes(kOwnMagic, 4);
  w.put<uint32_t>(1);
  w.put<uint64_t>(round);
  w.put<uint64_t>(index.size());
  w.bytes(index.data(), index.size() * 8);
  w.bytes(value.data(), value.size() * 4);
  return out;
}

Status decode_own_update(std::span<const uint8_t> bytes, uint64_t round, uint64_t elements, std::vector<uint64_t>& index,
                         std::vector<float>& value) {
  if (bytes.size() < 24 || std::memcmp(bytes.data(), kOwnMagic, 4) != 0) return corrupt("not an own update (no FMRO header)");
  uint32_t version = 0;
  uint64_t stored_round = 0, count = 0;
  std::memcpy(&version, bytes.data() + 4, 4);
  std::memcpy(&stored_round, bytes.data() + 8, 8);
  std::memcpy(&count, bytes.data() + 16, 8);
  if (version != 1) return corrupt("own update format version " + std::to_string(version) + ", this build reads 1");
  if (stored_round != round) {
    return corrupt("the own update of round " + std::to_string(round) + " holds round " + std::to_string(stored_round));
  }
  if (count > elements || bytes.size() != 24 + count * 12) {
    return corrupt("the own update of round " + std::to_string(round) + " is " + std::to_string(bytes.size()) +
                   " bytes for " + std::to_string(count) + " coordinates of a model of " + std::to_string(elements));
  }
  index.resize(count);
  value.resize(count);
  if (count > 0) {  // (an empty vector's data() may be null, which memcpy must not get)
    std::memcpy(index.data(), bytes.data() + 24, count * 8);
    std::memcpy(value.data(), bytes.data() + 24 + count * 8, count * 4);
  }
  for (uint64_t k = 0; k < count; ++k) {
    if (index[k] >= elements || (k > 0 && index[k] <= index[k - 1]) || !std::isfinite(value[k])) {
      return corrupt("the own update of round " + std::to_string(round) + " holds a bad entry at " + std::to_string(k));
    }
  }
  return Status::ok();
}

std::vector<uint8_t> encode_own_segments(uint64_t round, std::span<const protocol::EncodedTensor> tensors) {
  std::vector<uint8_t> out;
  size_t total = 32;
  for (const protocol::EncodedTensor& t : tensors) {
    total += 16;
    for (const protocol::EncodedSegment& segment : t.segments) total += 64 + segment.payload_bytes();
  }
  out.reserve(total);
  OwnWriter w{out};
  w.bytes(kOwnMagic, 4);
  w.put<uint32_t>(2);
  w.put<uint64_t>(round);
  w.put<uint64_t>(tensors.size());
  for (const protocol::EncodedTensor& t : tensors) {
    w.put<uint32_t>(static_cast<uint32_t>(t.descriptor.encoding));
    w.put<uint32_t>(t.descriptor.block_size);
    w.put<uint64_t>(t.segments.size());
    for (const protocol::EncodedSegment& segment : t.segments) {
      w.put<uint32_t>(segment.tensor);
      w.put<uint32_t>(static_cast<uint32_t>(segment.encoding));
      w.put<uint64_t>(segment.offset);
      w.put<uint64_t>(segment.count);
      w.put<uint64_t>(segment.nnz);
      w.put<uint32_t>(segment.block_size);
      w.put<uint32_t>(0);
      w.put<uint64_t>(segment.indices.size());
      w.put<uint64_t>(segment.values.size());
      w.put<uint64_t>(segment.scales.size());
      w.bytes(segment.indices.data(), segment.indices.size());
      w.bytes(segment.values.data(), segment.values.size());
      w.bytes(segment.scales.data(), segment.scales.size());
    }
  }
  return out;
}

uint32_t own_update_format(std::span<const uint8_t> bytes) {
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kOwnMagic, 4) != 0) return 0;
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 4, 4);
  return version;
}

Result<std::vector<protocol::EncodedTensor>> decode_own_segments(std::span<const uint8_t> bytes, uint64_t round,
                                                                 std::span<const protocol::TensorShape> manifest) {
  const std::string what = "the own update of round " + std::to_string(round);
  if (own_update_format(bytes) != 2) return corrupt("not an own update of format 2 (no FMRO header, or another version)");
  OwnReader r{bytes, 8};
  const auto stored_round = r.get<uint64_t>();
  const auto tensors = r.get<uint64_t>();
  if (r.failed) return corrupt(what + " is cut short");
  if (stored_round != round) return corrupt(what + " holds round " + std::to_string(stored_round));
  if (tensors != manifest.size()) {
    return corrupt(what + " has " + std::to_string(tensors) + " tensors for a model of " + std::to_string(manifest.size()));
  }
  std::vector<protocol::EncodedTensor> out;
  std::vector<float> scratch;
  for (size_t t = 0; t < manifest.size(); ++t) {
    protocol::EncodedTensor tensor;
    const auto encoding = r.get<uint32_t>();
    const auto block_size = r.get<uint32_t>();
    const auto segments = r.get<uint64_t>();
    if (r.failed) return corrupt(what + " is cut short");
    if (encoding >= static_cast<uint32_t>(protocol::kEncodingCount)) {
      return corrupt(what + ": tensor " + std::to_string(t) + " has no encoding " + std::to_string(encoding));
    }
    // Each segment is at least its 64-byte header: a count beyond what the
    // bytes left can hold is refused before anything is allocated for it.
    if (segments > (bytes.size() - r.at) / 64) return corrupt(what + ": tensor " + std::to_string(t) + " is cut short");
    tensor.descriptor = {manifest[t].name, manifest[t].dims, static_cast<protocol::Encoding>(encoding), block_size};
    for (uint64_t k = 0; k < segments; ++k) {
      protocol::EncodedSegment segment;
      segment.tensor = r.get<uint32_t>();
      const auto segment_encoding = r.get<uint32_t>();
      segment.offset = r.get<uint64_t>();
      segment.count = r.get<uint64_t>();
      segment.nnz = r.get<uint64_t>();
      segment.block_size = r.get<uint32_t>();
      const auto reserved = r.get<uint32_t>();
      const auto indices = r.get<uint64_t>(), values = r.get<uint64_t>(), scales = r.get<uint64_t>();
      if (r.failed || indices > bytes.size() || values > bytes.size() || scales > bytes.size()) {
        return corrupt(what + " is cut short");
      }
      if (reserved != 0) return corrupt(what + ": a segment's reserved field is " + std::to_string(reserved) + ", not 0");
      segment.indices = r.bytes(indices);
      segment.values = r.bytes(values);
      segment.scales = r.bytes(scales);
      if (r.failed) return corrupt(what + " is cut short");
      if (segment.tensor != t || segment_encoding != encoding) {
        return corrupt(what + ": a segment of tensor " + std::to_string(t) + " names tensor " +
                       std::to_string(segment.tensor) + " or another encoding");
      }
      segment.encoding = static_cast<protocol::Encoding>(segment_encoding);
      // Checked as a receiver checks it, and decoded once (indices and
      // values are checked as they are read), in a scratch of its range.
      const protocol::SegmentView view = segment.view();
      if (Status s = protocol::check_segment(view, manifest); !s.is_ok()) return corrupt(what + ": " + s.message());
      scratch.resize(segment.count);
      if (Status s = protocol::decode_segment_range(view, manifest, scratch); !s.is_ok()) {
        return corrupt(what + ": " + s.message());
      }
      tensor.segments.push_back(std::move(segment));
    }
    out.push_back(std::move(tensor));
  }
  if (r.at != bytes.size()) return corrupt(what + " has " + std::to_string(bytes.size() - r.at) + " bytes past its end");
  return out;
}

}  // namespace fedmesh::node
