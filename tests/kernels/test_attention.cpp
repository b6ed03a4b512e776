// Causal multi-head self-attention (kernels/attention.h) against a naive
// triple loop in double, finite differences of the fp32 kernel and of that
// reference, causality (exactly), bf16/fp16 against fp32 on the rounded
// values, and a 256-long sequence.
//
// Tolerances (u32 = 2^-24 ≈ 6e-8, the fp32 unit roundoff). Inputs and the
// loss weights R are uniform in [-1, 1) unless said otherwise. "Measured" is
// the largest error over the cases of the test (also written to the XML
// report); it stayed within 1.5x of these numbers over five other seeds.
// - Forward, 1e-5 absolute on out and on the saved log-sum-exps. A score
//   sums head_dim <= 8 products below 1 and is scaled by 1/sqrt(head_dim): its
//   fp32 error is below (head_dim + 2) u32 · sqrt(head_dim) < 2e-6. exp turns
//   the error of (score − row max) into the same relative error of a
//   probability (< 4e-6), and out = P·v with |v| < 1 and Σ P = 1 adds
//   (seq + 3) u32 ≈ 1.2e-6: about 5e-6 at worst; a log-sum-exp carries the
//   score's error plus a few u32 of its magnitude (< 5 here).
// - Gradient against central differences in double of the double reference,
//   2e-6 absolute. Their step 1e-5 leaves truncation h²/6·|L'''| and
//   cancellation 1e-16·|L|/h both below 1e-8 (|L| <= 432 here), so the
//   comparison sees the kernel's fp32 error alone: the forward's chains plus
//   sums of up to seq <= 9 terms below 1 (dV = Pᵀ·R, dQ = dS·k), a few 1e-7
//   typically. Measured: 1.2e-7.
// - Gradient of the fp32 kernel against central differences of the fp32
//   kernel itself (tests/support/gradient_check.h, every element): step 1e-2,
//   |analytic − numeric| <= 2e-4 + 1e-3·|numeric|. Truncation h²/6·|L'''| is
//   ~2e-5·|L'''|; the fp32 rounding of the forward (~1e-7 per output, at most
//   432 outputs) moves (L+ − L−)/2h by ~sqrt(432)·1e-7/2e-2 ≈ 1e-4 at worst.
//   Measured: 1.5e-5 (at most 7.7% of the allowance over ten seeds); smaller
//   steps lose to rounding (step 1e-3: 1.5e-4).
// - bf16/fp16 within 1 ulp of the output dtype of the fp32 kernel run on the
//   same (rounded) values and rounded once: the kernel widens exactly and
//   computes in fp32, so 0 ulp is expected (measured: 0); 1 ulp allows an
//   fp32 path that differs in the last fp32 bit to round the other way.
// - Long rows (seq 256, scores up to 36): the probabilities the backward
//   pass recomputes from the saved log-sum-exp, exp(score − L), sum to 1
//   within 1e-5 in every row (L's fp32 rounding at |L| <= 42 is below
//   2.6e-6, the same relative error in every term of the sum).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/attention.h"
#include "kernels/convert.h"
#include "kernels/parallel.h"
#include "kernels/tensor.h"
#include "tests/support/gradient_check.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

constexpr DType kAllDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr double kForwardTolerance = 1e-5;
constexpr double kReferenceGradientTolerance = 2e-6;
constexpr double kReferenceStep = 1e-5;  // finite differences in double, see the file comment
constexpr double kKernelStep = 1e-2;     // finite differences of the fp32 kernel
constexpr double kKernelAtol = 2e-4;
constexpr double kKernelRtol = 1e-3;
constexpr double kRowSumTolerance = 1e-5;

int64_t width_of(const AttentionShape& s) { return s.heads * s.head_dim; }
Shape qkv_shape(const AttentionShape& s) { return {s.batch, s.seq, 3 * width_of(s)}; }
Shape out_shape(const AttentionShape& s) { return {s.batch, s.seq, width_of(s)}; }

