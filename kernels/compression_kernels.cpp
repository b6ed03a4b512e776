// The CPU backend of CompressionKernels: compression_math.h's definitions
// spread over every core with parallel_for, OpenBLAS for the products.
#include "kernels/compression_kernels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <mutex>

#include "kernels/gemm.h"
#include "kernels/half.h"
#include "kernels/half_arrays.h"
#include "kernels/parallel.h"

namespace fedmesh::kernels {
namespace {

constexpr int64_t kGrain = int64_t{1} << 16;

struct Candidate {
  float value;  // signed: what is sent; its magnitude decides
  uint64_t index;
};
inline uint32_t magnitude_bits(const Candidate& c) { return std::bit_cast<uint32_t>(c.value) & 0x7fffffffu; }
// Candidates as gathered: parts in index order, each in index order (not
// joined: a copy of every candidate saved).
using CandidateParts = std::vector<std::vector<Candidate>>;
uint64_t candidate_count(const CandidateParts& parts) {
  uint64_t total = 0;
  for (const auto& part : parts) total += part.size();
  return total;
}
template <class Visit>
void for_each_candidate(const CandidateParts& parts, Visit visit) {
  for (const auto& part : parts) {
    for (const Candidate& c : part) visit(c);
  }
}

// The bits of the k-th largest magnitude among `candidates` (0 < k <= size),
// and how many candidates are larger. Few candidates: nth_element on a copy.
// Many: a radix selection on the magnitudes' bits (for finite magnitudes the
// bits order as the values do): a histogram of the high 16 bits finds the
// k-th's bucket, one of the low 16 bits among that bucket's candidates finds
// it; no copy, no sort.
std::pair<uint32_t, uint64_t> kth_magnitude(const CandidateParts& candidates, uint64_t k) {
  const uint64_t count = candidate_count(candidates);
  if (count < (uint64_t{1} << 16)) {
    std::vector<uint32_t> bits;
    bits.reserve(count);
    for_each_candidate(candidates, [&](const Candidate& c) { bits.push_back(magnitude_bits(c)); });
    std::nth_element(bits.begin(), bits.begin() + static_cast<int64_t>(k - 1), bits.end(), std::greater<uint32_t>());
    const uint32_t kth = bits[k - 1];
    uint64_t above = 0;
    for (size_t i = 0; i < k; ++i) above += bits[i] > kth ? 1 : 0;
    return {kth, above};
  }
  std::vector<uint32_t> counts(uint64_t{1} << 16, 0);
  for_each_candidate(candidates, [&](const Candidate& c) { ++counts[magnitude_bits(c) >> 16]; });
  uint64_t above = 0;  // candidates known to be larger than the k-th
  uint32_t high = 0xffff;
  while (above + counts[high] < k) above += counts[high--];
  std::fill(counts.begin(), counts.end(), 0u);
  for_each_candidate(candidates, [&](const Candidate& c) {
    const uint32_t bits = magnitude_bits(c);
    if (bits >> 16 == high) ++counts[bits & 0xffff];
  });
  uint32_t low = 0xffff;
  while (above + counts[low] < k) above += counts[low--];
  return {high << 16 | low, above};
}

// Keeps the k first candidates (given in index order) in the selection
// order, their indices ascending and their values: one pass in index order
// keeps every candidate above the k-th magnitude and, of those equal to it,
// the first ones (the lower indices), until k.
void keep_best(const CandidateParts& candidates, uint64_t k, TopKSelection& selection) {
  k = std::min<uint64_t>(k, candidate_count(candidates));
  std::vector<uint64_t>& indices = selection.indices;
  std::vector<float>& values = selection.values;
  indices.clear();
  values.clear();
  if (k == 0) return;
  const auto kth_and_above = kth_magnitude(candidates, k);
  const uint32_t kth = kth_and_above.first;  // (not a structured binding: clang 14 cannot capture one)
  uint64_t equal_kept = k - kth_and_above.second;  // of the candidates equal to the k-th, how many are kept
  indices.resize(k);
  values.resize(k);
  uint64_t kept = 0;
  for_each_candidate(candidates, [&](const Candidate& c) {
    const uint32_t bits = magnitude_bits(c);
    if (bits > kth || (bits == kth && equal_kept > 0)) {
      if (bits == kth) --equal_kept;
      indices[kept] = c.index;
      values[kept] = c.value;
      ++kept;
    }
  });
}

// Whether one of the 16 values at v has a magnitude whose bits are at least
// `bits` (the bits of a threshold >= 0; for finite values the same as
// |v| >= threshold). Written with GCC's vector extensions so that it runs
// on vector registers with the baseline SSE2 (the compiler turned the plain
// loop into a scalar chain).
inline bool any_at_least16(const float* v, int32_t bits) {
  using Lanes = int32_t __attribute__((vector_size(16)));
  const Lanes magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const Lanes below = {bits - 1, bits - 1, bits - 1, bits - 1};  // bits >= 0, so bits - 1 does not wrap
  Lanes hit = {0, 0, 0, 0};
  for (int g = 0; g < 4; ++g) {
    Lanes a;
    std::memcpy(&a, v + 4 * g, sizeof(a));
    hit |= (a & magnitude) > below;
  }
  return (hit[0] | hit[1] | hit[2] | hit[3]) != 0;
}

// Candidates gathered by all cores: gather_part(first, last, out) appends
// those of [first, last) in index order; the parts are joined in order.
// `expected`: about how many candidates there will be in all (each part
// reserves its share up front, so that no part grows by copies).
template <class GatherPart>
CandidateParts gather_in_parts(int64_t n, uint64_t expected, GatherPart gather_part) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(cpu_threads() * 4, (n + kGrain - 1) / kGrain));
  CandidateParts found(static_cast<size_t>(parts));
  parallel_for(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::vector<Candidate>& out = found[static_cast<size_t>(p)];
      const uint64_t share = expected / static_cast<uint64_t>(parts);
      out.reserve(std::min<uint64_t>(share + share / 4 + 64, static_cast<uint64_t>(n / parts + 1)));
      gather_part(n * p / parts, n * (p + 1) / parts, out);
    }
  });
  return found;
}

