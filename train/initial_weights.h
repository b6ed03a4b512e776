// `fedmesh train --init-from FILE`: a run that starts from given weights
// instead of its seeded initialization: a pre-trained model to fine-tune, a
// round exported by `fedmesh checkpoint export`, or PyTorch's initial state
// for a same-start comparison (bench/torch_gpt.py --write-init). The file is
// a safetensors, .npz or .npy file (train/data/arrays.h) holding one array
// per model parameter under the parameter's name, f4 or f8.
#pragma once

#include <string>

#include "base/status.h"
#include "train/model.h"

namespace fedmesh::train {

// Bounds the file read (GPT-2 124M in f8 is about 1 GiB).
inline constexpr size_t kMaxInitialWeightsBytes = size_t{16} << 30;

// Copies every parameter's array into its fp32 master and compute copies.
// Every parameter must be there with its exact shape, and nothing else: a
// missing, misshapen, non-float, non-finite or unknown array is refused with
// its name, and then nothing is copied. The model may be on either device.
Status load_initial_weights(Sequential& model, const std::string& path);

}  // namespace fedmesh::train
