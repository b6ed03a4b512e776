// Elementwise ops, reductions (kernels/elementwise.h) and embedding lookup
// (kernels/embedding.h) against direct formulas evaluated in double, in fp32
// and in bf16/fp16, on sizes that exercise parallel_for chunking.
//
// Tolerances. Each op computes in fp32 and rounds once to the output dtype.
// A result that is a few fp32 operations away from the exact value is within
// a small multiple of u32 = 2^-24 of the magnitudes involved; rounding to the
// output adds half an ulp, at most u_out * |value| (u_out = 2^-24, 2^-8, 2^-11
// for fp32, bf16, fp16) plus half the smallest subnormal. Inputs are rounded
// to their dtype first and the reference is computed on the rounded values,
// so input rounding never enters the tolerance.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/convert.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/parallel.h"
#include "kernels/tensor.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

constexpr double kU32 = 0x1p-24;
constexpr DType kAllDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
// 1 and 17 run inline; 100003 is several chunks of the 2^14 elementwise grain
// with an uneven tail.
constexpr int64_t kSizes[] = {1, 17, 100003};
// parallel_for splits into at most cpu_threads() chunks: run with one thread
// (inline) and with three (more chunks than this machine may have cores).
constexpr int kThreadCounts[] = {1, 3};

// out[i] == expected[i] within fp32_error[i] + one rounding to out's dtype.
void expect_close(const Tensor& out, const std::vector<double>& expected, const std::vector<double>& fp32_error,
                  const std::string& what) {
  ASSERT_EQ(static_cast<size_t>(out.numel()), expected.size()) << what;
  const std::vector<float> got = widen(out);
  const double u = unit_roundoff(out.dtype()), floor = subnormal_floor(out.dtype());
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    const double tolerance = fp32_error[i] + u * std::fabs(expected[i]) + floor;
    if (!(std::fabs(got[i] - expected[i]) <= tolerance)) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << expected[i] << " +- "
                    << tolerance;
      ++failures;
    }
  }
}

std::string label(const char* op, int64_t n, int threads, DType a, DType out) {
  return std::string(op) + " n=" + std::to_string(n) + " threads=" + std::to_string(threads) + " " +
         dtype_name(a) + "->" + dtype_name(out);
}

double gelu_reference(double x) {
  const double inner = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(inner));
}

// ------------------------------------------------------------ unary ops ----

namespace {
int64_t resident_anonymous_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8));
  }
  return -1;
}
}  // namespace

// A large zero tensor is fresh pages: it takes no memory until written (the
// aggregator's model keeps gradients it never writes), reads as zeros, and
// is written, copied and freed as any other.
TEST(Tensor, ALargeZeroTensorTakesNoMemoryUntilWritten) {
  constexpr int64_t kCount = 64 << 18;  // 64 MiB of fp32
  static_assert(kCount * 4 >= static_cast<int64_t>(Tensor::kZeroMappedBytes));
  const int64_t before = resident_anonymous_kb();
  ASSERT_GE(before, 0);
  Tensor zeros = Tensor::zeros({kCount});
  EXPECT_LT(resident_anonymous_kb() - before, 16 << 10) << "64 MiB of zeros took memory before any write";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(zeros.raw()) % 64, 0u);
  const float* values = zeros.data<float>();
  double sum = 0.0;
  for (int64_t i = 0; i < kCount; i += 997) sum += values[i];
  EXPECT_EQ(sum, 0.0);
  EXPECT_EQ(values[kCount - 1], 0.0f);
  float* written = zeros.data<float>();
  for (int64_t i = 0; i < kCount; ++i) written[i] = static_cast<float>(i % 7);
  EXPECT_GE(resident_anonymous_kb() - before, 60 << 10);
  const Tensor copy = zeros.clone();
  EXPECT_EQ(copy.data<float>()[kCount - 1], static_cast<float>((kCount - 1) % 7));
  // Small ones are the usual allocation, zeroed.
  const Tensor small = Tensor::zeros({1000});
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(small.data<float>()[i], 0.0f);
}

