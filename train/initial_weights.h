// `fedmesh train --init FILE`: a run that starts from given weights instead
// of its seeded initialization: a pre-trained model to fine-tune, a round
// exported by `fedmesh checkpoint export`, or PyTorch's initial state for a
// same-start comparison (bench/torch_gpt.py --write-init). The file is a
// safetensors, .npz or .npy file (train/data/arrays.h) holding one f4 or f8
// array per model parameter, under the parameter's name (format "fedmesh"),
// or a GPT-2 state dict in Hugging Face's layout (format "hf-gpt2":
// `transformer.` prefixes optional, h.N.* for hN.*, Conv1D weights stored
// (in, out) and transposed here, the attention-mask buffers and the tied
// lm_head dropped).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/model.h"

namespace fedmesh::train {

// Bounds the file read (GPT-2 124M in f8 is about 1 GiB).
inline constexpr size_t kMaxInitialWeightsBytes = size_t{16} << 30;

enum class InitFormat { kFedmesh, kHfGpt2 };

// "fedmesh" | "hf-gpt2"
Result<InitFormat> parse_init_format(std::string_view text);

// What a partial load left out, by name.
struct InitReport {
  int64_t loaded = 0;                // parameters taken from the file
  std::vector<std::string> seeded;   // parameters kept as seeded: missing or misshapen in the file
  std::vector<std::string> ignored;  // arrays of the file that are no parameter (or misshapen)
};

// Copies every parameter's array into its fp32 master and compute copies.
// Every parameter must be there with its exact shape, and nothing else: a
// missing, misshapen, non-float, non-finite or unknown array is refused with
// its name, and then nothing is copied. With `partial` (a new head on a
// pretrained trunk), a missing or misshapen parameter keeps its seeded
// values and an unknown array is ignored, each listed in `report`;
// non-float and non-finite arrays are still refused. The model may be on
// either device.
Status load_initial_weights(Sequential& model, const std::string& path, InitFormat format = InitFormat::kFedmesh,
                            bool partial = false, InitReport* report = nullptr);

// Where a model's first weights come from: its seed, or a file (`--init` of
// train; `init` and `init_format` in aggregator and site configs, where
// every process of a federation must give the same file, as it gives the
// same seed: version 0 is the model all of them start from).
struct InitialWeights {
  std::string path;                // "": the seeded initialization
  std::string format = "fedmesh";  // or "hf-gpt2"
  bool partial = false;            // --init-partial / init_partial: see load_initial_weights
  // LoRA adapters attached once the weights are in (train/lora.h; rank 0:
  // none): `--lora-rank`... of train, `training.lora` in configs, the same in
  // every process of a federation.
  LoraOptions lora;
};

// make_model, then the weights of `init` when it names a file, then its
// LoRA adapters. Errors name the file ("init: ..."); `report` (optional)
// says what a partial load left out.
Result<std::unique_ptr<Sequential>> make_initial_model(std::string_view name, uint64_t seed, const ModelInput& input,
                                                       const InitialWeights& init, InitReport* report = nullptr);

}  // namespace fedmesh::train