std::string describe(const AttentionShape& s) {
  return "batch " + std::to_string(s.batch) + " seq " + std::to_string(s.seq) + " heads " + std::to_string(s.heads) +
         " head_dim " + std::to_string(s.head_dim);
}

// Measured errors go to the XML report (--gtest_output=xml) as "1.23e-07".
std::string scientific(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2e", value);
  return text;
}

std::vector<double> to_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// The definition, in double: out (batch, seq, heads * head_dim) from qkv
// (batch, seq, 3 * heads * head_dim), and when asked for the probabilities
// (batch, heads, seq, seq) and each row's log-sum-exp of its scores (batch,
// heads, seq), what the kernel saves.
std::vector<double> reference_forward(const AttentionShape& s, const std::vector<double>& qkv,
                                      std::vector<double>* probabilities = nullptr,
                                      std::vector<double>* log_sum_exp = nullptr) {
  const int64_t seq = s.seq, head_dim = s.head_dim, width = width_of(s);
  std::vector<double> out(static_cast<size_t>(s.batch * seq * width), 0.0);
  if (probabilities != nullptr) probabilities->assign(static_cast<size_t>(s.batch * s.heads * seq * seq), 0.0);
  if (log_sum_exp != nullptr) log_sum_exp->assign(static_cast<size_t>(s.batch * s.heads * seq), 0.0);
  std::vector<double> weights(static_cast<size_t>(seq));
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h) {
    return &qkv[static_cast<size_t>((b * seq + t) * 3 * width + part * width + h * head_dim)];
  };
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < seq; ++i) {
        const double* q = at(b, i, 0, h);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = at(b, j, 1, h);
          double score = 0.0;
          for (int64_t c = 0; c < head_dim; ++c) score += q[c] * k[c];
          weights[static_cast<size_t>(j)] = score * scale;
          max_score = std::max(max_score, score * scale);
        }
        double total = 0.0;
        for (int64_t j = 0; j <= i; ++j) total += std::exp(weights[static_cast<size_t>(j)] - max_score);
        if (log_sum_exp != nullptr) {
          (*log_sum_exp)[static_cast<size_t>((b * s.heads + h) * seq + i)] = max_score + std::log(total);
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(weights[static_cast<size_t>(j)] - max_score) / total;
          weights[static_cast<size_t>(j)] = p;
          if (probabilities != nullptr) {
            (*probabilities)[static_cast<size_t>(((b * s.heads + h) * seq + i) * seq + j)] = p;
          }
        }
        double* o = &out[static_cast<size_t>((b * seq + i) * width + h * head_dim)];
        for (int64_t j = 0; j <= i; ++j) {
          const double* v = at(b, j, 2, h);
          for (int64_t c = 0; c < head_dim; ++c) o[c] += weights[static_cast<size_t>(j)] * v[c];
        }
      }
    }
  }
  return out;
}

double weighted_sum(const std::vector<double>& out, const std::vector<double>& r) {
  double total = 0.0;
  for (size_t i = 0; i < out.size(); ++i) total += out[i] * r[i];
  return total;
}

// d/d qkv of L = Σ reference_forward(qkv) ∘ r, by central differences in double.
std::vector<double> reference_gradient(const AttentionShape& s, std::vector<double> qkv,
                                       const std::vector<double>& r) {
  std::vector<double> gradient(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) {
    const double original = qkv[i];
    qkv[i] = original + kReferenceStep;
    const double plus = weighted_sum(reference_forward(s, qkv), r);
    qkv[i] = original - kReferenceStep;
    const double minus = weighted_sum(reference_forward(s, qkv), r);
    qkv[i] = original;
    gradient[i] = (plus - minus) / (2 * kReferenceStep);
  }
  return gradient;
}

double max_abs_difference(const std::vector<float>& got, const std::vector<double>& expected) {
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - expected[i]));
  return worst;
}

