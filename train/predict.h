// `fedmesh model predict`: a model's logits on given inputs, with given
// weights, in evaluation mode: what another framework compares with, and
// what a user runs on new samples. Inputs are the array `x` of a .npz,
// .npy or safetensors file (train/data/arrays.h): samples (N, ...) for the
// image and table models, token ids (N, context) for the GPTs.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "kernels/tensor.h"
#include "train/initial_weights.h"

namespace fedmesh::train {

// Bounds the input file read.
inline constexpr size_t kMaxPredictInputBytes = size_t{4} << 30;

struct PredictOptions {
  std::string model;      // a built-in name or a spec file
  InitialWeights weights; // path required; format fedmesh or hf-gpt2
  std::string input;      // the file holding x
  int64_t classes = 10;   // image and table models: the output size
  int64_t vocabulary = 0; // GPTs: 0, the model's own
  int64_t batch_size = 256;
};

struct Prediction {
  Tensor logits;          // (N, classes), or (N * context, vocabulary) for a GPT, fp32 on the host
  int64_t samples = 0;
};

// Reads x (f4 or f8 samples; ids as any integer or float type, each in
// [0, vocabulary)), builds the model for x's sample shape, loads the weights
// (every parameter by name and shape, as train --init) and runs it. Flaws
// of the file, of x and of the weights are refused naming them.
Result<Prediction> predict(const PredictOptions& options);

}  // namespace fedmesh::train