// Appends values[begin, end)'s elements with |v| >= at_least to out.
inline void gather_each(const float* values, int64_t begin, int64_t end, float at_least, std::vector<Candidate>& out) {
  for (int64_t j = begin; j < end; ++j) {
    if (std::fabs(values[j]) >= at_least) out.push_back({values[j], static_cast<uint64_t>(j)});
  }
}

// Groups of kGroup values none of which reaches the threshold (most, for a
// small k) are passed over after one vectorized test on the magnitudes'
// bits (for a threshold >= 0, |v| >= threshold exactly when bits(|v|) >=
// bits(threshold); values are finite here).
constexpr int64_t kGroup = 16;

// v[i] += d[i] for the 16 values at v, and whether one of the sums has a
// magnitude whose bits are at least `bits` (as any_at_least16), tested on
// the sums in registers: vector adds and one vector store per 4 values
// (scalar stores read back by a vector load would stall on every group).
inline bool add_any_at_least16(float* v, const float* d, int32_t bits) {
  using Floats = float __attribute__((vector_size(16)));
  using Lanes = int32_t __attribute__((vector_size(16)));
  const Lanes magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const Lanes below = {bits - 1, bits - 1, bits - 1, bits - 1};
  Lanes hit = {0, 0, 0, 0};
  for (int g = 0; g < 4; ++g) {
    Floats a, b;
    std::memcpy(&a, v + 4 * g, sizeof(a));
    std::memcpy(&b, d + 4 * g, sizeof(b));
    a += b;
    std::memcpy(v + 4 * g, &a, sizeof(a));
    Lanes a_bits;
    std::memcpy(&a_bits, &a, sizeof(a_bits));
    hit |= (a_bits & magnitude) > below;
  }
  return (hit[0] | hit[1] | hit[2] | hit[3]) != 0;
}

