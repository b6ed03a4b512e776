#include "protocol/compressor.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>

#include "base/random.h"
#include "kernels/half.h"
#include "kernels/half_arrays.h"
#include "kernels/parallel.h"

namespace fedmesh::protocol {
namespace {

constexpr int64_t kGrain = int64_t{1} << 16;

// out = in, over every core (a residual starts as a copy of its input).
void parallel_copy(std::span<const float> in, std::span<float> out) {
  parallel_for(static_cast<int64_t>(in.size()), kGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(out.data() + begin, in.data() + begin, static_cast<size_t>(end - begin) * sizeof(float));
  });
}

// Whether every value is finite: a branch-free scan over every core.
bool all_finite(std::span<const float> values) {
  std::atomic<bool> bad{false};
  parallel_for(static_cast<int64_t>(values.size()), kGrain, [&](int64_t begin, int64_t end) {
    uint32_t flag = 0;
    for (int64_t i = begin; i < end; ++i) {
      flag |= static_cast<uint32_t>((std::bit_cast<uint32_t>(values[static_cast<size_t>(i)]) & 0x7f800000u) == 0x7f800000u);
    }
    if (flag != 0) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

// Half bits are widened back to fp32 as the codec decodes them
// (kernels/half_arrays.h), this many at a time.
constexpr size_t kWidenBlock = 2048;  // floats widened at a time, on the stack

TensorDescriptorFields descriptor_of(const TensorShape& shape, Encoding encoding, uint32_t block_size = 0) {
  return {shape.name, shape.dims, encoding, block_size};
}

class IdentityCompressor final : public TensorCompressor {
 public:
  IdentityCompressor(TensorShape shape, Encoding encoding, size_t max_segment_bytes)
      : shape_(std::move(shape)), encoding_(encoding), max_segment_bytes_(max_segment_bytes) {}
  Result<EncodedTensor> compress(uint32_t index, std::span<const float> a, int64_t, uint64_t) override {
    Result<std::vector<EncodedSegment>> segments = encode_dense(index, a, encoding_, max_segment_bytes_, parallel_each);
    if (!segments.is_ok()) return segments.status();
    return EncodedTensor{descriptor_of(shape_, encoding_), std::move(*segments)};
  }

  // A half cast's D(C(a)) is its half bits widened, element by element: read
  // from the segments just encoded (the codec's own conversion, so bit for
  // bit its decoding) in one parallel pass, the bits kept for take_back.
  Status update_residual(const EncodedTensor& sent, std::span<const TensorShape> manifest, std::span<const float> a,
                         std::span<float> residual, std::span<float> decoded, kernels::CompressionKernels& kernels,
                         std::vector<float>& scratch) override {
    if (encoding_ == Encoding::kDenseF32) {
      return TensorCompressor::update_residual(sent, manifest, a, residual, decoded, kernels, scratch);
    }
    kept_half_.resize(a.size());
    const bool brain = encoding_ == Encoding::kDenseBf16;
    parallel_for(static_cast<int64_t>(sent.segments.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const EncodedSegment& segment = sent.segments[static_cast<size_t>(s)];
        const uint8_t* bytes = segment.values.data();
        uint16_t* kept = kept_half_.data() + segment.offset;
        const float* x = a.data() + segment.offset;
        float* e = residual.data() + segment.offset;
        float* out = decoded.empty() ? nullptr : decoded.data() + segment.offset;
        const uint64_t count = segment.count;
        std::memcpy(kept, bytes, count * sizeof(uint16_t));  // little-endian on the wire and here
        // Widened a cache-sized block at a time (the codec's own conversion).
        float d[kWidenBlock];
        for (uint64_t first = 0; first < count; first += kWidenBlock) {
          const uint64_t n = std::min<uint64_t>(kWidenBlock, count - first);
          half_to_fp32(kept + first, d, n, brain);
          if (out != nullptr) std::memcpy(out + first, d, n * sizeof(float));
          for (uint64_t i = 0; i < n; ++i) e[first + i] = x[first + i] - d[i];
        }
      }
    });
    return Status::ok();
  }

  Status take_back(std::span<float> residual, std::span<const TensorShape> manifest, kernels::CompressionKernels& kernels,
                   std::vector<float>& scratch) override {
    if (encoding_ == Encoding::kDenseF32) return TensorCompressor::take_back(residual, manifest, kernels, scratch);
    const bool brain = encoding_ == Encoding::kDenseBf16;
    parallel_for(static_cast<int64_t>(residual.size()), kGrain, [&](int64_t begin, int64_t end) {
      float d[kWidenBlock];
      for (auto first = static_cast<size_t>(begin); first < static_cast<size_t>(end); first += kWidenBlock) {
        const size_t n = std::min<size_t>(kWidenBlock, static_cast<size_t>(end) - first);
        half_to_fp32(kept_half_.data() + first, d, n, brain);
        for (size_t i = 0; i < n; ++i) residual[first + i] += d[i];
      }
    });
    return Status::ok();
  }

  void release() override {
    TensorCompressor::release();
    std::vector<uint16_t>().swap(kept_half_);
  }

 private:
  TensorShape shape_;
  Encoding encoding_;
  size_t max_segment_bytes_;
  std::vector<uint16_t> kept_half_;  // the last half-cast update, for take_back
};

class BlockCompressor final : public TensorCompressor {
 public:
  BlockCompressor(TensorShape shape, const CompressionSpec& spec, kernels::CompressionKernels& kernels,
                  size_t max_segment_bytes)
      : shape_(std::move(shape)), spec_(spec), kernels_(kernels), max_segment_bytes_(max_segment_bytes) {}
  Result<EncodedTensor> compress(uint32_t index, std::span<const float> a, int64_t, uint64_t seed) override {
    const kernels::BlockQuantization q{spec_.bits, spec_.block_size, spec_.rounding, seed};
    resize_for(a.size());
    kernels_.quantize_blocks(a, q, packed_, scales_);
    return encode(index, a.size(), seed);
  }

  Result<EncodedTensor> compress_with_residual(uint32_t index, std::span<const float> a, int64_t, uint64_t seed,
                                               std::span<const TensorShape>, std::span<float> residual,
                                               std::span<float> decoded, kernels::CompressionKernels& kernels,
                                               std::vector<float>& scratch) override {
    resize_for(a.size());
    kernels.quantize_blocks_with_residual(a, kernels::BlockQuantization{spec_.bits, spec_.block_size, spec_.rounding, seed},
                                          packed_, scales_, residual, decoded, scratch);
    return encode(index, a.size(), seed);
  }

  Result<EncodedTensor> compress_folding(uint32_t index, std::span<const float> delta, int64_t, uint64_t seed,
                                         std::span<const TensorShape> manifest, std::span<float> residual,
                                         std::span<float> decoded, kernels::CompressionKernels& kernels,
                                         std::vector<float>& scratch) override {
    resize_for(residual.size());
    kernels.add_quantize_blocks_with_residual(
        residual, delta, kernels::BlockQuantization{spec_.bits, spec_.block_size, spec_.rounding, seed}, packed_,
        scales_, decoded, scratch);
    last_seed_ = seed;
    Result<EncodedTensor> encoded = encode(index, residual.size(), seed);
    if (!encoded.is_ok()) {
      // The residual back to a, as promised.
      FEDMESH_RETURN_IF_ERROR(take_back(residual, manifest, kernels, scratch));
    }
    return encoded;
  }

  // The receiver decodes element i as q_i * scale: dequantizing what compress
  // kept is that, bit for bit, without parsing the segments again.
  Status update_residual(const EncodedTensor&, std::span<const TensorShape>, std::span<const float> a,
                         std::span<float> residual, std::span<float> decoded, kernels::CompressionKernels& kernels,
                         std::vector<float>& scratch) override {
    std::span<float> values = decoded;
    if (values.empty()) {
      scratch.resize(a.size());
      values = scratch;
    }
    kernels.dequantize_blocks(packed_, kernels::BlockQuantization{spec_.bits, spec_.block_size, spec_.rounding, last_seed_},
                              scales_, values);
    kernels.subtract(a, values, residual);
    return Status::ok();
  }

  Status take_back(std::span<float> residual, std::span<const TensorShape>, kernels::CompressionKernels& kernels,
                   std::vector<float>& scratch) override {
    if (packed_.size() != (spec_.bits == 4 ? (residual.size() + 1) / 2 : residual.size())) {
      return invalid_argument("tensor '" + shape_.name + "': no quantized update kept to give back");
    }
    scratch.resize(residual.size());
    kernels.dequantize_blocks(packed_, kernels::BlockQuantization{spec_.bits, spec_.block_size, spec_.rounding, last_seed_},
                              scales_, scratch);
    kernels.add(residual, scratch, residual);
    return Status::ok();
  }

  void release() override {
    std::vector<uint8_t>().swap(packed_);
    std::vector<float>().swap(scales_);
  }

 private:
  void resize_for(size_t n) {
    packed_.resize(spec_.bits == 4 ? (n + 1) / 2 : n);
    scales_.resize((n + spec_.block_size - 1) / spec_.block_size);
  }

  Result<EncodedTensor> encode(uint32_t index, size_t n, uint64_t seed) {
    const Encoding encoding = spec_.bits == 4 ? Encoding::kBlockInt4 : Encoding::kBlockInt8;
    Result<std::vector<EncodedSegment>> segments =
        encode_quantized_blocks(index, n, packed_, scales_, encoding, spec_.block_size, max_segment_bytes_,
                                parallel_each);
    if (!segments.is_ok()) return segments.status();
    last_seed_ = seed;
    return EncodedTensor{descriptor_of(shape_, encoding, spec_.block_size), std::move(*segments)};
  }

  TensorShape shape_;
  CompressionSpec spec_;
  kernels::CompressionKernels& kernels_;
  size_t max_segment_bytes_;
  std::vector<uint8_t> packed_;
  std::vector<float> scales_;
  uint64_t last_seed_ = 0;
};

class TopKCompressor final : public TensorCompressor {
 public:
  TopKCompressor(TensorShape shape, const CompressionSpec& spec, kernels::CompressionKernels& kernels,
                 size_t max_segment_bytes)
      : shape_(std::move(shape)), spec_(spec), kernels_(kernels), max_segment_bytes_(max_segment_bytes) {
    if (spec_.momentum > 0.0) momentum_.assign(shape_.element_count(), 0.0f);
  }

  // Deep Gradient Compression's momentum correction, at the granularity of
  // what is compressed (a round's delta): u <- m u + delta, a = e + u; the
  // positions sent are cleared from u afterwards (momentum factor masking).
  void form_input(std::span<const float> residual, std::span<const float> delta, std::span<float> a,
                  kernels::CompressionKernels& kernels) override {
    if (momentum_.empty()) return TensorCompressor::form_input(residual, delta, a, kernels);
    const float m = static_cast<float>(spec_.momentum);
    parallel_for(static_cast<int64_t>(a.size()), kGrain, [&](int64_t begin, int64_t end) {
      for (auto i = static_cast<size_t>(begin); i < static_cast<size_t>(end); ++i) {
        momentum_[i] = m * momentum_[i] + delta[i];
        a[i] = residual[i] + momentum_[i];
      }
    });
  }

  Result<EncodedTensor> compress(uint32_t index, std::span<const float> a, int64_t round, uint64_t seed) override {
    return encode_selection(index, a, kernels_.top_k(a, k_of(a.size(), round), kernels::TopKOptions{.seed = seed}),
                            false);
  }

  Result<EncodedTensor> compress_with_residual(uint32_t index, std::span<const float> a, int64_t round, uint64_t seed,
                                               std::span<const TensorShape> manifest, std::span<float> residual,
                                               std::span<float> decoded, kernels::CompressionKernels& kernels,
                                               std::vector<float>& scratch) override {
    return send_with_residual(index, a, kernels_.top_k(a, k_of(a.size(), round), kernels::TopKOptions{.seed = seed}),
                              manifest, residual, decoded, kernels, scratch);
  }

  // Without momentum, a = e + delta is formed in the pass that gathers the
  // candidates (one read of e and delta instead of a pass forming a and a
  // second reading it); the same selection, bytes and residual.
  Result<EncodedTensor> compress_folding(uint32_t index, std::span<const float> delta, int64_t round, uint64_t seed,
                                         std::span<const TensorShape> manifest, std::span<float> residual,
                                         std::span<float> decoded, kernels::CompressionKernels& kernels,
                                         std::vector<float>& scratch) override {
    if (!momentum_.empty()) {
      return TensorCompressor::compress_folding(index, delta, round, seed, manifest, residual, decoded, kernels,
                                                scratch);
    }
    return send_with_residual(
        index, residual,
        kernels.add_top_k(residual, delta, k_of(residual.size(), round), kernels::TopKOptions{.seed = seed}), manifest,
        residual, decoded, kernels, scratch);
  }

  // The selection encoded, then the residual stepped from what was sent.
  Result<EncodedTensor> send_with_residual(uint32_t index, std::span<const float> a, kernels::TopKSelection selection,
                                           std::span<const TensorShape> manifest, std::span<float> residual,
                                           std::span<float> decoded, kernels::CompressionKernels& kernels,
                                           std::vector<float>& scratch) {
    Result<EncodedTensor> encoded = encode_selection(index, a, std::move(selection), true);
    if (!encoded.is_ok()) return encoded;
    FEDMESH_RETURN_IF_ERROR(update_residual(*encoded, manifest, a, residual, decoded, kernels, scratch));
    return encoded;
  }

  uint64_t k_of(uint64_t n, int64_t round) const {
    const double density = topk_density(spec_, round);
    return std::clamp<uint64_t>(static_cast<uint64_t>(std::llround(density * static_cast<double>(n))), 1, n);
  }

  // The selection's values come with it from the CPU backend (read from a
  // otherwise: a random read per value). The positions and values sent are
  // kept for the residual step that follows, which then reads neither a
  // again.
  Result<EncodedTensor> encode_selection(uint32_t index, std::span<const float> a, kernels::TopKSelection selection,
                                         bool keep_for_residual) {
    const uint64_t n = a.size();
    std::vector<float> values = std::move(selection.values);
    if (values.size() != selection.indices.size()) {
      values.resize(selection.indices.size());
      for (size_t i = 0; i < values.size(); ++i) values[i] = a[selection.indices[i]];
    }
    const bool bitmap = sparse_index_cost(selection.indices, n).bitmap_smaller();
    const Encoding encoding = sparse_with_bitmap(spec_.values, bitmap);
    // For the residual step: what the receiver will decode at each position,
    // from the encoder (bit for bit the decoder's expression).
    std::vector<float> decoded;
    if (keep_for_residual) decoded.resize(values.size());
    Result<std::vector<EncodedSegment>> segments =
        encode_sparse(index, n, selection.indices, values, encoding, max_segment_bytes_, parallel_each, decoded);
    if (!segments.is_ok()) return segments.status();
    if (keep_for_residual) {
      sent_indices_ = std::move(selection.indices);
      sent_values_ = std::move(values);
      sent_decoded_ = std::move(decoded);
      sent_from_ = a.data();
    } else {
      forget_sent();
    }
    return EncodedTensor{descriptor_of(shape_, encoding), std::move(*segments)};
  }

  // The residual is a except at the k positions sent (in place when the
  // residual is a: nothing to copy), where the receiver's decoding (read back
  // from the segments' bytes) is subtracted; those k positions and values are
  // kept for take_back. The positions sent are also cleared from the momentum
  // (DGC's masking).
  Status update_residual(const EncodedTensor& sent, std::span<const TensorShape> manifest, std::span<const float> a,
                         std::span<float> residual, std::span<float> decoded, kernels::CompressionKernels&,
                         std::vector<float>&) override {
    if (residual.data() != a.data()) parallel_copy(a, residual);
    if (!decoded.empty()) std::fill(decoded.begin(), decoded.end(), 0.0f);
    // Entry j of the update (in the segments' order) is entry j - first[s]
    // of segment s.
    const size_t segments = sent.segments.size();
    std::vector<uint64_t> first(segments + 1, 0);
    for (size_t s = 0; s < segments; ++s) first[s + 1] = first[s] + sent.segments[s].nnz;
    const uint64_t total = first[segments];
    // a[i] at the j-th position sent, from what compress kept (in the same
    // order as the segments carry them) where it is this a's: no read of a.
    const bool kept_sent = sent_from_ == a.data() && sent_indices_.size() == total;
    if (kept_sent && sent_decoded_.size() == total) {
      // The encoder gave what the receiver decodes at each position sent:
      // the residual is stepped from that, with no parse of the segments.
      parallel_for(static_cast<int64_t>(total), kGrain, [&](int64_t begin, int64_t end) {
        for (auto j = static_cast<size_t>(begin); j < static_cast<size_t>(end); ++j) {
          const uint64_t i = sent_indices_[j];
          const float value = sent_decoded_[j];
          residual[i] = sent_values_[j] - value;
          if (!decoded.empty()) decoded[i] = value;
          if (!momentum_.empty()) momentum_[i] = 0.0f;
        }
      });
      kept_indices_ = std::move(sent_indices_);
      kept_values_ = std::move(sent_decoded_);
      forget_sent();
      return Status::ok();
    }
    std::vector<uint64_t>& positions = kept_sent ? sent_indices_ : kept_indices_;
    if (!kept_sent) kept_indices_.assign(total, 0);
    kept_values_.resize(total);
    std::vector<std::pair<uint64_t, float>> entries;
    for (size_t s = 0; s < segments; ++s) {
      FEDMESH_RETURN_IF_ERROR(sparse_entries(sent.segments[s].view(), manifest, entries));
      if (entries.size() != first[s + 1] - first[s]) {
        return corrupt("top-k: segment " + std::to_string(s) + " holds " + std::to_string(entries.size()) +
                       " entries, its nnz says " + std::to_string(first[s + 1] - first[s]));
      }
      // Written on every core: each position is a random write, which one
      // core would wait on one after another.
      parallel_for(static_cast<int64_t>(entries.size()), kGrain, [&](int64_t begin, int64_t end) {
        for (auto e = static_cast<size_t>(begin); e < static_cast<size_t>(end); ++e) {
          const auto [i, value] = entries[e];
          const uint64_t j = first[s] + e;
          const float at = kept_sent && positions[j] == i ? sent_values_[j] : a[i];
          positions[j] = i;
          residual[i] = at - value;
          kept_values_[j] = value;
          if (!decoded.empty()) decoded[i] = value;
          if (!momentum_.empty()) momentum_[i] = 0.0f;
        }
      });
    }
    if (kept_sent) kept_indices_ = std::move(sent_indices_);
    forget_sent();
    return Status::ok();
  }

  void forget_sent() {
    std::vector<uint64_t>().swap(sent_indices_);
    std::vector<float>().swap(sent_values_);
    std::vector<float>().swap(sent_decoded_);
    sent_from_ = nullptr;
  }

  Status take_back(std::span<float> residual, std::span<const TensorShape>, kernels::CompressionKernels&,
                   std::vector<float>&) override {
    for (size_t j = 0; j < kept_indices_.size(); ++j) residual[kept_indices_[j]] += kept_values_[j];
    return Status::ok();
  }

  void release() override {
    std::vector<uint64_t>().swap(kept_indices_);
    std::vector<float>().swap(kept_values_);
    forget_sent();
  }

  std::vector<float>* momentum() override { return momentum_.empty() ? nullptr : &momentum_; }

 private:
  TensorShape shape_;
  CompressionSpec spec_;
  kernels::CompressionKernels& kernels_;
  size_t max_segment_bytes_;
  std::vector<float> momentum_;
  std::vector<uint64_t> kept_indices_;  // the last update's positions and decoded values, for take_back
  std::vector<float> kept_values_;
  // What the last encode sent (positions, and a's values there) and from
  // which a, until the residual step uses them.
  std::vector<uint64_t> sent_indices_;
  std::vector<float> sent_values_;
  std::vector<float> sent_decoded_;  // what the receiver decodes for each, from the encoder
  const float* sent_from_ = nullptr;
};

// DeMo-style: per 64 x 64 chunk, the K largest DCT coefficients as signs with
// one magnitude, the mean |coefficient| kept (the magnitude that minimizes the
// squared error of a sign vector on those coefficients).
class DctSignCompressor final : public TensorCompressor {
 public:
  DctSignCompressor(TensorShape shape, const CompressionSpec& spec, kernels::CompressionKernels& kernels,
                    size_t max_segment_bytes)
      : shape_(std::move(shape)), spec_(spec), kernels_(kernels), max_segment_bytes_(max_segment_bytes) {}
  Result<EncodedTensor> compress(uint32_t index, std::span<const float> a, int64_t, uint64_t) override {
    const uint64_t n = a.size();
    const uint64_t chunks = (n + kernels::kDctChunk - 1) / kernels::kDctChunk;
    padded_.assign(chunks * kernels::kDctChunk, 0.0f);
    std::copy(a.begin(), a.end(), padded_.begin());
    coefficients_.resize(padded_.size());
    kernels_.dct_chunks(padded_, coefficients_, /*inverse=*/false);
    const std::vector<uint64_t> positions = kernels_.chunk_top_k(coefficients_, kernels::kDctChunk, spec_.chunk_k);
    std::vector<uint8_t> negative(positions.size());
    std::vector<double> sums(chunks, 0.0);
    std::vector<uint64_t> counts(chunks, 0);
    for (size_t i = 0; i < positions.size(); ++i) {
      const float c = coefficients_[positions[i]];
      negative[i] = c < 0.0f;
      sums[positions[i] / kernels::kDctChunk] += std::fabs(c);
      ++counts[positions[i] / kernels::kDctChunk];
    }
    std::vector<float> scales(chunks, 0.0f);
    for (uint64_t c = 0; c < chunks; ++c) {
      if (counts[c] > 0) scales[c] = static_cast<float>(sums[c] / static_cast<double>(counts[c]));
    }
    Result<std::vector<EncodedSegment>> segments =
        encode_dct_sign(index, n, positions, negative, scales, max_segment_bytes_);
    if (!segments.is_ok()) return segments.status();
    return EncodedTensor{descriptor_of(shape_, Encoding::kDctSign), std::move(*segments)};
  }

 private:
  TensorShape shape_;
  CompressionSpec spec_;
  kernels::CompressionKernels& kernels_;
  size_t max_segment_bytes_;
  std::vector<float> padded_, coefficients_;
};

Status check_finite(std::span<const float> values, const std::string& name) {
  if (all_finite(values)) return Status::ok();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return invalid_argument("tensor '" + name + "' element " + std::to_string(i) + " of the update is not finite");
    }
  }
  return Status::ok();
}

}  // namespace

