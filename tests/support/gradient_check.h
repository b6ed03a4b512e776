// Finite-difference gradient checks shared by the layer and model tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "base/random.h"
#include "kernels/tensor.h"

namespace fedmesh::testing {

inline Tensor random_tensor(Shape shape, Rng& rng, float scale = 1.0f) {
  Tensor t = Tensor::empty(std::move(shape));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(rng.normal()) * scale;
  return t;
}

// Central differences of loss() with respect to values[i] for a sample of
// indices, compared with analytic[i]. fp32 forward passes with step 1e-2 give
// central-difference truncation ~1e-4 and rounding ~1e-7·|loss|/1e-2, hence
// the tolerances: |analytic − numeric| ≤ atol + rtol·|numeric|.
inline void expect_gradient_matches(const std::string& what, float* values, const float* analytic, int64_t n,
                                    const std::function<double()>& loss, const std::function<void()>& after_change,
                                    Rng& rng, int samples = 24, double step = 1e-2, double atol = 5e-3,
                                    double rtol = 2e-2) {
  for (int s = 0; s < samples && n > 0; ++s) {
    const int64_t i = s < n && n <= samples ? s : static_cast<int64_t>(rng.below(static_cast<uint64_t>(n)));
    const float original = values[i];
    values[i] = original + static_cast<float>(step);
    after_change();
    const double plus = loss();
    values[i] = original - static_cast<float>(step);
    after_change();
    const double minus = loss();
    values[i] = original;
    after_change();
    const double numeric = (plus - minus) / (2.0 * step);
    EXPECT_NEAR(analytic[i], numeric, atol + rtol * std::fabs(numeric)) << what << " index " << i;
  }
}

}  // namespace fedmesh::testing