TEST(Elementwise, FillWritesTheRoundedValueEverywhere) {
  for (const DType dtype : kAllDtypes) {
    for (const int64_t n : kSizes) {
      Tensor x = Tensor::empty({n}, dtype);
      fill(x, 1.1f);
      visit_dtype(dtype, [&]<class T>() {
        const T expected = from_float<T>(1.1f);
        for (int64_t i = 0; i < n; ++i) {
          if constexpr (std::is_same_v<T, float>) {
            ASSERT_EQ(x.data<T>()[i], expected);
          } else {
            ASSERT_EQ(x.data<T>()[i].bits, expected.bits) << dtype_name(dtype) << " " << i;
          }
        }
      });
    }
  }
}

TEST(Elementwise, ScaleInPlace) {
  ThreadCountGuard restore;
  Rng rng(1);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const int64_t n : kSizes) {
        Tensor x = random_tensor({n}, dtype, rng, -4, 4);
        const std::vector<float> before = widen(x);
        const float factor = -0.3f;
        scale(x, factor);
        std::vector<double> expected(before.size()), error(before.size());
        for (size_t i = 0; i < before.size(); ++i) {
          expected[i] = static_cast<double>(before[i]) * factor;
          error[i] = kU32 * std::fabs(expected[i]);  // one fp32 multiply
        }
        expect_close(x, expected, error, label("scale", n, threads, dtype, dtype));
      }
    }
  }
}

TEST(Elementwise, AxpyMixedDtypes) {
  ThreadCountGuard restore;
  Rng rng(2);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType x_dtype : kAllDtypes) {
      for (const DType y_dtype : kAllDtypes) {
        for (const int64_t n : kSizes) {
          const Tensor x = random_tensor({n}, x_dtype, rng, -2, 2);
          Tensor y = random_tensor({n}, y_dtype, rng, -2, 2);
          const std::vector<float> vx = widen(x), vy = widen(y);
          const float alpha = 0.625f;
          axpy(alpha, x, y);
          std::vector<double> expected(vx.size()), error(vx.size());
          for (size_t i = 0; i < vx.size(); ++i) {
            expected[i] = vy[i] + static_cast<double>(alpha) * vx[i];
            error[i] = 2 * kU32 * (std::fabs(vy[i]) + std::fabs(alpha * vx[i]));  // a multiply and an add
          }
          expect_close(y, expected, error, label("axpy", n, threads, x_dtype, y_dtype));
        }
      }
    }
  }
}

TEST(Elementwise, AddAndMulMixedDtypes) {
  ThreadCountGuard restore;
  Rng rng(3);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType a_dtype : kAllDtypes) {
      for (const DType b_dtype : kAllDtypes) {
        for (const DType out_dtype : kAllDtypes) {
          for (const int64_t n : kSizes) {
            const Tensor a = random_tensor({n}, a_dtype, rng, -3, 3);
            const Tensor b = random_tensor({n}, b_dtype, rng, -3, 3);
            const std::vector<float> va = widen(a), vb = widen(b);
            Tensor sum_out = Tensor::empty({n}, out_dtype), product_out = Tensor::empty({n}, out_dtype);
            add(a, b, sum_out);
            mul(a, b, product_out);
            std::vector<double> sums(va.size()), products(va.size()), sum_error(va.size()), product_error(va.size());
            for (size_t i = 0; i < va.size(); ++i) {
              sums[i] = static_cast<double>(va[i]) + vb[i];
              products[i] = static_cast<double>(va[i]) * vb[i];
              sum_error[i] = kU32 * (std::fabs(va[i]) + std::fabs(vb[i]));
              product_error[i] = kU32 * std::fabs(products[i]);
            }
            expect_close(sum_out, sums, sum_error, label("add", n, threads, a_dtype, out_dtype));
            expect_close(product_out, products, product_error, label("mul", n, threads, a_dtype, out_dtype));
          }
        }
      }
    }
  }
}

