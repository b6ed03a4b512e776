// softmax_cross_entropy (kernels/loss.h) and layer normalization
// (kernels/layernorm.h) against direct formulas in double and central finite
// differences of those formulas.
//
// Finite differences are taken of the double-precision reference, never of
// the fp32 kernel, so their error is the truncation term h^2/6 |f'''| plus
// cancellation ~1e-16 |f| / h: with h = 1e-4 both are below 1e-8 for the O(1)
// values used here, negligible against the fp32 tolerances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/convert.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/tensor.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

constexpr double kU32 = 0x1p-24;
constexpr DType kAllDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr double kStep = 1e-4;  // finite-difference step, see the file comment

// ------------------------------------------------------- cross-entropy ----

// -log softmax(row)[label] by a direct log-sum-exp in double.
double row_loss(const double* row, int64_t classes, int32_t label) {
  double max_value = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < classes; ++j) max_value = std::max(max_value, row[j]);
  double total = 0.0;
  for (int64_t j = 0; j < classes; ++j) total += std::exp(row[j] - max_value);
  return max_value + std::log(total) - row[label];
}

struct CrossEntropyReference {
  double loss_sum = 0.0;
  int64_t correct = 0;
  std::vector<double> gradient;  // d loss_sum / d logits (softmax - onehot)
};

CrossEntropyReference reference_cross_entropy(const std::vector<float>& logits, int64_t rows, int64_t classes,
                                              const std::vector<int32_t>& labels) {
  CrossEntropyReference ref;
  ref.gradient.resize(logits.size());
  std::vector<double> row(static_cast<size_t>(classes));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < classes; ++j) row[static_cast<size_t>(j)] = logits[static_cast<size_t>(r * classes + j)];
    const int32_t label = labels[static_cast<size_t>(r)];
    const double loss = row_loss(row.data(), classes, label);
    ref.loss_sum += loss;
    const auto best = std::max_element(row.begin(), row.end()) - row.begin();  // first maximum
    ref.correct += best == label ? 1 : 0;
    const double log_total = loss + row[static_cast<size_t>(label)];  // max + log sum exp(. - max)
    for (int64_t j = 0; j < classes; ++j) {
      ref.gradient[static_cast<size_t>(r * classes + j)] =
          std::exp(row[static_cast<size_t>(j)] - log_total) - (j == label ? 1.0 : 0.0);
    }
  }
  return ref;
}

std::vector<int32_t> random_labels(int64_t rows, int64_t classes, Rng& rng) {
  std::vector<int32_t> labels(static_cast<size_t>(rows));
  for (auto& l : labels) l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(classes)));
  return labels;
}

TEST(CrossEntropy, LossGradientAndCountMatchDirectFormula) {
  Rng rng(1);
  struct RowsClasses {
    int64_t rows, classes;
  };
  const RowsClasses shapes[] = {{1, 1}, {1, 2}, {7, 13}, {64, 10}, {3, 1000}};
  for (const DType logit_dtype : kAllDtypes) {
    for (const DType grad_dtype : kAllDtypes) {
      for (const RowsClasses& s : shapes) {
        SCOPED_TRACE(std::string(dtype_name(logit_dtype)) + " logits, " + dtype_name(grad_dtype) + " grads, " +
                     std::to_string(s.rows) + "x" + std::to_string(s.classes));
        const Tensor logits = random_tensor({s.rows, s.classes}, logit_dtype, rng, -4, 4);
        const std::vector<int32_t> labels = random_labels(s.rows, s.classes, rng);
        Tensor dlogits = Tensor::empty({s.rows, s.classes}, grad_dtype);
        const CrossEntropyResult result = softmax_cross_entropy(logits, labels, &dlogits);
        const CrossEntropyReference ref = reference_cross_entropy(widen(logits), s.rows, s.classes, labels);

        // The kernel forms (x - max) in fp32 (one rounding of values below 8
        // in magnitude: 8 u32 each) and does the rest in double; summed over
        // rows.
        EXPECT_NEAR(result.loss_sum, ref.loss_sum, static_cast<double>(s.rows) * 16 * kU32 * 8);
        EXPECT_EQ(result.correct, ref.correct);
        // Gradient: the same fp32 rounding of (x - max) perturbs p by a
        // relative 8 u32, then one rounding to the gradient dtype.
        const std::vector<float> got = widen(dlogits);
        for (size_t i = 0; i < got.size(); ++i) {
          const double tolerance = 16 * kU32 * 8 + unit_roundoff(grad_dtype) * std::fabs(ref.gradient[i]) + 0x1p-25;
          ASSERT_NEAR(got[i], ref.gradient[i], tolerance) << "element " << i;
        }
      }
    }
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  Rng rng(2);
  const int64_t rows = 5, classes = 7;
  const Tensor logits = random_tensor({rows, classes}, DType::kF32, rng, -3, 3);
  const std::vector<int32_t> labels = random_labels(rows, classes, rng);
  Tensor dlogits = Tensor::empty({rows, classes});
  softmax_cross_entropy(logits, labels, &dlogits);

  const std::vector<float> base = widen(logits);
  std::vector<double> row(static_cast<size_t>(classes));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < classes; ++j) {
      const auto loss_with = [&](double delta) {
        for (int64_t q = 0; q < classes; ++q) row[static_cast<size_t>(q)] = base[static_cast<size_t>(r * classes + q)];
        row[static_cast<size_t>(j)] += delta;
        return row_loss(row.data(), classes, labels[static_cast<size_t>(r)]);
      };
      const double numeric = (loss_with(kStep) - loss_with(-kStep)) / (2 * kStep);
      // fp32 gradient of magnitude <= 1: a few u32, plus the FD error.
      EXPECT_NEAR(dlogits.data<float>()[r * classes + j], numeric, 1e-6) << r << "," << j;
    }
  }
}