void TensorCompressor::form_input(std::span<const float> residual, std::span<const float> delta, std::span<float> a,
                                  kernels::CompressionKernels& kernels) {
  kernels.add(residual, delta, a);
}

Result<EncodedTensor> TensorCompressor::compress_with_residual(uint32_t index, std::span<const float> a, int64_t round,
                                                               uint64_t seed, std::span<const TensorShape> manifest,
                                                               std::span<float> residual, std::span<float> decoded,
                                                               kernels::CompressionKernels& kernels,
                                                               std::vector<float>& scratch) {
  Result<EncodedTensor> encoded = compress(index, a, round, seed);
  if (!encoded.is_ok()) return encoded;
  FEDMESH_RETURN_IF_ERROR(update_residual(*encoded, manifest, a, residual, decoded, kernels, scratch));
  return encoded;
}

Result<EncodedTensor> TensorCompressor::compress_folding(uint32_t index, std::span<const float> delta, int64_t round,
                                                         uint64_t seed, std::span<const TensorShape> manifest,
                                                         std::span<float> residual, std::span<float> decoded,
                                                         kernels::CompressionKernels& kernels,
                                                         std::vector<float>& scratch) {
  form_input(residual, delta, residual, kernels);
  return compress_with_residual(index, residual, round, seed, manifest, residual, decoded, kernels, scratch);
}

