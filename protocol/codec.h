// The update codec: how one tensor's values travel inside UpdateChunk and
// ModelChunk messages. It knows nothing of Cap'n Proto or sockets: the wire
// adapter (protocol/wire.h) copies a TensorSegment's fields into the schema's
// TensorSegment struct and back, and everything here works on plain spans so
// that the fuzz target and the property tests reach it directly.
//
// A tensor is cut into segments, each covering elements [offset, offset+count)
// of the flattened tensor and decodable on its own, so that a receiver can
// accumulate every chunk as it arrives. Byte layouts (all little-endian):
//
//   dense fp32/bf16/fp16   values: count elements of the dtype
//   sparse fp32/fp16/int8  indices: nnz unsigned LEB128 varints, each the gap
//                          to the previous index (the first is relative to
//                          offset), so indices are strictly increasing and lie
//                          in [offset, offset+count)
//                          values: nnz elements (fp32, fp16, or int8 times
//                          one fp32 scale stored in scales)
//   block int8 / int4      scales: ceil(count / block_size) fp32 scales
//                          values: count int8, or ceil(count / 2) bytes of two
//                          int4 (low nibble first, two's complement, -7..7)
//                          element i decodes to q_i * scales[i / block_size]
//
// Bounds for the lossy forms (|x - decode(encode(x))|, per element):
//   bf16: 2^-8 |x| ; fp16: 2^-11 |x| in the normal range
//   block int8: scale / 2 with scale = max|x in block| / 127
//   block int4: scale / 2 with scale = max|x in block| / 7
//   sparse int8: scale / 2 with scale = max|value| / 127
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace fedmesh::protocol {

enum class Encoding : uint8_t {
  kDenseF32 = 0,
  kDenseBf16 = 1,
  kDenseF16 = 2,
  kSparseF32 = 3,
  kSparseF16 = 4,
  kSparseInt8 = 5,
  kBlockInt8 = 6,
  kBlockInt4 = 7,
};
inline constexpr int kEncodingCount = 8;

const char* encoding_name(Encoding encoding);  // "dense-f32", "sparse-int8", ...
bool encoding_is_sparse(Encoding encoding);
bool encoding_is_block(Encoding encoding);
bool encoding_is_lossless(Encoding encoding);  // dense-f32 and sparse-f32 only

// Bounds on everything a peer declares. Checked before any allocation.
inline constexpr uint32_t kDefaultBlockSize = 256;
inline constexpr uint32_t kMaxBlockSize = 1u << 16;
inline constexpr uint64_t kMaxTensorElements = uint64_t{1} << 36;  // 64 Gi elements

// One tensor of the model's manifest: what a receiver expects.
struct TensorShape {
  std::string name;
  std::vector<int64_t> dims;
  uint64_t element_count() const;  // product of dims (1 for a scalar)
};

// A segment as read from the wire: borrowed spans, nothing owned. The codec
// checks every field against the manifest before it reads a value.
struct SegmentView {
  uint32_t tensor = 0;           // index into the manifest
  Encoding encoding = Encoding::kDenseF32;
  uint64_t offset = 0;           // first element covered
  uint64_t count = 0;            // elements covered (dense length of the range)
  uint64_t nnz = 0;              // sparse forms: stored values; 0 otherwise
  uint32_t block_size = 0;       // block forms: elements per scale; 0 otherwise
  std::span<const uint8_t> indices;
  std::span<const uint8_t> values;
  std::span<const uint8_t> scales;
};

// A segment as built by the encoder: owns its bytes.
struct EncodedSegment {
  uint32_t tensor = 0;
  Encoding encoding = Encoding::kDenseF32;
  uint64_t offset = 0;
  uint64_t count = 0;
  uint64_t nnz = 0;
  uint32_t block_size = 0;
  std::vector<uint8_t> indices;
  std::vector<uint8_t> values;
  std::vector<uint8_t> scales;

  SegmentView view() const;
  size_t payload_bytes() const { return indices.size() + values.size() + scales.size(); }
};

// Errors about NaN/Inf values (or scales) carry this phrase, so a receiver
// can answer with its own reason code (non-finite rather than malformed).
inline constexpr std::string_view kNonFiniteMarker = "non-finite";
bool is_non_finite_error(const Status& status);

// Validates a segment against the manifest without decoding it: tensor index,
// range inside the tensor, byte lengths consistent with count/nnz/block_size,
// block_size in [1, kMaxBlockSize], scales finite and >= 0. Sparse indices and
// value finiteness are checked while decoding (one pass).
Status check_segment(const SegmentView& segment, std::span<const TensorShape> manifest);

// Decodes the segment and adds weight * value to target[offset + i]
// (target is the whole flattened tensor, target.size() == element_count).
// Rejects (kCorrupt, naming what was wrong) anything check_segment rejects,
// indices out of order or out of range, truncated varints or trailing bytes,
// and any non-finite decoded value. It validates the whole segment before it
// writes, so on error target is left unchanged (never half-applied).
Status accumulate_segment(const SegmentView& segment, std::span<const TensorShape> manifest,
                          float weight, std::span<float> target);

// Same, but writes the decoded values into target[offset, offset+count)
// (zeros where a sparse segment stores nothing).
Status decode_segment(const SegmentView& segment, std::span<const TensorShape> manifest,
                      std::span<float> target);

// Encoders. Each cuts the tensor into segments whose payload_bytes() is at
// most max_segment_bytes (and at least one element per segment), so the
// caller can pack them into chunks of a bounded size. They fail
// (kInvalidArgument) on a non-finite input value.
Result<std::vector<EncodedSegment>> encode_dense(uint32_t tensor, std::span<const float> values,
                                                 Encoding encoding, size_t max_segment_bytes);
// indices: strictly increasing positions in [0, element_count); values: one each.
Result<std::vector<EncodedSegment>> encode_sparse(uint32_t tensor, uint64_t element_count,
                                                  std::span<const uint64_t> indices,
                                                  std::span<const float> values, Encoding encoding,
                                                  size_t max_segment_bytes);
Result<std::vector<EncodedSegment>> encode_blocks(uint32_t tensor, std::span<const float> values,
                                                  Encoding encoding, uint32_t block_size,
                                                  size_t max_segment_bytes);

}  // namespace fedmesh::protocol