TEST(CrossEntropy, StableForLogitsOfPlusMinusAThousand) {
  // exp(1000) overflows even double; a stable kernel subtracts the row max.
  const int64_t classes = 4;
  const std::vector<float> values = {
      1000.0f,  -1000.0f, 996.0f,   0.0f,      // label 1, far below the max: loss ~ 2000
      -1000.0f, -1000.0f, -1000.0f, -1000.0f,  // all equal: loss = log 4
      1000.0f,  1000.0f,  -1000.0f, 1000.0f,   // three tied maxima, label 2 at -1000
  };
  const std::vector<int32_t> labels = {1, 2, 2};
  const int64_t rows = 3;
  const double expected_loss = 2000.0 + std::log1p(std::exp(-4.0)) + std::log(4.0) + 2000.0 + std::log(3.0);
  for (const DType dtype : kAllDtypes) {  // +-1000 and 996 are exact in all three
    const Tensor logits = from_values(values, {rows, classes}, dtype);
    ASSERT_EQ(widen(logits), values);
    Tensor dlogits = Tensor::empty({rows, classes});
    const CrossEntropyResult result = softmax_cross_entropy(logits, labels, &dlogits);
    const CrossEntropyReference ref = reference_cross_entropy(values, rows, classes, labels);
    ASSERT_TRUE(std::isfinite(result.loss_sum)) << dtype_name(dtype);
    // Differences from the row max are exact in fp32 here, so only double
    // rounding (~1e-16 relative on a loss of 4000) remains.
    EXPECT_NEAR(ref.loss_sum, expected_loss, 1e-9);
    EXPECT_NEAR(result.loss_sum, expected_loss, 1e-9) << dtype_name(dtype);
    for (int64_t i = 0; i < rows * classes; ++i) {
      const float g = dlogits.data<float>()[i];
      ASSERT_TRUE(std::isfinite(g)) << i;
      // Probabilities computed in double, rounded once to fp32.
      EXPECT_NEAR(g, ref.gradient[static_cast<size_t>(i)], kU32) << dtype_name(dtype) << " element " << i;
    }
    // Row 0: softmax = (1, 0, e^-4, 0) / (1 + e^-4); the label's p is 0, so its gradient is -1.
    EXPECT_NEAR(dlogits.data<float>()[0], 1.0 / (1.0 + std::exp(-4.0)), kU32);
    EXPECT_EQ(dlogits.data<float>()[1], -1.0f);
    EXPECT_EQ(dlogits.data<float>()[3], 0.0f);  // exp(-1000) underflows to exactly 0
    // Row 2: a third on each tied maximum, -1 on the label.
    EXPECT_NEAR(dlogits.data<float>()[8], 1.0 / 3.0, kU32);
    EXPECT_EQ(dlogits.data<float>()[10], -1.0f);
    // Rows 0 and 2: the label is not a maximum. Row 1 ties everywhere; taking
    // the first (or the last) maximum, label 2 is not it.
    EXPECT_EQ(result.correct, 0);
  }
}

