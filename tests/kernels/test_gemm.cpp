// sgemm and gemm (kernels/gemm.h) against a naive double-precision reference
// on odd shapes, every transpose combination, alpha/beta combinations and
// every operand dtype, with guard rows around c to catch out-of-bounds writes.
//
// Tolerance: any fp32 summation of k products, in any order and blocking,
// with or without FMA, is within gamma_k ~ k * u (u = 2^-24) of the exact sum,
// relative to sum |a_ip * b_pj| (Higham, "Accuracy and Stability of Numerical
// Algorithms", 3.1). The alpha and beta terms add two more roundings, hence
// (k + 2) * u * (|alpha| * sum |a*b| + |beta * c|). Low-precision operands are
// compared against a reference computed on the already-rounded values, so the
// bound stays the fp32 one; a low-precision c adds one rounding of the result
// (half an ulp: u_out * |result|, plus half the smallest subnormal).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/convert.h"
#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "kernels/tensor.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

constexpr double kF32Unit = 0x1p-24;  // unit roundoff of fp32
constexpr int64_t kGuardRows = 3;
constexpr unsigned char kGuardByte = 0xA5;

// A (rows, cols) output viewed inside a larger tensor whose first and last
// kGuardRows rows hold a byte pattern that no correct gemm touches.
struct GuardedOutput {
  Tensor storage;
  Tensor c;

  GuardedOutput(int64_t rows, int64_t cols, DType dtype)
      : storage(Tensor::empty({rows + 2 * kGuardRows, cols}, dtype)) {
    std::memset(storage.raw(), kGuardByte, storage.nbytes());
    c = storage.slice_rows(kGuardRows, kGuardRows + rows);
  }

  bool guards_intact() const {
    const auto* bytes = static_cast<const unsigned char*>(storage.raw());
    const size_t guard_bytes = storage.nbytes() / static_cast<size_t>(storage.dim(0)) * kGuardRows;
    for (size_t i = 0; i < guard_bytes; ++i) {
      if (bytes[i] != kGuardByte || bytes[storage.nbytes() - 1 - i] != kGuardByte) return false;
    }
    return true;
  }
};

// Fills c with random values (rounded to its dtype) or, when c must not be
// read (beta == 0), with NaN so that reading it would show.
void initialize_output(Tensor& c, bool nan, Rng& rng) {
  std::vector<float> values(static_cast<size_t>(c.numel()));
  for (auto& v : values) v = nan ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(2 * rng.uniform() - 1);
  narrow_from_f32(values.data(), c.raw(), c.dtype(), c.numel());
}

struct Reference {
  std::vector<double> value;      // alpha * op(a) op(b) + beta * c0, exactly (to double rounding)
  std::vector<double> tolerance;  // per element, from the bound in the file comment
};

// op(a) is (m, k): stored (m, k), or (k, m) when transposed; likewise op(b) (k, n).
Reference reference_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha,
                         const std::vector<float>& a, const std::vector<float>& b, double beta,
                         const std::vector<float>& c0, DType c_dtype) {
  Reference ref;
  ref.value.resize(static_cast<size_t>(m * n));
  ref.tolerance.resize(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double total = 0.0, magnitude = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = a[static_cast<size_t>(transpose_a ? p * m + i : i * k + p)];
        const double bv = b[static_cast<size_t>(transpose_b ? j * k + p : p * n + j)];
        total += av * bv;
        magnitude += std::fabs(av * bv);
      }
      const size_t index = static_cast<size_t>(i * n + j);
      double result = alpha * total;
      double scale = std::fabs(alpha) * magnitude;
      if (beta != 0.0) {
        result += beta * c0[index];
        scale += std::fabs(beta * c0[index]);
      }
      ref.value[index] = result;
      ref.tolerance[index] = static_cast<double>(k + 2) * kF32Unit * scale +
                             unit_roundoff(c_dtype) * std::fabs(result) * (c_dtype == DType::kF32 ? 0.0 : 1.0) +
                             subnormal_floor(c_dtype);
    }
  }
  return ref;
}

struct Shape3 {
  int64_t m, n, k;
};

