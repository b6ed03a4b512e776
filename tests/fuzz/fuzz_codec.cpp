// libFuzzer target for the update codec's receive side (protocol/codec.h):
// check_segment, decode_segment(_range) and accumulate_segment on a segment built
// from the input. How to build and run it: tests/fuzz/README.md.
//
// Input layout (every byte string is a valid input; missing bytes read as 0):
//   byte 0     flags: bits 0-1 the shape of tensor 0 ({64}, {7, 9}, {} (a
//              scalar), {2500}); bits 2-4 the accumulate weight (1, 0.5, -2,
//              0, 1e30, FLT_MAX, NaN, Inf); bit 5 a target one element too
//              short; bit 6 a target of huge values (near FLT_MAX / 2)
//   byte 1     the encoding, as the raw byte (12 and up are unknown encodings)
//   then       unsigned LEB128 varints (at most 10 bytes, extra high bits
//              dropped): tensor, offset, count, nnz, block_size,
//              indices length, values length
//   rest       indices = the next `indices length` bytes, values = the next
//              `values length` bytes (each clamped to what is left),
//              scales = everything after them
// The manifest is tensor 0 (chosen above), tensor 1 {5, 0} (no elements) and
// tensor 2 {-3, 4} (invalid: a negative dimension).
//
// For every input, besides "no crash, no sanitizer report":
//   - a segment check_segment rejects is rejected by decode and accumulate
//     too, with the same code; a check_segment rejection is kCorrupt unless
//     the manifest tensor itself is invalid (kInvalidArgument);
//   - on any error the target is bit-for-bit unchanged and the message is
//     not empty;
//   - on success every target element is finite, and elements outside
//     [offset, offset + count) are unchanged; a successful dense-f32 decode
//     stores the value bytes exactly;
//   - decode_segment_range (into the segment's range alone) accepts what
//     decode_segment accepts (given a whole target) and decodes the same
//     values, bit for bit.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "protocol/codec.h"

namespace {

using fedmesh::Status;
using fedmesh::StatusCode;
using fedmesh::protocol::Encoding;
using fedmesh::protocol::SegmentView;
using fedmesh::protocol::TensorShape;

constexpr uint8_t kShortTargetFlag = 0x20, kHugeTargetFlag = 0x40;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_codec: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

struct Reader {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;

  uint8_t byte() { return pos < size ? data[pos++] : 0; }
  uint64_t varint() {
    uint64_t value = 0;
    for (int i = 0; i < 10 && pos < size; ++i) {
      const uint8_t b = data[pos++];
      value |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) break;
    }
    return value;
  }
  std::span<const uint8_t> take(uint64_t length) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length, size - pos));
    std::span<const uint8_t> part(data + pos, n);
    pos += n;
    return part;
  }
  std::span<const uint8_t> rest() { return {data + pos, size - pos}; }
};

const std::vector<int64_t> kShapes[] = {{64}, {7, 9}, {}, {2500}};
const float kWeights[] = {1.0f,
                          0.5f,
                          -2.0f,
                          0.0f,
                          1e30f,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()};