// Elements with |x| >= threshold, in index order, gathered by all cores.
CandidateParts gather_at_least(std::span<const float> x, float threshold, uint64_t expected) {
  return gather_in_parts(static_cast<int64_t>(x.size()), expected, [&](int64_t first, int64_t last, std::vector<Candidate>& out) {
    // Locals, not the captured span and threshold: push_back's stores may
    // alias anything, and would make the loop reload them every element.
    const float* values = x.data();
    const float at_least = threshold;
    const auto at_least_bits = static_cast<int32_t>(std::bit_cast<uint32_t>(at_least));
    int64_t i = first;
    for (; i + kGroup <= last; i += kGroup) {
      if (any_at_least16(values + i, at_least_bits)) gather_each(values, i, i + kGroup, at_least, out);
    }
    gather_each(values, i, last, at_least, out);
  });
}

// e += delta and, in the same pass, the elements of the sum with
// |e| >= threshold, in index order: e and delta are read once.
CandidateParts add_gather_at_least(std::span<float> e, std::span<const float> delta, float threshold,
                                   uint64_t expected) {
  return gather_in_parts(static_cast<int64_t>(e.size()), expected, [&](int64_t first, int64_t last, std::vector<Candidate>& out) {
    float* values = e.data();
    const float* d = delta.data();
    const float at_least = threshold;
    const auto at_least_bits = static_cast<int32_t>(std::bit_cast<uint32_t>(at_least));
    int64_t i = first;
    for (; i + kGroup <= last; i += kGroup) {
      if (add_any_at_least16(values + i, d + i, at_least_bits)) gather_each(values, i, i + kGroup, at_least, out);
    }
    for (int64_t j = i; j < last; ++j) values[j] += d[j];
    gather_each(values, i, last, at_least, out);
  });
}

// Runs body(first block, first element, element count) over tasks of an even
// number of whole blocks, so that tasks start at an even element and no two
// share an int4 byte.
template <class Body>
void for_each_task(uint64_t blocks, uint64_t block, uint64_t n, Body body) {
  const uint64_t per_task = (std::max<uint64_t>(1, kGrain / block) + 1) & ~uint64_t{1};
  const int64_t tasks = static_cast<int64_t>((blocks + per_task - 1) / per_task);
  parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint64_t first_block = static_cast<uint64_t>(t) * per_task;
      const uint64_t first = first_block * block;
      const uint64_t last = std::min<uint64_t>(n, (first_block + per_task) * block);
      body(first_block, first, last - first);
    }
  });
}

}  // namespace

void CompressionKernels::quantize_blocks_with_residual(std::span<const float> a, const BlockQuantization& q,
                                                       std::span<uint8_t> packed, std::span<float> scales,
                                                       std::span<float> residual, std::span<float> decoded,
                                                       std::vector<float>& scratch) {
  quantize_blocks(a, q, packed, scales);
  std::span<float> values = decoded;
  if (values.empty()) {
    scratch.resize(a.size());
    values = scratch;
  }
  dequantize_blocks(packed, q, scales, values);
  subtract(a, values, residual);
}

void CompressionKernels::add_quantize_blocks_with_residual(std::span<float> residual, std::span<const float> delta,
                                                           const BlockQuantization& q, std::span<uint8_t> packed,
                                                           std::span<float> scales, std::span<float> decoded,
                                                           std::vector<float>& scratch) {
  add(residual, delta, residual);
  quantize_blocks_with_residual(residual, q, packed, scales, residual, decoded, scratch);
}

