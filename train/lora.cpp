#include "train/lora.h"

#include <fnmatch.h>

#include <cmath>

#include "base/random.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"

namespace fedmesh::train {

namespace {

constexpr uint64_t kFactorASalt = 0x10a0f0c7a5eedull;

uint64_t name_hash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

int64_t rows_of(const Parameter& p) { return p.value.rank() >= 1 ? p.value.dim(0) : 1; }

}  // namespace

Status LoraOptions::validate() const {
  if (rank < 0 || rank > kMaxLoraRank) {
    return invalid_argument("training.lora.rank must be in [0, " + std::to_string(kMaxLoraRank) + "] (0: off), not " +
                            std::to_string(rank));
  }
  if (!(alpha >= 0.0f) || !std::isfinite(alpha)) {
    return invalid_argument("training.lora.alpha must be a finite number >= 0 (0: twice the rank)");
  }
  if (targets.size() > kMaxLoraTargets) {
    return invalid_argument("training.lora.targets holds " + std::to_string(targets.size()) + " globs, at most " +
                            std::to_string(kMaxLoraTargets));
  }
  for (const std::string& glob : targets) {
    if (glob.empty() || glob.size() > 256) return invalid_argument("training.lora.targets: a glob is empty or over 256 characters");
  }
  if (rank == 0 && (alpha != 0.0f || !targets.empty())) {
    return invalid_argument("training.lora.alpha and .targets need training.lora.rank > 0");
  }
  return Status::ok();
}

nlohmann::json LoraOptions::to_json() const {
  return {{"rank", rank}, {"alpha", alpha > 0.0f ? alpha : 2.0f * static_cast<float>(rank)}, {"targets", targets}};
}

std::string LoraOptions::describe() const {
  std::string targets_text;
  for (const std::string& t : targets) targets_text += (targets_text.empty() ? "" : " ") + t;
  char alpha_text[32];
  std::snprintf(alpha_text, sizeof alpha_text, "%g", static_cast<double>(scale() * static_cast<float>(rank)));
  return "rank " + std::to_string(rank) + ", alpha " + alpha_text + ", targets " +
         (targets_text.empty() ? "every weight" : targets_text);
}

Result<LoraOptions> lora_from_json(const nlohmann::json& value, const std::string& where) {
  if (!value.is_object()) return invalid_argument(where + ": lora must be an object");
  LoraOptions options;
  for (const auto& [key, item] : value.items()) {
    if (key == "rank" && item.is_number_integer()) {
      options.rank = item.get<int64_t>();
    } else if (key == "alpha" && item.is_number()) {
      options.alpha = item.get<float>();
    } else if (key == "targets" && item.is_array()) {
      for (const nlohmann::json& glob : item) {
        if (!glob.is_string()) return invalid_argument(where + ": lora.targets must be strings");
        options.targets.push_back(glob.get<std::string>());
      }
    } else {
      return invalid_argument(where + ": lora." + key + " is unknown or of the wrong type");
    }
  }
  FEDMESH_RETURN_IF_ERROR(options.validate());
  return options;
}

void read_lora_keys(ConfigReader& reader, LoraOptions& options) {
  reader.read("training.lora.rank", options.rank);
  reader.read("training.lora.alpha", options.alpha);
  reader.read("training.lora.targets", options.targets);
}

bool lora_targets(const std::vector<std::string>& globs, const std::string& name) {
  if (globs.empty()) return true;
  for (const std::string& glob : globs) {
    if (::fnmatch(glob.c_str(), name.c_str(), 0) == 0) return true;
  }
  return false;
}

std::vector<float> lora_factor_a(uint64_t seed, const std::string& name, int64_t rank, int64_t cols) {
  Rng rng(mix_seed(seed ^ kFactorASalt, name_hash(name)));
  const double bound = 1.0 / std::sqrt(static_cast<double>(cols));
  std::vector<float> a(static_cast<size_t>(rank * cols));
  for (float& v : a) v = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
  return a;
}

LowRankAdapter::LowRankAdapter(Parameter& target, int64_t rank, float scale, uint64_t seed)
    : target_(target),
      rows_(rows_of(target)),
      cols_(target.value.numel() / rows_of(target)),
      scale_(scale),
      base_(target.value.clone()),
      a_(Tensor::empty({rank, cols_})),
      b_(target.name + ".lora_b", {rows_, rank}) {
  FEDMESH_CHECK(target.value.device() == Device::kCpu, "LoRA adapters are attached on the host");
  std::vector<float> a = lora_factor_a(seed, target.name, rank, cols_);
  a_.copy_from(Tensor::view_of(a.data(), {rank, cols_}, DType::kF32));
}

void LowRankAdapter::merge() {
  target_.value.copy_from(base_);
  Tensor merged = target_.value.reshape({rows_, cols_});
  gemm(/*transpose_a=*/false, /*transpose_b=*/false, scale_, b_.value, a_, 1.0f, merged);
  target_.refresh_compute();
}

void LowRankAdapter::fold_gradient() {
  const Tensor gradient = target_.grad.reshape({rows_, cols_});
  gemm(/*transpose_a=*/false, /*transpose_b=*/true, scale_, gradient, a_, 1.0f, b_.grad);
}

void LowRankAdapter::to_device(Device device) {
  if (base_.device() == device) return;
  base_ = base_.to(device);
  a_ = a_.to(device);
}

}  // namespace fedmesh::train