TEST(CrossEntropy, GradScaleAndNormalizer) {
  // dlogits = grad_scale / normalizer * (softmax - onehot); loss_sum is the
  // unscaled sum whatever the scale.
  Rng rng(3);
  const int64_t rows = 8, classes = 10;
  const Tensor logits = random_tensor({rows, classes}, DType::kF32, rng, -2, 2);
  const std::vector<int32_t> labels = random_labels(rows, classes, rng);
  const CrossEntropyReference ref = reference_cross_entropy(widen(logits), rows, classes, labels);
  struct ScaleCase {
    float grad_scale, normalizer;
  };
  for (const ScaleCase c : {ScaleCase{1.0f, 1.0f}, ScaleCase{1.0f, 8.0f}, ScaleCase{1024.0f, 8.0f},
                            ScaleCase{65536.0f, 1.0f}, ScaleCase{0.5f, 3.0f}}) {
    for (const DType grad_dtype : kAllDtypes) {
      Tensor dlogits = Tensor::empty({rows, classes}, grad_dtype);
      const CrossEntropyResult result = softmax_cross_entropy(logits, labels, &dlogits, c.grad_scale, c.normalizer);
      EXPECT_NEAR(result.loss_sum, ref.loss_sum, rows * 1e-6);
      const double factor = static_cast<double>(c.grad_scale) / c.normalizer;
      const std::vector<float> got = widen(dlogits);
      for (size_t i = 0; i < got.size(); ++i) {
        const double want = factor * ref.gradient[i];
        // fp32 logits differences (relative 4 u32 on p) and the factor, then
        // one rounding to the gradient dtype.
        const double tolerance = factor * 16 * kU32 * 4 + unit_roundoff(grad_dtype) * std::fabs(want) + 0x1p-25;
        ASSERT_NEAR(got[i], want, tolerance)
            << "scale " << c.grad_scale << " / " << c.normalizer << " " << dtype_name(grad_dtype) << " " << i;
      }
    }
  }
  // Without dlogits only the loss and the count are computed.
  const CrossEntropyResult no_grad = softmax_cross_entropy(logits, labels, nullptr);
  EXPECT_NEAR(no_grad.loss_sum, ref.loss_sum, rows * 1e-6);
  EXPECT_EQ(no_grad.correct, ref.correct);
}

TEST(CrossEntropy, CountsCorrectRows) {
  // Row r has its maximum at column (3 r) % 5; labels agree on rows 0, 2, 3.
  const int64_t rows = 5, classes = 5;
  std::vector<float> values(rows * classes, 0.0f);
  for (int64_t r = 0; r < rows; ++r) values[static_cast<size_t>(r * classes + (3 * r) % 5)] = 2.0f;
  const std::vector<int32_t> labels = {0, 1, 1, 4, 0};  // argmaxes are 0, 3, 1, 4, 2
  for (const DType dtype : kAllDtypes) {
    const CrossEntropyResult result = softmax_cross_entropy(from_values(values, {rows, classes}, dtype), labels,
                                                            nullptr);
    EXPECT_EQ(result.correct, 3) << dtype_name(dtype);
  }
}

// ------------------------------------------------------------ layernorm ----

struct LayerNormReference {
  std::vector<double> y, mean, rstd;
};

LayerNormReference reference_layernorm(const std::vector<double>& x, const std::vector<double>& gamma,
                                       const std::vector<double>& beta, int64_t rows, int64_t n, double epsilon) {
  LayerNormReference ref;
  ref.y.resize(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * n;
    double mean = 0.0;
    for (int64_t j = 0; j < n; ++j) mean += row[j];
    mean /= static_cast<double>(n);
    double variance = 0.0;
    for (int64_t j = 0; j < n; ++j) variance += (row[j] - mean) * (row[j] - mean);
    variance /= static_cast<double>(n);
    const double rstd = 1.0 / std::sqrt(variance + epsilon);
    ref.mean.push_back(mean);
    ref.rstd.push_back(rstd);
    for (int64_t j = 0; j < n; ++j) {
      ref.y[static_cast<size_t>(r * n + j)] =
          (row[j] - mean) * rstd * gamma[static_cast<size_t>(j)] + beta[static_cast<size_t>(j)];
    }
  }
  return ref;
}

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Rows with mean near 3 and standard deviation near 2, so that removing the
// mean and the scale both matter.
Tensor layernorm_input(int64_t rows, int64_t n, DType dtype, Rng& rng) {
  std::vector<float> values(static_cast<size_t>(rows * n));
  for (auto& v : values) v = static_cast<float>(3.0 + 2.0 * rng.normal());
  return from_values(values, {rows, n}, dtype);
}

