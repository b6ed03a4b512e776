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
//   sparse-bitmap f32/fp16/int8
//                          as sparse, but indices is a bitmap of ceil(count / 8)
//                          bytes, bit i (least significant first) set when
//                          element offset + i is stored; nnz bits are set and
//                          the bits past count are 0. Senders pick it when it
//                          is smaller than the varints (dense selections).
//   dct-sign               the segment covers whole 64 x 64 chunks of the
//                          flattened tensor from offset (a multiple of 4096;
//                          the last chunk of the tensor is zero-padded to 4096
//                          elements): each chunk was sent as its orthonormal
//                          2-D DCT-II (kernels/compression_math.h), of which
//                          nnz coefficients over all chunks are kept.
//                          indices: nnz varint gaps (as sparse) over the
//                          coefficient positions [0, chunks * 4096), position p
//                          being coefficient p % 4096 of chunk p / 4096
//                          values: ceil(nnz / 8) bytes of sign bits (bit set:
//                          negative; least significant first; unused bits 0)
//                          scales: one fp32 per chunk, the magnitude of every
//                          kept coefficient of that chunk
//                          the receiver rebuilds each chunk's coefficients and
//                          applies the inverse DCT; count covers only real
//                          elements (the padding is dropped).
//
// Bounds for the lossy forms (|x - decode(encode(x))|, per element):
//   bf16: 2^-8 |x| ; fp16: 2^-11 |x| in the normal range
//   block int8: scale / 2 with scale = max|x in block| / 127
//   block int4: scale / 2 with scale = max|x in block| / 7
//   sparse int8: scale / 2 with scale = max|value| / 127
//   stochastic rounding (block int8/int4): scale, and unbiased
//   dct-sign: none per element (a sign compressor); what it drops stays in
//   the sender's error-feedback residual
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/compression_math.h"

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
  kSparseBitmapF32 = 8,
  kSparseBitmapF16 = 9,
  kSparseBitmapInt8 = 10,
  kDctSign = 11,
};
inline constexpr int kEncodingCount = 12;

const char* encoding_name(Encoding encoding);  // "dense-f32", "sparse-int8", ...
bool encoding_is_sparse(Encoding encoding);         // varint or bitmap indices (not dct-sign)
bool encoding_has_bitmap(Encoding encoding);        // sparse with bitmap indices
bool encoding_is_block(Encoding encoding);
// The sparse encoding that stores the same values with the other index form.
Encoding sparse_with_bitmap(Encoding sparse, bool bitmap);
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

// The bytes a whole update of `manifest` takes in fp32, as a receiver stages it.
uint64_t staged_bytes(std::span<const TensorShape> manifest);

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
  // A deferred dense segment (encode_dense with defer_values): `values`
  // stays empty and these input values, already checked, are written in
  // the segment's encoding where the segment is serialized (fill_segment),
  // deferred_bytes of them. The input must outlive the segment.
  std::span<const float> dense_source;
  size_t deferred_bytes = 0;

  SegmentView view() const;  // not of a deferred segment
  size_t payload_bytes() const { return indices.size() + values.size() + deferred_bytes + scales.size(); }
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

// Runs fill(i) for every i in [0, count), in any order and on any threads:
// how a dense or block encoder fills its segments' bytes (each segment its
// own), and how a decoder writes the disjoint parts of a segment it has
// validated. Empty: one after the other on the calling thread (the codec
// itself starts no threads); the compressor and the receivers pass
// fedmesh::parallel_each.
using SegmentRunner = std::function<void(size_t count, const std::function<void(size_t)>& fill)>;

// Decodes the segment and adds weight * value to target[offset + i]
// (target is the whole flattened tensor, target.size() == element_count).
// Rejects (kCorrupt, naming what was wrong) anything check_segment rejects,
// indices out of order or out of range, truncated varints or trailing bytes,
// and any non-finite decoded value. It validates the whole segment before it
// writes, so on error target is left unchanged (never half-applied).
Status accumulate_segment(const SegmentView& segment, std::span<const TensorShape> manifest,
                          float weight, std::span<float> target, const SegmentRunner& runner = {});

// Same, but writes the decoded values into target[offset, offset+count)
// (zeros where a sparse segment stores nothing).
Status decode_segment(const SegmentView& segment, std::span<const TensorShape> manifest,
                      std::span<float> target, const SegmentRunner& runner = {});