// Zeros, ones, primes, and k around and across the kGemmBlockK = 256 block of
// the low-precision path (256, 257, 513, 600, 1000). The last three have
// m * n * k (and m * n * 256) above sgemm's threshold for splitting c into
// per-thread slabs: by columns (n >= m) or by rows, with uneven last slabs.
const Shape3 kShapes[] = {
    {0, 5, 3},    {5, 0, 3},    {4, 5, 0},      {0, 0, 0},     {1, 1, 1},     {7, 13, 31},
    {13, 7, 600}, {31, 1, 257}, {1, 31, 513},   {257, 13, 7},  {3, 257, 300}, {17, 19, 256},
    {2, 3, 1000}, {65, 97, 300}, {257, 33, 40}, {31, 257, 35},
};

struct Scalars {
  float alpha, beta;
};
const Scalars kScalars[] = {{1.0f, 0.0f}, {0.5f, 0.0f}, {-1.25f, 1.0f}, {2.0f, -0.75f}, {0.0f, 1.5f}};

std::string describe(bool ta, bool tb, const Shape3& s, const Scalars& sc, DType da, DType db, DType dc) {
  return std::string("ta=") + (ta ? "1" : "0") + " tb=" + (tb ? "1" : "0") + " m=" + std::to_string(s.m) +
         " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) + " alpha=" + std::to_string(sc.alpha) +
         " beta=" + std::to_string(sc.beta) + " dtypes a=" + dtype_name(da) + " b=" + dtype_name(db) +
         " c=" + dtype_name(dc);
}

// Runs gemm once and compares every element of c with the reference.
void check_gemm(bool ta, bool tb, const Shape3& s, const Scalars& sc, DType da, DType db, DType dc, Rng& rng) {
  SCOPED_TRACE(describe(ta, tb, s, sc, da, db, dc));
  const Tensor a = random_tensor(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, da, rng);
  const Tensor b = random_tensor(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, db, rng);
  GuardedOutput out(s.m, s.n, dc);
  initialize_output(out.c, sc.beta == 0.0f, rng);
  const std::vector<float> c0 = widen(out.c);

  gemm(ta, tb, sc.alpha, a, b, sc.beta, out.c);

  EXPECT_TRUE(out.guards_intact()) << "gemm wrote outside c";
  const Reference ref = reference_gemm(ta, tb, s.m, s.n, s.k, sc.alpha, widen(a), widen(b), sc.beta, c0, dc);
  const std::vector<float> result = widen(out.c);
  int failures = 0;
  for (size_t i = 0; i < result.size() && failures < 5; ++i) {
    const double error = std::fabs(static_cast<double>(result[i]) - ref.value[i]);
    if (!(error <= ref.tolerance[i])) {  // also catches NaN
      ADD_FAILURE() << "element " << i << ": got " << result[i] << ", want " << ref.value[i] << " +- "
                    << ref.tolerance[i];
      ++failures;
    }
  }
}

TEST(Gemm, Fp32AllTransposesShapesAndScalars) {
  Rng rng(1);
  for (const bool ta : {false, true})
    for (const bool tb : {false, true})
      for (const Shape3& s : kShapes)
        for (const Scalars& sc : kScalars) check_gemm(ta, tb, s, sc, DType::kF32, DType::kF32, DType::kF32, rng);
}

TEST(Gemm, LowPrecisionOperandsAndOutputs) {
  struct Dtypes {
    DType a, b, c;
  };
  const Dtypes combinations[] = {
      {DType::kBF16, DType::kBF16, DType::kF32}, {DType::kF16, DType::kF16, DType::kF32},
      {DType::kBF16, DType::kF32, DType::kF32},  {DType::kF32, DType::kF16, DType::kF32},
      {DType::kBF16, DType::kF16, DType::kF32},  {DType::kBF16, DType::kBF16, DType::kBF16},
      {DType::kF16, DType::kF16, DType::kF16},   {DType::kF32, DType::kF32, DType::kBF16},
      {DType::kF32, DType::kF32, DType::kF16},   {DType::kF16, DType::kF32, DType::kBF16},
  };
  Rng rng(2);
  for (const Dtypes& d : combinations)
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const Shape3& s : kShapes)
          for (const Scalars& sc : kScalars) check_gemm(ta, tb, s, sc, d.a, d.b, d.c, rng);
}