TEST(LayerNorm, ForwardNormalizesEachRow) {
  // gamma = 1, beta = 0: every row of y has mean 0 and variance v / (v + eps).
  Rng rng(4);
  const int64_t rows = 100, n = 37;  // 100 rows: several parallel_for chunks of 16 rows
  const Tensor x = layernorm_input(rows, n, DType::kF32, rng);
  Tensor gamma = Tensor::empty({n}), beta = Tensor::zeros({n});
  for (int64_t j = 0; j < n; ++j) gamma.data<float>()[j] = 1.0f;
  Tensor y = Tensor::empty({rows, n}), mean = Tensor::empty({rows}), rstd = Tensor::empty({rows});
  layernorm_forward(x, gamma, beta, y, mean, rstd);

  const std::vector<float> vx = widen(x), vy = widen(y);
  for (int64_t r = 0; r < rows; ++r) {
    double input_mean = 0.0, input_variance = 0.0, y_mean = 0.0, y_variance = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      input_mean += vx[static_cast<size_t>(r * n + j)];
      y_mean += vy[static_cast<size_t>(r * n + j)];
    }
    input_mean /= n;
    y_mean /= n;
    for (int64_t j = 0; j < n; ++j) {
      input_variance += std::pow(vx[static_cast<size_t>(r * n + j)] - input_mean, 2);
      y_variance += std::pow(vy[static_cast<size_t>(r * n + j)] - y_mean, 2);
    }
    input_variance /= n;
    y_variance /= n;
    // y values are O(2) with fp32 errors of a few u32 relative to |x|/std ~ 4:
    // 1e-6 is dozens of u32 on either statistic.
    EXPECT_NEAR(y_mean, 0.0, 1e-6) << "row " << r;
    EXPECT_NEAR(y_variance, input_variance / (input_variance + kLayerNormEpsilon), 1e-6) << "row " << r;
    EXPECT_NEAR(mean.data<float>()[r], input_mean, 4 * kU32 * std::fabs(input_mean)) << "row " << r;
    const double want_rstd = 1.0 / std::sqrt(input_variance + kLayerNormEpsilon);
    EXPECT_NEAR(rstd.data<float>()[r], want_rstd, 4 * kU32 * want_rstd) << "row " << r;
  }
}

TEST(LayerNorm, ForwardMatchesDirectFormulaWithAffine) {
  Rng rng(5);
  struct RowsN {
    int64_t rows, n;
  };
  for (const RowsN s : {RowsN{1, 1}, RowsN{1, 37}, RowsN{7, 5}, RowsN{100, 37}, RowsN{33, 768}}) {
    for (const DType in_dtype : kAllDtypes) {
      for (const DType out_dtype : kAllDtypes) {
        SCOPED_TRACE(std::to_string(s.rows) + "x" + std::to_string(s.n) + " " + dtype_name(in_dtype) + "->" +
                     dtype_name(out_dtype));
        const Tensor x = layernorm_input(s.rows, s.n, in_dtype, rng);
        const Tensor gamma = random_tensor({s.n}, DType::kF32, rng, 0.5, 1.5);
        const Tensor beta = random_tensor({s.n}, DType::kF32, rng, -1, 1);
        Tensor y = Tensor::empty({s.rows, s.n}, out_dtype), mean = Tensor::empty({s.rows}),
               rstd = Tensor::empty({s.rows});
        layernorm_forward(x, gamma, beta, y, mean, rstd);
        const std::vector<float> vx = widen(x), vg = widen(gamma), vb = widen(beta);
        const LayerNormReference ref =
            reference_layernorm(as_double(vx), as_double(vg), as_double(vb), s.rows, s.n, kLayerNormEpsilon);
        const std::vector<float> vy = widen(y);
        for (size_t i = 0; i < vy.size(); ++i) {
          const size_t r = i / static_cast<size_t>(s.n), j = i % static_cast<size_t>(s.n);
          // fp32: mean and rstd rounded to float (relative u32 each), then
          // (x - mean) * rstd * gamma + beta in four roundings: the error is
          // a few u32 times (|x| rstd |gamma| + |beta|); 16 u32 covers it.
          const double magnitude = std::fabs(vx[i]) * ref.rstd[r] * std::fabs(vg[j]) + std::fabs(vb[j]) +
                                   std::fabs(ref.mean[r]) * ref.rstd[r] * std::fabs(vg[j]);
          const double tolerance = 16 * kU32 * magnitude + unit_roundoff(out_dtype) * std::fabs(ref.y[i]) + 0x1p-25;
          ASSERT_NEAR(vy[i], ref.y[i], tolerance) << "element " << i;
        }
        for (int64_t r = 0; r < s.rows; ++r) {
          const auto sr = static_cast<size_t>(r);
          // One row of n = 1 has variance 0: rstd = 1/sqrt(eps) exactly as the formula says.
          EXPECT_NEAR(mean.data<float>()[r], ref.mean[sr], 4 * kU32 * std::fabs(ref.mean[sr]));
          EXPECT_NEAR(rstd.data<float>()[r], ref.rstd[sr], 4 * kU32 * ref.rstd[sr]);
        }
      }
    }
  }
}