// Same, into the segment's range alone: range[i] is element offset + i
// (range.size() == segment.count), for a receiver that stages elsewhere.
Status decode_segment_range(const SegmentView& segment, std::span<const TensorShape> manifest,
                            std::span<float> range, const SegmentRunner& runner = {});

// For a sparse segment (varint or bitmap indices): calls visit(index, value)
// for every stored entry, in order, after validating the whole segment as
// decode_segment does (nothing is visited when it fails). index is the
// element's position in the tensor. Costs O(nnz), not O(count).
Status visit_sparse_entries(const SegmentView& segment, std::span<const TensorShape> manifest,
                            const std::function<void(uint64_t index, float value)>& visit);
// The same entries, (index, value) in order, into `entries` (empty when the
// segment fails): for a caller that writes them on several threads.
Status sparse_entries(const SegmentView& segment, std::span<const TensorShape> manifest,
                      std::vector<std::pair<uint64_t, float>>& entries);

// Encoders. Each cuts the tensor into segments whose payload_bytes() is at
// most max_segment_bytes (and at least one element per segment), so the
// caller can pack them into chunks of a bounded size. They fail
// (kInvalidArgument) on a non-finite input value.
// What every encoder checks of its input: each value finite, and finite
// once cast for the half encodings (kCorrupt naming the first that is not).
Status check_input_values(std::span<const float> values, Encoding encoding);

// With defer_values, the values are checked but not copied: each segment
// refers to its range of `values` (EncodedSegment::dense_source), written
// once, where it is serialized.
Result<std::vector<EncodedSegment>> encode_dense(uint32_t tensor, std::span<const float> values,
                                                 Encoding encoding, size_t max_segment_bytes,
                                                 const SegmentRunner& runner = {}, bool defer_values = false);
// A dense segment's bytes: `values` as fp32, or cast to fp16/bf16, into
// out (values.size() x 4 or 2 bytes). The values must have passed
// check_input_values for the encoding.
void write_dense_values(std::span<const float> values, Encoding encoding, uint8_t* out);
// indices: strictly increasing positions in [0, element_count); values: one each.
// A bitmap encoding stores the positions as bitmaps, a varint one as gaps.
// The entries are checked and written in parts on `runner`'s threads. When
// `decoded` is given (one float per entry), it receives what a receiver
// decodes for each entry, bit for bit: the sender's residual without parsing
// the segments again.
Result<std::vector<EncodedSegment>> encode_sparse(uint32_t tensor, uint64_t element_count,
                                                  std::span<const uint64_t> indices,
                                                  std::span<const float> values, Encoding encoding,
                                                  size_t max_segment_bytes, const SegmentRunner& runner = {},
                                                  std::span<float> decoded = {});
// Quantizes with kernels::quantize_blocks (round to nearest by default; with
// kStochastic the draws depend on seed and each element's tensor position).
Result<std::vector<EncodedSegment>> encode_blocks(uint32_t tensor, std::span<const float> values,
                                                  Encoding encoding, uint32_t block_size,
                                                  size_t max_segment_bytes,
                                                  kernels::Rounding rounding = kernels::Rounding::kNearest,
                                                  uint64_t seed = 0);
// Segments of values already quantized by kernels::quantize_blocks over the
// whole tensor (packed and scales as it writes them).
Result<std::vector<EncodedSegment>> encode_quantized_blocks(uint32_t tensor, uint64_t element_count,
                                                            std::span<const uint8_t> packed,
                                                            std::span<const float> scales, Encoding encoding,
                                                            uint32_t block_size, size_t max_segment_bytes,
                                                            const SegmentRunner& runner = {});

// The bytes the index forms of a sparse selection would take in one segment:
// delta varints, or a bitmap over element_count elements.
struct SparseIndexCost {
  uint64_t varint_bytes = 0;
  uint64_t bitmap_bytes = 0;
  bool bitmap_smaller() const { return bitmap_bytes < varint_bytes; }
};
SparseIndexCost sparse_index_cost(std::span<const uint64_t> indices, uint64_t element_count);

// dct-sign: `positions` are strictly increasing coefficient positions in
// [0, chunks * 4096) with chunks = ceil(element_count / 4096), `negative` their
// signs and chunk_scales one magnitude per chunk (finite, >= 0).
Result<std::vector<EncodedSegment>> encode_dct_sign(uint32_t tensor, uint64_t element_count,
                                                    std::span<const uint64_t> positions,
                                                    std::span<const uint8_t> negative,
                                                    std::span<const float> chunk_scales, size_t max_segment_bytes);

}  // namespace fedmesh::protocol