namespace {

// Error feedback's block step, a block at a time over every core: with
// `delta`, first a = x + delta in place (x is then the residual itself);
// quantize a, D(q) into `decoded` or a block of scratch, residual = a - D(q).
// Each block is read from memory once and stepped while it is in cache.
void fused_block_step(const float* x, const float* delta, const BlockQuantization& q, std::span<uint8_t> packed,
                      std::span<float> scales, std::span<float> residual, std::span<float> decoded) {
  const uint64_t n = residual.size();
  const uint64_t block = q.block_size;
  const uint64_t blocks = (n + block - 1) / block;
  for_each_task(blocks, block, n, [&](uint64_t first_block, uint64_t first, uint64_t count) {
    thread_local std::vector<float> values;
    if (decoded.empty()) values.resize(block);
    for (uint64_t offset = 0; offset < count; offset += block) {
      const uint64_t at = first + offset;
      const uint64_t m = std::min(block, count - offset);
      float* e = residual.data() + at;
      if (delta != nullptr) {
        const float* d = delta + at;
        for (uint64_t i = 0; i < m; ++i) e[i] += d[i];
      }
      uint8_t* bytes = packed.data() + (q.bits == 4 ? at / 2 : at);
      float* scale = scales.data() + first_block + offset / block;
      const float* a = x + at;
      kernels::quantize_blocks(a, m, q.bits, q.block_size, q.rounding, q.seed, at, bytes, scale);
      float* out = decoded.empty() ? values.data() : decoded.data() + at;
      kernels::dequantize_blocks(bytes, m, q.bits, q.block_size, scale, out);
      for (uint64_t i = 0; i < m; ++i) e[i] = a[i] - out[i];
    }
  });
}

// Small tensors, and a k that is most of the tensor, are selected from
// every element; others from the candidates above a sampled threshold.
bool selects_exactly(uint64_t n, uint64_t k, const TopKOptions& options) {
  return n <= options.exact_below || k * 4 > n;
}

// Deep Gradient Compression: the threshold that keeps k of n elements is
// about the (k/n) quantile of a random sample's magnitudes. Aim a little low
// (1.25 k) so that one pass usually gathers enough; lower it and gather again
// (from `a`) when the sample was unlucky. sample_at(j) is |a[j]|;
// first_gather(threshold, expected count) gathers a's candidates the first
// time (and may form a on the way). 0 < k <= n.
template <class SampleAt, class FirstGather>
TopKSelection sampled_top_k(std::span<const float> a, uint64_t k, const TopKOptions& options, SampleAt sample_at,
                            FirstGather first_gather) {
  TopKSelection selection;
  const uint64_t n = a.size();
  selection.sampled = true;
  const uint64_t samples = std::min<uint64_t>(
      n, std::max<uint64_t>(1024, std::min<uint64_t>(kMaxTopKSamples, static_cast<uint64_t>(options.sample_fraction *
                                                                                             static_cast<double>(n)))));
  // Drawn as runs of kRun neighbours from random places: a cache line each,
  // not a cache miss per value (the threshold only decides how many
  // candidates one pass gathers; the k kept are the exact top k whatever
  // the sample).
  constexpr uint64_t kRun = 16;
  std::vector<float> sample(samples);
  const uint64_t runs = (samples + kRun - 1) / kRun;
  const uint64_t starts = n - std::min(n, kRun) + 1;  // a run starts in [0, starts)
  parallel_for(static_cast<int64_t>(runs), 256, [&](int64_t begin, int64_t end) {
    for (auto r = static_cast<uint64_t>(begin); r < static_cast<uint64_t>(end); ++r) {
      const uint64_t start =
          std::min<uint64_t>(starts - 1, static_cast<uint64_t>(uniform_at(options.seed, r) * static_cast<float>(starts)));
      for (uint64_t j = 0; j < kRun && r * kRun + j < samples; ++j) sample[r * kRun + j] = sample_at(start + j);
    }
  });
  double wanted = 1.25 * static_cast<double>(k);
  for (bool first = true;; first = false) {
    const uint64_t rank =
        std::min<uint64_t>(samples - 1, static_cast<uint64_t>(wanted / static_cast<double>(n) * static_cast<double>(samples)));
    std::nth_element(sample.begin(), sample.begin() + static_cast<int64_t>(rank), sample.end(), std::greater<float>());
    const float threshold = rank + 1 >= samples ? 0.0f : sample[rank];
    const auto expected = static_cast<uint64_t>(wanted);
    CandidateParts candidates = first ? first_gather(threshold, expected) : gather_at_least(a, threshold, expected);
    selection.candidates = candidate_count(candidates);
    if (selection.candidates >= k) {
      keep_best(candidates, k, selection);
      return selection;
    }
    ++selection.refinements;
    wanted *= 4.0;
  }
}

class CpuCompressionKernels final : public CompressionKernels {
 public:
  std::string device_name() const override { return "cpu"; }

  void add(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    parallel_for(static_cast<int64_t>(out.size()), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[static_cast<size_t>(i)] = a[static_cast<size_t>(i)] + b[static_cast<size_t>(i)];
    });
  }

