// LoRA (Hu et al., 2021) in the form a federation can average exactly.
//
// A weight W (rows, cols: a linear layer's (out, in), a convolution's
// (out, in * k * k), an embedding table's (vocabulary, width)) is adapted as
//   W = W0 + (alpha / rank) · B · A,   B (rows, rank), A (rank, cols),
// with W0 the pretrained weight, frozen. A is drawn once from the run's
// seed and the weight's name (uniform in ±1/sqrt(cols), as PyTorch's PEFT
// draws it) and stays frozen too; only B trains, starting at zero, so the
// first model is exactly the pretrained one. Every other parameter is
// frozen: the model's trainable parameters (Sequential::parameters()) are
// the B factors alone, and they are all a site sends.
//
// Why only B: the federation averages what sites send, and the average of
// the products B_i · A_i is not the product of the averages of B_i and A_i.
// With A the same everywhere (the same seed and name), mean_i(B_i · A) =
// mean_i(B_i) · A, so averaging B is exactly averaging the weight updates
// (FFA-LoRA, Sun et al., ICLR 2024), and secure aggregation, compression,
// staleness weights and server optimizers apply to B unchanged.
//
// How it runs: the layers compute with the merged weight W (kept in the
// target parameter's value after every change of B), their backward pass
// leaves dL/dW in its gradient as always, and the adapter folds that into
// dL/dB = scale · dL/dW · Aᵀ when the layer is done. No layer knows about
// LoRA, so every layer with a 2-D-or-more weight can be adapted, on the CPU
// and on the CUDA device alike. The cost against factored LoRA: the full
// dL/dW is still computed (as in full fine-tuning) and W0 is kept beside
// the merged W; the bytes sent, which are what a federation pays for, are
// the same.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "base/toml_input.h"
#include "kernels/parameter.h"

namespace fedmesh::train {

inline constexpr int64_t kMaxLoraRank = 4096;
inline constexpr size_t kMaxLoraTargets = 64;

struct LoraOptions {
  int64_t rank = 0;    // 0: off, every parameter trains
  float alpha = 0.0f;  // the update's scale is alpha / rank; 0: alpha = 2 * rank (scale 2)
  // Globs (`*`, `?`, `[...]`) over parameter names ("h*.attn.c_attn.weight");
  // only parameters of 2 or more dimensions are adapted. Empty: every one.
  std::vector<std::string> targets;

  bool enabled() const { return rank > 0; }
  float scale() const { return (alpha > 0.0f ? alpha : 2.0f * static_cast<float>(rank)) / static_cast<float>(rank); }
  Status validate() const;
  // {"rank", "alpha", "targets"} as recorded in stores and fingerprints.
  nlohmann::json to_json() const;
  // "rank 8, alpha 16, targets h*.attn.c_attn.weight" (for messages).
  std::string describe() const;
};

// A recorded to_json() back; wrong types and unknown keys are refused
// naming `where`.
Result<LoraOptions> lora_from_json(const nlohmann::json& value, const std::string& where);
// `training.lora.rank`, `.alpha`, `.targets` of a config file (also written
// `training.lora = { rank = 8, alpha = 16, targets = ["h*.attn.*"] }`).
void read_lora_keys(ConfigReader& reader, LoraOptions& options);

// Whether `name` matches one of the globs (every name when there are none).
bool lora_targets(const std::vector<std::string>& globs, const std::string& name);

// One adapted weight.
class LowRankAdapter {
 public:
  // The target's current value becomes W0. A is drawn from `seed` and the
  // target's name; B is a new parameter "<target>.lora_b" of zeros.
  LowRankAdapter(Parameter& target, int64_t rank, float scale, uint64_t seed);

  Parameter& target() { return target_; }
  Parameter& factor_b() { return b_; }
  const Tensor& factor_a() const { return a_; }  // (rank, cols), fp32
  const Tensor& base() const { return base_; }   // W0, the target's shape, fp32
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  float scale() const { return scale_; }

  // target = W0 + scale · B · A, and its compute copy.
  void merge();
  // B.grad += scale · target.grad · Aᵀ.
  void fold_gradient();
  // W0 and A to `device` (B moves with the model's parameters).
  void to_device(Device device);

 private:
  Parameter& target_;
  int64_t rows_, cols_;
  float scale_;
  Tensor base_, a_;
  Parameter b_;
};

// A's values for a weight: what LowRankAdapter draws (exposed for tests).
std::vector<float> lora_factor_a(uint64_t seed, const std::string& name, int64_t rank, int64_t cols);

}  // namespace fedmesh::train