TEST(Elementwise, AddAliasingAnInput) {
  // out may be one of the inputs (x += y written as add(x, y, x)).
  Rng rng(4);
  Tensor a = random_tensor({100003}, DType::kF32, rng);
  const Tensor b = random_tensor({100003}, DType::kF32, rng);
  const std::vector<float> va = widen(a), vb = widen(b);
  add(a, b, a);
  for (int64_t i = 0; i < a.numel(); ++i) {
    const auto s = static_cast<size_t>(i);
    ASSERT_EQ(a.data<float>()[i], va[s] + vb[s]);  // one fp32 add, exactly as the formula
  }
}

// ------------------------------------------------------------ bias ops ----

TEST(Elementwise, AddBiasBroadcastsOverRows) {
  ThreadCountGuard restore;
  Rng rng(5);
  struct RowsCols {
    int64_t rows, cols;
  };
  // (3001, 37): 111037 elements, several chunks of rows.
  const RowsCols shapes[] = {{1, 1}, {17, 3}, {1, 100003}, {3001, 37}};
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const RowsCols& s : shapes) {
        Tensor y = random_tensor({s.rows, s.cols}, dtype, rng, -2, 2);
        const Tensor bias = random_tensor({s.cols}, DType::kF32, rng, -2, 2);
        const std::vector<float> vy = widen(y), vb = widen(bias);
        add_bias(y, bias);
        std::vector<double> expected(vy.size()), error(vy.size());
        for (int64_t r = 0; r < s.rows; ++r) {
          for (int64_t j = 0; j < s.cols; ++j) {
            const auto i = static_cast<size_t>(r * s.cols + j);
            expected[i] = static_cast<double>(vy[i]) + vb[static_cast<size_t>(j)];
            error[i] = kU32 * (std::fabs(vy[i]) + std::fabs(vb[static_cast<size_t>(j)]));
          }
        }
        expect_close(y, expected, error, label("add_bias", s.rows * s.cols, threads, dtype, dtype));
      }
    }
  }
}

TEST(Elementwise, BiasGradSumsRowsAndAccumulates) {
  Rng rng(6);
  for (const DType dtype : kAllDtypes) {
    for (const bool accumulate : {false, true}) {
      const int64_t rows = 3001, cols = 37;
      const Tensor dy = random_tensor({rows, cols}, dtype, rng);
      Tensor db = random_tensor({cols}, DType::kF32, rng);  // garbage when !accumulate
      const std::vector<float> vdy = widen(dy), initial = widen(db);
      bias_grad(dy, db, accumulate);
      std::vector<double> expected(static_cast<size_t>(cols)), error(static_cast<size_t>(cols));
      for (int64_t j = 0; j < cols; ++j) {
        double total = accumulate ? initial[static_cast<size_t>(j)] : 0.0, magnitude = std::fabs(total);
        for (int64_t r = 0; r < rows; ++r) {
          total += vdy[static_cast<size_t>(r * cols + j)];
          magnitude += std::fabs(vdy[static_cast<size_t>(r * cols + j)]);
        }
        expected[static_cast<size_t>(j)] = total;
        // fp32 sum of rows + 1 terms: within (rows + 1) * u32 of the magnitude.
        error[static_cast<size_t>(j)] = static_cast<double>(rows + 1) * kU32 * magnitude;
      }
      expect_close(db, expected, error, std::string("bias_grad ") + dtype_name(dtype) + (accumulate ? " +=" : " ="));
    }
  }
}

