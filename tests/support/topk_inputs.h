// Test inputs for top-k selection shared by the CPU and CUDA kernel tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/compression_math.h"

namespace fedmesh::testing {

// An adversarial input for the sampled-threshold path (white box: the
// sampler draws position uniform_at(seed, s) * n for s = 0, 1, ...): the
// positions a `seed` sample of 10,000 reads hold large values, everything
// else is tiny and distinct, so the sample's quantile overestimates the
// threshold and the first gather finds too few candidates.
inline std::vector<float> topk_refinement_input(size_t n, uint64_t seed) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = 1e-6f * (1.0f + static_cast<float>(i) / static_cast<float>(n));
  for (uint64_t s = 0; s < 10'000; ++s) {
    const auto position = static_cast<size_t>(kernels::uniform_at(seed, s) * static_cast<float>(n));
    x[std::min(position, n - 1)] = 10.0f + static_cast<float>(s % 97);
  }
  return x;
}

}  // namespace fedmesh::testing