TEST(Gemm, SplitAcrossThreads) {
  // sgemm splits large products into per-thread slabs of c: every thread
  // count (1 = no split; 3 and 5: more slabs than this machine may have
  // cores) must give the reference result and leave the guard rows alone.
  ThreadCountGuard restore;
  const Shape3 shapes[] = {{65, 97, 300}, {257, 33, 40}, {31, 257, 35}, {100, 1000, 3}, {1000, 70, 5}};
  Rng rng(6);
  for (const int threads : {1, 2, 3, 5}) {
    set_cpu_threads(threads);
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const Shape3& s : shapes) {
          check_gemm(ta, tb, s, Scalars{1.5f, -0.5f}, DType::kF32, DType::kF32, DType::kF32, rng);
          check_gemm(ta, tb, s, Scalars{1.0f, 0.0f}, DType::kBF16, DType::kF32, DType::kF16, rng);
        }
  }
}

TEST(Gemm, AccumulatesIntoCAcrossCalls) {
  // c = a1 b1, then c += a2 b2 (beta = 1): the gradient-accumulation pattern.
  Rng rng(3);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t m = 13, n = 31, k = 600;
    const Tensor a1 = random_tensor({m, k}, dtype, rng), b1 = random_tensor({k, n}, dtype, rng);
    const Tensor a2 = random_tensor({k, m}, dtype, rng), b2 = random_tensor({n, k}, dtype, rng);
    GuardedOutput out(m, n, DType::kF32);
    gemm(false, false, 1.0f, a1, b1, 0.0f, out.c);
    gemm(true, true, 1.0f, a2, b2, 1.0f, out.c);
    EXPECT_TRUE(out.guards_intact());

    const std::vector<float> va1 = widen(a1), vb1 = widen(b1), va2 = widen(a2), vb2 = widen(b2);
    const std::vector<float> result = widen(out.c);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double expected = 0.0, magnitude = 0.0;
        for (int64_t p = 0; p < k; ++p) {
          const double t1 = static_cast<double>(va1[static_cast<size_t>(i * k + p)]) * vb1[static_cast<size_t>(p * n + j)];
          const double t2 = static_cast<double>(va2[static_cast<size_t>(p * m + i)]) * vb2[static_cast<size_t>(j * k + p)];
          expected += t1 + t2;
          magnitude += std::fabs(t1) + std::fabs(t2);
        }
        // Two chained fp32 sums of k terms each: within (2k + 2) u of the total magnitude.
        const double tolerance = static_cast<double>(2 * k + 2) * kF32Unit * magnitude;
        ASSERT_NEAR(result[static_cast<size_t>(i * n + j)], expected, tolerance) << dtype_name(dtype) << " " << i
                                                                                 << "," << j;
      }
    }
  }
}

TEST(Sgemm, LeadingDimensionsLargerThanTheMatrix) {
  // Row-major buffers with padded rows: lda, ldb, ldc exceed the column counts,
  // and the padding between c's rows must survive.
  Rng rng(4);
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      const int64_t m = 7, n = 13, k = 31, pad = 5;
      const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
      const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
      std::vector<float> a(static_cast<size_t>(a_rows * lda)), b(static_cast<size_t>(b_rows * ldb));
      for (auto& v : a) v = static_cast<float>(2 * rng.uniform() - 1);
      for (auto& v : b) v = static_cast<float>(2 * rng.uniform() - 1);
      const float sentinel = -12345.0f;
      std::vector<float> c(static_cast<size_t>(m * ldc), sentinel);
      std::vector<float> c0(static_cast<size_t>(m * n));
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          c[static_cast<size_t>(i * ldc + j)] = static_cast<float>(rng.uniform());
          c0[static_cast<size_t>(i * n + j)] = c[static_cast<size_t>(i * ldc + j)];
        }
      }
      const float alpha = 0.75f, beta = -0.5f;
      sgemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);

      // Dense copies for the reference.
      std::vector<float> dense_a(static_cast<size_t>(a_rows * a_cols)), dense_b(static_cast<size_t>(b_rows * b_cols));
      for (int64_t r = 0; r < a_rows; ++r)
        for (int64_t q = 0; q < a_cols; ++q)
          dense_a[static_cast<size_t>(r * a_cols + q)] = a[static_cast<size_t>(r * lda + q)];
      for (int64_t r = 0; r < b_rows; ++r)
        for (int64_t q = 0; q < b_cols; ++q)
          dense_b[static_cast<size_t>(r * b_cols + q)] = b[static_cast<size_t>(r * ldb + q)];
      const Reference ref = reference_gemm(ta, tb, m, n, k, alpha, dense_a, dense_b, beta, c0, DType::kF32);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const float got = c[static_cast<size_t>(i * ldc + j)];
          if (j >= n) {
            ASSERT_EQ(got, sentinel) << "padding of row " << i << " overwritten";
            continue;
          }
          const size_t index = static_cast<size_t>(i * n + j);
          ASSERT_NEAR(got, ref.value[index], ref.tolerance[index]) << "ta=" << ta << " tb=" << tb;
        }
      }
    }
  }
}

