// Convolution and max pooling (kernels/conv.h) against naive direct loops in
// double over many geometries, im2col/col2im adjointness, and low-precision
// inputs against fp32 on the rounded values.
//
// Tolerances: the kernel reduces through an fp32 GEMM; a sum of K products in
// any order is within (K + 2) u32 (u32 = 2^-24) of the sum of their absolute
// values (Higham 3.1), the +2 covering the bias add and the final rounding.
// Every bound below is that, with K the length of the reduction.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/conv.h"
#include "kernels/convert.h"
#include "kernels/tensor.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

constexpr double kU32 = 0x1p-24;

std::string describe(const Conv2dGeometry& g) {
  return "batch " + std::to_string(g.batch) + ", " + std::to_string(g.in_channels) + "x" +
         std::to_string(g.height) + "x" + std::to_string(g.width) + " -> " + std::to_string(g.out_channels) +
         ", kernel " + std::to_string(g.kernel) + " stride " + std::to_string(g.stride) + " padding " +
         std::to_string(g.padding);
}

// 7x5 images, 3 input and 4 output channels, batch 1 and 3, every kernel,
// stride and padding asked for; plus a 1x1 image, a wider odd case and a
// larger one.
std::vector<Conv2dGeometry> geometries() {
  std::vector<Conv2dGeometry> all;
  for (const int64_t batch : {1, 3})
    for (const int64_t kernel : {1, 3, 5})
      for (const int64_t stride : {1, 2})
        for (const int64_t padding : {0, 1, 2}) {
          Conv2dGeometry g{batch, 3, 7, 5, 4, kernel, stride, padding};
          if (g.height + 2 * padding < kernel || g.width + 2 * padding < kernel) continue;
          all.push_back(g);
        }
  all.push_back(Conv2dGeometry{1, 1, 1, 1, 1, 1, 1, 0});
  all.push_back(Conv2dGeometry{2, 1, 3, 3, 2, 3, 1, 1});
  all.push_back(Conv2dGeometry{2, 5, 11, 13, 6, 3, 2, 1});
  // Large enough (16 x 1024 x 72 multiply-adds) that sgemm splits its GEMMs
  // across threads, forward and backward.
  all.push_back(Conv2dGeometry{4, 8, 16, 16, 16, 3, 1, 1});
  return all;
}

// x value at (b, c, row, column) with zero padding outside the image.
double padded(const std::vector<float>& x, const Conv2dGeometry& g, int64_t b, int64_t c, int64_t row, int64_t col) {
  if (row < 0 || row >= g.height || col < 0 || col >= g.width) return 0.0;
  return x[static_cast<size_t>(((b * g.in_channels + c) * g.height + row) * g.width + col)];
}

struct ConvReference {
  std::vector<double> value, tolerance;
};

// y[b][o][i][j] = bias[o] + sum over c, ki, kj of w[o][c][ki][kj] x[b][c][i s - p + ki][j s - p + kj].
ConvReference reference_forward(const Conv2dGeometry& g, const std::vector<float>& x, const std::vector<float>& w,
                                const std::vector<float>& bias) {
  const int64_t oh = g.out_height(), ow = g.out_width(), k = g.kernel;
  ConvReference ref;
  for (int64_t b = 0; b < g.batch; ++b)
    for (int64_t o = 0; o < g.out_channels; ++o)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          double total = bias[static_cast<size_t>(o)], magnitude = std::fabs(total);
          for (int64_t c = 0; c < g.in_channels; ++c)
            for (int64_t ki = 0; ki < k; ++ki)
              for (int64_t kj = 0; kj < k; ++kj) {
                const double term = w[static_cast<size_t>(((o * g.in_channels + c) * k + ki) * k + kj)] *
                                    padded(x, g, b, c, i * g.stride - g.padding + ki, j * g.stride - g.padding + kj);
                total += term;
                magnitude += std::fabs(term);
              }
          ref.value.push_back(total);
          ref.tolerance.push_back(static_cast<double>(g.patch_size() + 2) * kU32 * magnitude);
        }
  return ref;
}

