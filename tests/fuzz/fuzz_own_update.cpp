// libFuzzer target for a gossip replica peer's own updates as its store
// keeps them (node/own_update_bytes.h): the pending update's bytes come from
// a file. How to build and run it: tests/fuzz/README.md.
//
// The input is the bytes, read against a fixed model of two tensors ({64}
// and {7, 9}) as the update of round 4, in both formats.
//
// For every input, besides "no crash, no sanitizer report, no unbounded
// allocation":
//   - a refusal carries a message;
//   - what format 2 accepts is written back to the very same bytes (the
//     format is canonical), its tensors are one per model tensor, and every
//     segment decodes into its range;
//   - what format 1 accepts is written back to the very same bytes, with
//     indices ascending inside the model and finite values;
//   - own_update_format names the format that accepted it.
// A violation prints what was wrong and traps.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "node/own_update_bytes.h"

namespace {

using fedmesh::Result;
using fedmesh::Status;
namespace node = fedmesh::node;
namespace protocol = fedmesh::protocol;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_own_update: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  const std::vector<protocol::TensorShape> manifest = {protocol::TensorShape{"a", {64}},
                                                       protocol::TensorShape{"b", {7, 9}}};
  constexpr uint64_t kRound = 4, kElements = 64 + 63;
  const uint32_t format = node::own_update_format(bytes);

  Result<std::vector<protocol::EncodedTensor>> segments = node::decode_own_segments(bytes, kRound, manifest);
  if (!segments.is_ok()) {
    if (segments.status().message().empty()) violated("a format-2 refusal without a message");
  } else {
    if (format != 2) violated("format 2 accepted bytes own_update_format calls " + std::to_string(format));
    if (segments->size() != manifest.size()) violated("format 2 accepted the wrong number of tensors");
    const std::vector<uint8_t> again = node::encode_own_segments(kRound, *segments);
    if (again.size() != size || !std::equal(again.begin(), again.end(), data)) {
      violated("format 2 accepted bytes it does not write back the same");
    }
    std::vector<float> range;
    for (const protocol::EncodedTensor& tensor : *segments) {
      for (const protocol::EncodedSegment& segment : tensor.segments) {
        range.assign(segment.count, 0.0f);
        if (Status s = protocol::decode_segment_range(segment.view(), manifest, range); !s.is_ok()) {
          violated("an accepted segment does not decode: " + s.message());
        }
      }
    }
  }

  std::vector<uint64_t> index;
  std::vector<float> value;
  const Status first = node::decode_own_update(bytes, kRound, kElements, index, value);
  if (!first.is_ok()) {
    if (first.message().empty()) violated("a format-1 refusal without a message");
  } else {
    if (format != 1) violated("format 1 accepted bytes own_update_format calls " + std::to_string(format));
    for (size_t k = 0; k < index.size(); ++k) {
      if (index[k] >= kElements || (k > 0 && index[k] <= index[k - 1]) || !std::isfinite(value[k])) {
        violated("format 1 accepted a bad entry at " + std::to_string(k));
      }
    }
    const std::vector<uint8_t> again = node::encode_own_update(kRound, index, value);
    if (again.size() != size || !std::equal(again.begin(), again.end(), data)) {
      violated("format 1 accepted bytes it does not write back the same");
    }
  }
  return 0;
}