Status TensorCompressor::update_residual(const EncodedTensor& sent, std::span<const TensorShape> manifest,
                                         std::span<const float> a, std::span<float> residual, std::span<float> decoded,
                                         kernels::CompressionKernels& kernels, std::vector<float>& scratch) {
  std::span<float> values = decoded;
  if (values.empty()) {
    scratch.resize(a.size());
    values = scratch;
  }
  for (const EncodedSegment& segment : sent.segments) {
    FEDMESH_RETURN_IF_ERROR(decode_segment(segment.view(), manifest, values));
  }
  if (!residual.empty()) kernels.subtract(a, values, residual);
  kept_ = sent.segments;
  return Status::ok();
}

Status TensorCompressor::take_back(std::span<float> residual, std::span<const TensorShape> manifest,
                                   kernels::CompressionKernels& kernels, std::vector<float>& scratch) {
  scratch.assign(residual.size(), 0.0f);
  for (const EncodedSegment& segment : kept_) {
    FEDMESH_RETURN_IF_ERROR(decode_segment(segment.view(), manifest, scratch));
  }
  kernels.add(residual, scratch, residual);
  return Status::ok();
}

void TensorCompressor::release() { std::vector<EncodedSegment>().swap(kept_); }

double topk_density(const CompressionSpec& spec, int64_t round) {
  if (round >= spec.warmup_rounds) return spec.density;
  return std::pow(spec.density, static_cast<double>(round + 1) / static_cast<double>(spec.warmup_rounds + 1));
}