struct ConvGradients {
  std::vector<double> dweight, dbias, dx;
  std::vector<double> dweight_magnitude, dbias_magnitude, dx_magnitude;  // sums of |terms|
};

// The naive backward: every output gradient scattered along the same index
// map as the forward.
ConvGradients reference_backward(const Conv2dGeometry& g, const std::vector<float>& x, const std::vector<float>& w,
                                 const std::vector<float>& dy) {
  const int64_t oh = g.out_height(), ow = g.out_width(), k = g.kernel;
  ConvGradients ref;
  ref.dweight.assign(w.size(), 0.0);
  ref.dweight_magnitude.assign(w.size(), 0.0);
  ref.dbias.assign(static_cast<size_t>(g.out_channels), 0.0);
  ref.dbias_magnitude.assign(static_cast<size_t>(g.out_channels), 0.0);
  ref.dx.assign(x.size(), 0.0);
  ref.dx_magnitude.assign(x.size(), 0.0);
  for (int64_t b = 0; b < g.batch; ++b)
    for (int64_t o = 0; o < g.out_channels; ++o)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          const double grad = dy[static_cast<size_t>(((b * g.out_channels + o) * oh + i) * ow + j)];
          ref.dbias[static_cast<size_t>(o)] += grad;
          ref.dbias_magnitude[static_cast<size_t>(o)] += std::fabs(grad);
          for (int64_t c = 0; c < g.in_channels; ++c)
            for (int64_t ki = 0; ki < k; ++ki)
              for (int64_t kj = 0; kj < k; ++kj) {
                const int64_t row = i * g.stride - g.padding + ki, col = j * g.stride - g.padding + kj;
                const auto wi = static_cast<size_t>(((o * g.in_channels + c) * k + ki) * k + kj);
                const double xv = padded(x, g, b, c, row, col);
                ref.dweight[wi] += grad * xv;
                ref.dweight_magnitude[wi] += std::fabs(grad * xv);
                if (row < 0 || row >= g.height || col < 0 || col >= g.width) continue;
                const auto xi = static_cast<size_t>(((b * g.in_channels + c) * g.height + row) * g.width + col);
                ref.dx[xi] += grad * w[wi];
                ref.dx_magnitude[xi] += std::fabs(grad * w[wi]);
              }
        }
  return ref;
}

// got[i] within (terms + 2) u32 * magnitude[i] of want[i] (minus an initial value).
void expect_within_bound(const std::vector<float>& got, const std::vector<float>& initial,
                         const std::vector<double>& want, const std::vector<double>& magnitude, int64_t terms,
                         const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    const double start = initial.empty() ? 0.0 : initial[i];
    const double tolerance = static_cast<double>(terms + 2) * kU32 * (magnitude[i] + std::fabs(start)) + 1e-30;
    if (!(std::fabs(got[i] - (want[i] + start)) <= tolerance)) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << ", want " << want[i] + start << " +- "
                    << tolerance;
      ++failures;
    }
  }
}

TEST(Conv2d, ForwardMatchesDirectConvolution) {
  Rng rng(1);
  for (const Conv2dGeometry& g : geometries()) {
    SCOPED_TRACE(describe(g));
    const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
    const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, DType::kF32, rng);
    const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
    Tensor y = nan_tensor({g.batch, g.out_channels, g.out_height(), g.out_width()}, DType::kF32);
    std::vector<float> col;
    conv2d_forward(g, x, weight, bias, y, col);
    EXPECT_EQ(static_cast<int64_t>(col.size()), g.patch_size() * g.columns());
    const ConvReference ref = reference_forward(g, widen(x), widen(weight), widen(bias));
    const std::vector<float> got = widen(y);
    ASSERT_EQ(got.size(), ref.value.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], ref.value[i], ref.tolerance[i]) << "y " << i;
  }
}