// Distance in units in the last place of their dtype between same-dtype
// tensors, largest over elements (sign-magnitude bits mapped onto a line).
int64_t max_ulp_distance(const Tensor& got, const Tensor& expected) {
  const auto ordered = [](const Tensor& t, int64_t i) -> int64_t {
    if (dtype_size(t.dtype()) == 4) {
      uint32_t bits = 0;
      std::memcpy(&bits, static_cast<const char*>(t.raw()) + i * 4, 4);
      return (bits & 0x80000000u) ? -static_cast<int64_t>(bits & 0x7fffffffu) : static_cast<int64_t>(bits);
    }
    uint16_t bits = 0;
    std::memcpy(&bits, static_cast<const char*>(t.raw()) + i * 2, 2);
    return (bits & 0x8000u) ? -static_cast<int64_t>(bits & 0x7fffu) : static_cast<int64_t>(bits);
  };
  EXPECT_EQ(got.dtype(), expected.dtype());
  EXPECT_EQ(got.numel(), expected.numel());
  int64_t worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) worst = std::max(worst, std::abs(ordered(got, i) - ordered(expected, i)));
  return worst;
}

// Whether row `row` of two (rows, width) fp32 tensors holds the same bits.
bool same_row(const Tensor& a, const Tensor& b, int64_t row, int64_t width) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(width);
  return std::memcmp(a.data<float>() + row * width, b.data<float>() + row * width, bytes) == 0;
}

TEST(CausalAttention, ForwardMatchesDoubleReference) {
  Rng rng(1);
  double worst_out = 0.0, worst_lse = 0.0;
  for (const int64_t seq : {1, 5, 17}) {
    for (const int64_t heads : {1, 3}) {
      for (const int64_t head_dim : {4, 8}) {
        const AttentionShape s{2, seq, heads, head_dim};
        SCOPED_TRACE(describe(s));
        const Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng);
        Tensor out = Tensor::empty(out_shape(s));
        Tensor saved;
        causal_attention_forward(s, qkv, out, saved);
        ASSERT_EQ(saved.shape(), (Shape{s.batch, heads, seq})) << "O(seq) saved per head, not the probabilities";
        ASSERT_EQ(saved.dtype(), DType::kF32);

        std::vector<double> log_sum_exp;
        const std::vector<double> expected = reference_forward(s, to_double(widen(qkv)), nullptr, &log_sum_exp);
        const double out_error = max_abs_difference(widen(out), expected);
        const double lse_error = max_abs_difference(widen(saved), log_sum_exp);
        EXPECT_LE(out_error, kForwardTolerance);
        EXPECT_LE(lse_error, kForwardTolerance);
        worst_out = std::max(worst_out, out_error);
        worst_lse = std::max(worst_lse, lse_error);
      }
    }
  }
  RecordProperty("max_out_error", scientific(worst_out));
  RecordProperty("max_log_sum_exp_error", scientific(worst_lse));
}