TEST(Elementwise, ChannelBiasGradSumsBatchAndPositions) {
  ThreadCountGuard restore;
  Rng rng(7);
  const Shape shapes[] = {{3, 4, 7, 5}, {1, 1, 1}, {2, 5, 1}, {5, 3, 6007}};
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const Shape& shape : shapes) {
        for (const bool accumulate : {false, true}) {
          const Tensor dy = random_tensor(shape, dtype, rng);
          const int64_t batch = shape[0], channels = shape[1], positions = dy.numel() / (batch * channels);
          Tensor db = random_tensor({channels}, DType::kF32, rng);
          const std::vector<float> vdy = widen(dy), initial = widen(db);
          channel_bias_grad(dy, db, accumulate);
          std::vector<double> expected(static_cast<size_t>(channels)), error(static_cast<size_t>(channels));
          for (int64_t c = 0; c < channels; ++c) {
            double total = 0.0, magnitude = 0.0;
            for (int64_t b = 0; b < batch; ++b) {
              for (int64_t p = 0; p < positions; ++p) {
                const float v = vdy[static_cast<size_t>((b * channels + c) * positions + p)];
                total += v;
                magnitude += std::fabs(v);
              }
            }
            if (accumulate) {
              total += initial[static_cast<size_t>(c)];
              magnitude += std::fabs(initial[static_cast<size_t>(c)]);
            }
            expected[static_cast<size_t>(c)] = total;
            error[static_cast<size_t>(c)] = static_cast<double>(batch * positions + 1) * kU32 * magnitude;
          }
          expect_close(db, expected, error,
                       label("channel_bias_grad", dy.numel(), threads, dtype, DType::kF32) +
                           (accumulate ? " +=" : " ="));
        }
      }
    }
  }
}

// ----------------------------------------------------------- activations ----

TEST(Elementwise, ReluForwardAndBackwardAreExact) {
  ThreadCountGuard restore;
  Rng rng(8);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const int64_t n : kSizes) {
        std::vector<float> xs(static_cast<size_t>(n));
        for (auto& v : xs) {
          // A quarter exact zeros (both signs), the rest random of both signs.
          const uint64_t kind = rng.below(8);
          v = kind == 0 ? 0.0f : kind == 1 ? -0.0f : static_cast<float>(4 * rng.uniform() - 2);
        }
        const Tensor x = from_values(xs, {n}, dtype);
        Tensor y = Tensor::empty({n}, dtype);
        relu_forward(x, y);
        Tensor dy = random_tensor({n}, dtype, rng);
        const std::vector<float> vx = widen(x), vy = widen(y), vdy = widen(dy);
        for (size_t i = 0; i < vx.size(); ++i) ASSERT_EQ(vy[i], vx[i] > 0 ? vx[i] : 0.0f) << i;

        Tensor dx = Tensor::empty({n}, DType::kF32);
        relu_backward(y, dy, dx);
        for (size_t i = 0; i < vx.size(); ++i) ASSERT_EQ(dx.data<float>()[i], vy[i] > 0 ? vdy[i] : 0.0f) << i;
        // dx may alias dy.
        relu_backward(y, dy, dy);
        const std::vector<float> in_place = widen(dy);
        for (size_t i = 0; i < vx.size(); ++i) ASSERT_EQ(in_place[i], vy[i] > 0 ? vdy[i] : 0.0f) << i;
      }
    }
  }
}

TEST(Elementwise, GeluForwardMatchesTanhFormula) {
  ThreadCountGuard restore;
  Rng rng(9);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType in_dtype : kAllDtypes) {
      for (const DType out_dtype : kAllDtypes) {
        for (const int64_t n : kSizes) {
          const Tensor x = random_tensor({n}, in_dtype, rng, -8, 8);
          Tensor y = Tensor::empty({n}, out_dtype);
          gelu_forward(x, y);
          const std::vector<float> vx = widen(x);
          std::vector<double> expected(vx.size()), error(vx.size());
          for (size_t i = 0; i < vx.size(); ++i) {
            expected[i] = gelu_reference(vx[i]);
            // fp32: the cubic and tanh are a few ulps off, and 1 + tanh cancels
            // for negative x, leaving errors of a few u32 relative to 1, scaled
            // by 0.5 |x|. 16 u32 (1 + |x|) covers it with margin.
            error[i] = 16 * kU32 * (1.0 + std::fabs(vx[i]));
          }
          expect_close(y, expected, error, label("gelu", n, threads, in_dtype, out_dtype));
        }
      }
    }
  }
  // Landmarks: gelu(0) = 0, gelu(x) ~ x for large x and ~ 0 for very negative x.
  Tensor x = from_values({0.0f, 10.0f, -10.0f, 1.0f}, {4}, DType::kF32);
  Tensor y = Tensor::empty({4}, DType::kF32);
  gelu_forward(x, y);
  EXPECT_EQ(y.data<float>()[0], 0.0f);
  EXPECT_FLOAT_EQ(y.data<float>()[1], 10.0f);
  EXPECT_NEAR(y.data<float>()[2], 0.0f, 1e-6);
  EXPECT_NEAR(y.data<float>()[3], 0.8411920071, 1e-6);  // 0.5 (1 + tanh(sqrt(2/pi) 1.044715))
}