std::string powersgd_factor_name(const std::string& tensor, char factor) {
  return tensor + "@powersgd." + factor;
}

Result<std::unique_ptr<TensorCompressor>> make_tensor_compressor(const CompressionSpec& spec, const TensorShape& shape,
                                                                 kernels::CompressionKernels& kernels,
                                                                 size_t max_segment_bytes) {
  switch (spec.method) {
    case CompressionMethod::kIdentity:
      return std::unique_ptr<TensorCompressor>(new IdentityCompressor(shape, Encoding::kDenseF32, max_segment_bytes));
    case CompressionMethod::kHalf:
      return std::unique_ptr<TensorCompressor>(new IdentityCompressor(
          shape, spec.half == kernels::HalfType::kBf16 ? Encoding::kDenseBf16 : Encoding::kDenseF16,
          max_segment_bytes));
    case CompressionMethod::kBlock:
      return std::unique_ptr<TensorCompressor>(new BlockCompressor(shape, spec, kernels, max_segment_bytes));
    case CompressionMethod::kTopK:
      return std::unique_ptr<TensorCompressor>(new TopKCompressor(shape, spec, kernels, max_segment_bytes));
    case CompressionMethod::kDctSign:
      return std::unique_ptr<TensorCompressor>(new DctSignCompressor(shape, spec, kernels, max_segment_bytes));
    case CompressionMethod::kPowerSgd: break;
  }
  return invalid_argument("tensor '" + shape.name + "': " + spec.to_string() +
                          " is run by UpdateCompressor with a shared P, not per tensor");
}