// L(x, gamma, beta) = sum(r * layernorm(x)) in double: the loss whose
// gradients layernorm_backward must produce when given dy = r.
double projected_loss(const std::vector<double>& x, const std::vector<double>& gamma, const std::vector<double>& beta,
                      const std::vector<double>& projection, int64_t rows, int64_t n) {
  const LayerNormReference ref = reference_layernorm(x, gamma, beta, rows, n, kLayerNormEpsilon);
  double total = 0.0;
  for (size_t i = 0; i < ref.y.size(); ++i) total += projection[i] * ref.y[i];
  return total;
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  Rng rng(6);
  struct RowsN {
    int64_t rows, n;
  };
  for (const RowsN s : {RowsN{1, 2}, RowsN{4, 37}, RowsN{3, 64}}) {
    for (const DType dtype : kAllDtypes) {  // x and dy; dx in fp32 for a tight comparison
      SCOPED_TRACE(std::to_string(s.rows) + "x" + std::to_string(s.n) + " " + dtype_name(dtype));
      const Tensor x = layernorm_input(s.rows, s.n, dtype, rng);
      const Tensor gamma = random_tensor({s.n}, DType::kF32, rng, 0.5, 1.5);
      const Tensor beta = random_tensor({s.n}, DType::kF32, rng, -1, 1);
      const Tensor dy = random_tensor({s.rows, s.n}, dtype, rng, -1, 1);  // the projection r
      Tensor y = Tensor::empty({s.rows, s.n}), mean = Tensor::empty({s.rows}), rstd = Tensor::empty({s.rows});
      layernorm_forward(x, gamma, beta, y, mean, rstd);

      Tensor dx = Tensor::empty({s.rows, s.n});
      // dgamma and dbeta accumulate: start from known nonzero values.
      Tensor dgamma = random_tensor({s.n}, DType::kF32, rng, -1, 1);
      Tensor dbeta = random_tensor({s.n}, DType::kF32, rng, -1, 1);
      const std::vector<float> dgamma0 = widen(dgamma), dbeta0 = widen(dbeta);
      layernorm_backward(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);

      std::vector<double> vx = as_double(widen(x)), vg = as_double(widen(gamma)), vb = as_double(widen(beta));
      const std::vector<double> projection = as_double(widen(dy));
      const auto central = [&](std::vector<double>& values, size_t i) {
        const double saved = values[i];
        values[i] = saved + kStep;
        const double plus = projected_loss(vx, vg, vb, projection, s.rows, s.n);
        values[i] = saved - kStep;
        const double minus = projected_loss(vx, vg, vb, projection, s.rows, s.n);
        values[i] = saved;
        return (plus - minus) / (2 * kStep);
      };

      // Gradients here are O(rstd * n * |r| |gamma|) at worst, with rstd ~ 1/2;
      // the fp32 kernel sums n terms per row: (n + 8) u32 relative error on
      // sums of magnitude ~ n, so 2e-5 (1 + |g|) with n <= 64 has margin,
      // and the finite-difference error (< 1e-8) is negligible.
      for (size_t i = 0; i < vx.size(); ++i) {
        const double numeric = central(vx, i);
        EXPECT_NEAR(dx.data<float>()[i], numeric, 2e-5 * (1 + std::fabs(numeric))) << "dx " << i;
      }
      for (size_t j = 0; j < vg.size(); ++j) {
        const double numeric = central(vg, j);
        EXPECT_NEAR(dgamma.data<float>()[j] - dgamma0[j], numeric, 2e-5 * (1 + std::fabs(numeric))) << "dgamma " << j;
      }
      for (size_t j = 0; j < vb.size(); ++j) {
        const double numeric = central(vb, j);  // = sum over rows of r
        EXPECT_NEAR(dbeta.data<float>()[j] - dbeta0[j], numeric, 2e-5 * (1 + std::fabs(numeric))) << "dbeta " << j;
      }
    }
  }
}