TEST(Elementwise, GeluBackwardMatchesCentralDifferences) {
  ThreadCountGuard restore;
  Rng rng(10);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const int64_t n : kSizes) {
        const Tensor x = random_tensor({n}, dtype, rng, -6, 6);
        const Tensor dy = random_tensor({n}, dtype, rng, -2, 2);
        Tensor dx = Tensor::empty({n}, DType::kF32);
        gelu_backward(x, dy, dx);
        const std::vector<float> vx = widen(x), vdy = widen(dy);
        std::vector<double> expected(vx.size()), error(vx.size());
        for (size_t i = 0; i < vx.size(); ++i) {
          // Central difference in double with h = 1e-4: truncation h^2/6 |gelu'''|
          // < 1e-8 and cancellation 1e-16 / h = 1e-12, far below fp32 error.
          const double h = 1e-4;
          const double slope = (gelu_reference(vx[i] + h) - gelu_reference(vx[i] - h)) / (2 * h);
          expected[i] = vdy[i] * slope;
          // fp32 kernel: a few u32 per term (tanh, 1 - t^2, the cubic) times
          // |x| factors as in the forward; 32 u32 (1 + |x|) |dy| plus the
          // finite-difference error.
          error[i] = 32 * kU32 * (1.0 + std::fabs(vx[i])) * std::fabs(vdy[i]) + 1e-8;
        }
        expect_close(dx, expected, error, label("gelu_backward", n, threads, dtype, DType::kF32));
      }
    }
  }
  // Low-precision dx rounds once from fp32.
  Rng rng2(11);
  const Tensor x = random_tensor({1000}, DType::kBF16, rng2, -4, 4);
  const Tensor dy = random_tensor({1000}, DType::kBF16, rng2);
  Tensor dx32 = Tensor::empty({1000}, DType::kF32), dx16 = Tensor::empty({1000}, DType::kBF16);
  gelu_backward(x, dy, dx32);
  gelu_backward(x, dy, dx16);
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(dx16.data<bf16>()[i].bits, to_bf16(dx32.data<float>()[i]).bits) << i;
}

// ------------------------------------------------------------ reductions ----

TEST(Reductions, SumAndSquaredNormMatchDoubleAndAreDeterministic) {
  ThreadCountGuard restore;
  Rng rng(12);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{100003}, int64_t{1000003}}) {
        const Tensor x = random_tensor({n}, dtype, rng, -3, 5);
        const std::vector<float> vx = widen(x);
        double total = 0.0, squares = 0.0, magnitude = 0.0;
        for (const float v : vx) {
          total += v;
          squares += static_cast<double>(v) * v;
          magnitude += std::fabs(v);
        }
        const double s = sum(x), q = squared_l2_norm(x);
        // Both accumulate in double: any order of n additions is within
        // n * 2^-53 of the magnitude (squares are exact in double).
        const double bound = static_cast<double>(n + 1) * 0x1p-53;
        EXPECT_NEAR(s, total, bound * magnitude) << dtype_name(dtype) << " n=" << n;
        EXPECT_NEAR(q, squares, bound * squares) << dtype_name(dtype) << " n=" << n;
        for (int repeat = 0; repeat < 5; ++repeat) {
          EXPECT_EQ(sum(x), s) << "sum must not depend on scheduling";
          EXPECT_EQ(squared_l2_norm(x), q);
        }
      }
    }
  }
}

