#include "protocol/compression_spec.h"

#include <fnmatch.h>

#include <cmath>

#include "base/text.h"

namespace fedmesh::protocol {
namespace {

Status bad_spec(std::string_view text, const std::string& why) {
  return invalid_argument("compression spec '" + std::string(text) + "': " + why +
                          " (expected identity, fp16, bf16, int8[:stochastic][:block=N], int4[...], "
                          "topk:F[+fp16|+int8|+fp32][:warmup=R][:momentum=M], powersgd:R or dct-sign:K)");
}

}  // namespace

std::string CompressionSpec::to_string() const {
  switch (method) {
    case CompressionMethod::kIdentity: return "identity";
    case CompressionMethod::kHalf: return half == kernels::HalfType::kBf16 ? "bf16" : "fp16";
    case CompressionMethod::kBlock: {
      std::string text = bits == 4 ? "int4" : "int8";
      if (rounding == kernels::Rounding::kStochastic) text += ":stochastic";
      if (block_size != 4096) text += ":block=" + std::to_string(block_size);
      return text;
    }
    case CompressionMethod::kTopK: {
      std::string text = "topk:" + format_shortest(density);
      text += values == Encoding::kSparseInt8 ? "+int8" : values == Encoding::kSparseF32 ? "+fp32" : "+fp16";
      if (warmup_rounds > 0) text += ":warmup=" + std::to_string(warmup_rounds);
      if (momentum > 0.0) text += ":momentum=" + format_shortest(momentum);
      return text;
    }
    case CompressionMethod::kPowerSgd: return "powersgd:" + std::to_string(rank);
    case CompressionMethod::kDctSign: return "dct-sign:" + std::to_string(chunk_k);
  }
  return "identity";
}

Result<CompressionSpec> parse_compression_spec(std::string_view text) {
  CompressionSpec spec;
  // "topk:0.01+int8:warmup=3": the value type sits between '+' and the next
  // ':'; the rest is NAME[:ARG][:OPTION...].
  std::string base(text);
  std::string_view value_type;
  if (const size_t plus = text.find('+'); plus != std::string_view::npos) {
    const std::string_view rest = text.substr(plus + 1);
    const size_t colon = rest.find(':');
    value_type = rest.substr(0, colon);
    base = std::string(text.substr(0, plus)) + (colon == std::string_view::npos ? "" : std::string(rest.substr(colon)));
  }
  const std::vector<std::string_view> parts = split(base, ':');
  const std::string_view name = parts[0];
  auto options = std::span(parts).subspan(1);
  if (name == "identity" || name == "fp32" || name == "dense") {
    spec.method = CompressionMethod::kIdentity;
  } else if (name == "fp16" || name == "bf16") {
    spec.method = CompressionMethod::kHalf;
    spec.half = name == "bf16" ? kernels::HalfType::kBf16 : kernels::HalfType::kFp16;
  } else if (name == "int8" || name == "int4") {
    spec.method = CompressionMethod::kBlock;
    spec.bits = name == "int4" ? 4 : 8;
    for (const std::string_view option : options) {
      if (option == "stochastic") {
        spec.rounding = kernels::Rounding::kStochastic;
      } else if (option == "nearest") {
        spec.rounding = kernels::Rounding::kNearest;
      } else if (option.starts_with("block=")) {
        if (!parse_number(option.substr(6), spec.block_size) || spec.block_size < 1 || spec.block_size > kMaxBlockSize) {
          return bad_spec(text, "block= needs a whole number in [1, " + std::to_string(kMaxBlockSize) + "]");
        }
      } else {
        return bad_spec(text, "unknown option '" + std::string(option) + "' for " + std::string(name));
      }
    }
    options = {};
  } else if (name == "topk") {
    spec.method = CompressionMethod::kTopK;
    if (options.empty() || !parse_number(options[0], spec.density) || !(spec.density > 0.0 && spec.density <= 1.0)) {
      return bad_spec(text, "topk needs a fraction F with 0 < F <= 1, e.g. topk:0.01");
    }
    for (const std::string_view option : options.subspan(1)) {
      if (option.starts_with("warmup=")) {
        if (!parse_number(option.substr(7), spec.warmup_rounds) || spec.warmup_rounds < 0 || spec.warmup_rounds > 1000) {
          return bad_spec(text, "warmup= needs a number of rounds in [0, 1000]");
        }
      } else if (option.starts_with("momentum=")) {
        if (!parse_number(option.substr(9), spec.momentum) || !(spec.momentum >= 0.0 && spec.momentum < 1.0)) {
          return bad_spec(text, "momentum= needs a value in [0, 1)");
        }
      } else {
        return bad_spec(text, "unknown option '" + std::string(option) + "' for topk");
      }
    }
    options = {};
  } else if (name == "powersgd") {
    spec.method = CompressionMethod::kPowerSgd;
    if (options.size() != 1 || !parse_number(options[0], spec.rank) || spec.rank < 1 || spec.rank > kMaxPowerSgdRank) {
      return bad_spec(text, "powersgd needs a rank in [1, " + std::to_string(kMaxPowerSgdRank) + "], e.g. powersgd:4");
    }
    options = {};
  } else if (name == "dct-sign") {
    spec.method = CompressionMethod::kDctSign;
    if (options.size() != 1 || !parse_number(options[0], spec.chunk_k) || spec.chunk_k < 1 ||
        spec.chunk_k > kernels::kDctChunk) {
      return bad_spec(text, "dct-sign needs K coefficients per 4096-element chunk, 1 <= K <= 4096, e.g. dct-sign:32");
    }
    options = {};
  } else {
    return bad_spec(text, "unknown method '" + std::string(name) + "'");
  }
  if (!options.empty()) return bad_spec(text, std::string(name) + " takes no options");
  if (!value_type.empty()) {
    if (spec.method != CompressionMethod::kTopK) return bad_spec(text, "only topk takes a +VALUES type");
    if (value_type == "fp16") {
      spec.values = Encoding::kSparseF16;
    } else if (value_type == "int8") {
      spec.values = Encoding::kSparseInt8;
    } else if (value_type == "fp32") {
      spec.values = Encoding::kSparseF32;
    } else {
      return bad_spec(text, "topk values must be +fp16, +int8 or +fp32, not +" + std::string(value_type));
    }
  }
  return spec;
}

Result<TensorOverride> parse_tensor_override(std::string_view text) {
  const size_t equals = text.find('=');
  if (equals == std::string_view::npos || equals == 0) {
    return invalid_argument("tensor override '" + std::string(text) +
                            "': expected GLOB=SPEC, e.g. '*.bias=identity' or 'fc1.weight=topk:0.001'");
  }
  Result<CompressionSpec> spec = parse_compression_spec(text.substr(equals + 1));
  if (!spec.is_ok()) return spec.status();
  return TensorOverride{std::string(text.substr(0, equals)), *spec};
}

CompressionSpec CompressionPlan::for_tensor(const std::string& name, std::span<const int64_t> dims) const {
  uint64_t elements = 1;
  for (const int64_t d : dims) elements *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  CompressionSpec spec = elements < dense_below ? CompressionSpec{} : default_spec;
  for (const TensorOverride& o : overrides) {
    if (fnmatch(o.pattern.c_str(), name.c_str(), 0) == 0) {
      spec = o.spec;
      break;
    }
  }
  if (spec.method == CompressionMethod::kPowerSgd && dims.size() != 2) return CompressionSpec{};
  return spec;
}

bool CompressionPlan::is_identity() const {
  if (default_spec.method != CompressionMethod::kIdentity) return false;
  for (const TensorOverride& o : overrides) {
    if (o.spec.method != CompressionMethod::kIdentity) return false;
  }
  return true;
}

bool CompressionPlan::uses_powersgd() const {
  if (default_spec.method == CompressionMethod::kPowerSgd) return true;
  for (const TensorOverride& o : overrides) {
    if (o.spec.method == CompressionMethod::kPowerSgd) return true;
  }
  return false;
}

std::string CompressionPlan::to_string() const {
  std::string text = default_spec.to_string();
  for (const TensorOverride& o : overrides) text += "; " + o.pattern + "=" + o.spec.to_string();
  if (dense_below > 0) text += "; dense_below=" + std::to_string(dense_below);
  return text;
}

Result<CompressionPlan> make_compression_plan(std::string_view default_spec, std::span<const std::string> overrides,
                                              uint64_t dense_below) {
  CompressionPlan plan;
  Result<CompressionSpec> spec = parse_compression_spec(default_spec);
  if (!spec.is_ok()) return spec.status();
  plan.default_spec = *spec;
  for (const std::string& text : overrides) {
    Result<TensorOverride> o = parse_tensor_override(text);
    if (!o.is_ok()) return o.status();
    plan.overrides.push_back(std::move(*o));
  }
  plan.dense_below = dense_below;
  return plan;
}

}  // namespace fedmesh::protocol