TEST(Conv2d, BackwardMatchesNaiveBackward) {
  Rng rng(2);
  for (const Conv2dGeometry& g : geometries()) {
    SCOPED_TRACE(describe(g));
    const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
    const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, DType::kF32, rng);
    const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
    Tensor y = Tensor::empty({g.batch, g.out_channels, g.out_height(), g.out_width()});
    std::vector<float> col;
    conv2d_forward(g, x, weight, bias, y, col);

    const Tensor dy = random_tensor(y.shape(), DType::kF32, rng);
    // dweight and dbias accumulate: start from known values. dx is
    // overwritten: start from NaN, which must not survive anywhere.
    Tensor dweight = random_tensor(weight.shape(), DType::kF32, rng);
    Tensor dbias = random_tensor(bias.shape(), DType::kF32, rng);
    Tensor dx = nan_tensor(x.shape(), DType::kF32);
    const std::vector<float> dweight0 = widen(dweight), dbias0 = widen(dbias);
    conv2d_backward(g, col, weight, dy, dweight, dbias, &dx);

    const ConvGradients ref = reference_backward(g, widen(x), widen(weight), widen(dy));
    const int64_t positions = g.batch * g.out_height() * g.out_width();
    // dweight and dbias reduce over every output position; dx over at most
    // out_channels * kernel^2 contributions.
    expect_within_bound(widen(dweight), dweight0, ref.dweight, ref.dweight_magnitude, positions + 1, "dweight");
    expect_within_bound(widen(dbias), dbias0, ref.dbias, ref.dbias_magnitude, positions + 1, "dbias");
    expect_within_bound(widen(dx), {}, ref.dx, ref.dx_magnitude, g.out_channels * g.kernel * g.kernel, "dx");

    // Without dx, the weight gradients still accumulate (a second time).
    conv2d_backward(g, col, weight, dy, dweight, dbias, nullptr);
    std::vector<double> twice_dweight = ref.dweight, twice_magnitude = ref.dweight_magnitude;
    for (size_t i = 0; i < twice_dweight.size(); ++i) {
      twice_dweight[i] *= 2;
      twice_magnitude[i] *= 2;
    }
    expect_within_bound(widen(dweight), dweight0, twice_dweight, twice_magnitude, 2 * positions + 2, "dweight x2");
  }
}

TEST(Conv2d, BackwardDxMatchesFiniteDifferences) {
  // An independent check of dx on one geometry: L = sum(r * y) is linear in
  // x, so a central difference with h = 1/16 is exact up to rounding of the
  // fp32 forward (2 (K + 2) u32 * sum |r| |y| / (2h)).
  const Conv2dGeometry g{2, 3, 7, 5, 4, 3, 2, 1};
  Rng rng(3);
  const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
  const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, DType::kF32, rng);
  const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
  const Shape y_shape = {g.batch, g.out_channels, g.out_height(), g.out_width()};
  const Tensor r = random_tensor(y_shape, DType::kF32, rng);
  const std::vector<float> vr = widen(r);
  std::vector<float> col;
  const auto loss = [&](const Tensor& input) {
    Tensor y = Tensor::empty(y_shape);
    std::vector<float> scratch;
    conv2d_forward(g, input, weight, bias, y, scratch);
    double total = 0.0;
    for (int64_t i = 0; i < y.numel(); ++i) total += vr[static_cast<size_t>(i)] * y.data<float>()[i];
    return total;
  };
  Tensor y = Tensor::empty(y_shape);
  conv2d_forward(g, x, weight, bias, y, col);
  Tensor dweight = Tensor::zeros(weight.shape()), dbias = Tensor::zeros(bias.shape());
  Tensor dx = Tensor::empty(x.shape());
  conv2d_backward(g, col, weight, r, dweight, dbias, &dx);

  const double h = 1.0 / 16;
  double output_scale = 0.0;
  for (size_t i = 0; i < vr.size(); ++i) output_scale += std::fabs(vr[i]) * (g.patch_size() + 1);
  const double tolerance = 2 * static_cast<double>(g.patch_size() + 4) * kU32 * output_scale / (2 * h);
  for (int64_t i = 0; i < x.numel(); ++i) {
    Tensor shifted = x.clone();
    const float up = x.data<float>()[i] + static_cast<float>(h), down = x.data<float>()[i] - static_cast<float>(h);
    shifted.data<float>()[i] = up;
    const double plus = loss(shifted);
    shifted.data<float>()[i] = down;
    const double minus = loss(shifted);
    // Divide by the step actually taken (x +- h rounded to fp32).
    ASSERT_NEAR(dx.data<float>()[i], (plus - minus) / (static_cast<double>(up) - down), tolerance) << "dx " << i;
  }
}