TEST(CausalAttention, LaterPositionsNeverReachEarlierOutputs) {
  Rng rng(2);
  const AttentionShape s{2, 7, 2, 4};
  const int64_t width = width_of(s), rows = s.batch * s.seq;
  const Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng);
  const Tensor dout = random_tensor(out_shape(s), DType::kF32, rng);
  Tensor out = Tensor::empty(out_shape(s)), saved;
  causal_attention_forward(s, qkv, out, saved);
  Tensor dqkv = Tensor::empty(qkv_shape(s));
  causal_attention_backward(s, qkv, out, saved, dout, dqkv);

  for (int64_t t = 0; t < s.seq; ++t) {
    // Forward: move q, k or v of every head at position t.
    for (int64_t part = 0; part < 3; ++part) {
      SCOPED_TRACE("position " + std::to_string(t) + ", part " + "qkv"[part]);
      Tensor changed = qkv.clone();
      for (int64_t b = 0; b < s.batch; ++b) {
        float* row = changed.data<float>() + (b * s.seq + t) * 3 * width + part * width;
        for (int64_t c = 0; c < width; ++c) row[c] += 0.5f;
      }
      Tensor changed_out = Tensor::empty(out_shape(s)), changed_saved;
      causal_attention_forward(s, changed, changed_out, changed_saved);
      bool later_changed = false;
      for (int64_t r = 0; r < rows; ++r) {
        if (r % s.seq < t) {
          EXPECT_TRUE(same_row(out, changed_out, r, width)) << "output row " << r;
        } else {
          later_changed = later_changed || !same_row(out, changed_out, r, width);
        }
      }
      // Only q at position 0 changes nothing: its one probability is 1.
      if (part != 0 || t != 0) {
        EXPECT_TRUE(later_changed);
      }
    }

    // Backward: dout at position t reaches no gradient at positions after t.
    SCOPED_TRACE("dout at position " + std::to_string(t));
    Tensor changed_dout = dout.clone();
    for (int64_t b = 0; b < s.batch; ++b) {
      float* row = changed_dout.data<float>() + (b * s.seq + t) * width;
      for (int64_t c = 0; c < width; ++c) row[c] += 0.5f;
    }
    Tensor changed_dqkv = Tensor::empty(qkv_shape(s));
    causal_attention_backward(s, qkv, out, saved, changed_dout, changed_dqkv);
    bool earlier_changed = false;
    for (int64_t r = 0; r < rows; ++r) {
      if (r % s.seq > t) {
        EXPECT_TRUE(same_row(dqkv, changed_dqkv, r, 3 * width)) << "gradient row " << r;
      } else {
        earlier_changed = earlier_changed || !same_row(dqkv, changed_dqkv, r, 3 * width);
      }
    }
    EXPECT_TRUE(earlier_changed);
  }
}

TEST(CausalAttention, BackwardMatchesFiniteDifferences) {
  Rng rng(3);
  const AttentionShape shapes[] = {{1, 1, 1, 4}, {2, 6, 2, 4}, {2, 9, 3, 8}};
  double worst = 0.0;
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(describe(s));
    Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng);
    const Tensor r = random_tensor(out_shape(s), DType::kF32, rng);
    Tensor out = Tensor::empty(out_shape(s)), saved;
    causal_attention_forward(s, qkv, out, saved);
    Tensor dqkv = Tensor::empty(qkv_shape(s));
    causal_attention_backward(s, qkv, out, saved, r, dqkv);

    // Against central differences of the double reference: tight.
    const std::vector<double> expected = reference_gradient(s, to_double(widen(qkv)), to_double(widen(r)));
    const double error = max_abs_difference(widen(dqkv), expected);
    EXPECT_LE(error, kReferenceGradientTolerance);
    worst = std::max(worst, error);

    // Against central differences of the fp32 kernel itself, every element.
    const float* weights = r.data<float>();
    const auto loss = [&] {
      causal_attention_forward(s, qkv, out, saved);
      double total = 0.0;
      for (int64_t i = 0; i < out.numel(); ++i) total += static_cast<double>(out.data<float>()[i]) * weights[i];
      return total;
    };
    expect_gradient_matches("dqkv", qkv.data<float>(), dqkv.data<float>(), qkv.numel(), loss, [] {}, rng,
                            static_cast<int>(qkv.numel()), kKernelStep, kKernelAtol, kKernelRtol);
  }
  RecordProperty("max_gradient_error", scientific(worst));
}

TEST(CausalAttention, LowPrecisionEqualsFp32RoundedOnce) {
  Rng rng(4);
  const AttentionShape s{2, 11, 3, 8};
  for (const DType qkv_dtype : kAllDtypes) {
    for (const DType out_dtype : kAllDtypes) {
      // A training step in these dtypes: dout like out, dqkv like qkv.
      SCOPED_TRACE(std::string("qkv ") + dtype_name(qkv_dtype) + ", out " + dtype_name(out_dtype));
      const Tensor qkv = random_tensor(qkv_shape(s), qkv_dtype, rng);
      const Tensor dout = random_tensor(out_shape(s), out_dtype, rng);
      Tensor out = Tensor::empty(out_shape(s), out_dtype), saved;
      causal_attention_forward(s, qkv, out, saved);
      Tensor dqkv = Tensor::empty(qkv_shape(s), qkv_dtype);
      causal_attention_backward(s, qkv, out, saved, dout, dqkv);

      const Tensor qkv32 = to_dtype(qkv, DType::kF32);
      Tensor out32 = Tensor::empty(out_shape(s)), saved32;
      causal_attention_forward(s, qkv32, out32, saved32);
      Tensor dqkv32 = Tensor::empty(qkv_shape(s));
      causal_attention_backward(s, qkv32, out32, saved32, to_dtype(dout, DType::kF32), dqkv32);

      EXPECT_LE(max_ulp_distance(out, to_dtype(out32, out_dtype)), 1);
      EXPECT_LE(max_ulp_distance(dqkv, to_dtype(dqkv32, qkv_dtype)), 1);
    }
  }
}

