// Helpers shared by the kernel tests: tensors from values, random tensors in
// any dtype, per-dtype rounding bounds, relative L2 distances, and a guard
// that restores the thread count a test changed.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "base/random.h"
#include "kernels/convert.h"
#include "kernels/parallel.h"
#include "kernels/tensor.h"

namespace fedmesh::testing {

inline constexpr double kF32UnitRoundoff = 0x1p-24;

// Unit roundoff (half an ulp of 1) of each storage dtype.
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 0x1p-8;
    case DType::kF16: return 0x1p-11;
    case DType::kF32: break;
  }
  return kF32UnitRoundoff;
}

// Half the smallest subnormal of the dtype: the absolute error floor of one rounding.
inline double subnormal_floor(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 0x1p-134;
    case DType::kF16: return 0x1p-25;
    case DType::kF32: break;
  }
  return 0x1p-150;
}

// Restores the default thread count when a test that changes it ends.
class ThreadCountGuard {
 public:
  ThreadCountGuard() = default;
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;
  ~ThreadCountGuard() { set_cpu_threads(0); }
};

inline std::vector<float> widen(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  widen_to_f32(t.raw(), t.dtype(), out.data(), t.numel());
  return out;
}

// The relative L2 distance ||a - b|| / ||b|| over all the tensors together
// (any dtype, either device; sums in double): a per-tensor ratio is
// meaningless for a tensor that is near zero, such as biases that start at
// zero. Infinity when a holds a NaN or an infinity, or the shapes differ.
inline double relative_l2(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  if (a.size() != b.size()) return kInfinity;
  double difference = 0.0, norm = 0.0;
  for (size_t t = 0; t < a.size(); ++t) {
    const std::vector<float> x = widen(a[t].to(Device::kCpu)), y = widen(b[t].to(Device::kCpu));
    if (x.size() != y.size()) return kInfinity;
    for (size_t i = 0; i < y.size(); ++i) {
      if (!std::isfinite(x[i])) return kInfinity;
      difference += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
      norm += double{y[i]} * y[i];
    }
  }
  return std::sqrt(difference / std::max(norm, 1e-30));
}
inline double relative_l2(const Tensor& a, const Tensor& b) {
  return relative_l2(std::vector<Tensor>{a}, std::vector<Tensor>{b});
}

inline Tensor from_values(const std::vector<float>& values, Shape shape, DType dtype) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  narrow_from_f32(values.data(), t.raw(), dtype, t.numel());
  return t;
}

// Uniform in [lo, hi), rounded to dtype.
inline Tensor random_tensor(Shape shape, DType dtype, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (auto& v : values) v = static_cast<float>(lo + (hi - lo) * rng.uniform());
  return from_values(values, std::move(shape), dtype);
}

inline Tensor nan_tensor(Shape shape, DType dtype) {
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)), std::numeric_limits<float>::quiet_NaN());
  return from_values(values, std::move(shape), dtype);
}

}  // namespace fedmesh::testing