// ---- UpdateCompressor ---------------------------------------------------------

struct UpdateCompressor::State {
  std::vector<TensorShape> manifest;
  std::vector<CompressionSpec> specs;
  std::vector<std::unique_ptr<TensorCompressor>> compressors;  // null for PowerSGD tensors
  std::vector<std::vector<float>> residuals;                   // empty for lossless tensors; a from begin to finish
  std::vector<std::vector<float>> inputs;                      // a lossless tensor's a (= delta), from begin on
  std::vector<std::vector<float>> scratch;                     // decoding buffers kept between updates
  std::vector<uint8_t> given;  // per tensor: finish() took D(C(a)) out of its residual, rollback() may give it back
  std::vector<std::vector<float>> powersgd_kept;  // per tensor: P then Q_i of the last finish (take_back)
  std::vector<size_t> powersgd;
  kernels::CompressionKernels* kernels = nullptr;
  size_t max_segment_bytes = 0;
  uint64_t seed = 0;
  int64_t rounds = 0;
  bool begun = false;
};

UpdateCompressor::UpdateCompressor() : state_(std::make_unique<State>()) {}
UpdateCompressor::UpdateCompressor(UpdateCompressor&&) noexcept = default;
UpdateCompressor& UpdateCompressor::operator=(UpdateCompressor&&) noexcept = default;
UpdateCompressor::~UpdateCompressor() = default;

