#include "kernels/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "kernels/convert.h"
#include "kernels/device_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {

namespace {

// Below this many multiply-adds a GEMM runs on one thread: splitting costs more.
constexpr int64_t kParallelGemmMinWork = 1 << 18;
// Column/row split granularity, a multiple of OpenBLAS's register blocking.
constexpr int64_t kGemmSplitAlign = 32;

void blas_sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

}  // namespace

void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const ProfileScope profile(StepTime::kGemm);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  const int threads = cpu_threads();
  if (threads == 1 || m * n * k < kParallelGemmMinWork) {
    blas_sgemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Split the larger of m and n into one aligned slab per thread; each slab is
  // an independent GEMM writing its own part of c, so results do not depend on
  // scheduling.
  const bool split_columns = n >= m;
  const int64_t extent = split_columns ? n : m;
  const int64_t slabs = std::min<int64_t>(threads, (extent + kGemmSplitAlign - 1) / kGemmSplitAlign);
  const int64_t per_slab = (extent + slabs - 1) / slabs;
  const int64_t slab = (per_slab + kGemmSplitAlign - 1) / kGemmSplitAlign * kGemmSplitAlign;
  parallel_for(slabs, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t begin = s * slab;
      const int64_t size = std::min(extent, begin + slab) - begin;
      if (size <= 0) continue;
      if (split_columns) {
        const float* b_slab = transpose_b ? b + begin * ldb : b + begin;
        blas_sgemm(transpose_a, transpose_b, m, size, k, alpha, a, lda, b_slab, ldb, beta, c + begin, ldc);
      } else {
        const float* a_slab = transpose_a ? a + begin : a + begin * lda;
        blas_sgemm(transpose_a, transpose_b, size, n, k, alpha, a_slab, lda, b, ldb, beta, c + begin * ldc, ldc);
      }
    }
  });
}

namespace {

// Widens the sub-matrix rows [r0, r0+rows) × cols [c0, c0+cols) of a row-major
// (.., ld) matrix into a dense (rows, cols) fp32 block.
void widen_block(const void* src, DType dtype, int64_t ld, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                 float* dst) {
  const char* base = static_cast<const char*>(src);
  const size_t element = dtype_size(dtype);
  for (int64_t r = 0; r < rows; ++r) {
    widen_to_f32(base + static_cast<size_t>((r0 + r) * ld + c0) * element, dtype, dst + r * cols, cols);
  }
}

}  // namespace

GemmDims gemm_dims(bool transpose_a, bool transpose_b, const Tensor& a, const Tensor& b, const Tensor& c) {
  FEDMESH_CHECK(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "gemm takes 2-D tensors");
  const int64_t m = transpose_a ? a.dim(1) : a.dim(0);
  const int64_t k = transpose_a ? a.dim(0) : a.dim(1);
  const int64_t n = transpose_b ? b.dim(0) : b.dim(1);
  FEDMESH_CHECK((transpose_b ? b.dim(1) : b.dim(0)) == k && c.dim(0) == m && c.dim(1) == n,
                "gemm shapes do not match: a " + shape_to_string(a.shape()) + ", b " + shape_to_string(b.shape()) +
                    ", c " + shape_to_string(c.shape()));
  return {m, n, k};
}

void gemm(bool transpose_a, bool transpose_b, float alpha, const Tensor& a, const Tensor& b, float beta,
          Tensor& c) {
  const ProfileScope profile(StepTime::kGemm);
  if (device::on_cuda(c)) return device::gemm(transpose_a, transpose_b, alpha, a, b, beta, c);
  const auto [m, n, k] = gemm_dims(transpose_a, transpose_b, a, b, c);
  const bool all_f32 = a.dtype() == DType::kF32 && b.dtype() == DType::kF32 && c.dtype() == DType::kF32;
  if (all_f32) {
    sgemm(transpose_a, transpose_b, m, n, k, alpha, a.data<float>(), a.dim(1), b.data<float>(), b.dim(1), beta,
          c.data<float>(), n);
    return;
  }

  // fp32 accumulator for c (c itself when it is fp32).
  thread_local std::vector<float> accumulator, block_a, block_b;
  float* acc = nullptr;
  if (c.dtype() == DType::kF32) {
    acc = c.data<float>();
  } else {
    accumulator.resize(static_cast<size_t>(m * n));
    acc = accumulator.data();
    if (beta != 0.0f) widen_to_f32(c.raw(), c.dtype(), acc, m * n);
  }
  if (k == 0) {
    sgemm(false, false, m, n, 0, alpha, nullptr, 1, nullptr, 1, beta, acc, n);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kGemmBlockK) {
    const int64_t kb = std::min(kGemmBlockK, k - k0);
    const float block_beta = k0 == 0 ? beta : 1.0f;
    const float *pa = nullptr, *pb = nullptr;
    int64_t lda = 0, ldb = 0;
    if (a.dtype() == DType::kF32) {
      pa = a.data<float>() + (transpose_a ? k0 * a.dim(1) : k0);
      lda = a.dim(1);
    } else {
      block_a.resize(static_cast<size_t>(m * kb));
      if (transpose_a) {  // a is (k, m): rows k0..k0+kb
        widen_block(a.raw(), a.dtype(), m, k0, kb, 0, m, block_a.data());
        lda = m;
      } else {  // a is (m, k): columns k0..k0+kb
        widen_block(a.raw(), a.dtype(), k, 0, m, k0, kb, block_a.data());
        lda = kb;
      }
      pa = block_a.data();
    }
    if (b.dtype() == DType::kF32) {
      pb = b.data<float>() + (transpose_b ? k0 : k0 * b.dim(1));
      ldb = b.dim(1);
    } else {
      block_b.resize(static_cast<size_t>(kb * n));
      if (transpose_b) {  // b is (n, k): columns k0..k0+kb
        widen_block(b.raw(), b.dtype(), k, 0, n, k0, kb, block_b.data());
        ldb = kb;
      } else {  // b is (k, n): rows k0..k0+kb
        widen_block(b.raw(), b.dtype(), n, k0, kb, 0, n, block_b.data());
        ldb = n;
      }
      pb = block_b.data();
    }
    sgemm(transpose_a, transpose_b, m, n, kb, alpha, pa, lda, pb, ldb, block_beta, acc, n);
  }
  if (c.dtype() != DType::kF32) narrow_from_f32(acc, c.raw(), c.dtype(), m * n);
}

}  // namespace fedmesh
