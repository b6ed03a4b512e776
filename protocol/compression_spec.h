// How a site compresses its update, as configuration: one spec per run
// (`--compress SPEC`, `[compression] default`) and per-tensor overrides
// (`--compress-tensor GLOB=SPEC`, `[compression] overrides`). A spec reads
//
//   identity | fp32         dense fp32, lossless
//   fp16 | bf16             dense cast
//   int8 | int4             block quantization; options: block=N (default
//                           4096), stochastic (unbiased rounding; default:
//                           nearest)
//   topk:F[+fp16|+int8|+fp32]
//                           the fraction F of largest magnitudes (0 < F <= 1),
//                           values in fp16 (default), int8 or fp32; indices as
//                           delta varints or a bitmap, whichever is smaller;
//                           options: warmup=R (density falls geometrically
//                           from 1 to F over the first R rounds, as in Deep
//                           Gradient Compression), momentum=M (DGC's momentum
//                           correction, applied to the rounds' deltas: see
//                           compressor.h)
//   powersgd:R              rank-R PowerSGD on 2-D weights (1-D tensors go
//                           dense); aggregator path only (see powersgd.h)
//   dct-sign:K              DeMo-style: per 64 x 64 chunk of the flattened
//                           tensor, the K largest DCT coefficients, sent as
//                           signs with one magnitude per chunk
//
// e.g. `topk:0.01+int8:warmup=3`, `int4:stochastic`, `powersgd:4`.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/compression_kernels.h"
#include "protocol/codec.h"

namespace fedmesh::protocol {

enum class CompressionMethod : uint8_t { kIdentity, kHalf, kBlock, kTopK, kPowerSgd, kDctSign };

inline constexpr int kMaxPowerSgdRank = 64;

struct CompressionSpec {
  CompressionMethod method = CompressionMethod::kIdentity;
  kernels::HalfType half = kernels::HalfType::kFp16;  // kHalf
  int bits = 8;                                       // kBlock: 8 or 4
  uint32_t block_size = 4096;
  kernels::Rounding rounding = kernels::Rounding::kNearest;
  double density = 0.01;                              // kTopK
  Encoding values = Encoding::kSparseF16;             // kTopK: sparse f32, f16 or int8
  int warmup_rounds = 0;
  double momentum = 0.0;
  int rank = 4;                                       // kPowerSgd
  uint32_t chunk_k = 32;                              // kDctSign: coefficients per 4096-element chunk

  std::string to_string() const;  // parses back to an equal spec
  bool operator==(const CompressionSpec&) const = default;
};

Result<CompressionSpec> parse_compression_spec(std::string_view text);

struct TensorOverride {
  std::string pattern;  // a shell glob over tensor names (fnmatch), e.g. "*.bias"
  CompressionSpec spec;
};
Result<TensorOverride> parse_tensor_override(std::string_view text);  // "GLOB=SPEC"

struct CompressionPlan {
  CompressionSpec default_spec;
  std::vector<TensorOverride> overrides;  // the first match wins
  uint64_t dense_below = 0;               // tensors with fewer elements go dense fp32 unless an override names them

  // The spec for one tensor: its override, else identity below dense_below,
  // else the default. PowerSGD on a tensor that is not 2-D gives identity.
  CompressionSpec for_tensor(const std::string& name, std::span<const int64_t> dims) const;
  bool is_identity() const;   // every tensor dense fp32 whatever its name
  bool uses_powersgd() const;
  std::string to_string() const;  // "topk:0.01+int8; *.bias=identity; dense_below=1024"
};

// A plan from its three settings as a user gives them (flags or config).
Result<CompressionPlan> make_compression_plan(std::string_view default_spec, std::span<const std::string> overrides,
                                              uint64_t dense_below);

}  // namespace fedmesh::protocol