Result<UpdateCompressor> UpdateCompressor::create(const CompressionPlan& plan, std::vector<TensorShape> manifest,
                                                  uint64_t seed, kernels::CompressionKernels& kernels,
                                                  size_t max_segment_bytes) {
  UpdateCompressor compressor;
  State& s = *compressor.state_;
  s.kernels = &kernels;
  s.max_segment_bytes = max_segment_bytes;
  s.seed = seed;
  for (size_t t = 0; t < manifest.size(); ++t) {
    const CompressionSpec spec = plan.for_tensor(manifest[t].name, manifest[t].dims);
    s.specs.push_back(spec);
    const bool lossless = spec.method == CompressionMethod::kIdentity;
    s.residuals.emplace_back(lossless ? 0 : manifest[t].element_count(), 0.0f);
    if (spec.method == CompressionMethod::kPowerSgd) {
      s.powersgd.push_back(t);
      s.compressors.emplace_back();
      continue;
    }
    Result<std::unique_ptr<TensorCompressor>> made = make_tensor_compressor(spec, manifest[t], kernels, max_segment_bytes);
    if (!made.is_ok()) return made.status();
    s.compressors.push_back(std::move(*made));
  }
  s.manifest = std::move(manifest);
  s.inputs.resize(s.manifest.size());
  s.scratch.resize(s.manifest.size());
  s.given.assign(s.manifest.size(), 0);
  s.powersgd_kept.resize(s.manifest.size());
  return compressor;
}

const std::vector<TensorShape>& UpdateCompressor::manifest() const { return state_->manifest; }
const CompressionSpec& UpdateCompressor::spec(size_t tensor) const { return state_->specs[tensor]; }
const std::vector<size_t>& UpdateCompressor::powersgd_tensors() const { return state_->powersgd; }
int64_t UpdateCompressor::rounds() const { return state_->rounds; }
void UpdateCompressor::set_rounds(int64_t rounds) { state_->rounds = rounds; }

namespace {

Status check_delta(std::span<const std::span<const float>> delta, const std::vector<TensorShape>& manifest) {
  if (delta.size() != manifest.size()) {
    return invalid_argument("the update has " + std::to_string(delta.size()) + " tensors, the manifest " +
                            std::to_string(manifest.size()));
  }
  for (size_t t = 0; t < delta.size(); ++t) {
    if (delta[t].size() != manifest[t].element_count()) {
      return invalid_argument("tensor '" + manifest[t].name + "' has " + std::to_string(delta[t].size()) +
                              " values, its shape " + std::to_string(manifest[t].element_count()));
    }
    FEDMESH_RETURN_IF_ERROR(check_finite(delta[t], manifest[t].name));
  }
  return Status::ok();
}

}  // namespace

// e <- a = e + delta for a lossy tensor, in the residual's buffer. From here
// until finish() the residual holds all of the update: a begin not followed
// by a finish loses nothing.
void UpdateCompressor::form_in_residual(size_t t, std::span<const float> delta) {
  State& s = *state_;
  std::vector<float>& e = s.residuals[t];
  if (s.compressors[t]) {
    s.compressors[t]->form_input(e, delta, e, *s.kernels);
  } else {
    s.kernels->add(e, delta, e);
  }
  s.given[t] = 0;
}

Status UpdateCompressor::begin(std::span<const std::span<const float>> delta) {
  FEDMESH_RETURN_IF_ERROR(take_delta(delta, nullptr));
  for (size_t t = 0; t < delta.size(); ++t) {
    if (!state_->residuals[t].empty()) form_in_residual(t, delta[t]);
  }
  return Status::ok();
}

Status UpdateCompressor::begin(std::vector<std::vector<float>>&& delta) {
  const std::vector<std::span<const float>> spans(delta.begin(), delta.end());
  FEDMESH_RETURN_IF_ERROR(take_delta(spans, &delta));
  for (size_t t = 0; t < delta.size(); ++t) {
    if (state_->residuals[t].empty()) continue;
    form_in_residual(t, spans[t]);
    std::vector<float>().swap(delta[t]);
  }
  return Status::ok();
}