TEST(Conv2d, Im2colAndCol2imAreAdjoint) {
  // <im2col(x), c> == <x, col2im(c)> for every x and c: col2im must be the
  // exact transpose of im2col's index map, padding included.
  Rng rng(4);
  for (const Conv2dGeometry& g : geometries()) {
    SCOPED_TRACE(describe(g));
    const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
    std::vector<float> columns(static_cast<size_t>(g.patch_size() * g.columns()));
    im2col(g, x, columns.data());
    std::vector<float> c(columns.size());
    for (auto& v : c) v = static_cast<float>(2 * rng.uniform() - 1);
    Tensor folded = nan_tensor(x.shape(), DType::kF32);
    col2im(g, c.data(), folded);

    const std::vector<float> vx = widen(x), vf = widen(folded);
    double left = 0.0, right = 0.0, magnitude = 0.0;
    for (size_t i = 0; i < columns.size(); ++i) {
      left += static_cast<double>(columns[i]) * c[i];
      magnitude += std::fabs(static_cast<double>(columns[i]) * c[i]);
    }
    for (size_t i = 0; i < vx.size(); ++i) right += static_cast<double>(vx[i]) * vf[i];
    // im2col copies exactly; col2im sums at most kernel^2 fp32 terms per pixel.
    EXPECT_NEAR(left, right, static_cast<double>(g.kernel * g.kernel + 1) * kU32 * magnitude + 1e-12);
  }
}

TEST(Conv2d, Im2colPlacesPaddedPatches) {
  // Direct check of the column layout: row (c, ki, kj), column (b, i, j).
  Rng rng(5);
  for (const Conv2dGeometry& g : geometries()) {
    SCOPED_TRACE(describe(g));
    const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
    std::vector<float> columns(static_cast<size_t>(g.patch_size() * g.columns()), -7.0f);
    im2col(g, x, columns.data());
    const std::vector<float> vx = widen(x);
    const int64_t oh = g.out_height(), ow = g.out_width(), k = g.kernel;
    for (int64_t c = 0; c < g.in_channels; ++c)
      for (int64_t ki = 0; ki < k; ++ki)
        for (int64_t kj = 0; kj < k; ++kj)
          for (int64_t b = 0; b < g.batch; ++b)
            for (int64_t i = 0; i < oh; ++i)
              for (int64_t j = 0; j < ow; ++j) {
                const int64_t row = (c * k + ki) * k + kj, column = (b * oh + i) * ow + j;
                const double want = padded(vx, g, b, c, i * g.stride - g.padding + ki, j * g.stride - g.padding + kj);
                ASSERT_EQ(columns[static_cast<size_t>(row * g.columns() + column)], want)
                    << "row " << row << " column " << column;
              }
  }
}