TEST(Reductions, Fp32SquaredNormIndependentOfThreadCount) {
  // The fp32 squared norm uses fixed blocks (elementwise.cpp), so its value
  // depends only on the data: bit-identical for every thread count.
  ThreadCountGuard restore;
  Rng rng(18);
  for (const int64_t n : {int64_t{17}, int64_t{100003}, int64_t{1000003}}) {
    const Tensor x = random_tensor({n}, DType::kF32, rng, -3, 5);
    set_cpu_threads(1);
    const double reference = squared_l2_norm(x);
    for (const int threads : {2, 3, 5}) {
      set_cpu_threads(threads);
      EXPECT_EQ(squared_l2_norm(x), reference) << "n=" << n << " threads=" << threads;
    }
  }
}

TEST(Reductions, MaxAbs) {
  Rng rng(13);
  for (const DType dtype : kAllDtypes) {
    for (const int64_t n : kSizes) {
      Tensor x = random_tensor({n}, dtype, rng, -1, 1);
      std::vector<float> vx = widen(x);
      // Put the largest magnitude, negative, somewhere inside.
      const size_t where = static_cast<size_t>(rng.below(static_cast<uint64_t>(n)));
      vx[where] = -3.5f;
      x = from_values(vx, {n}, dtype);
      EXPECT_EQ(max_abs(x), 3.5f) << dtype_name(dtype) << " n=" << n;
    }
  }
  EXPECT_EQ(max_abs(Tensor::empty({0})), 0.0f);
}

TEST(Reductions, AllFiniteFindsOneBadValueAnywhere) {
  ThreadCountGuard restore;
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  Rng rng(14);
  for (const int threads : kThreadCounts) {
    set_cpu_threads(threads);
    for (const DType dtype : kAllDtypes) {
      for (const int64_t n : kSizes) {
        const std::vector<float> clean = widen(random_tensor({n}, dtype, rng, -100, 100));
        EXPECT_TRUE(all_finite(from_values(clean, {n}, dtype)));
        for (const int64_t where : {int64_t{0}, n / 2, n - 1}) {
          for (const float bad : bad_values) {
            std::vector<float> dirty = clean;
            dirty[static_cast<size_t>(where)] = bad;
            EXPECT_FALSE(all_finite(from_values(dirty, {n}, dtype)))
                << dtype_name(dtype) << " n=" << n << " " << bad << " at " << where;
          }
        }
      }
    }
  }
  EXPECT_TRUE(all_finite(Tensor::empty({0})));
  // 1e5 is finite in fp32 and bf16 but overflows fp16 to Inf.
  const std::vector<float> big = {1e5f};
  EXPECT_TRUE(all_finite(from_values(big, {1}, DType::kBF16)));
  EXPECT_FALSE(all_finite(from_values(big, {1}, DType::kF16)));
}

TEST(Reductions, ArgmaxRows) {
  Rng rng(15);
  for (const DType dtype : kAllDtypes) {
    for (const int64_t cols : {int64_t{1}, int64_t{2}, int64_t{10}, int64_t{200}}) {
      const int64_t rows = 31;
      // Distinct values per row: a random permutation of 0..cols-1, shifted
      // to all-negative for odd rows; integers up to 256 in magnitude are
      // exact in every dtype.
      std::vector<float> values(static_cast<size_t>(rows * cols));
      std::vector<int32_t> expected(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<int32_t> order(static_cast<size_t>(cols));
        for (int64_t j = 0; j < cols; ++j) order[static_cast<size_t>(j)] = static_cast<int32_t>(j);
        rng.shuffle(std::span<int32_t>(order));
        const int64_t shift = (r % 2) ? -cols : 0;
        for (int64_t j = 0; j < cols; ++j) {
          values[static_cast<size_t>(r * cols + j)] = static_cast<float>(order[static_cast<size_t>(j)] + shift);
          if (order[static_cast<size_t>(j)] == cols - 1) expected[static_cast<size_t>(r)] = static_cast<int32_t>(j);
        }
      }
      const Tensor x = from_values(values, {rows, cols}, dtype);
      std::vector<int32_t> got(static_cast<size_t>(rows), -1);
      argmax_rows(x, got);
      EXPECT_EQ(got, expected) << dtype_name(dtype) << " cols=" << cols;
    }
  }
}

