// The update codec (protocol/codec.h). Everything a SegmentView carries comes
// from a peer: every length is checked against the manifest and against the
// bytes actually present before a value is read, nothing is allocated from a
// declared size, and each decoder runs a validation pass over the whole
// segment before a write pass, so a rejected segment never touches target.
#include "protocol/codec.h"

#include <algorithm>
#include <bit>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "kernels/half.h"
#include "kernels/half_arrays.h"

namespace fedmesh::protocol {

// Values are copied between the wire and floats as they are: the layouts are
// little-endian by definition and so is every host we build for.
static_assert(std::endian::native == std::endian::little, "the codec assumes a little-endian host");

namespace {

constexpr uint32_t kF32ExponentMask = 0x7f800000u;
constexpr uint16_t kF16ExponentMask = 0x7c00u;
constexpr uint16_t kBf16ExponentMask = 0x7f80u;
// The smallest fp32 magnitudes (as bits) that round to a half's Inf: 65520,
// halfway past fp16's largest 65504; halfway past bf16's largest 0x7f7f.
constexpr uint32_t kF16OverflowBits = 0x477ff000u;
constexpr uint32_t kBf16OverflowBits = 0x7f7f8000u;
constexpr size_t kMaxVarintBytes = 10;
constexpr size_t kScaleBytes = 4;
using kernels::kInt4Max;
using kernels::kInt8Max;
// int4 elements decoded per step into a stack buffer (4 KiB).
constexpr uint64_t kInt4ChunkElements = 1024;
// Encoders clamp max_segment_bytes to this before doing arithmetic on it: no
// segment of a tensor within kMaxTensorElements comes near it, and below it
// nothing in the segment-size formulas overflows.
constexpr uint64_t kSegmentBytesCap = uint64_t{1} << 40;
// element_count() of a shape with a negative dimension or more than
// kMaxTensorElements elements; check_segment rejects it as it is above the limit.
constexpr uint64_t kInvalidElementCount = std::numeric_limits<uint64_t>::max();

// ---- small helpers -----------------------------------------------------------

// 1 where x is NaN or Inf, as an integer so that a loop can OR it into a flag
// without a branch (and so vectorize).
inline uint32_t non_finite(float x) {
  return static_cast<uint32_t>((std::bit_cast<uint32_t>(x) & kF32ExponentMask) == kF32ExponentMask);
}
inline bool is_finite(float x) { return non_finite(x) == 0; }

inline float load_f32(const uint8_t* bytes) {
  float x;
  std::memcpy(&x, bytes, sizeof x);
  return x;
}
inline uint16_t load_u16(const uint8_t* bytes) {
  uint16_t x;
  std::memcpy(&x, bytes, sizeof x);
  return x;
}
inline void append_f32(std::vector<uint8_t>& out, float x) {
  uint8_t bytes[4];
  std::memcpy(bytes, &x, sizeof bytes);
  out.insert(out.end(), bytes, bytes + 4);
}
inline void append_u16(std::vector<uint8_t>& out, uint16_t x) {
  out.push_back(static_cast<uint8_t>(x));
  out.push_back(static_cast<uint8_t>(x >> 8));
}

// The one expression both the validation and the write pass of an accumulate
// use, so that what was checked to be finite is exactly what is stored.
inline float accumulated(float target, float weight, float value) { return target + weight * value; }

// Low nibble first, two's complement.
inline int int4_at(const uint8_t* bytes, uint64_t i) {
  const int nibble = (bytes[i / 2] >> (4 * (i & 1))) & 0xf;
  return (nibble ^ 8) - 8;
}

// Rounds |x| <= 2^22 to the nearest integer, ties to even, with two additions
// (vectorizable, unlike a call to roundf on baseline x86-64). Both additions are
// exact or correctly rounded because the sum stays in [2^23, 2^24).
inline float round_small(float x) {
  constexpr float kMagic = 0x1.8p23f;
  return (x + kMagic) - kMagic;
}

// The value a receiver decodes for a sparse int8 byte: the one expression the
// encoder (for its caller's residual) and the decoder share.
inline float sparse_int8_value(uint8_t byte, float scale) {
  return static_cast<float>(static_cast<int8_t>(byte)) * scale;
}

std::string format_float(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.9g", x);
  return buffer;
}

// 7 bits a byte: without a loop, so that sums of sizes vectorize.
size_t varint_bytes(uint64_t value) { return 1 + static_cast<size_t>(std::bit_width(value | 1) - 1) / 7; }

// Writes value's varint at out; returns the byte after it.
inline uint8_t* put_varint(uint8_t* out, uint64_t value) {
  while (value >= 0x80) {
    *out++ = static_cast<uint8_t>(value | 0x80);
    value >>= 7;
  }
  *out++ = static_cast<uint8_t>(value);
  return out;
}

void append_varint(std::vector<uint8_t>& out, uint64_t value) {
  uint8_t bytes[kMaxVarintBytes];
  out.insert(out.end(), bytes, put_varint(bytes, value));
}

enum class VarintError { kNone, kTruncated, kTooLong, kOverflow, kNotMinimal };

// Unsigned LEB128 at bytes[pos...]; advances pos past it. Only the shortest
// form is accepted, so that an update has one encoding (its signature covers
// these bytes) and a peer cannot pad a varint to ten bytes.
VarintError read_varint(std::span<const uint8_t> bytes, size_t& pos, uint64_t& value) {
  uint64_t result = 0;
  for (size_t i = 0; i < kMaxVarintBytes; ++i) {
    if (pos == bytes.size()) return VarintError::kTruncated;
    const uint8_t byte = bytes[pos++];
    if (i == kMaxVarintBytes - 1 && byte > 1) {
      // The tenth byte holds bit 63 only.
      return (byte & 0x80) ? VarintError::kTooLong : VarintError::kOverflow;
    }
    result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
    if ((byte & 0x80) == 0) {
      if (byte == 0 && i > 0) return VarintError::kNotMinimal;
      value = result;
      return VarintError::kNone;
    }
  }
  return VarintError::kTooLong;  // not reached: the tenth byte returns above
}

const char* varint_error_text(VarintError error) {
  switch (error) {
    case VarintError::kNone: return "ok";
    case VarintError::kTruncated: return "is truncated (the bytes end inside it)";
    case VarintError::kTooLong: return "is longer than 10 bytes";
    case VarintError::kOverflow: return "does not fit in 64 bits";
    case VarintError::kNotMinimal: return "is not in its shortest form (overlong)";
  }
  return "is invalid";
}

// ---- per-encoding facts ------------------------------------------------------

bool encoding_known(Encoding encoding) { return static_cast<uint8_t>(encoding) < kEncodingCount; }

// Bytes per stored value; int4 (half a byte) is handled apart.
// A bitmap sparse encoding stores its values as the varint one does.
Encoding value_form(Encoding encoding) {
  return encoding_has_bitmap(encoding) ? sparse_with_bitmap(encoding, false) : encoding;
}

// Bytes per stored value; int4 (half a byte) and sign bits are handled apart.
uint64_t value_bytes(Encoding encoding) {
  switch (value_form(encoding)) {
    case Encoding::kDenseF32:
    case Encoding::kSparseF32: return 4;
    case Encoding::kDenseBf16:
    case Encoding::kDenseF16:
    case Encoding::kSparseF16: return 2;
    default: return 1;
  }
}

const char* value_type(Encoding encoding) {
  switch (value_form(encoding)) {
    case Encoding::kDenseF32:
    case Encoding::kSparseF32: return "fp32";
    case Encoding::kDenseBf16: return "bf16";
    case Encoding::kDenseF16:
    case Encoding::kSparseF16: return "fp16";
    case Encoding::kSparseInt8:
    case Encoding::kBlockInt8: return "int8";
    case Encoding::kBlockInt4: return "int4";
    case Encoding::kDctSign: return "sign";
    default: return "?";
  }
}

uint64_t bitmap_bytes(uint64_t count) { return (count + 7) / 8; }
uint64_t dct_chunks_covering(uint64_t count) { return (count + kernels::kDctChunk - 1) / kernels::kDctChunk; }

// "tensor 3 ('fc.weight') segment at offset 128 (dense-f32): "
std::string where(const SegmentView& segment, std::span<const TensorShape> manifest) {
  std::string text = "tensor " + std::to_string(segment.tensor);
  if (segment.tensor < manifest.size()) text += " ('" + manifest[segment.tensor].name + "')";
  text += " segment at offset " + std::to_string(segment.offset) + " (";
  text += encoding_known(segment.encoding)
              ? encoding_name(segment.encoding)
              : "encoding " + std::to_string(static_cast<unsigned>(segment.encoding));
  return text + "): ";
}

std::string bytes_expected(const char* field, size_t actual, uint64_t expected, const std::string& for_what) {
  return std::string(field) + " has " + std::to_string(actual) + " bytes, " + std::to_string(expected) +
         " expected for " + for_what;
}

// ---- validation of the header and the byte lengths ------------------------------

// Scales: finite and >= 0 (the sign lives in the quantized values).
Status check_scales(const SegmentView& s, std::span<const TensorShape> manifest) {
  for (size_t b = 0; b < s.scales.size() / kScaleBytes; ++b) {
    const float scale = load_f32(s.scales.data() + b * kScaleBytes);
    if (!is_finite(scale) || !(scale >= 0.0f)) {
      return corrupt(where(s, manifest) + "scale " + std::to_string(b) + " is " + format_float(scale) +
                     (is_finite(scale) ? "" : " (" + std::string(kNonFiniteMarker) + ")") +
                     ", a finite value >= 0 expected");
    }
  }
  return Status::ok();
}

Status check_dct_lengths(const SegmentView& s, std::span<const TensorShape> manifest, uint64_t element_count) {
  if (s.block_size != 0) {
    return corrupt(where(s, manifest) + "block_size is " + std::to_string(s.block_size) + ", 0 expected for dct-sign");
  }
  if (s.offset % kernels::kDctChunk != 0) {
    return corrupt(where(s, manifest) + "offset " + std::to_string(s.offset) +
                   " does not start a 4096-element DCT chunk");
  }
  if (s.count % kernels::kDctChunk != 0 && s.offset + s.count != element_count) {
    return corrupt(where(s, manifest) + "covers " + std::to_string(s.count) +
                   " elements: whole 4096-element chunks expected, except at the tensor's end");
  }
  const uint64_t chunks = dct_chunks_covering(s.count);
  if (s.nnz > chunks * kernels::kDctChunk) {
    return corrupt(where(s, manifest) + "nnz " + std::to_string(s.nnz) + " is more than the " +
                   std::to_string(chunks * kernels::kDctChunk) + " coefficients of its " + std::to_string(chunks) +
                   " chunks");
  }
  if (s.indices.size() < s.nnz || s.indices.size() > s.nnz * kMaxVarintBytes) {
    return corrupt(where(s, manifest) + "indices has " + std::to_string(s.indices.size()) + " bytes, outside the " +
                   std::to_string(s.nnz) + " to " + std::to_string(s.nnz * kMaxVarintBytes) + " that " +
                   std::to_string(s.nnz) + " varints take");
  }
  if (s.values.size() != bitmap_bytes(s.nnz)) {
    return corrupt(where(s, manifest) + bytes_expected("values", s.values.size(), bitmap_bytes(s.nnz),
                                                       std::to_string(s.nnz) + " sign bits"));
  }
  if (s.scales.size() != chunks * kScaleBytes) {
    return corrupt(where(s, manifest) + bytes_expected("scales", s.scales.size(), chunks * kScaleBytes,
                                                       std::to_string(chunks) + " fp32 chunk scales"));
  }
  return check_scales(s, manifest);
}

Status check_lengths(const SegmentView& s, std::span<const TensorShape> manifest, uint64_t& element_count) {
  if (s.tensor >= manifest.size()) {
    return corrupt("segment names tensor " + std::to_string(s.tensor) + ", but the manifest has " +
                   std::to_string(manifest.size()) + " tensors");
  }
  const TensorShape& shape = manifest[s.tensor];
  element_count = shape.element_count();
  if (element_count > kMaxTensorElements) {
    // The manifest is ours, not the peer's: the caller can fix it.
    return invalid_argument("manifest tensor " + std::to_string(s.tensor) + " ('" + shape.name +
                            "') has a negative dimension or more than 2^36 elements");
  }
  if (!encoding_known(s.encoding)) {
    return corrupt(where(s, manifest) + "unknown encoding " + std::to_string(static_cast<unsigned>(s.encoding)));
  }
  if (s.count == 0) return corrupt(where(s, manifest) + "covers no elements (count 0)");
  if (s.offset > element_count || s.count > element_count - s.offset) {
    return corrupt(where(s, manifest) + "covers " + std::to_string(s.count) + " elements from offset " +
                   std::to_string(s.offset) + ", outside the tensor's " + std::to_string(element_count) +
                   " elements");
  }
  const Encoding e = s.encoding;
  const uint64_t vb = value_bytes(e);
  if (!encoding_is_block(e) && s.block_size != 0) {
    return corrupt(where(s, manifest) + "block_size is " + std::to_string(s.block_size) +
                   ", 0 expected for a non-block encoding");
  }
  if (e == Encoding::kDctSign) return check_dct_lengths(s, manifest, element_count);
  if (!encoding_is_sparse(e) && s.nnz != 0) {
    return corrupt(where(s, manifest) + "nnz is " + std::to_string(s.nnz) + ", 0 expected for a non-sparse encoding");
  }
  if (!encoding_is_sparse(e) && !s.indices.empty()) {
    return corrupt(where(s, manifest) + "indices has " + std::to_string(s.indices.size()) +
                   " bytes, 0 expected for a non-sparse encoding");
  }

  if (!encoding_is_sparse(e) && !encoding_is_block(e)) {  // dense
    if (!s.scales.empty()) {
      return corrupt(where(s, manifest) + "scales has " + std::to_string(s.scales.size()) +
                     " bytes, 0 expected for a dense encoding");
    }
    const uint64_t expected = s.count * vb;  // count <= 2^36: no overflow
    if (s.values.size() != expected) {
      return corrupt(where(s, manifest) + bytes_expected("values", s.values.size(), expected,
                                                         std::to_string(s.count) + " " + value_type(e) + " values"));
    }
    return Status::ok();
  }

  if (encoding_is_sparse(e)) {
    if (s.nnz > s.count) {
      return corrupt(where(s, manifest) + "nnz " + std::to_string(s.nnz) + " is more than the " +
                     std::to_string(s.count) + " elements the segment covers");
    }
    const uint64_t expected_values = s.nnz * vb;  // nnz <= count <= 2^36
    if (s.values.size() != expected_values) {
      return corrupt(where(s, manifest) + bytes_expected("values", s.values.size(), expected_values,
                                                         std::to_string(s.nnz) + " " + value_type(e) + " values"));
    }
    if (encoding_has_bitmap(e)) {
      if (s.indices.size() != bitmap_bytes(s.count)) {
        return corrupt(where(s, manifest) + bytes_expected("indices", s.indices.size(), bitmap_bytes(s.count),
                                                           "a bitmap of " + std::to_string(s.count) + " elements"));
      }
    } else if (s.indices.size() < s.nnz) {  // each varint takes 1 to 10 bytes: a cheap bound before parsing
      return corrupt(where(s, manifest) + "indices has " + std::to_string(s.indices.size()) +
                     " bytes, too few for " + std::to_string(s.nnz) + " varints (at least 1 byte each)");
    }
    if (!encoding_has_bitmap(e) && s.indices.size() > s.nnz * kMaxVarintBytes) {
      return corrupt(where(s, manifest) + "indices has " + std::to_string(s.indices.size()) +
                     " bytes, more than " + std::to_string(s.nnz) + " varints can take (10 bytes each)");
    }
    const bool int8 = value_form(e) == Encoding::kSparseInt8;
    const uint64_t expected_scales = int8 ? kScaleBytes : 0;
    if (s.scales.size() != expected_scales) {
      return corrupt(where(s, manifest) + bytes_expected("scales", s.scales.size(), expected_scales,
                                                         int8 ? "one fp32 scale" : "a sparse float encoding"));
    }
  } else {  // block
    if (s.block_size == 0 || s.block_size > kMaxBlockSize) {
      return corrupt(where(s, manifest) + "block_size " + std::to_string(s.block_size) + " is outside [1, " +
                     std::to_string(kMaxBlockSize) + "]");
    }
    const uint64_t blocks = (s.count + s.block_size - 1) / s.block_size;
    if (s.scales.size() != blocks * kScaleBytes) {
      return corrupt(where(s, manifest) + bytes_expected("scales", s.scales.size(), blocks * kScaleBytes,
                                                         std::to_string(blocks) + " fp32 scales (" +
                                                             std::to_string(s.count) + " elements in blocks of " +
                                                             std::to_string(s.block_size) + ")"));
    }
    const uint64_t expected_values = e == Encoding::kBlockInt8 ? s.count : (s.count + 1) / 2;
    if (s.values.size() != expected_values) {
      return corrupt(where(s, manifest) + bytes_expected("values", s.values.size(), expected_values,
                                                         std::to_string(s.count) + " " + value_type(e) + " values"));
    }
  }

  return check_scales(s, manifest);
}

// ---- the two passes ------------------------------------------------------------

// Where the decoded values go: decode writes them, accumulate adds weight times
// them. out points at target[offset].
struct Sink {
  float* out;
  float weight;
  bool accumulate;
  const SegmentRunner* runner;  // writes the validated parts on its threads when set
};

// fill(i) for i in [0, count): on the runner when there is one, else in
// order on this thread.
void run_segments(const SegmentRunner& runner, size_t count, const std::function<void(size_t)>& fill) {
  if (runner && count > 1) {
    runner(count, fill);
    return;
  }
  for (size_t i = 0; i < count; ++i) fill(i);
}

// Runs write(first, count) over [0, n) in parts of `part` elements, on the
// sink's runner.
void write_in_parts(const Sink& sink, uint64_t n, uint64_t part, const std::function<void(uint64_t, uint64_t)>& write) {
  run_segments(*sink.runner, (n + part - 1) / part, [&](size_t p) {
    const uint64_t first = p * part;
    write(first, std::min(part, n - first));
  });
}

// Parts of a segment written on separate threads: large enough that each
// is worth a task, small enough that a 4 MB chunk's segment splits.
constexpr uint64_t kWritePart = uint64_t{1} << 16;

// Validation pass over n values: 1 if a decoded value, or what accumulating it
// would store, is not finite. Branch-free so that it vectorizes.
template <class Load>
uint32_t scan_range(const Sink& sink, const float* out, uint64_t n, Load load) {
  uint32_t bad = 0;
  if (sink.accumulate) {
    const float weight = sink.weight;
    for (uint64_t i = 0; i < n; ++i) bad |= non_finite(accumulated(out[i], weight, load(i)));
  } else {
    for (uint64_t i = 0; i < n; ++i) bad |= non_finite(load(i));
  }
  return bad;
}

template <class Load>
void write_range(const Sink& sink, float* out, uint64_t n, Load load) {
  if (sink.accumulate) {
    const float weight = sink.weight;
    for (uint64_t i = 0; i < n; ++i) out[i] = accumulated(out[i], weight, load(i));
  } else {
    for (uint64_t i = 0; i < n; ++i) out[i] = load(i);
  }
}

// The slow path after a scan found something: names the first bad element.
// position is the element's index in the tensor.
Status describe_value(const std::string& prefix, const Sink& sink, uint64_t position, float target, float value,
                      const char* what) {
  if (!is_finite(value)) {
    return corrupt(prefix + what + " at element " + std::to_string(position) + " decodes to " + format_float(value) +
                   " (" + std::string(kNonFiniteMarker) + ")");
  }
  if (sink.accumulate && !is_finite(accumulated(target, sink.weight, value))) {
    return corrupt(prefix + what + " at element " + std::to_string(position) + " (" + format_float(value) +
                   ") times weight " + format_float(sink.weight) + " added to " + format_float(target) +
                   " is " + std::string(kNonFiniteMarker) + " in fp32");
  }
  return Status::ok();
}

template <class Load>
Status find_bad(const std::string& prefix, const Sink& sink, const float* out, uint64_t first_position, uint64_t n,
                Load load, const char* what) {
  for (uint64_t i = 0; i < n; ++i) {
    Status status = describe_value(prefix, sink, first_position + i, sink.accumulate ? out[i] : 0.0f, load(i), what);
    if (!status.is_ok()) return status;
  }
  return corrupt(prefix + "a value is " + std::string(kNonFiniteMarker));  // not reached when the scan found one
}

template <class Load>
Status apply_dense(const SegmentView& s, std::span<const TensorShape> manifest, const Sink& sink, Load load) {
  if (scan_range(sink, sink.out, s.count, load) != 0) {
    return find_bad(where(s, manifest), sink, sink.out, s.offset, s.count, load, "value");
  }
  write_in_parts(sink, s.count, kWritePart, [&](uint64_t first, uint64_t n) {
    write_range(sink, sink.out + first, n, [&load, first](uint64_t i) { return load(first + i); });
  });
  return Status::ok();
}

// Decodes a dense half segment (not an accumulate) with kernels/half_arrays.h
// when every value is finite, which the bits tell without converting (the
// exponent all ones is Inf or NaN); false, writing nothing, when one is not:
// the caller's apply_dense then names it.
bool decode_dense_half(const SegmentView& s, const Sink& sink, bool brain) {
  const uint8_t* values = s.values.data();
  const uint16_t exponent = brain ? kBf16ExponentMask : kF16ExponentMask;
  uint32_t bad = 0;
  for (uint64_t i = 0; i < s.count; ++i) bad |= static_cast<uint32_t>((load_u16(values + 2 * i) & exponent) == exponent);
  if (bad != 0) return false;
  write_in_parts(sink, s.count, kWritePart,
                 [&](uint64_t first, uint64_t n) { half_to_fp32(values + 2 * first, sink.out + first, n, brain); });
  return true;
}

// Decodes int4 elements [first, first + n) of a segment's values times scale
// into out: the odd element at either end alone, the rest a byte at a time.
void unpack_int4(const uint8_t* values, uint64_t first, uint64_t n, float scale, float* out) {
  uint64_t i = 0;
  if ((first & 1) != 0 && n > 0) {
    out[0] = static_cast<float>(int4_at(values, first)) * scale;
    i = 1;
  }
  const uint8_t* bytes = values + (first + i) / 2;
  const uint64_t pairs = (n - i) / 2;
  for (uint64_t p = 0; p < pairs; ++p) {
    const uint8_t byte = bytes[p];
    out[i + 2 * p] = static_cast<float>(((byte & 0xf) ^ 8) - 8) * scale;
    out[i + 2 * p + 1] = static_cast<float>(((byte >> 4) ^ 8) - 8) * scale;
  }
  if (i + 2 * pairs < n) out[n - 1] = static_cast<float>(int4_at(values, first + n - 1)) * scale;
}

Status apply_blocks(const SegmentView& s, std::span<const TensorShape> manifest, const Sink& sink) {
  const bool int4 = s.encoding == Encoding::kBlockInt4;
  const uint8_t* values = s.values.data();
  if (int4) {
    // -8 is outside the symmetric range, and an odd count leaves the last
    // high nibble unused: it must be 0 so that the encoding is unique.
    uint32_t bad = 0;
    for (size_t i = 0; i < s.values.size(); ++i) {
      bad |= static_cast<uint32_t>((values[i] & 0xf) == 8) | static_cast<uint32_t>((values[i] >> 4) == 8);
    }
    if (bad != 0) {
      for (uint64_t i = 0; i < s.count; ++i) {
        if (int4_at(values, i) == -8) {
          return corrupt(where(s, manifest) + "int4 value " + std::to_string(i) + " is -8, outside -7..7");
        }
      }
    }
    if ((s.count & 1) != 0 && (values[s.count / 2] >> 4) != 0) {
      return corrupt(where(s, manifest) + "the unused high nibble of the last values byte is " +
                     std::to_string(values[s.count / 2] >> 4) + ", 0 expected for an odd count");
    }
  }

  const uint64_t block_size = s.block_size;
  const uint64_t blocks = (s.count + block_size - 1) / block_size;
  // Runs f(first element of the block, its length, its scale) for every block.
  auto for_each_block = [&](auto&& f) -> bool {
    for (uint64_t b = 0; b < blocks; ++b) {
      const uint64_t first = b * block_size;
      const uint64_t n = std::min(block_size, s.count - first);
      if (!f(first, n, load_f32(s.scales.data() + b * kScaleBytes))) return false;
    }
    return true;
  };
  auto int8_loader = [values](uint64_t first, float scale) {
    return [values, first, scale](uint64_t i) {
      return static_cast<float>(static_cast<int8_t>(values[first + i])) * scale;
    };
  };

  // int4 values are unpacked a chunk at a time into decoded[], two per byte,
  // which is what lets the loops below vectorize.
  float decoded[kInt4ChunkElements];
  auto from_decoded = [&decoded](uint64_t i) { return decoded[i]; };

  // Decoded values are q * scale with |q| <= 128: finite whatever q is when
  // the scale is at most FLT_MAX / 128, so such a block needs no scan unless
  // it is added to a target.
  constexpr float kScaleFiniteForAnyQ = std::numeric_limits<float>::max() / 128.0f;
  Status failure;
  const bool all_good = for_each_block([&](uint64_t first, uint64_t n, float scale) {
    if (!sink.accumulate && scale <= kScaleFiniteForAnyQ) return true;
    const float* out = sink.out + first;
    if (!int4) {
      if (scan_range(sink, out, n, int8_loader(first, scale)) == 0) return true;
      failure = find_bad(where(s, manifest), sink, out, s.offset + first, n, int8_loader(first, scale), "q * scale");
      return false;
    }
    for (uint64_t done = 0; done < n; done += kInt4ChunkElements) {
      const uint64_t m = std::min<uint64_t>(kInt4ChunkElements, n - done);
      unpack_int4(values, first + done, m, scale, decoded);
      if (scan_range(sink, out + done, m, from_decoded) == 0) continue;
      failure = find_bad(where(s, manifest), sink, out + done, s.offset + first + done, m, from_decoded, "q * scale");
      return false;
    }
    return true;
  });
  if (!all_good) return failure;

  // Validated: written in groups of whole blocks, on the runner's threads
  // when there is one (each group its own int4 scratch).
  write_in_parts(sink, blocks, std::max<uint64_t>(1, kWritePart / block_size), [&](uint64_t first_block, uint64_t count) {
    float unpacked[kInt4ChunkElements];
    auto from_unpacked = [&unpacked](uint64_t i) { return unpacked[i]; };
    for (uint64_t b = first_block; b < first_block + count; ++b) {
      const uint64_t first = b * block_size;
      const uint64_t n = std::min(block_size, s.count - first);
      const float scale = load_f32(s.scales.data() + b * kScaleBytes);
      float* out = sink.out + first;
      if (!int4) {
        write_range(sink, out, n, int8_loader(first, scale));
        continue;
      }
      for (uint64_t done = 0; done < n; done += kInt4ChunkElements) {
        const uint64_t m = std::min<uint64_t>(kInt4ChunkElements, n - done);
        unpack_int4(values, first + done, m, scale, unpacked);
        write_range(sink, out + done, m, from_unpacked);
      }
    }
  });
  return Status::ok();
}

// Parses the index varints and calls visit(k, index) for each, in order, with
// every index checked to be strictly increasing and inside the segment.
// Positions range over [offset, offset + range): range is count for sparse
// segments and the padded chunk coefficients for dct-sign.
template <class Visit>
Status walk_varints(const SegmentView& s, std::span<const TensorShape> manifest, uint64_t range, Visit visit) {
  const uint64_t end = s.offset + range;  // checked against the tensor already
  size_t pos = 0;
  uint64_t previous = 0;
  for (uint64_t k = 0; k < s.nnz; ++k) {
    const size_t start = pos;
    uint64_t gap = 0;
    const VarintError error = read_varint(s.indices, pos, gap);
    if (error != VarintError::kNone) {
      return corrupt(where(s, manifest) + "index " + std::to_string(k) + ": the varint at indices byte " +
                     std::to_string(start) + " " + varint_error_text(error));
    }
    uint64_t index = 0;
    if (k == 0) {
      if (gap >= range) {
        return corrupt(where(s, manifest) + "index 0 is offset + " + std::to_string(gap) +
                       ", outside the segment's " + std::to_string(range) + " positions");
      }
      index = s.offset + gap;
    } else {
      if (gap == 0) {
        return corrupt(where(s, manifest) + "index " + std::to_string(k) + " repeats index " +
                       std::to_string(k - 1) + " (" + std::to_string(previous) + "): indices must strictly increase");
      }
      if (gap >= end - previous) {
        return corrupt(where(s, manifest) + "index " + std::to_string(k) + " is " + std::to_string(previous) +
                       " + " + std::to_string(gap) + ", past the segment's end " + std::to_string(end) +
                       " (out of order or out of range)");
      }
      index = previous + gap;
    }
    Status status = visit(k, index);
    if (!status.is_ok()) return status;
    previous = index;
  }
  if (pos != s.indices.size()) {
    return corrupt(where(s, manifest) + "indices has " + std::to_string(s.indices.size() - pos) +
                   " trailing bytes after " + std::to_string(s.nnz) + " varints");
  }
  return Status::ok();
}

// The bitmap form: the same visits, from set bits.
template <class Visit>
Status walk_bitmap(const SegmentView& s, std::span<const TensorShape> manifest, Visit visit) {
  uint64_t k = 0;
  const uint8_t* bits = s.indices.data();
  for (uint64_t byte = 0; byte < s.indices.size(); ++byte) {
    uint8_t b = bits[byte];
    if (byte == s.indices.size() - 1 && (s.count & 7) != 0 && (b >> (s.count & 7)) != 0) {
      return corrupt(where(s, manifest) + "the bitmap sets bits past the segment's " + std::to_string(s.count) +
                     " elements");
    }
    while (b != 0) {
      const int bit = std::countr_zero(b);
      b = static_cast<uint8_t>(b & (b - 1));
      if (k == s.nnz) {
        return corrupt(where(s, manifest) + "the bitmap sets more than nnz = " + std::to_string(s.nnz) + " bits");
      }
      Status status = visit(k++, s.offset + byte * 8 + static_cast<uint64_t>(bit));
      if (!status.is_ok()) return status;
    }
  }
  if (k != s.nnz) {
    return corrupt(where(s, manifest) + "the bitmap sets " + std::to_string(k) + " bits, nnz is " +
                   std::to_string(s.nnz));
  }
  return Status::ok();
}

template <class Visit>
Status walk_sparse(const SegmentView& s, std::span<const TensorShape> manifest, Visit visit) {
  return encoding_has_bitmap(s.encoding) ? walk_bitmap(s, manifest, visit) : walk_varints(s, manifest, s.count, visit);
}

template <class Load>
Status apply_sparse_with(const SegmentView& s, std::span<const TensorShape> manifest, const Sink& sink, Load load) {
  float* const target = sink.out;  // target[offset]: index - offset below
  std::string prefix;
  // Decoding with a runner, the validation pass keeps the positions, and
  // the values are written from them on the runner's threads: each is a
  // random write, which one thread would wait on one after another.
  // (4 bytes a position: a segment's range is under 2^32 elements, or it
  // takes the one-thread path.)
  const bool scatter = !sink.accumulate && sink.runner != nullptr && s.nnz >= kWritePart && s.count <= UINT32_MAX;
  std::vector<uint32_t> positions;
  if (scatter) positions.resize(s.nnz);
  FEDMESH_RETURN_IF_ERROR(walk_sparse(s, manifest, [&](uint64_t k, uint64_t index) -> Status {
    const float value = load(k);
    const float current = sink.accumulate ? target[index - s.offset] : 0.0f;
    const float stored = sink.accumulate ? accumulated(current, sink.weight, value) : value;
    if (scatter) positions[k] = static_cast<uint32_t>(index - s.offset);  // k < nnz: the walk counts them
    if (is_finite(stored) && is_finite(value)) return Status::ok();
    if (prefix.empty()) prefix = where(s, manifest);
    return describe_value(prefix, sink, index, current, value, "value");
  }));
  if (scatter) {
    // Each part of the range is zeroed and then given its entries (the
    // positions increase, so they are one run) while it is in cache.
    write_in_parts(sink, s.count, kWritePart, [&](uint64_t first, uint64_t n) {
      std::fill(target + first, target + first + n, 0.0f);
      const auto begin = std::lower_bound(positions.begin(), positions.end(), static_cast<uint32_t>(first));
      const auto end = std::lower_bound(begin, positions.end(), static_cast<uint32_t>(first + n));
      for (auto at = begin; at != end; ++at) target[*at] = load(static_cast<uint64_t>(at - positions.begin()));
    });
    return Status::ok();
  }
  if (!sink.accumulate) {
    write_in_parts(sink, s.count, kWritePart,
                   [target](uint64_t first, uint64_t n) { std::fill(target + first, target + first + n, 0.0f); });
  }
  return walk_sparse(s, manifest, [&](uint64_t k, uint64_t index) -> Status {
    float& slot = target[index - s.offset];
    slot = sink.accumulate ? accumulated(slot, sink.weight, load(k)) : load(k);
    return Status::ok();
  });
}

Status apply_sparse(const SegmentView& s, std::span<const TensorShape> manifest, const Sink& sink) {
  const uint8_t* values = s.values.data();
  switch (value_form(s.encoding)) {
    case Encoding::kSparseF32:
      return apply_sparse_with(s, manifest, sink, [values](uint64_t k) { return load_f32(values + 4 * k); });
    case Encoding::kSparseF16:
      return apply_sparse_with(s, manifest, sink,
                               [values](uint64_t k) { return to_float(fp16{load_u16(values + 2 * k)}); });
    case Encoding::kSparseInt8: {
      const float scale = load_f32(s.scales.data());
      return apply_sparse_with(s, manifest, sink,
                               [values, scale](uint64_t k) { return sparse_int8_value(values[k], scale); });
    }
    default: break;
  }
  return corrupt(where(s, manifest) + "not a sparse encoding");
}

// dct-sign: rebuild each chunk's coefficients (+-scale), inverse DCT, then
// the usual two passes per chunk (validate every chunk first, then write), so
// a bad chunk leaves the target untouched.
Status apply_dct(const SegmentView& s, std::span<const TensorShape> manifest, const Sink& sink) {
  const uint64_t chunks = dct_chunks_covering(s.count);
  // Chunk c's coefficients are entries [first_entry[c], first_entry[c + 1]).
  std::vector<uint64_t> positions;
  positions.reserve(s.nnz);
  FEDMESH_RETURN_IF_ERROR(walk_varints(s, manifest, chunks * kernels::kDctChunk, [&](uint64_t, uint64_t index) {
    positions.push_back(index - s.offset);
    return Status::ok();
  }));
  std::vector<float> coefficients(kernels::kDctChunk), decoded(kernels::kDctChunk);
  auto decode_chunk = [&](uint64_t c, size_t& entry) {
    std::fill(coefficients.begin(), coefficients.end(), 0.0f);
    const float scale = load_f32(s.scales.data() + c * kScaleBytes);
    for (; entry < positions.size() && positions[entry] / kernels::kDctChunk == c; ++entry) {
      const bool negative = (s.values[entry / 8] >> (entry % 8)) & 1u;
      coefficients[positions[entry] % kernels::kDctChunk] = negative ? -scale : scale;
    }
    kernels::idct_chunk(coefficients.data(), decoded.data());
  };
  if (s.nnz % 8 != 0 && (s.values.back() >> (s.nnz % 8)) != 0) {
    return corrupt(where(s, manifest) + "the sign bits past nnz = " + std::to_string(s.nnz) + " are not 0");
  }
  auto from_decoded = [&decoded](uint64_t i) { return decoded[i]; };
  for (int pass = 0; pass < 2; ++pass) {
    size_t entry = 0;
    for (uint64_t c = 0; c < chunks; ++c) {
      const uint64_t first = c * kernels::kDctChunk;
      const uint64_t n = std::min<uint64_t>(kernels::kDctChunk, s.count - first);
      decode_chunk(c, entry);
      float* out = sink.out + first;
      if (pass == 1) {
        write_range(sink, out, n, from_decoded);
      } else if (scan_range(sink, out, n, from_decoded) != 0) {
        return find_bad(where(s, manifest), sink, out, s.offset + first, n, from_decoded, "inverse DCT value");
      }
    }
  }
  return Status::ok();
}

// target is the whole tensor (whole_tensor) or the segment's range alone.
Status apply_segment(const SegmentView& s, std::span<const TensorShape> manifest, std::span<float> target,
                     float weight, bool accumulate, const SegmentRunner& runner, bool whole_tensor = true) {
  uint64_t element_count = 0;
  FEDMESH_RETURN_IF_ERROR(check_lengths(s, manifest, element_count));
  const uint64_t expected = whole_tensor ? element_count : s.count;
  if (target.size() != expected) {
    return invalid_argument("target has " + std::to_string(target.size()) + " elements, " +
                            (whole_tensor ? "tensor " : "the segment's range in tensor ") + std::to_string(s.tensor) +
                            " ('" + manifest[s.tensor].name + "') has " + std::to_string(expected));
  }
  if (accumulate && !is_finite(weight)) {
    return invalid_argument("accumulate weight is " + format_float(weight) + ", a finite value expected");
  }
  const Sink sink{target.data() + (whole_tensor ? s.offset : 0), weight, accumulate, &runner};
  const uint8_t* values = s.values.data();
  switch (s.encoding) {
    case Encoding::kDenseF32:
      return apply_dense(s, manifest, sink, [values](uint64_t i) { return load_f32(values + 4 * i); });
    case Encoding::kDenseBf16:
      if (!accumulate && decode_dense_half(s, sink, true)) return Status::ok();
      return apply_dense(s, manifest, sink, [values](uint64_t i) { return to_float(bf16{load_u16(values + 2 * i)}); });
    case Encoding::kDenseF16:
      if (!accumulate && decode_dense_half(s, sink, false)) return Status::ok();
      return apply_dense(s, manifest, sink, [values](uint64_t i) { return to_float(fp16{load_u16(values + 2 * i)}); });
    case Encoding::kSparseF32:
    case Encoding::kSparseF16:
    case Encoding::kSparseInt8:
    case Encoding::kSparseBitmapF32:
    case Encoding::kSparseBitmapF16:
    case Encoding::kSparseBitmapInt8: return apply_sparse(s, manifest, sink);
    case Encoding::kBlockInt8:
    case Encoding::kBlockInt4: return apply_blocks(s, manifest, sink);
    case Encoding::kDctSign: return apply_dct(s, manifest, sink);
  }
  return corrupt(where(s, manifest) + "unknown encoding");
}

// ---- encoder helpers -------------------------------------------------------------

Status check_input_value(float x, uint64_t position, Encoding encoding) {
  if (!is_finite(x)) {
    return invalid_argument(std::string(encoding_name(encoding)) + " input value at element " +
                            std::to_string(position) + " is " + format_float(x));
  }
  // A finite fp32 can round to Inf in a half type; the receiver would reject
  // the segment, so refuse to build it.
  // (Converted only for the half encodings: the other encodings' checks
  // are the finiteness above.)
  const bool overflows =
      (encoding == Encoding::kDenseBf16 && (to_bf16(x).bits & kBf16ExponentMask) == kBf16ExponentMask) ||
      ((encoding == Encoding::kDenseF16 || encoding == Encoding::kSparseF16) &&
       (to_fp16(x).bits & kF16ExponentMask) == kF16ExponentMask);
  if (overflows) {
    return invalid_argument(std::string(encoding_name(encoding)) + " input value at element " +
                            std::to_string(position) + " (" + format_float(x) + ") overflows " + value_type(encoding));
  }
  return Status::ok();
}

}  // namespace

// All of values at once: a branch-free scan (finite in fp32, and for the
// half types once rounded), then the slow path only to name the culprit.
namespace {

// check_input_values' scan: nonzero when a value is refused.
uint32_t scan_input_values(std::span<const float> values, Encoding encoding) {
  uint32_t bad = 0;
  // A half cast is Inf or NaN exactly when |x| is at or past the magnitude
  // that rounds (to nearest even) to Inf, NaN and Inf included: compared as
  // bits, with no conversion (test_codec checks both sides of each bound).
  const bool fp16 = value_form(encoding) == Encoding::kDenseF16 || value_form(encoding) == Encoding::kSparseF16;
  if (encoding == Encoding::kDenseBf16 || fp16) {
    const uint32_t overflow = fp16 ? kF16OverflowBits : kBf16OverflowBits;
    for (const float x : values) bad |= static_cast<uint32_t>((std::bit_cast<uint32_t>(x) & 0x7fffffffu) >= overflow);
  } else {
    for (const float x : values) bad |= non_finite(x);
  }
  return bad;
}

}  // namespace

Status check_input_values(std::span<const float> values, Encoding encoding) {
  if (scan_input_values(values, encoding) == 0) return Status::ok();
  for (size_t i = 0; i < values.size(); ++i) FEDMESH_RETURN_IF_ERROR(check_input_value(values[i], i, encoding));
  return Status::ok();
}

namespace {

// Callers skip a sparse int8 segment whose scale is 0: its values stay 0.
inline int quantize(float x, float scale, int q_max) {
  const float q = round_small(x / scale);
  return static_cast<int>(std::clamp(q, -static_cast<float>(q_max), static_cast<float>(q_max)));
}

uint64_t clamp_segment_bytes(size_t max_segment_bytes) {
  return std::min<uint64_t>(max_segment_bytes, kSegmentBytesCap);
}

}  // namespace

// ---- public -----------------------------------------------------------------------

bool is_non_finite_error(const Status& status) {
  return status.code() == StatusCode::kCorrupt && status.message().find(kNonFiniteMarker) != std::string::npos;
}

const char* encoding_name(Encoding encoding) {
  switch (encoding) {
    case Encoding::kDenseF32: return "dense-f32";
    case Encoding::kDenseBf16: return "dense-bf16";
    case Encoding::kDenseF16: return "dense-f16";
    case Encoding::kSparseF32: return "sparse-f32";
    case Encoding::kSparseF16: return "sparse-f16";
    case Encoding::kSparseInt8: return "sparse-int8";
    case Encoding::kBlockInt8: return "block-int8";
    case Encoding::kBlockInt4: return "block-int4";
    case Encoding::kSparseBitmapF32: return "sparse-bitmap-f32";
    case Encoding::kSparseBitmapF16: return "sparse-bitmap-f16";
    case Encoding::kSparseBitmapInt8: return "sparse-bitmap-int8";
    case Encoding::kDctSign: return "dct-sign";
  }
  return "unknown";
}

bool encoding_is_sparse(Encoding encoding) {
  return encoding == Encoding::kSparseF32 || encoding == Encoding::kSparseF16 || encoding == Encoding::kSparseInt8 ||
         encoding_has_bitmap(encoding);
}

bool encoding_has_bitmap(Encoding encoding) {
  return encoding == Encoding::kSparseBitmapF32 || encoding == Encoding::kSparseBitmapF16 ||
         encoding == Encoding::kSparseBitmapInt8;
}

Encoding sparse_with_bitmap(Encoding sparse, bool bitmap) {
  switch (sparse) {
    case Encoding::kSparseF32:
    case Encoding::kSparseBitmapF32: return bitmap ? Encoding::kSparseBitmapF32 : Encoding::kSparseF32;
    case Encoding::kSparseF16:
    case Encoding::kSparseBitmapF16: return bitmap ? Encoding::kSparseBitmapF16 : Encoding::kSparseF16;
    default: return bitmap ? Encoding::kSparseBitmapInt8 : Encoding::kSparseInt8;
  }
}

bool encoding_is_block(Encoding encoding) {
  return encoding == Encoding::kBlockInt8 || encoding == Encoding::kBlockInt4;
}

bool encoding_is_lossless(Encoding encoding) {
  return encoding == Encoding::kDenseF32 || encoding == Encoding::kSparseF32 || encoding == Encoding::kSparseBitmapF32;
}

// A negative dimension, or a product above kMaxTensorElements (including one
// that would overflow 64 bits), gives kInvalidElementCount, which is above the
// limit, so check_segment rejects the tensor. A zero dimension gives 0 however
// large the others are.
uint64_t TensorShape::element_count() const {
  for (const int64_t dim : dims) {
    if (dim < 0) return kInvalidElementCount;
  }
  for (const int64_t dim : dims) {
    if (dim == 0) return 0;
  }
  uint64_t product = 1;
  for (const int64_t dim : dims) {
    const uint64_t d = static_cast<uint64_t>(dim);
    if (d > kMaxTensorElements || product > kMaxTensorElements / d) return kInvalidElementCount;
    product *= d;
  }
  return product;
}

uint64_t staged_bytes(std::span<const TensorShape> manifest) {
  uint64_t bytes = 0;
  for (const TensorShape& shape : manifest) bytes += shape.element_count() * sizeof(float);
  return bytes;
}

SegmentView EncodedSegment::view() const {
  FEDMESH_CHECK(dense_source.empty(), "view() of a deferred dense segment");
  SegmentView view;
  view.tensor = tensor;
  view.encoding = encoding;
  view.offset = offset;
  view.count = count;
  view.nnz = nnz;
  view.block_size = block_size;
  view.indices = indices;
  view.values = values;
  view.scales = scales;
  return view;
}

Status check_segment(const SegmentView& segment, std::span<const TensorShape> manifest) {
  uint64_t element_count = 0;
  return check_lengths(segment, manifest, element_count);
}

Status accumulate_segment(const SegmentView& segment, std::span<const TensorShape> manifest, float weight,
                          std::span<float> target, const SegmentRunner& runner) {
  return apply_segment(segment, manifest, target, weight, /*accumulate=*/true, runner);
}

Status decode_segment(const SegmentView& segment, std::span<const TensorShape> manifest, std::span<float> target,
                      const SegmentRunner& runner) {
  return apply_segment(segment, manifest, target, 1.0f, /*accumulate=*/false, runner);
}

Status decode_segment_range(const SegmentView& segment, std::span<const TensorShape> manifest,
                            std::span<float> range, const SegmentRunner& runner) {
  return apply_segment(segment, manifest, range, 1.0f, /*accumulate=*/false, runner, /*whole_tensor=*/false);
}

Status visit_sparse_entries(const SegmentView& segment, std::span<const TensorShape> manifest,
                            const std::function<void(uint64_t index, float value)>& visit) {
  // Collected first so that a segment that fails part way visits nothing.
  std::vector<std::pair<uint64_t, float>> entries;
  FEDMESH_RETURN_IF_ERROR(sparse_entries(segment, manifest, entries));
  for (const auto& [index, value] : entries) visit(index, value);
  return Status::ok();
}

Status sparse_entries(const SegmentView& segment, std::span<const TensorShape> manifest,
                      std::vector<std::pair<uint64_t, float>>& entries) {
  entries.clear();
  uint64_t element_count = 0;
  FEDMESH_RETURN_IF_ERROR(check_lengths(segment, manifest, element_count));
  if (!encoding_is_sparse(segment.encoding)) {
    return invalid_argument(where(segment, manifest) + "visit_sparse_entries needs a sparse segment");
  }
  entries.reserve(segment.nnz);
  float scratch = 0.0f;
  const Sink collect{&scratch, 1.0f, /*accumulate=*/false};
  const uint8_t* values = segment.values.data();
  const auto walk = [&](auto load) {
    return walk_sparse(segment, manifest, [&](uint64_t k, uint64_t index) -> Status {
      const float value = load(k);
      if (!is_finite(value)) return describe_value(where(segment, manifest), collect, index, 0.0f, value, "value");
      entries.emplace_back(index, value);
      return Status::ok();
    });
  };
  Status status;
  switch (value_form(segment.encoding)) {
    case Encoding::kSparseF32: status = walk([values](uint64_t k) { return load_f32(values + 4 * k); }); break;
    case Encoding::kSparseF16:
      status = walk([values](uint64_t k) { return to_float(fp16{load_u16(values + 2 * k)}); });
      break;
    default: {
      const float scale = load_f32(segment.scales.data());
      status = walk([values, scale](uint64_t k) { return sparse_int8_value(values[k], scale); });
      break;
    }
  }
  if (!status.is_ok()) entries.clear();
  return status;
}

void write_dense_values(std::span<const float> values, Encoding encoding, uint8_t* out) {
  switch (encoding) {
    case Encoding::kDenseF32: std::memcpy(out, values.data(), values.size_bytes()); break;
    default: fp32_to_half(values.data(), out, values.size(), encoding == Encoding::kDenseBf16); break;  // the half types
  }
}

Result<std::vector<EncodedSegment>> encode_dense(uint32_t tensor, std::span<const float> values, Encoding encoding,
                                                 size_t max_segment_bytes, const SegmentRunner& runner,
                                                 bool defer_values) {
  if (!encoding_known(encoding) || encoding_is_sparse(encoding) || encoding_is_block(encoding)) {
    return invalid_argument(std::string("encode_dense: ") + encoding_name(encoding) + " is not a dense encoding");
  }
  if (values.size() > kMaxTensorElements) {
    return invalid_argument("encode_dense: " + std::to_string(values.size()) + " values, more than 2^36");
  }
  const uint64_t vb = value_bytes(encoding);
  const uint64_t per_segment = clamp_segment_bytes(max_segment_bytes) / vb;
  if (per_segment == 0) {
    return invalid_argument("encode_dense: max_segment_bytes " + std::to_string(max_segment_bytes) +
                            " is smaller than one " + value_type(encoding) + " value");
  }
  std::vector<EncodedSegment> segments;
  for (uint64_t offset = 0; offset < values.size(); offset += per_segment) {
    EncodedSegment& segment = segments.emplace_back();
    segment.tensor = tensor;
    segment.encoding = encoding;
    segment.offset = offset;
    segment.count = std::min<uint64_t>(per_segment, values.size() - offset);
  }
  // Each segment's values are checked where they are converted, on the
  // runner's threads; a refused one is named by the ordered check after.
  std::vector<uint8_t> refused(segments.size(), 0);
  run_segments(runner, segments.size(), [&](size_t i) {
    EncodedSegment& segment = segments[i];
    const uint64_t offset = segment.offset;
    if (scan_input_values(values.subspan(offset, segment.count), encoding) != 0) {
      refused[i] = 1;
      return;
    }
    const std::span<const float> source = values.subspan(offset, segment.count);
    if (defer_values) {
      segment.dense_source = source;
      segment.deferred_bytes = segment.count * vb;
      return;
    }
    segment.values.resize(segment.count * vb);
    write_dense_values(source, encoding, segment.values.data());
  });
  if (std::find(refused.begin(), refused.end(), uint8_t{1}) != refused.end()) {
    const Status named = check_input_values(values, encoding);  // the same scan, then the first value named
    FEDMESH_CHECK(!named.is_ok(), "encode_dense: a segment's scan refused a value the ordered check accepts");
    return named;
  }
  return segments;
}

namespace {

// What encode_sparse refuses of its input, named for the first entry that
// has it (run only once a parallel scan found one).
Status describe_sparse_input(uint64_t element_count, std::span<const uint64_t> indices, std::span<const float> values,
                             Encoding encoding) {
  for (size_t k = 0; k < indices.size(); ++k) {
    if (indices[k] >= element_count) {
      return invalid_argument("encode_sparse: index " + std::to_string(k) + " (" + std::to_string(indices[k]) +
                              ") is outside the tensor's " + std::to_string(element_count) + " elements");
    }
    if (k > 0 && indices[k] <= indices[k - 1]) {
      return invalid_argument("encode_sparse: index " + std::to_string(k) + " (" + std::to_string(indices[k]) +
                              ") does not follow index " + std::to_string(k - 1) + " (" +
                              std::to_string(indices[k - 1]) + "): indices must strictly increase");
    }
    FEDMESH_RETURN_IF_ERROR(check_input_value(values[k], indices[k], encoding));
  }
  return Status::ok();
}

// Entries a part of a sparse encode covers: one task each on the runner.
constexpr uint64_t kEncodePart = uint64_t{1} << 16;

}  // namespace

Result<std::vector<EncodedSegment>> encode_sparse(uint32_t tensor, uint64_t element_count,
                                                  std::span<const uint64_t> indices, std::span<const float> values,
                                                  Encoding encoding, size_t max_segment_bytes,
                                                  const SegmentRunner& runner, std::span<float> decoded) {
  if (!encoding_is_sparse(encoding)) {
    return invalid_argument(std::string("encode_sparse: ") + encoding_name(encoding) + " is not a sparse encoding");
  }
  if (element_count > kMaxTensorElements) {
    return invalid_argument("encode_sparse: element_count " + std::to_string(element_count) + " is more than 2^36");
  }
  if (indices.size() != values.size()) {
    return invalid_argument("encode_sparse: " + std::to_string(indices.size()) + " indices but " +
                            std::to_string(values.size()) + " values");
  }
  if (!decoded.empty() && decoded.size() != values.size()) {
    return invalid_argument("encode_sparse: room for " + std::to_string(decoded.size()) + " decoded values, " +
                            std::to_string(values.size()) + " entries");
  }
  // The entries checked in parts on the runner, branch-free; the first bad
  // one is named by a second, ordered pass.
  {
    const size_t parts = (indices.size() + kEncodePart - 1) / kEncodePart;
    std::vector<uint8_t> bad(parts, 0);
    run_segments(runner, parts, [&](size_t p) {
      const uint64_t first = p * kEncodePart, last = std::min<uint64_t>(indices.size(), first + kEncodePart);
      uint32_t flag = scan_input_values(values.subspan(first, last - first), encoding);
      uint64_t previous = first > 0 ? indices[first - 1] : 0;
      for (uint64_t k = first; k < last; ++k) {
        flag |= static_cast<uint32_t>(indices[k] >= element_count) | static_cast<uint32_t>(k > 0 && indices[k] <= previous);
        previous = indices[k];
      }
      bad[p] = static_cast<uint8_t>(flag != 0);
    });
    if (std::find(bad.begin(), bad.end(), uint8_t{1}) != bad.end()) {
      FEDMESH_RETURN_IF_ERROR(describe_sparse_input(element_count, indices, values, encoding));
    }
  }
  std::vector<EncodedSegment> segments;
  if (element_count == 0) return segments;

  const uint64_t vb = value_bytes(encoding);
  const bool int8 = value_form(encoding) == Encoding::kSparseInt8;
  const bool bitmap = encoding_has_bitmap(encoding);
  const uint64_t fixed = int8 ? kScaleBytes : 0;
  const uint64_t budget = clamp_segment_bytes(max_segment_bytes);
  // The smallest segment that holds a value: its index is the segment's
  // offset, so its varint is the one byte 0.
  if (budget < fixed + 1 + vb) {
    return invalid_argument("encode_sparse: max_segment_bytes " + std::to_string(max_segment_bytes) +
                            " is smaller than one " + encoding_name(encoding) + " entry (" +
                            std::to_string(fixed + 1 + vb) + " bytes)");
  }

  // Segments tile [0, element_count) so that decoding them all defines every
  // element. Greedy: an entry that does not fit closes the segment just before
  // its index and opens the next one there (where its gap costs one byte).
  struct Range {
    uint64_t offset, first, last;  // covers [offset, next offset); entries [first, last)
  };
  std::vector<Range> ranges;
  Range current{0, 0, 0};
  uint64_t used = fixed;
  if (bitmap) {
    // A segment's bitmap grows with the range it covers, so a long empty
    // stretch closes it too; the tail is tiled with empty segments.
    const uint64_t span = 8 * (budget - fixed);  // elements an empty segment's bitmap covers
    for (size_t k = 0; k < indices.size(); ++k) {
      while (fixed + bitmap_bytes(indices[k] - current.offset + 1) + (k + 1 - current.first) * vb > budget) {
        const uint64_t cut = current.last > current.first ? indices[current.last - 1] + 1
                                                           : std::min(current.offset + span, indices[k]);
        ranges.push_back(current);
        current = Range{cut, k, k};
      }
      current.last = k + 1;
    }
    const auto fits_to_end = [&](const Range& r) {
      return fixed + bitmap_bytes(element_count - r.offset) + (r.last - r.first) * vb <= budget;
    };
    while (!fits_to_end(current)) {
      const uint64_t cut = current.last > current.first ? indices[current.last - 1] + 1 : current.offset + span;
      ranges.push_back(current);
      current = Range{cut, current.last, current.last};
    }
    ranges.push_back(current);
  } else {
    for (size_t k = 0; k < indices.size(); ++k) {
      const uint64_t gap = current.last == current.first ? indices[k] - current.offset : indices[k] - indices[k - 1];
      const uint64_t cost = varint_bytes(gap) + vb;
      if (used + cost > budget) {
        ranges.push_back(current);
        current = Range{indices[k], k, k};
        used = fixed + 1 + vb;
      } else {
        used += cost;
      }
      current.last = k + 1;
    }
    ranges.push_back(current);
  }

  for (size_t r = 0; r < ranges.size(); ++r) {
    const Range& range = ranges[r];
    EncodedSegment& segment = segments.emplace_back();
    segment.tensor = tensor;
    segment.encoding = encoding;
    segment.offset = range.offset;
    segment.count = (r + 1 < ranges.size() ? ranges[r + 1].offset : element_count) - range.offset;
    segment.nnz = range.last - range.first;
    // The segment's entries in parts, each written on the runner where it
    // lies: a bitmap part starts where a new byte of the bitmap does (so no
    // two parts write one byte), a varint part where the sizes of the gaps
    // before it put it.
    std::vector<uint64_t> starts;
    for (uint64_t k = range.first; k < range.last; k += kEncodePart) {
      uint64_t start = k;
      if (bitmap) {
        while (start > range.first && start < range.last &&
               (indices[start] - range.offset) / 8 == (indices[start - 1] - range.offset) / 8) {
          ++start;
        }
      }
      if (starts.empty() || start > starts.back()) starts.push_back(start);
    }
    starts.push_back(range.last);
    const size_t parts = starts.size() - 1;
    const auto gap_of = [&](uint64_t k) { return k == range.first ? indices[k] - range.offset : indices[k] - indices[k - 1]; };
    float scale = 0.0f;
    if (int8) {
      std::vector<float> part_max(parts, 0.0f);
      run_segments(runner, parts, [&](size_t p) {
        float m = 0.0f;
        for (uint64_t k = starts[p]; k < starts[p + 1]; ++k) m = std::max(m, std::fabs(values[k]));
        part_max[p] = m;
      });
      float max_abs = 0.0f;
      for (const float m : part_max) max_abs = std::max(max_abs, m);
      scale = kernels::quantization_scale(max_abs, kInt8Max);
      append_f32(segment.scales, scale);
    }
    std::vector<uint64_t> index_at(parts + 1, 0);  // where each part's indices begin
    if (bitmap) {
      segment.indices.assign(bitmap_bytes(segment.count), 0);
    } else {
      run_segments(runner, parts, [&](size_t p) {
        uint64_t bytes = 0;
        for (uint64_t k = starts[p]; k < starts[p + 1]; ++k) bytes += varint_bytes(gap_of(k));
        index_at[p + 1] = bytes;
      });
      for (size_t p = 0; p < parts; ++p) index_at[p + 1] += index_at[p];
      segment.indices.resize(index_at[parts]);
    }
    segment.values.resize(segment.nnz * vb);
    run_segments(runner, parts, [&](size_t p) {
      uint8_t* index_out = segment.indices.data() + index_at[p];
      for (uint64_t k = starts[p]; k < starts[p + 1]; ++k) {
        if (bitmap) {
          const uint64_t bit = indices[k] - range.offset;
          segment.indices[bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
        } else {
          index_out = put_varint(index_out, gap_of(k));
        }
        uint8_t* value_out = segment.values.data() + (k - range.first) * vb;
        float sent = 0.0f;
        switch (value_form(encoding)) {
          case Encoding::kSparseF32:
            std::memcpy(value_out, &values[k], 4);
            sent = values[k];
            break;
          case Encoding::kSparseF16: {
            const uint16_t bits = to_fp16(values[k]).bits;
            value_out[0] = static_cast<uint8_t>(bits);
            value_out[1] = static_cast<uint8_t>(bits >> 8);
            sent = to_float(fp16{bits});
            break;
          }
          default:
            value_out[0] =
                scale > 0.0f ? static_cast<uint8_t>(static_cast<int8_t>(quantize(values[k], scale, kInt8Max))) : 0;
            sent = sparse_int8_value(value_out[0], scale);
            break;
        }
        if (!decoded.empty()) decoded[k] = sent;
      }
    });
  }
  return segments;
}

Result<std::vector<EncodedSegment>> encode_blocks(uint32_t tensor, std::span<const float> values, Encoding encoding,
                                                  uint32_t block_size, size_t max_segment_bytes,
                                                  kernels::Rounding rounding, uint64_t seed) {
  if (!encoding_is_block(encoding)) {
    return invalid_argument(std::string("encode_blocks: ") + encoding_name(encoding) + " is not a block encoding");
  }
  if (block_size == 0 || block_size > kMaxBlockSize) {
    return invalid_argument("encode_blocks: block_size " + std::to_string(block_size) + " is outside [1, " +
                            std::to_string(kMaxBlockSize) + "]");
  }
  if (values.size() > kMaxTensorElements) {
    return invalid_argument("encode_blocks: " + std::to_string(values.size()) + " values, more than 2^36");
  }
  const bool int4 = encoding == Encoding::kBlockInt4;
  FEDMESH_RETURN_IF_ERROR(check_input_values(values, encoding));

  const uint64_t blocks = (values.size() + block_size - 1) / block_size;
  std::vector<uint8_t> packed(int4 ? (values.size() + 1) / 2 : values.size());
  std::vector<float> scales(blocks);
  kernels::quantize_blocks(values.data(), values.size(), int4 ? 4 : 8, block_size, rounding, seed, 0, packed.data(),
                           scales.data());
  return encode_quantized_blocks(tensor, values.size(), packed, scales, encoding, block_size, max_segment_bytes);
}

Result<std::vector<EncodedSegment>> encode_quantized_blocks(uint32_t tensor, uint64_t element_count,
                                                            std::span<const uint8_t> packed,
                                                            std::span<const float> scales, Encoding encoding,
                                                            uint32_t block_size, size_t max_segment_bytes,
                                                            const SegmentRunner& runner) {
  if (!encoding_is_block(encoding) || block_size == 0 || block_size > kMaxBlockSize) {
    return invalid_argument(std::string("encode_quantized_blocks: ") + encoding_name(encoding) +
                            " with block_size " + std::to_string(block_size) + " is not a block encoding");
  }
  const bool int4 = encoding == Encoding::kBlockInt4;
  const uint64_t blocks = (element_count + block_size - 1) / block_size;
  if (packed.size() != (int4 ? (element_count + 1) / 2 : element_count) || scales.size() != blocks) {
    return invalid_argument("encode_quantized_blocks: " + std::to_string(packed.size()) + " value bytes and " +
                            std::to_string(scales.size()) + " scales do not fit " + std::to_string(element_count) +
                            " elements");
  }
  const uint64_t budget = clamp_segment_bytes(max_segment_bytes);
  // Whole blocks per segment, an even number of elements for int4 (so that a
  // segment starts on a byte) unless one block is all that fits.
  uint64_t blocks_per_segment =
      int4 ? 2 * budget / (block_size + 2 * kScaleBytes) : budget / (block_size + kScaleBytes);
  if (int4 && (block_size & 1) != 0 && blocks_per_segment > 1) blocks_per_segment &= ~uint64_t{1};
  if (blocks_per_segment == 0) {
    return invalid_argument("encode_quantized_blocks: max_segment_bytes " + std::to_string(max_segment_bytes) +
                            " is smaller than one " + encoding_name(encoding) + " block of " +
                            std::to_string(block_size) + " elements");
  }
  const uint64_t per_segment = blocks_per_segment * block_size;
  std::vector<EncodedSegment> segments;
  for (uint64_t offset = 0; offset < element_count; offset += per_segment) {
    EncodedSegment& segment = segments.emplace_back();
    segment.tensor = tensor;
    segment.encoding = encoding;
    segment.offset = offset;
    segment.count = std::min<uint64_t>(per_segment, element_count - offset);
    segment.block_size = block_size;
  }
  run_segments(runner, segments.size(), [&](size_t i) {
    EncodedSegment& segment = segments[i];
    const uint64_t offset = segment.offset;
    const uint64_t first_block = offset / block_size;
    const uint64_t segment_blocks = (segment.count + block_size - 1) / block_size;
    segment.scales.resize(segment_blocks * kScaleBytes);
    std::memcpy(segment.scales.data(), scales.data() + first_block, segment_blocks * kScaleBytes);
    if (!int4) {
      segment.values.assign(packed.begin() + static_cast<int64_t>(offset),
                            packed.begin() + static_cast<int64_t>(offset + segment.count));
    } else if ((offset & 1) == 0) {
      segment.values.assign(packed.begin() + static_cast<int64_t>(offset / 2),
                            packed.begin() + static_cast<int64_t>(offset / 2 + (segment.count + 1) / 2));
      if ((segment.count & 1) != 0) segment.values.back() &= 0x0f;  // the next segment's nibble is not ours
    } else {  // one odd-sized block per segment: shift the nibbles down
      segment.values.assign((segment.count + 1) / 2, 0);
      for (uint64_t i = 0; i < segment.count; ++i) {
        const uint64_t source = offset + i;
        const uint8_t nibble = (packed[source / 2] >> (4 * (source & 1))) & 0xf;
        segment.values[i / 2] |= static_cast<uint8_t>(nibble << (4 * (i & 1)));
      }
    }
  });
  return segments;
}

}  // namespace fedmesh::protocol

namespace fedmesh::protocol {

SparseIndexCost sparse_index_cost(std::span<const uint64_t> indices, uint64_t element_count) {
  SparseIndexCost cost;
  cost.bitmap_bytes = bitmap_bytes(element_count);
  uint64_t previous = 0;
  for (size_t k = 0; k < indices.size(); ++k) {
    cost.varint_bytes += varint_bytes(k == 0 ? indices[k] : indices[k] - previous);
    previous = indices[k];
  }
  return cost;
}

Result<std::vector<EncodedSegment>> encode_dct_sign(uint32_t tensor, uint64_t element_count,
                                                    std::span<const uint64_t> positions,
                                                    std::span<const uint8_t> negative,
                                                    std::span<const float> chunk_scales, size_t max_segment_bytes) {
  constexpr uint64_t kChunk = kernels::kDctChunk;
  if (element_count > kMaxTensorElements) {
    return invalid_argument("encode_dct_sign: element_count " + std::to_string(element_count) + " is more than 2^36");
  }
  const uint64_t chunks = dct_chunks_covering(element_count);
  if (chunk_scales.size() != chunks || negative.size() != positions.size()) {
    return invalid_argument("encode_dct_sign: " + std::to_string(chunk_scales.size()) + " chunk scales for " +
                            std::to_string(chunks) + " chunks, " + std::to_string(negative.size()) + " signs for " +
                            std::to_string(positions.size()) + " positions");
  }
  for (size_t k = 0; k < positions.size(); ++k) {
    if (positions[k] >= chunks * kChunk || (k > 0 && positions[k] <= positions[k - 1])) {
      return invalid_argument("encode_dct_sign: position " + std::to_string(k) + " (" + std::to_string(positions[k]) +
                              ") is out of order or outside the " + std::to_string(chunks * kChunk) + " coefficients");
    }
  }
  for (size_t c = 0; c < chunk_scales.size(); ++c) {
    if (!is_finite(chunk_scales[c]) || !(chunk_scales[c] >= 0.0f)) {
      return invalid_argument("encode_dct_sign: chunk scale " + std::to_string(c) + " is " +
                              format_float(chunk_scales[c]));
    }
  }
  const uint64_t budget = clamp_segment_bytes(max_segment_bytes);
  // Whole chunks per segment: a chunk costs its scale, at most 10 bytes per
  // index and an eighth of a byte per sign; a segment closes before a chunk
  // that would not fit (one chunk always goes in, whatever its size).
  std::vector<EncodedSegment> segments;
  size_t entry = 0;
  for (uint64_t c = 0; c < chunks;) {
    EncodedSegment& segment = segments.emplace_back();
    segment.tensor = tensor;
    segment.encoding = Encoding::kDctSign;
    segment.offset = c * kChunk;
    const size_t first_entry = entry;
    uint64_t previous = segment.offset, used = 0;
    std::vector<uint8_t> indices;
    do {
      size_t end = entry;
      while (end < positions.size() && positions[end] / kChunk == c) ++end;
      const uint64_t cost = kScaleBytes + (end - entry) * (kMaxVarintBytes + 1);
      if (used > 0 && used + cost > budget) break;
      used += cost;
      append_f32(segment.scales, chunk_scales[c]);
      for (; entry < end; ++entry) {
        append_varint(indices, positions[entry] - previous);
        previous = positions[entry];
      }
      ++c;
    } while (c < chunks);
    segment.count = std::min<uint64_t>(c * kChunk, element_count) - segment.offset;
    segment.nnz = entry - first_entry;
    segment.indices = std::move(indices);
    segment.values.assign(bitmap_bytes(segment.nnz), 0);
    for (size_t k = first_entry; k < entry; ++k) {
      if (negative[k]) segment.values[(k - first_entry) / 8] |= static_cast<uint8_t>(1u << ((k - first_entry) % 8));
    }
  }
  return segments;
}

}  // namespace fedmesh::protocol