Result<std::vector<std::vector<float>>> UpdateCompressor::powersgd_p(std::span<const std::vector<float>> shared_q) const {
  const State& s = *state_;
  if (!s.begun) return invalid_argument("powersgd_p before begin");
  if (shared_q.size() != s.powersgd.size()) {
    return invalid_argument(std::to_string(shared_q.size()) + " shared Q for " + std::to_string(s.powersgd.size()) +
                            " PowerSGD tensors");
  }
  std::vector<std::vector<float>> p(s.powersgd.size());
  for (size_t i = 0; i < s.powersgd.size(); ++i) {
    const size_t t = s.powersgd[i];
    const int64_t rows = s.manifest[t].dims[0], cols = s.manifest[t].dims[1], r = s.specs[t].rank;
    if (shared_q[i].size() != static_cast<size_t>(cols * r)) {
      return invalid_argument("shared Q of '" + s.manifest[t].name + "' has " + std::to_string(shared_q[i].size()) +
                              " values, " + std::to_string(cols * r) + " expected");
    }
    p[i].resize(static_cast<size_t>(rows * r));
    s.kernels->matmul(false, false, rows, r, cols, s.residuals[t], shared_q[i], p[i]);
  }
  return p;
}

Result<CompressedUpdate> UpdateCompressor::finish(std::span<const std::vector<float>> shared_p, bool want_decoded) {
  return finish_folding(shared_p, want_decoded, {});
}

Result<CompressedUpdate> UpdateCompressor::finish_folding(std::span<const std::vector<float>> shared_p,
                                                          bool want_decoded,
                                                          std::span<const std::span<const float>> fold) {
  State& s = *state_;
  if (!s.begun) return invalid_argument("finish before begin");
  if (shared_p.size() != s.powersgd.size()) {
    return invalid_argument(std::to_string(shared_p.size()) + " shared P for " + std::to_string(s.powersgd.size()) +
                            " PowerSGD tensors");
  }
  CompressedUpdate out;
  if (want_decoded) out.decoded.resize(s.manifest.size());
  const std::span<const TensorShape> manifest(s.manifest);
  // A tensor that fails gives back the ones compressed before it, and the
  // deltas not yet folded go into their residuals: the caller sends
  // nothing, and nothing is lost.
  size_t t = 0;
  auto fail = [&](Status status) -> Result<CompressedUpdate> {
    rollback();
    if (!fold.empty()) {
      for (size_t u = t + 1; u < s.manifest.size(); ++u) {
        if (!s.residuals[u].empty()) form_in_residual(u, fold[u]);
      }
    }
    s.begun = fold.empty();  // begin()'s a is still there to finish; compress()'s is folded back
    return status;
  };
  size_t powersgd_index = 0;
  for (; t < s.manifest.size(); ++t) {
    const auto index = static_cast<uint32_t>(t);
    const bool lossless = s.residuals[t].empty();
    // A lossy tensor's a is its residual's buffer, written in place with a - D(C(a)).
    std::span<float> residual = s.residuals[t];
    const std::span<const float> a = lossless ? std::span<const float>(s.inputs[t]) : std::span<const float>(residual);
    std::span<float> decoded;
    if (want_decoded) {
      out.decoded[t].resize(a.size());
      decoded = out.decoded[t];
    }
    const uint64_t seed = mix_seed(mix_seed(s.seed, t), static_cast<uint64_t>(s.rounds));
    if (!s.compressors[t]) {  // PowerSGD: Q_i = a^T P, decoded = P Q_i^T
      const std::vector<float>& p = shared_p[powersgd_index++];
      const TensorShape& shape = s.manifest[t];
      const int64_t rows = shape.dims[0], cols = shape.dims[1], r = s.specs[t].rank;
      if (p.size() != static_cast<size_t>(rows * r)) {
        return fail(invalid_argument("shared P of '" + shape.name + "' has " + std::to_string(p.size()) + " values, " +
                                     std::to_string(rows * r) + " expected"));
      }
      std::vector<float> q(static_cast<size_t>(cols * r));
      s.kernels->matmul(true, false, cols, r, rows, a, p, q);
      if (decoded.empty()) {
        s.scratch[t].resize(a.size());
        decoded = s.scratch[t];
      }
      s.kernels->matmul(false, true, rows, cols, r, p, q, decoded);
      s.kernels->subtract(a, decoded, residual);
      s.powersgd_kept[t] = p;
      s.powersgd_kept[t].insert(s.powersgd_kept[t].end(), q.begin(), q.end());
      s.given[t] = 1;
      Result<std::vector<EncodedSegment>> segments = encode_dense(index, q, Encoding::kDenseF32, s.max_segment_bytes);
      if (!segments.is_ok()) return fail(segments.status());
      out.tensors.push_back(EncodedTensor{{powersgd_factor_name(shape.name, 'q'), {cols, r}, Encoding::kDenseF32, 0},
                                          std::move(*segments)});
      continue;
    }
    Result<EncodedTensor> encoded =
        lossless         ? s.compressors[t]->compress(index, a, s.rounds, seed)
        : fold.empty()   ? s.compressors[t]->compress_with_residual(index, a, s.rounds, seed, manifest, residual,
                                                                    decoded, *s.kernels, s.scratch[t])
                         : s.compressors[t]->compress_folding(index, fold[t], s.rounds, seed, manifest, residual,
                                                              decoded, *s.kernels, s.scratch[t]);
    if (!encoded.is_ok()) return fail(encoded.status());
    if (!lossless) s.given[t] = 1;
    // Lossless (dense fp32): D(C(a)) = a.
    if (lossless && want_decoded) parallel_copy(a, decoded);
    out.tensors.push_back(std::move(*encoded));
  }
  for (const EncodedTensor& tensor : out.tensors) {
    for (const EncodedSegment& segment : tensor.segments) out.payload_bytes += segment.payload_bytes();
  }
  ++s.rounds;
  s.begun = false;
  return out;
}