TEST(CausalAttention, LongRowsStayNormalizedAndMasked) {
  Rng rng(5);
  const AttentionShape s{1, 256, 4, 16};
  // Inputs in [-3, 3): scores up to 16 · 3² / 4 = 36, so rows range from
  // nearly uniform to one dominant key.
  const Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng, -3.0, 3.0);
  Tensor out = Tensor::empty(out_shape(s)), saved;
  causal_attention_forward(s, qkv, out, saved);
  for (const float v : widen(out)) ASSERT_TRUE(std::isfinite(v));

  // The probabilities the backward pass recomputes, exp(score − L[t]) with
  // the kernel's L and the scores in double, sum to 1 in every row.
  const std::vector<double> q = to_double(widen(qkv));
  const float* lse = saved.data<float>();
  const int64_t width = width_of(s);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  double worst_sum_error = 0.0;
  for (int64_t h = 0; h < s.heads; ++h) {
    for (int64_t t = 0; t < s.seq; ++t) {
      double total = 0.0;
      for (int64_t j = 0; j <= t; ++j) {
        double score = 0.0;
        for (int64_t c = 0; c < s.head_dim; ++c) {
          score += q[static_cast<size_t>(t * 3 * width + h * s.head_dim + c)] *
                   q[static_cast<size_t>(j * 3 * width + width + h * s.head_dim + c)];
        }
        total += std::exp(score * scale - lse[h * s.seq + t]);
      }
      worst_sum_error = std::max(worst_sum_error, std::fabs(total - 1.0));
    }
  }
  EXPECT_LE(worst_sum_error, kRowSumTolerance);
  RecordProperty("max_row_sum_error", scientific(worst_sum_error));

  Tensor dqkv = Tensor::empty(qkv_shape(s));
  causal_attention_backward(s, qkv, out, saved, random_tensor(out_shape(s), DType::kF32, rng), dqkv);
  for (const float v : widen(dqkv)) ASSERT_TRUE(std::isfinite(v));
}

TEST(CausalAttention, ScoresOfTwoThousandDoNotOverflow) {
  // q = 32 and k[j] = 32 + j/64 in every component, head_dim 4: each score is
  // exactly 0.5 · 4 · 32 · (32 + j/64) = 2048 + j in fp32 too. exp(2048)
  // overflows even double, so only a softmax that subtracts the row max gets
  // P[i][j] ∝ e^(j - i).
  Rng rng(7);
  const AttentionShape s{1, 9, 2, 4};
  const int64_t width = width_of(s);
  Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng);  // v stays random
  for (int64_t t = 0; t < s.seq; ++t) {
    float* row = qkv.data<float>() + t * 3 * width;
    for (int64_t c = 0; c < width; ++c) {
      row[c] = 32.0f;
      row[width + c] = 32.0f + static_cast<float>(t) / 64.0f;
    }
  }
  Tensor out = Tensor::empty(out_shape(s)), saved;
  causal_attention_forward(s, qkv, out, saved);
  std::vector<double> log_sum_exp;
  const std::vector<double> expected = reference_forward(s, to_double(widen(qkv)), nullptr, &log_sum_exp);
  EXPECT_LE(max_abs_difference(widen(out), expected), kForwardTolerance);
  // L[t] is about 2048 + t: 4 fp32 units in the last place of it.
  const std::vector<float> got = widen(saved);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], log_sum_exp[i], 4 * std::ldexp(std::fabs(log_sum_exp[i]), -24)) << "row " << i;
  }
  Tensor dqkv = Tensor::empty(qkv_shape(s));
  causal_attention_backward(s, qkv, out, saved, random_tensor(out_shape(s), DType::kF32, rng), dqkv);
  for (const float v : widen(dqkv)) ASSERT_TRUE(std::isfinite(v));
}