TEST(Conv2d, LowPrecisionInputsMatchFp32OnRoundedValues) {
  Rng rng(6);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    for (const Conv2dGeometry& g : {Conv2dGeometry{3, 3, 7, 5, 4, 3, 1, 1}, Conv2dGeometry{1, 3, 7, 5, 4, 5, 2, 2}}) {
      SCOPED_TRACE(describe(g) + " " + dtype_name(dtype));
      const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, dtype, rng);
      const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, dtype, rng);
      const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
      const Shape y_shape = {g.batch, g.out_channels, g.out_height(), g.out_width()};

      // The same values, widened to fp32, through the fp32 path.
      const Tensor x32 = to_dtype(x, DType::kF32), weight32 = to_dtype(weight, DType::kF32);
      Tensor y32 = Tensor::empty(y_shape);
      std::vector<float> col32;
      conv2d_forward(g, x32, weight32, bias, y32, col32);

      Tensor y = Tensor::empty(y_shape);  // fp32 output
      std::vector<float> col;
      conv2d_forward(g, x, weight, bias, y, col);
      // The column matrix holds the widened inputs: identical to the fp32 one.
      EXPECT_EQ(col, col32);
      const ConvReference ref = reference_forward(g, widen(x), widen(weight), widen(bias));
      const std::vector<float> got = widen(y), got32 = widen(y32);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], ref.value[i], ref.tolerance[i]) << "y " << i;
        ASSERT_NEAR(got[i], got32[i], 2 * ref.tolerance[i]) << "y vs fp32 path " << i;
      }

      // Low-precision output: the fp32 result rounded once.
      Tensor y_low = Tensor::empty(y_shape, dtype);
      conv2d_forward(g, x, weight, bias, y_low, col);
      const std::vector<float> low = widen(y_low);
      const double u = dtype == DType::kBF16 ? 0x1p-8 : 0x1p-11;
      for (size_t i = 0; i < low.size(); ++i)
        ASSERT_NEAR(low[i], ref.value[i], ref.tolerance[i] + u * std::fabs(ref.value[i]) + 0x1p-25) << "y " << i;

      // Backward with a low-precision dy and dx.
      const Tensor dy = random_tensor(y_shape, dtype, rng);
      Tensor dweight = Tensor::zeros(weight.shape()), dbias = Tensor::zeros(bias.shape());
      Tensor dx = nan_tensor(x.shape(), dtype);
      conv2d_backward(g, col, weight, dy, dweight, dbias, &dx);
      const ConvGradients grads = reference_backward(g, widen(x), widen(weight), widen(dy));
      const int64_t positions = g.batch * g.out_height() * g.out_width();
      expect_within_bound(widen(dweight), {}, grads.dweight, grads.dweight_magnitude, positions, "dweight");
      expect_within_bound(widen(dbias), {}, grads.dbias, grads.dbias_magnitude, positions, "dbias");
      const std::vector<float> vdx = widen(dx);
      for (size_t i = 0; i < vdx.size(); ++i) {
        const double tolerance = static_cast<double>(g.out_channels * g.kernel * g.kernel + 2) * kU32 *
                                     grads.dx_magnitude[i] +
                                 u * std::fabs(grads.dx[i]) + 0x1p-25;
        ASSERT_NEAR(vdx[i], grads.dx[i], tolerance) << "dx " << i;
      }
    }
  }
}

// ---------------------------------------------------------------- maxpool ----

// Values that are all distinct (a shuffled ramp), so every window has one maximum.
Tensor distinct_input(const Pool2dGeometry& g, DType dtype, Rng& rng) {
  const int64_t n = g.batch * g.channels * g.height * g.width;
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i - n / 2);
  rng.shuffle(std::span<float>(values));
  return from_values(values, {g.batch, g.channels, g.height, g.width}, dtype);  // |values| <= 256: exact
}

std::string describe(const Pool2dGeometry& g) {
  return "batch " + std::to_string(g.batch) + ", " + std::to_string(g.channels) + "x" + std::to_string(g.height) +
         "x" + std::to_string(g.width) + ", kernel " + std::to_string(g.kernel) + " stride " +
         std::to_string(g.stride);
}

const Pool2dGeometry kPoolGeometries[] = {
    {1, 1, 2, 2, 2, 2}, {2, 3, 6, 8, 2, 2}, {3, 2, 7, 5, 2, 2},  // odd sizes drop the last row/column
    {2, 3, 7, 7, 3, 2}, {1, 2, 8, 6, 3, 2},                      // overlapping windows
    {1, 1, 5, 5, 3, 1},
};