Status UpdateCompressor::give_back(size_t t) {
  State& s = *state_;
  std::vector<float>& e = s.residuals[t];
  if (s.compressors[t]) return s.compressors[t]->take_back(e, s.manifest, *s.kernels, s.scratch[t]);
  // PowerSGD: D = P Q_i^T again from the P and Q_i kept.
  const TensorShape& shape = s.manifest[t];
  const int64_t rows = shape.dims[0], cols = shape.dims[1], r = s.specs[t].rank;
  const std::vector<float>& kept = s.powersgd_kept[t];
  const auto p_size = static_cast<size_t>(rows * r);
  s.scratch[t].resize(e.size());
  s.kernels->matmul(false, true, rows, cols, r, std::span<const float>(kept).first(p_size),
                    std::span<const float>(kept).subspan(p_size), s.scratch[t]);
  s.kernels->add(e, s.scratch[t], e);
  return Status::ok();
}

void UpdateCompressor::rollback() {
  State& s = *state_;
  for (size_t t = 0; t < s.manifest.size(); ++t) {
    if (!s.given[t]) continue;
    s.given[t] = 0;
    // What was kept was made by this compressor from its own update: giving
    // it back cannot fail short of a bug.
    const Status back = give_back(t);
    FEDMESH_CHECK(back.is_ok(), "rollback of tensor '" + s.manifest[t].name + "': " + back.message());
  }
}

void UpdateCompressor::release_buffers() {
  State& s = *state_;
  for (std::vector<float>& a : s.inputs) std::vector<float>().swap(a);
  for (std::vector<float>& b : s.scratch) std::vector<float>().swap(b);
  for (std::vector<float>& kept : s.powersgd_kept) std::vector<float>().swap(kept);
  for (const std::unique_ptr<TensorCompressor>& c : s.compressors) {
    if (c) c->release();
  }
  std::fill(s.given.begin(), s.given.end(), uint8_t{0});
}

// The delta checked, a lossless tensor's taken as its a (copied, or moved
// from `owned`); a lossy tensor's is left for begin() to form in its residual
// or for compress() to fold in the pass that steps it.
Status UpdateCompressor::take_delta(std::span<const std::span<const float>> delta,
                                    std::vector<std::vector<float>>* owned) {
  State& s = *state_;
  FEDMESH_RETURN_IF_ERROR(check_delta(delta, s.manifest));
  for (size_t t = 0; t < delta.size(); ++t) {
    if (!s.residuals[t].empty()) {
      s.given[t] = 0;
    } else if (owned != nullptr) {
      s.inputs[t] = std::move((*owned)[t]);  // a = delta as it is
    } else {
      s.inputs[t].resize(delta[t].size());
      parallel_copy(delta[t], s.inputs[t]);
    }
  }
  s.begun = true;
  return Status::ok();
}

namespace {

Status refuse_powersgd_without_p(bool has_powersgd) {
  if (!has_powersgd) return Status::ok();
  return invalid_argument("powersgd needs the shared P of the aggregator path: use begin / powersgd_p / finish");
}

}  // namespace

Result<CompressedUpdate> UpdateCompressor::compress(std::span<const std::span<const float>> delta, bool want_decoded) {
  FEDMESH_RETURN_IF_ERROR(refuse_powersgd_without_p(!state_->powersgd.empty()));
  FEDMESH_RETURN_IF_ERROR(take_delta(delta, nullptr));
  return finish_folding({}, want_decoded, delta);
}

Result<CompressedUpdate> UpdateCompressor::compress(std::vector<std::vector<float>>&& delta, bool want_decoded) {
  // The lossy tensors' spans stay valid: only lossless tensors' buffers move.
  const std::vector<std::span<const float>> spans(delta.begin(), delta.end());
  FEDMESH_RETURN_IF_ERROR(refuse_powersgd_without_p(!state_->powersgd.empty()));
  FEDMESH_RETURN_IF_ERROR(take_delta(spans, &delta));
  Result<CompressedUpdate> out = finish_folding({}, want_decoded, spans);
  for (std::vector<float>& d : delta) std::vector<float>().swap(d);
  return out;
}

std::vector<UpdateCompressor::StateTensor> UpdateCompressor::state_tensors() {
  State& s = *state_;
  std::vector<StateTensor> tensors;
  for (size_t t = 0; t < s.manifest.size(); ++t) {
    if (!s.residuals[t].empty()) tensors.push_back({"residual", s.manifest[t].name, s.manifest[t].dims, &s.residuals[t]});
    if (s.compressors[t] && s.compressors[t]->momentum()) {
      tensors.push_back({"momentum", s.manifest[t].name, s.manifest[t].dims, s.compressors[t]->momentum()});
    }
  }
  return tensors;
}

}  // namespace fedmesh::protocol