std::vector<float> make_target(size_t n, bool huge) {
  std::vector<float> target(n);
  for (size_t i = 0; i < n; ++i) {
    target[i] = huge ? std::numeric_limits<float>::max() / 2 * ((i & 1) ? -1.0f : 1.0f)
                     : static_cast<float>(static_cast<int>(i % 7) - 3) + 0.25f;
  }
  return target;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void check_result(const char* what, const Status& status, const Status& checked, const SegmentView& segment,
                  const std::vector<float>& before, const std::vector<float>& after) {
  if (!checked.is_ok() && status.code() != checked.code()) {
    violated(std::string(what) + " answered '" + status.to_string() + "' where check_segment answered '" +
             checked.to_string() + "'");
  }
  if (!status.is_ok()) {
    if (status.message().empty()) violated(std::string(what) + " failed with an empty message");
    if (!same_bits(before, after)) violated(std::string(what) + " changed the target and failed: " + status.to_string());
    return;
  }
  for (size_t i = 0; i < after.size(); ++i) {
    if (!std::isfinite(after[i])) violated(std::string(what) + " succeeded and stored a non-finite value at " + std::to_string(i));
    const bool inside = i >= segment.offset && i - segment.offset < segment.count;
    if (!inside && std::memcmp(&before[i], &after[i], sizeof(float)) != 0) {
      violated(std::string(what) + " succeeded and changed element " + std::to_string(i) + " outside its range");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const uint8_t flags = in.byte();
  const std::vector<TensorShape> manifest = {TensorShape{"fuzzed", kShapes[flags & 3]}, TensorShape{"empty", {5, 0}},
                                             TensorShape{"negative", {-3, 4}}};
  SegmentView segment;
  segment.encoding = static_cast<Encoding>(in.byte());
  segment.tensor = static_cast<uint32_t>(in.varint());
  segment.offset = in.varint();
  segment.count = in.varint();
  segment.nnz = in.varint();
  segment.block_size = static_cast<uint32_t>(in.varint());
  const uint64_t indices_length = in.varint();
  const uint64_t values_length = in.varint();
  segment.indices = in.take(indices_length);
  segment.values = in.take(values_length);
  segment.scales = in.rest();
  const float weight = kWeights[(flags >> 2) & 7];

  const Status checked = fedmesh::protocol::check_segment(segment, manifest);
  const bool manifest_valid = segment.tensor < manifest.size() &&
                              manifest[segment.tensor].element_count() <= fedmesh::protocol::kMaxTensorElements;
  if (!checked.is_ok()) {
    const StatusCode expected =
        segment.tensor < manifest.size() && !manifest_valid ? StatusCode::kInvalidArgument : StatusCode::kCorrupt;
    if (checked.code() != expected) violated("check_segment answered " + checked.to_string());
  }

  size_t elements = manifest_valid ? static_cast<size_t>(manifest[segment.tensor].element_count()) : 16;
  if ((flags & kShortTargetFlag) != 0 && elements > 0) --elements;
  const std::vector<float> before = make_target(elements, (flags & kHugeTargetFlag) != 0);

  std::vector<float> decoded = before;
  const Status decode_status = fedmesh::protocol::decode_segment(segment, manifest, decoded);
  check_result("decode_segment", decode_status, checked, segment, before, decoded);
  if (decode_status.is_ok() && segment.encoding == Encoding::kDenseF32 &&
      std::memcmp(decoded.data() + segment.offset, segment.values.data(), segment.values.size()) != 0) {
    violated("dense-f32 decode did not store the value bytes exactly");
  }

  // Into the segment's range alone (a receiver staging on disk): the same
  // answer, and on success the same values as the whole-tensor decode.
  if (checked.is_ok() && segment.count <= (uint64_t{1} << 24)) {
    std::vector<float> range(static_cast<size_t>(segment.count), 0.0f);
    const Status range_status = fedmesh::protocol::decode_segment_range(segment, manifest, range);
    if (decode_status.is_ok() != range_status.is_ok() && (flags & kShortTargetFlag) == 0) {
      violated("decode_segment_range answered '" + range_status.to_string() + "' where decode_segment answered '" +
               decode_status.to_string() + "'");
    }
    if (decode_status.is_ok() && range_status.is_ok() &&
        std::memcmp(range.data(), decoded.data() + segment.offset, range.size() * sizeof(float)) != 0) {
      violated("decode_segment_range decoded other values than decode_segment");
    }
  }

  // FUZZ_CODEC_VERBOSE=1 prints what each input came to (to check seeds).
  static const bool verbose = std::getenv("FUZZ_CODEC_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "fuzz_codec: decode: %s\n", decode_status.to_string().c_str());

  std::vector<float> accumulated = before;
  const Status accumulate_status = fedmesh::protocol::accumulate_segment(segment, manifest, weight, accumulated);
  check_result("accumulate_segment", accumulate_status, checked, segment, before, accumulated);
  if (!std::isfinite(weight) && accumulate_status.code() != StatusCode::kInvalidArgument && checked.is_ok()) {
    violated("accumulate with a non-finite weight answered " + accumulate_status.to_string());
  }
  // Both validate the same bytes: a segment decode rejects, accumulate
  // rejects too; one decode accepts can only fail to accumulate through the
  // weight or the target (an overflowing sum), which |weight| <= 1 and a
  // small target rule out.
  if (!decode_status.is_ok() && accumulate_status.is_ok()) {
    violated("accumulate accepted what decode rejected: " + decode_status.to_string());
  }
  if (decode_status.is_ok() && !accumulate_status.is_ok() && std::fabs(weight) <= 1.0f &&
      (flags & kHugeTargetFlag) == 0) {
    violated("decode accepted what accumulate rejected: " + accumulate_status.to_string());
  }
  return 0;
}