TEST(LayerNorm, BackwardLowPrecisionDxRoundsOnce) {
  // The bf16/fp16 dx is the fp32 dx rounded once.
  Rng rng(7);
  const int64_t rows = 5, n = 33;
  const Tensor x = layernorm_input(rows, n, DType::kBF16, rng);
  const Tensor gamma = random_tensor({n}, DType::kF32, rng, 0.5, 1.5);
  const Tensor beta = random_tensor({n}, DType::kF32, rng, -1, 1);
  const Tensor dy = random_tensor({rows, n}, DType::kBF16, rng, -1, 1);
  Tensor y = Tensor::empty({rows, n}, DType::kBF16), mean = Tensor::empty({rows}), rstd = Tensor::empty({rows});
  layernorm_forward(x, gamma, beta, y, mean, rstd);
  Tensor dx32 = Tensor::empty({rows, n});
  Tensor dgamma = Tensor::zeros({n}), dbeta = Tensor::zeros({n});
  layernorm_backward(x, dy, gamma, mean, rstd, dx32, dgamma, dbeta);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    Tensor dx = Tensor::empty({rows, n}, dtype);
    Tensor dgamma2 = Tensor::zeros({n}), dbeta2 = Tensor::zeros({n});
    layernorm_backward(x, dy, gamma, mean, rstd, dx, dgamma2, dbeta2);
    const Tensor expected = to_dtype(dx32, dtype);
    const std::vector<float> got = widen(dx), want = widen(expected);
    EXPECT_EQ(got, want) << dtype_name(dtype);
    EXPECT_EQ(widen(dgamma2), widen(dgamma));
    EXPECT_EQ(widen(dbeta2), widen(dbeta));
  }
}

// squared_error: loss_sum = sum (p - y)^2, abs_sum = sum |p - y|, and
// dpredictions = grad_scale / normalizer * 2 (p - y), for every prediction dtype.
TEST(SquaredError, LossAbsoluteErrorAndGradientMatchTheFormula) {
  Rng rng(21);
  const int64_t rows = 17;
  for (const DType dtype : kAllDtypes) {
    const Tensor predictions = random_tensor({rows, 1}, dtype, rng, -3, 3);
    std::vector<float> values(static_cast<size_t>(rows));
    for (float& v : values) v = static_cast<float>(rng.uniform() * 4.0 - 2.0);
    const std::vector<float> p = widen(predictions);
    double want_loss = 0.0, want_abs = 0.0;
    for (size_t i = 0; i < values.size(); ++i) {
      const double e = static_cast<double>(p[i]) - values[i];
      want_loss += e * e;
      want_abs += std::fabs(e);
    }
    const float grad_scale = 512.0f, normalizer = 17.0f;
    Tensor dpredictions = Tensor::empty({rows, 1}, dtype);
    const SquaredErrorResult got = squared_error(predictions, values, &dpredictions, grad_scale, normalizer);
    EXPECT_NEAR(got.loss_sum, want_loss, 1e-9 * (1.0 + want_loss)) << dtype_name(dtype);
    EXPECT_NEAR(got.abs_sum, want_abs, 1e-9 * (1.0 + want_abs)) << dtype_name(dtype);
    const std::vector<float> g = widen(dpredictions);
    for (size_t i = 0; i < values.size(); ++i) {
      const double want = 2.0 * grad_scale / normalizer * (static_cast<double>(p[i]) - values[i]);
      ASSERT_NEAR(g[i], want, 2 * unit_roundoff(dtype) * std::fabs(want) + 1e-6) << dtype_name(dtype) << " " << i;
    }
    const SquaredErrorResult no_grad = squared_error(predictions, values, nullptr);
    EXPECT_EQ(no_grad.loss_sum, got.loss_sum);
  }
}

}  // namespace
}  // namespace fedmesh