// ------------------------------------------------------------- embedding ----

TEST(Embedding, ForwardGathersRows) {
  Rng rng(16);
  const int64_t vocabulary = 11, dim = 7;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 3, 7, 0, 10};
  for (const DType table_dtype : kAllDtypes) {
    for (const DType out_dtype : kAllDtypes) {
      const Tensor table = random_tensor({vocabulary, dim}, table_dtype, rng, -5, 5);
      Tensor out = Tensor::empty({static_cast<int64_t>(ids.size()), dim}, out_dtype);
      embedding_forward(table, ids, out);
      const std::vector<float> vt = widen(table), vo = widen(out);
      for (size_t i = 0; i < ids.size(); ++i) {
        for (int64_t j = 0; j < dim; ++j) {
          // The row converted to the output dtype: exact widening, one rounding.
          const float source = vt[static_cast<size_t>(ids[i] * dim + j)];
          const float want = widen(from_values({source}, {1}, out_dtype))[0];
          ASSERT_EQ(vo[i * static_cast<size_t>(dim) + static_cast<size_t>(j)], want)
              << dtype_name(table_dtype) << "->" << dtype_name(out_dtype) << " id " << ids[i];
        }
      }
    }
  }
  // No ids: nothing to do.
  const Tensor table = random_tensor({vocabulary, dim}, DType::kF32, rng);
  Tensor empty_out = Tensor::empty({0, dim});
  embedding_forward(table, std::span<const int32_t>(), empty_out);
}

TEST(Embedding, BackwardScatterAddsRepeatedIds) {
  // Multiples of 1/8 below 2^10 add exactly in fp32 in any order, so the
  // scatter-add must match the reference exactly.
  Rng rng(17);
  const int64_t vocabulary = 11, dim = 7;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 3, 7, 0, 10, 3};
  const auto dyadic = [&rng] { return static_cast<float>(static_cast<int>(rng.below(65)) - 32) / 8.0f; };
  for (const DType dtype : kAllDtypes) {
    std::vector<float> grads(ids.size() * static_cast<size_t>(dim)), initial(static_cast<size_t>(vocabulary * dim));
    for (auto& v : grads) v = dyadic();
    for (auto& v : initial) v = dyadic();
    const Tensor dout = from_values(grads, {static_cast<int64_t>(ids.size()), dim}, dtype);
    Tensor dtable = from_values(initial, {vocabulary, dim}, DType::kF32);
    embedding_backward(ids, dout, dtable);

    std::vector<double> expected(initial.begin(), initial.end());
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t j = 0; j < dim; ++j)
        expected[static_cast<size_t>(ids[i] * dim + j)] += grads[i * static_cast<size_t>(dim) + static_cast<size_t>(j)];
    for (int64_t i = 0; i < vocabulary * dim; ++i) {
      ASSERT_EQ(static_cast<double>(dtable.data<float>()[i]), expected[static_cast<size_t>(i)])
          << dtype_name(dtype) << " row " << i / dim;
    }
    // Rows no id names (1, 2, 4, 5, 6, 8, 9) keep their initial values.
    for (const int64_t row : {1, 2, 4, 5, 6, 8, 9})
      for (int64_t j = 0; j < dim; ++j)
        ASSERT_EQ(dtable.data<float>()[row * dim + j], initial[static_cast<size_t>(row * dim + j)]);
  }
}

}  // namespace
}  // namespace fedmesh
