// Update codec throughput (Google Benchmark): encode and accumulate of one
// 64 Mi-element fp32 tensor (256 MiB, the scale of a 100M-parameter update),
// reported as GB/s of fp32 input (bytes_per_second = 4 bytes x elements),
// for dense-f32, dense-bf16, block-int8, block-int4 and a 1% sparse-f32.
// Segments are 4 MiB, a typical chunk payload.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "base/random.h"
#include "protocol/codec.h"

namespace fedmesh::protocol {
namespace {

constexpr uint64_t kElements = uint64_t{64} << 20;
constexpr size_t kSegmentBytes = size_t{4} << 20;
constexpr double kSparseDensity = 0.01;

const std::vector<float>& dense_input() {
  static const std::vector<float> values = [] {
    Rng rng(1);
    std::vector<float> v(kElements);
    for (auto& x : v) x = static_cast<float>(rng.normal() * 1e-3);
    return v;
  }();
  return values;
}

struct SparseInput {
  std::vector<uint64_t> indices;
  std::vector<float> values;
};

const SparseInput& sparse_input() {
  static const SparseInput input = [] {
    Rng rng(2);
    SparseInput s;
    for (uint64_t i = 0; i < kElements; ++i) {
      if (rng.uniform() < kSparseDensity) {
        s.indices.push_back(i);
        s.values.push_back(static_cast<float>(rng.normal() * 1e-3));
      }
    }
    return s;
  }();
  return input;
}

Result<std::vector<EncodedSegment>> encode(Encoding encoding) {
  if (encoding_is_sparse(encoding)) {
    const SparseInput& s = sparse_input();
    return encode_sparse(0, kElements, s.indices, s.values, encoding, kSegmentBytes);
  }
  if (encoding_is_block(encoding)) return encode_blocks(0, dense_input(), encoding, kDefaultBlockSize, kSegmentBytes);
  return encode_dense(0, dense_input(), encoding, kSegmentBytes);
}

void BM_Encode(benchmark::State& state, Encoding encoding) {
  // Build the inputs outside the timing.
  dense_input();
  if (encoding_is_sparse(encoding)) sparse_input();
  for (auto _ : state) {
    auto segments = encode(encoding);
    if (!segments.is_ok()) state.SkipWithError(segments.status().to_string().c_str());
    benchmark::DoNotOptimize(segments);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kElements * sizeof(float)));
}

void BM_Accumulate(benchmark::State& state, Encoding encoding) {
  auto segments = encode(encoding);
  if (!segments.is_ok()) {
    state.SkipWithError(segments.status().to_string().c_str());
    return;
  }
  const std::vector<TensorShape> manifest = {TensorShape{"update", {static_cast<int64_t>(kElements)}}};
  std::vector<float> target(kElements, 0.0f);
  for (auto _ : state) {
    for (const auto& segment : *segments) {
      const Status status = accumulate_segment(segment.view(), manifest, 0.25f, target);
      if (!status.is_ok()) state.SkipWithError(status.to_string().c_str());
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kElements * sizeof(float)));
}

#define CODEC_BENCHMARKS(name, encoding)                                                      \
  BENCHMARK_CAPTURE(BM_Encode, name, encoding)->Unit(benchmark::kMillisecond)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_Accumulate, name, encoding)->Unit(benchmark::kMillisecond)->UseRealTime()

CODEC_BENCHMARKS(dense_f32, Encoding::kDenseF32);
CODEC_BENCHMARKS(dense_bf16, Encoding::kDenseBf16);
CODEC_BENCHMARKS(block_int8, Encoding::kBlockInt8);
CODEC_BENCHMARKS(block_int4, Encoding::kBlockInt4);
CODEC_BENCHMARKS(sparse_f32_1pct, Encoding::kSparseF32);

}  // namespace
}  // namespace fedmesh::protocol

BENCHMARK_MAIN();