TEST(MaxPool2d, ForwardValuesAndArgmax) {
  Rng rng(7);
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Pool2dGeometry& g : kPoolGeometries) {
      SCOPED_TRACE(describe(g) + " " + dtype_name(dtype));
      const Tensor x = distinct_input(g, dtype, rng);
      const int64_t oh = g.out_height(), ow = g.out_width();
      Tensor y = nan_tensor({g.batch, g.channels, oh, ow}, dtype);
      std::vector<int32_t> argmax;
      maxpool2d_forward(g, x, y, argmax);
      ASSERT_EQ(static_cast<int64_t>(argmax.size()), g.batch * g.channels * oh * ow);
      const std::vector<float> vx = widen(x), vy = widen(y);
      for (int64_t p = 0; p < g.batch * g.channels; ++p) {
        const float* plane = vx.data() + p * g.height * g.width;
        for (int64_t i = 0; i < oh; ++i) {
          for (int64_t j = 0; j < ow; ++j) {
            float best = -std::numeric_limits<float>::infinity();
            int64_t best_index = -1;
            for (int64_t ki = 0; ki < g.kernel; ++ki) {
              for (int64_t kj = 0; kj < g.kernel; ++kj) {
                const int64_t index = (i * g.stride + ki) * g.width + j * g.stride + kj;
                if (plane[index] > best) {
                  best = plane[index];
                  best_index = index;
                }
              }
            }
            const auto out = static_cast<size_t>((p * oh + i) * ow + j);
            ASSERT_EQ(vy[out], best) << "plane " << p << " at " << i << "," << j;
            ASSERT_EQ(argmax[out], best_index) << "plane " << p << " at " << i << "," << j;
          }
        }
      }
    }
  }
}

TEST(MaxPool2d, BackwardRoutesGradientsToTheMaxima) {
  Rng rng(8);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Pool2dGeometry& g : kPoolGeometries) {
      SCOPED_TRACE(describe(g) + " " + dtype_name(dtype));
      const Tensor x = distinct_input(g, DType::kF32, rng);
      const int64_t oh = g.out_height(), ow = g.out_width();
      Tensor y = Tensor::empty({g.batch, g.channels, oh, ow});
      std::vector<int32_t> argmax;
      maxpool2d_forward(g, x, y, argmax);

      // Dyadic gradients add exactly in fp32 (and are exact in bf16) whatever
      // the order, so overlapping windows that pick the same input must sum to
      // exactly the reference.
      std::vector<float> grads(static_cast<size_t>(y.numel()));
      for (auto& v : grads) v = static_cast<float>(static_cast<int>(rng.below(33)) - 16) / 4.0f;
      const Tensor dy = from_values(grads, y.shape(), dtype);
      Tensor dx = nan_tensor(x.shape(), dtype);  // overwritten everywhere
      maxpool2d_backward(g, argmax, dy, dx);

      // Reference routing from the window maxima themselves (not from argmax).
      const std::vector<float> vx = widen(x);
      std::vector<double> expected(vx.size(), 0.0);
      for (int64_t p = 0; p < g.batch * g.channels; ++p) {
        const float* plane = vx.data() + p * g.height * g.width;
        for (int64_t i = 0; i < oh; ++i) {
          for (int64_t j = 0; j < ow; ++j) {
            int64_t best_index = (i * g.stride) * g.width + j * g.stride;
            for (int64_t ki = 0; ki < g.kernel; ++ki)
              for (int64_t kj = 0; kj < g.kernel; ++kj) {
                const int64_t index = (i * g.stride + ki) * g.width + j * g.stride + kj;
                if (plane[index] > plane[best_index]) best_index = index;
              }
            expected[static_cast<size_t>(p * g.height * g.width + best_index)] +=
                grads[static_cast<size_t>((p * oh + i) * ow + j)];
          }
        }
      }
      const std::vector<float> got = widen(dx);
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(static_cast<double>(got[i]), expected[i]) << "dx " << i;
    }
  }
}

}  // namespace
}  // namespace fedmesh