  void subtract(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    parallel_for(static_cast<int64_t>(out.size()), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[static_cast<size_t>(i)] = a[static_cast<size_t>(i)] - b[static_cast<size_t>(i)];
    });
  }

  void quantize_blocks(std::span<const float> x, const BlockQuantization& q, std::span<uint8_t> packed,
                       std::span<float> scales) override {
    // Parallel over whole blocks, an even number of elements per task so that
    // no two tasks share an int4 byte.
    const uint64_t n = x.size();
    const uint64_t block = q.block_size;
    const uint64_t blocks = (n + block - 1) / block;
    for_each_task(blocks, block, n, [&](uint64_t first_block, uint64_t first, uint64_t count) {
      kernels::quantize_blocks(x.data() + first, count, q.bits, q.block_size, q.rounding, q.seed, first,
                               packed.data() + (q.bits == 4 ? first / 2 : first), scales.data() + first_block);
    });
  }

  void quantize_blocks_with_residual(std::span<const float> a, const BlockQuantization& q, std::span<uint8_t> packed,
                                     std::span<float> scales, std::span<float> residual, std::span<float> decoded,
                                     std::vector<float>& scratch) override {
    // Block starts must fall on whole int4 bytes.
    if (q.bits == 4 && q.block_size % 2 != 0) {
      CompressionKernels::quantize_blocks_with_residual(a, q, packed, scales, residual, decoded, scratch);
      return;
    }
    fused_block_step(a.data(), nullptr, q, packed, scales, residual, decoded);
  }

  void add_quantize_blocks_with_residual(std::span<float> residual, std::span<const float> delta,
                                         const BlockQuantization& q, std::span<uint8_t> packed, std::span<float> scales,
                                         std::span<float> decoded, std::vector<float>& scratch) override {
    if (q.bits == 4 && q.block_size % 2 != 0) {
      CompressionKernels::add_quantize_blocks_with_residual(residual, delta, q, packed, scales, decoded, scratch);
      return;
    }
    fused_block_step(residual.data(), delta.data(), q, packed, scales, residual, decoded);
  }

  void dequantize_blocks(std::span<const uint8_t> packed, const BlockQuantization& q, std::span<const float> scales,
                         std::span<float> out) override {
    const uint64_t n = out.size();
    const uint64_t block = q.block_size;
    const uint64_t blocks = (n + block - 1) / block;
    for_each_task(blocks, block, n, [&](uint64_t first_block, uint64_t first, uint64_t count) {
      kernels::dequantize_blocks(packed.data() + (q.bits == 4 ? first / 2 : first), count, q.bits, q.block_size,
                                 scales.data() + first_block, out.data() + first);
    });
  }

  void cast_half(std::span<const float> x, HalfType type, std::span<uint16_t> out) override {
    parallel_for(static_cast<int64_t>(x.size()), kGrain, [&](int64_t begin, int64_t end) {
      fp32_to_half(x.data() + begin, out.data() + begin, static_cast<size_t>(end - begin), type == HalfType::kBf16);
    });
  }

  void widen_half(std::span<const uint16_t> x, HalfType type, std::span<float> out) override {
    parallel_for(static_cast<int64_t>(x.size()), kGrain, [&](int64_t begin, int64_t end) {
      half_to_fp32(x.data() + begin, out.data() + begin, static_cast<size_t>(end - begin), type == HalfType::kBf16);
    });
  }

  TopKSelection top_k(std::span<const float> x, uint64_t k, const TopKOptions& options) override {
    k = std::min<uint64_t>(k, x.size());
    if (k == 0) return {};
    if (selects_exactly(x.size(), k, options)) {
      TopKSelection selection;
      CandidateParts all = gather_at_least(x, 0.0f, x.size());
      selection.candidates = candidate_count(all);
      keep_best(all, k, selection);
      return selection;
    }
    return sampled_top_k(
        x, k, options, [&](uint64_t j) { return std::fabs(x[j]); },
        [&](float threshold, uint64_t expected) { return gather_at_least(x, threshold, expected); });
  }

  TopKSelection add_top_k(std::span<float> e, std::span<const float> delta, uint64_t k,
                          const TopKOptions& options) override {
    FEDMESH_CHECK(e.size() == delta.size(), "add_top_k: sizes differ");
    k = std::min<uint64_t>(k, e.size());
    if (k == 0 || selects_exactly(e.size(), k, options)) {
      add(e, delta, e);
      return top_k(e, k, options);
    }
    // The sample reads e + delta where it lies (the very sums the pass will
    // write), so the first gather forms a as it goes; any later gather (an
    // unlucky sample) reads the a it left in e.
    return sampled_top_k(
        e, k, options, [&](uint64_t j) { return std::fabs(e[j] + delta[j]); },
        [&](float threshold, uint64_t expected) { return add_gather_at_least(e, delta, threshold, expected); });
  }
  void dct_chunks(std::span<const float> x, std::span<float> out, bool inverse) override {
    const int64_t chunks = static_cast<int64_t>(x.size() / kDctChunk);
    parallel_for(chunks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const float* in = x.data() + c * kDctChunk;
        float* o = out.data() + c * kDctChunk;
        if (inverse) {
          idct_chunk(in, o);
        } else {
          dct_chunk(in, o);
        }
      }
    });
  }

  std::vector<uint64_t> chunk_top_k(std::span<const float> x, uint32_t chunk, uint32_t k) override {
    const uint64_t n = x.size();
    const int64_t chunks = static_cast<int64_t>((n + chunk - 1) / chunk);
    std::vector<std::vector<uint64_t>> per_chunk(static_cast<size_t>(chunks));
    parallel_for(chunks, 16, [&](int64_t begin, int64_t end) {
      CandidateParts candidates(1);
      for (int64_t c = begin; c < end; ++c) {
        const uint64_t first = static_cast<uint64_t>(c) * chunk;
        const uint64_t last = std::min<uint64_t>(n, first + chunk);
        candidates[0].clear();
        for (uint64_t i = first; i < last; ++i) candidates[0].push_back({x[i], i});
        TopKSelection kept;
        keep_best(candidates, k, kept);
        per_chunk[static_cast<size_t>(c)] = std::move(kept.indices);
      }
    });
    std::vector<uint64_t> indices;
    for (const auto& part : per_chunk) indices.insert(indices.end(), part.begin(), part.end());
    return indices;
  }

  void matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, std::span<const float> a,
              std::span<const float> b, std::span<float> c) override {
    sgemm(transpose_a, transpose_b, m, n, k, 1.0f, a.data(), transpose_a ? m : k, b.data(), transpose_b ? k : n, 0.0f,
          c.data(), n);
  }

  void orthonormalize_columns(std::span<float> p, int64_t m, int64_t r) override {
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t i = 0; i < j; ++i) {
        double dot = 0.0;
        for (int64_t row = 0; row < m; ++row) dot += static_cast<double>(p[static_cast<size_t>(row * r + i)]) * p[static_cast<size_t>(row * r + j)];
        const float d = static_cast<float>(dot);
        for (int64_t row = 0; row < m; ++row) p[static_cast<size_t>(row * r + j)] -= d * p[static_cast<size_t>(row * r + i)];
      }
      double norm = 0.0;
      for (int64_t row = 0; row < m; ++row) norm += static_cast<double>(p[static_cast<size_t>(row * r + j)]) * p[static_cast<size_t>(row * r + j)];
      norm = std::sqrt(norm);
      const float inverse = norm < 1e-12 ? 0.0f : static_cast<float>(1.0 / norm);
      for (int64_t row = 0; row < m; ++row) p[static_cast<size_t>(row * r + j)] *= inverse;
    }
  }
};

}  // namespace

CompressionKernels& cpu_compression_kernels() {
  static CpuCompressionKernels kernels;
  return kernels;
}

Result<CompressionKernels*> compression_kernels_named(std::string_view device) {
  if (device == "cpu") return &cpu_compression_kernels();
  if (device == "cuda") return cuda_compression_kernels();
  if (device == "auto") {
    Result<CompressionKernels*> cuda = cuda_compression_kernels();
    return cuda.is_ok() ? *cuda : &cpu_compression_kernels();
  }
  return invalid_argument("compression device '" + std::string(device) + "': expected cpu, cuda or auto");
}

}  // namespace fedmesh::kernels