TEST(CausalAttention, SameThreadCountGivesSameBits) {
  ThreadCountGuard guard;
  Rng rng(6);
  const AttentionShape s{2, 64, 3, 16};
  const Tensor qkv = random_tensor(qkv_shape(s), DType::kF32, rng);
  const Tensor dout = random_tensor(out_shape(s), DType::kF32, rng);
  for (const int threads : {1, 3}) {
    set_cpu_threads(threads);
    SCOPED_TRACE(std::to_string(threads) + " threads");
    Tensor out[2], saved[2], dqkv[2];
    for (int run = 0; run < 2; ++run) {
      out[run] = Tensor::empty(out_shape(s));
      dqkv[run] = Tensor::empty(qkv_shape(s));
      causal_attention_forward(s, qkv, out[run], saved[run]);
      causal_attention_backward(s, qkv, out[run], saved[run], dout, dqkv[run]);
    }
    EXPECT_EQ(std::memcmp(out[0].raw(), out[1].raw(), out[0].nbytes()), 0);
    EXPECT_EQ(std::memcmp(saved[0].raw(), saved[1].raw(), saved[0].nbytes()), 0);
    EXPECT_EQ(std::memcmp(dqkv[0].raw(), dqkv[1].raw(), dqkv[0].nbytes()), 0);
  }
}

TEST(CausalAttention, EmptyBatchAndSequenceDoNothing) {
  for (const AttentionShape& s : {AttentionShape{0, 5, 2, 4}, AttentionShape{2, 0, 2, 4}}) {
    SCOPED_TRACE(describe(s));
    const Tensor qkv = Tensor::empty(qkv_shape(s));
    Tensor out = Tensor::empty(out_shape(s)), saved;
    causal_attention_forward(s, qkv, out, saved);
    EXPECT_EQ(saved.numel(), 0);
    Tensor dqkv = Tensor::empty(qkv_shape(s));
    causal_attention_backward(s, qkv, out, saved, out, dqkv);
  }
}

TEST(CausalAttentionDeathTest, WrongShapesAreNamed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the kernels' worker pool may be running
  const AttentionShape s{2, 5, 2, 4};
  const Tensor qkv = Tensor::zeros(qkv_shape(s));
  Tensor out = Tensor::empty(out_shape(s)), saved;
  Tensor narrow_qkv = Tensor::zeros({2, 5, 20});
  EXPECT_DEATH(causal_attention_forward(s, narrow_qkv, out, saved),
               "causal_attention_forward: qkv is \\(2, 5, 20\\), expected \\(2, 5, 24\\)");
  Tensor short_out = Tensor::empty({2, 4, 8});
  EXPECT_DEATH(causal_attention_forward(s, qkv, short_out, saved),
               "causal_attention_forward: out is \\(2, 4, 8\\), expected \\(2, 5, 8\\)");
  EXPECT_DEATH(causal_attention_forward(AttentionShape{2, 5, 0, 4}, qkv, out, saved), "bad attention shape");
  causal_attention_forward(s, qkv, out, saved);
  Tensor dqkv = Tensor::empty(qkv_shape(s));
  const Tensor wrong_saved = Tensor::zeros({2, 2, 5, 4});
  EXPECT_DEATH(causal_attention_backward(s, qkv, out, wrong_saved, out, dqkv),
               "causal_attention_backward: saved is fp32 \\(2, 2, 5, 4\\)");
  EXPECT_DEATH(causal_attention_backward(s, qkv, short_out, saved, out, dqkv),
               "causal_attention_backward: out is \\(2, 4, 8\\), expected \\(2, 5, 8\\)");
}

}  // namespace
}  // namespace fedmesh