TEST(Sgemm, EmptyInnerDimensionScalesC) {
  // k = 0: op(a) op(b) is the zero matrix, so c = beta * c; beta = 0 clears
  // c even when it holds NaN (BLAS semantics: c is not read).
  std::vector<float> c = {1.0f, -2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  sgemm(false, false, 2, 3, 0, 1.0f, nullptr, 1, nullptr, 1, 0.5f, c.data(), 3);
  EXPECT_EQ(c, (std::vector<float>{0.5f, -1.0f, 1.5f, 2.0f, 2.5f, 3.0f}));
  std::fill(c.begin(), c.end(), std::numeric_limits<float>::quiet_NaN());
  sgemm(true, true, 2, 3, 0, 1.0f, nullptr, 1, nullptr, 1, 0.0f, c.data(), 3);
  EXPECT_EQ(c, std::vector<float>(6, 0.0f));
  // m = 0 or n = 0: nothing is touched.
  std::vector<float> untouched = {7.0f};
  sgemm(false, false, 0, 1, 4, 1.0f, nullptr, 4, nullptr, 1, 0.0f, untouched.data(), 1);
  sgemm(false, false, 1, 0, 4, 1.0f, nullptr, 4, nullptr, 1, 0.0f, untouched.data(), 1);
  EXPECT_EQ(untouched[0], 7.0f);
}

TEST(Gemm, ExactOnSmallIntegers) {
  // Small integers are exact in bf16/fp16 storage, and their products and sums
  // (far below 2^24) are exact in fp32, so the result must be bit-exact
  // regardless of summation order or blocking: a single dropped, doubled or
  // misplaced term along k (e.g. at a kGemmBlockK boundary) shows.
  const Shape3 shapes[] = {{3, 2, 300}, {7, 13, 600}, {1, 1, 257}, {5, 4, 256}};
  Rng rng(5);
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        for (const Shape3& s : shapes) {
          std::vector<float> va(static_cast<size_t>(s.m * s.k)), vb(static_cast<size_t>(s.k * s.n));
          for (auto& v : va) v = static_cast<float>(static_cast<int>(rng.below(7)) - 3);
          for (auto& v : vb) v = static_cast<float>(static_cast<int>(rng.below(7)) - 3);
          Tensor a = Tensor::empty(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, dtype);
          Tensor b = Tensor::empty(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, dtype);
          narrow_from_f32(va.data(), a.raw(), dtype, s.m * s.k);
          narrow_from_f32(vb.data(), b.raw(), dtype, s.k * s.n);
          GuardedOutput out(s.m, s.n, DType::kF32);
          gemm(ta, tb, 1.0f, a, b, 0.0f, out.c);
          EXPECT_TRUE(out.guards_intact());
          const std::vector<float> result = widen(out.c);
          for (int64_t i = 0; i < s.m; ++i) {
            for (int64_t j = 0; j < s.n; ++j) {
              int64_t expected = 0;
              for (int64_t p = 0; p < s.k; ++p) {
                const float av = va[static_cast<size_t>(ta ? p * s.m + i : i * s.k + p)];
                const float bv = vb[static_cast<size_t>(tb ? j * s.k + p : p * s.n + j)];
                expected += static_cast<int64_t>(av) * static_cast<int64_t>(bv);
              }
              ASSERT_EQ(result[static_cast<size_t>(i * s.n + j)], static_cast<float>(expected))
                  << dtype_name(dtype) << " ta=" << ta << " tb=" << tb << " k=" << s.k << " at " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace fedmesh
