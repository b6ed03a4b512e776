// The CUDA training ops (kernels/cuda_ops.h) against the CPU kernels, the
// oracle, on seeded random inputs of awkward sizes (1, 7, 255, 4097
// elements; rows that are not multiples of a block; GEMM shapes (m, n, k) of
// 1x1x1, 7x13x5, 64x512x784 and 129x257x65 in every transpose combination,
// dense and with padded leading dimensions). Every output buffer has guard
// bytes on both sides that no kernel may touch. Every test asks
// cuda::available() first and skips with its reason where there is no
// backend (a build without CUDA, or no usable GPU): the binary then exits 77
// and meson reports SKIP.
//
// Tolerances, per element, with u(d) the unit roundoff of dtype d (2^-24 fp32,
// 2^-8 bf16, 2^-11 fp16) and ulp(d, v) = 2 u(d) |v| + the dtype's smallest
// subnormal: one step of the output dtype, for a low-precision result whose
// fp32 value differs by a rounding error and so may round to the neighbour.
// - Bit-identical: fill, scale, axpy, cast (NaN payloads included), add_bias,
//   relu forward/backward, im2col, col2im, maxpool forward (values and
//   argmax) and backward, embedding forward, SGD and AdamW (weights, state and
//   compute copy, over several steps, with and without a device loss scale),
//   unscale_and_check, gradient_scale_factor, delta, weighted_accumulate, and
//   the fallback GEMM epilogue against GEMM + add_bias + gelu_forward on the
//   device, multiply, avgpool forward and backward (overlapping windows
//   included) and plane_mean backward. These do the CPU's IEEE operations in
//   its order (the CUDA code writes them as round-to-nearest intrinsics, so no
//   FMA contraction).
// - GEMM: |gpu - cpu| <= r * (|alpha| sum_p |a_ip b_pj| + |beta c_ij|) +
//   ulp(c, cpu), r = 1e-5 for fp32 operands: both are fp32 sums of k
//   products in some order (Higham: k u of that sum at worst, sqrt(k) u
//   typically), and TF32 (10-bit mantissa, ~5e-4) fails it. r = 4e-5 for
//   bf16/fp16 operands, compared with the CPU's sgemm on the same (exactly
//   widened) values: tensor cores may truncate instead of rounding while they
//   accumulate in fp32 (Fasi et al. 2021), a few times the fp32 error.
// - GEMM epilogues: the bias enters the magnitude above; where cuBLASLt takes
//   it in a bf16/fp16 c's dtype its epilogue may run in that precision (the
//   bias rounded, the product rounded before the add, then the add and GELU):
//   4 u (|bias| + |v|) more (H200, cuBLAS 13.1: up to 1.44x the bound
//   without it), still far below a missing bias; GELU's output may
//   differ by 1.13 (max |gelu'|) times that, plus 2^-20 |v| for fedmesh's own
//   epilogue kernel (tanhf: 2 ulp on CUDA and glibc) or 2^-11 |v| for
//   cuBLASLt's fused one (its tanh may be the hardware's approximate tanh,
//   relative error ~2^-11). That looser bound still catches a missing bias,
//   a missing GELU, ReLU for GELU, or a transposed operand.
// - gelu forward: 2^-20 |x| + ulp(y): only tanhf differs (4 ulp of t together,
//   times 0.5 |x|, plus rounding flips). gelu backward: |dy| 2^-19 (1 + |x| +
//   0.11 |x|^3) + ulp(dx): the same error of t through 0.5 x (1 - t^2) d_inner.
// - silu forward: 2^-20 |y| + ulp(y): only expf differs (CUDA 2 ulp, glibc
//   0.502), so e = exp(-x) by 2.5 ulp; s = 1 / (1 + e) and y = x s each add
//   at most one ulp of rounding flip: 5.5 ulp of y in all. silu backward:
//   |dy| s 2^-18 (1 + |x|) + ulp(dx): s within 2^-20 s, which 1 - s (exact)
//   turns into an absolute error that x (1 - s) multiplies by |x|, plus the
//   flips of the remaining four operations.// - Column and channel sums (bias_grad, channel_bias_grad, dgamma, dbeta,
//   conv's dbias), and embedding backward (atomicAdd): 2 (N + 1) u sum |terms|,
//   N terms (including the value accumulated into) summed in another order.
// - squared_l2_norm: 1e-12 relative (fp64 sums in another order); two runs
//   give the same bits (fixed order).
// - fp64 sums of N terms in another order differ by at most
//   2 (N + 1) 2^-53 sum |terms| (fp64_sum_bound), far below an fp32 step
//   except where the sum cancels; an fp32 value rounded from such a sum may
//   then land one step (2^-23 relative) away.
// - plane_mean forward: 2^-22 |y| + fp64_sum_bound / area + ulp(y).
// - group norm (fp64 sums as layer norm's, in another order): mean 2^-22
//   |mean| + fp64_sum_bound / size, rstd 2^-22 |rstd|, y as layer norm's y.
//   Backward from the CPU's statistics: dx within rstd (2^-20 (|d| + |mean d|
//   + |xhat mean(d xhat)|) + fp64_sum_bound of those means) + ulp(dx), d = dy
//   gamma: only the fp64 means differ, then one flip each for the rounding to
//   fp32 and the product with rstd. dgamma and dbeta are fp64 sums rounded
//   once and added once to fp32: 2^-22 (|initial| + sum |terms|). Without dx
//   they are the same bits as with it.
// - layer norm: mean 2^-22 |mean| + 1e-12 mean|x| and rstd 2^-22 |rstd| (the
//   fp64 sums differ in their last bits, which can move the fp32 rounding by
//   one step); y within 2^-20 (|xhat g| + |g| rstd |mean| + |beta|) + ulp(y);
//   dx within 2^-20 rstd (|dxhat| + |mean dxhat| + |xhat mean(dxhat xhat)|) +
//   ulp(dx), the same one-step shifts of the fp32 means.
// - cross-entropy: the device takes exp in fp32 (expf, 2 ulp) where the CPU
//   uses fp64. A thread sums ceil(classes / 256) terms in fp32, so the
//   row's denominator is within (classes / 256 + 6) 2^-23 relative, and so is
//   each row's loss absolutely: loss_sum within rows times that + 1e-12 |loss|.
//   p = exp(v - shift) in fp32, shift = max + log(denominator) rounded to
//   fp32: relative error ulp(shift) + ulp(v - shift) + the denominator's + 2
//   ulp, under 2^-16 for these logits; dlogits within 2^-16 p |scale /
//   normalizer| + ulp(dlogits). correct is exact (ties pick the first maximum
//   on both).
// - conv2d: GEMM's bound, with conv2d itself on |x| and |w| (and backward on
//   |col| and |dy|) giving the magnitudes.
// - fused attention: 4 u(d) times the sum of each output's absolute terms
//   (two roundings to d, and fp32 differences far below u), the log-sum-exps
//   within their fp32 differences; the derivation is above the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "base/random.h"
#include "base/status.h"
#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/convert.h"
#include "kernels/cuda_ops.h"
#include "kernels/device_info.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optimizer.h"
#include "kernels/tensor.h"
#include "tests/support/attention_testing.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using testing::attention_pass;
using testing::AttentionPass;
using testing::from_values;
using testing::random_tensor;
using testing::relative_l2;
using testing::widen;

constexpr std::array<int64_t, 4> kSizes = {1, 7, 255, 4097};
constexpr std::array<DType, 3> kDTypes = {DType::kF32, DType::kBF16, DType::kF16};

constexpr double kGemmRelativeF32 = 1e-5;
constexpr double kGemmRelativeHalf = 4e-5;
constexpr double kGeluDerivativeMax = 1.13;
constexpr double kOwnGeluRelative = 0x1p-20;
constexpr double kCublasLtGeluRelative = 0x1p-11;
constexpr double kNormRelative = 1e-12;
constexpr double kSiluRelative = 0x1p-20;
constexpr double kSiluGradRelative = 0x1p-18;
constexpr double kStatisticRelative = 0x1p-22;  // an fp32 rounding of an fp64 statistic: one step at most

double gemm_relative(DType operands) { return operands == DType::kF32 ? kGemmRelativeF32 : kGemmRelativeHalf; }

// One step of dtype at v (see the header).
double one_step(DType dtype, double v) {
  return 2.0 * testing::unit_roundoff(dtype) * std::fabs(v) + 2.0 * testing::subnormal_floor(dtype);
}

// Rigorous bound for two orders of an fp32 sum of `terms` terms of absolute sum `magnitude`.
double sum_bound(double terms, double magnitude) { return 2.0 * (terms + 1.0) * 0x1p-24 * magnitude; }
// The same for an fp64 sum.
double fp64_sum_bound(double terms, double magnitude) { return 2.0 * (terms + 1.0) * 0x1p-53 * magnitude; }

cuda::Stream stream() { return cuda::default_stream(); }

std::string describe(DType dtype) { return dtype_name(dtype); }

// The shape of a (rows, columns) matrix: a batch of rows of n features, or of
// logits over n classes.
struct Matrix {
  int64_t rows, columns;
};

std::string describe(const Matrix& s) {
  return "rows " + std::to_string(s.rows) + " columns " + std::to_string(s.columns);
}

// ---- device buffers with guards ------------------------------------------------

// A device buffer of `bytes` between two guard regions of a byte pattern that
// no correct kernel writes; the middle starts 256-byte aligned, as a fresh
// block does.
class DeviceArray {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr unsigned char kPattern = 0xA5;

  explicit DeviceArray(size_t bytes) : bytes_(bytes), buffer_(bytes + 2 * kGuard, stream()) {
    const std::vector<unsigned char> pattern(bytes + 2 * kGuard, kPattern);
    cuda::copy_to_device(pattern.data(), buffer_.data(), pattern.size(), stream());
  }
  DeviceArray(const void* host, size_t bytes) : DeviceArray(bytes) {
    cuda::copy_to_device(host, data(), bytes, stream());
  }
  explicit DeviceArray(const Tensor& host) : DeviceArray(host.raw(), host.nbytes()) {}
  template <class T>
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.data(), host.size() * sizeof(T)) {}

  void* data() const { return static_cast<char*>(buffer_.data()) + kGuard; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data());
  }

  // The bytes between the guards (a failure is added when a guard changed).
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> all(bytes_ + 2 * kGuard);
    cuda::copy_to_host(buffer_.data(), all.data(), all.size(), stream());
    for (size_t i = 0; i < kGuard; ++i) {
      if (all[i] != kPattern || all[all.size() - 1 - i] != kPattern) {
        ADD_FAILURE() << "a kernel wrote into the guard bytes " << i << " from an edge of its output";
        break;
      }
    }
    return {all.begin() + kGuard, all.end() - kGuard};
  }
  template <class T>
  std::vector<T> values() const {
    const std::vector<unsigned char> bytes = download();
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }
  Tensor tensor(const Shape& shape, DType dtype) const {
    Tensor out = Tensor::empty(shape, dtype);
    EXPECT_EQ(out.nbytes(), bytes_);
    const std::vector<unsigned char> bytes = download();
    std::memcpy(out.raw(), bytes.data(), std::min(out.nbytes(), bytes.size()));
    return out;
  }

 private:
  size_t bytes_;
  cuda::DeviceBuffer buffer_;
};

// ---- comparisons ---------------------------------------------------------------

std::string value_text(const unsigned char* element, DType dtype) {
  float widened = 0.0f;
  widen_to_f32(element, dtype, &widened, 1);
  return std::to_string(widened);
}

// Equal bit patterns element by element (so NaN payloads and -0 count).
::testing::AssertionResult same_bits(const Tensor& expected, const Tensor& got) {
  if (expected.nbytes() != got.nbytes() || expected.dtype() != got.dtype()) {
    return ::testing::AssertionFailure() << "sizes or dtypes differ";
  }
  const size_t element = dtype_size(expected.dtype());
  const auto* e = static_cast<const unsigned char*>(expected.raw());
  const auto* g = static_cast<const unsigned char*>(got.raw());
  int64_t mismatches = 0, first = 0;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    if (std::memcmp(e + i * element, g + i * element, element) != 0 && mismatches++ == 0) first = i;
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " of " << expected.numel() << " differ; first at " << first
                                       << ": cpu " << value_text(e + first * element, expected.dtype()) << ", gpu "
                                       << value_text(g + first * element, expected.dtype());
}

template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& expected, const std::vector<T>& got) {
  if (expected.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::memcmp(&expected[i], &got[i], sizeof(T)) != 0 && mismatches++ == 0) first = i;
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " of " << expected.size() << " differ; first at " << first
                                       << ": cpu " << +expected[first] << ", gpu " << +got[first];
}

// `cpu` writes a fresh (shape, dtype) tensor, `gpu` a fresh device array of
// the same size: their bits must be equal. Both outputs are returned.
struct BothOutputs {
  Tensor cpu;
  DeviceArray gpu;
};

template <class Cpu, class Gpu>
BothOutputs expect_same_output(const Shape& shape, DType dtype, Cpu cpu, Gpu gpu, const std::string& what) {
  BothOutputs out{Tensor::empty(shape, dtype),
                  DeviceArray(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype))};
  cpu(out.cpu);
  gpu(out.gpu.data());
  EXPECT_TRUE(same_bits(out.cpu, out.gpu.tensor(shape, dtype))) << what;
  return out;
}

// |got - expected| <= tolerance[i] everywhere, and NaN exactly where expected is NaN.
template <class T>
::testing::AssertionResult within(const std::vector<T>& expected, const std::vector<T>& got,
                                  const std::vector<double>& tolerance) {
  if (expected.size() != got.size() || expected.size() != tolerance.size()) {
    return ::testing::AssertionFailure() << "sizes differ";
  }
  size_t bad = 0, first = 0;
  double worst = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double e = expected[i], g = got[i];
    bool ok = std::isnan(e) ? std::isnan(g) : std::fabs(g - e) <= tolerance[i];
    if (std::isinf(e)) ok = g == e;
    if (!std::isnan(e) && !std::isinf(e) && tolerance[i] > 0.0)
      worst = std::max(worst, std::fabs(g - e) / tolerance[i]);
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess() << "worst error / tolerance " << worst;
  return ::testing::AssertionFailure() << bad << " of " << expected.size() << " outside tolerance; first at " << first
                                       << ": cpu " << +expected[first] << ", gpu " << +got[first] << ", tolerance "
                                       << tolerance[first] << " (worst ratio " << worst << ")";
}

// ---- inputs --------------------------------------------------------------------

// Uniform in [lo, hi) and representable in dtype, as fp32 values.
std::vector<float> random_values(int64_t n, DType dtype, Rng& rng, double lo = -1.0, double hi = 1.0) {
  return widen(random_tensor({n}, dtype, rng, lo, hi));
}

// Values over many magnitudes with, every 13th, the edges of the formats
// (overflow of the low-precision ones, subnormals, zeros of both signs) and
// infinities.
std::vector<float> awkward_values(int64_t n, Rng& rng) {
  const std::array<float, 10> edges = {0.0f,     -0.0f,    INFINITY,  -INFINITY, FLT_MAX,
                                       65520.0f, 0x1p-24f, 0x1p-130f, -3.0e38f,  1.0f + 0x1p-8f};
  std::vector<float> x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = i % 13 == 5 ? edges[(i / 13) % edges.size()]
                       : static_cast<float>(rng.normal() * std::pow(10.0, 8.0 * rng.uniform() - 4.0));
  }
  return x;
}

Tensor awkward_tensor(int64_t n, DType dtype, Rng& rng) { return from_values(awkward_values(n, rng), {n}, dtype); }

// Finite in every dtype (|v| < 6e4) over many magnitudes: added to infinities
// it never makes a NaN, whose bits x86 and CUDA choose differently.
Tensor finite_tensor(int64_t n, DType dtype, Rng& rng) {
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x)
    v = static_cast<float>(std::clamp(rng.normal() * std::pow(10.0, 8.0 * rng.uniform() - 4.0), -6e4, 6e4));
  return from_values(x, {n}, dtype);
}

// Every test runs against the backend, or skips saying why there is none.
class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status status = cuda::available();
    if (!status.is_ok()) GTEST_SKIP() << "no CUDA backend: " << status.to_string();
  }
};

// ---- the backend ---------------------------------------------------------------

TEST(CudaOpsBackend, SaysWhyItIsUnavailable) {
  EXPECT_EQ(cuda::device_allocator().device(), Device::kCuda);
  { const cuda::DeviceBuffer empty; }  // destroying an empty buffer never needs a device
  const Status status = cuda::available();
  if (status.is_ok()) return;
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_FALSE(status.message().empty());
  if (!query_cuda().compiled) {
    EXPECT_NE(status.message().find("this build has no CUDA backend"), std::string::npos) << status.message();
  }
  GTEST_SKIP() << "no CUDA backend: " << status.to_string();
}

TEST_F(CudaOps, AllocatorReusesFreedBlocksWithoutCudaMalloc) {
  Allocator& allocator = cuda::device_allocator();
  EXPECT_EQ(allocator.device(), Device::kCuda);
  EXPECT_EQ(allocator.allocate(0), nullptr);
  allocator.deallocate(nullptr, 0);

  const size_t bytes = 3001;  // class 3072
  void* first = allocator.allocate(bytes);
  ASSERT_NE(first, nullptr);
  const cuda::AllocatorStats allocated = cuda::allocator_stats();
  EXPECT_GE(allocated.bytes_in_use, 3072u);
  EXPECT_GE(allocated.peak_bytes, allocated.bytes_in_use);
  allocator.deallocate(first, bytes);
  const cuda::AllocatorStats freed = cuda::allocator_stats();
  EXPECT_EQ(freed.bytes_in_use, allocated.bytes_in_use - 3072);
  EXPECT_EQ(freed.bytes_cached, allocated.bytes_cached + 3072);

  void* again = allocator.allocate(bytes);
  EXPECT_EQ(again, first) << "the freed block of this class is handed out again";
  allocator.deallocate(again, bytes);
  void* same_class = allocator.allocate(2561);  // also class 3072
  EXPECT_EQ(same_class, first);
  EXPECT_EQ(cuda::allocator_stats().device_mallocs, freed.device_mallocs) << "no cudaMalloc for a cached class";

  // Large blocks: 2 MiB classes.
  void* large = allocator.allocate((size_t{3} << 20) + 1);
  EXPECT_EQ(cuda::allocator_stats().bytes_in_use, freed.bytes_in_use + 3072 + (size_t{4} << 20));
  allocator.deallocate(large, (size_t{3} << 20) + 1);
  const uint64_t mallocs = cuda::allocator_stats().device_mallocs;
  void* large_again = allocator.allocate(size_t{4} << 20);
  EXPECT_EQ(large_again, large);
  EXPECT_EQ(cuda::allocator_stats().device_mallocs, mallocs);

  // The block is usable memory.
  std::vector<int32_t> pattern(2561 / sizeof(int32_t));
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<int32_t>(i * 7919);
  std::vector<int32_t> back(pattern.size());
  cuda::copy_to_device(pattern.data(), same_class, pattern.size() * sizeof(int32_t), stream());
  cuda::copy_to_host(same_class, back.data(), back.size() * sizeof(int32_t), stream());
  EXPECT_EQ(back, pattern);

  // A block freed on one stream is not handed to another stream.
  allocator.deallocate(same_class, 2561);
  const cuda::Stream other = cuda::create_stream();
  void* on_other = cuda::allocate(2561, other);
  EXPECT_NE(on_other, same_class);
  cuda::deallocate(on_other);
  void* back_on_other = cuda::allocate(3000, other);
  EXPECT_EQ(back_on_other, on_other) << "that stream's own pool serves it";
  cuda::deallocate(back_on_other);
  cuda::destroy_stream(other);

  allocator.deallocate(large_again, size_t{4} << 20);
  cuda::empty_cache();
  const cuda::AllocatorStats emptied = cuda::allocator_stats();
  EXPECT_EQ(emptied.bytes_cached, 0u);
  EXPECT_GE(emptied.peak_bytes, freed.bytes_in_use + 3072 + (size_t{4} << 20));
}

TEST_F(CudaOps, CopiesRoundTrip) {
  Rng rng(1);
  for (const int64_t n : kSizes) {
    const std::vector<float> x = random_values(n, DType::kF32, rng);
    const DeviceArray source(x);
    DeviceArray copy(x.size() * sizeof(float));
    cuda::copy_on_device(source.data(), copy.data(), x.size() * sizeof(float), stream());
    EXPECT_TRUE(same_bits(x, copy.values<float>()));
    cuda::set_zero(copy.data(), x.size() * sizeof(float), stream());
    EXPECT_TRUE(same_bits(std::vector<float>(x.size(), 0.0f), copy.values<float>()));
  }
}

// ---- GEMM ----------------------------------------------------------------------

struct GemmShape {
  int64_t m, n, k;
};
constexpr std::array<GemmShape, 4> kGemmShapes = {GemmShape{1, 1, 1}, GemmShape{7, 13, 5}, GemmShape{64, 512, 784},
                                                  GemmShape{129, 257, 65}};

// One GEMM problem as stored: row-major a, b, c with leading dimensions
// (padding columns hold values too, which the GEMM must ignore or keep).
struct GemmProblem {
  bool transpose_a, transpose_b;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  DType ab_type, c_type;
  std::vector<float> a, b, c;  // values representable in their dtypes
  std::vector<float> bias;     // (n), for epilogues

  int64_t a_rows() const { return transpose_a ? k : m; }
  int64_t b_rows() const { return transpose_b ? n : k; }
};

GemmProblem make_gemm(const GemmShape& s, bool transpose_a, bool transpose_b, int64_t pad, float alpha, float beta,
                      DType ab_type, DType c_type, Rng& rng) {
  GemmProblem p{transpose_a,
                transpose_b,
                s.m,
                s.n,
                s.k,
                (transpose_a ? s.m : s.k) + pad,
                (transpose_b ? s.k : s.n) + pad,
                s.n + pad,
                alpha,
                beta,
                ab_type,
                c_type,
                {},
                {},
                {},
                {}};
  p.a = random_values(p.a_rows() * p.lda, ab_type, rng);
  p.b = random_values(p.b_rows() * p.ldb, ab_type, rng);
  p.c = random_values(p.m * p.ldc, c_type, rng);
  p.bias = random_values(p.n, DType::kF32, rng);
  return p;
}

// The CPU's fp32 result alpha op(a) op(b) + beta c (+ bias), before any
// rounding to c's dtype, and the magnitude sum |alpha a b| + |beta c| (+ |bias|).
struct GemmReference {
  std::vector<float> value, magnitude;
};

GemmReference cpu_gemm(const GemmProblem& p, bool with_bias) {
  GemmReference r{p.c, p.c};
  sgemm(p.transpose_a, p.transpose_b, p.m, p.n, p.k, p.alpha, p.a.data(), p.lda, p.b.data(), p.ldb, p.beta,
        r.value.data(), p.ldc);
  std::vector<float> abs_a(p.a.size()), abs_b(p.b.size());
  std::transform(p.a.begin(), p.a.end(), abs_a.begin(), [](float v) { return std::fabs(v); });
  std::transform(p.b.begin(), p.b.end(), abs_b.begin(), [](float v) { return std::fabs(v); });
  for (float& v : r.magnitude) v = std::fabs(v);
  sgemm(p.transpose_a, p.transpose_b, p.m, p.n, p.k, std::fabs(p.alpha), abs_a.data(), p.lda, abs_b.data(), p.ldb,
        std::fabs(p.beta), r.magnitude.data(), p.ldc);
  if (with_bias) {
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        r.value[static_cast<size_t>(i * p.ldc + j)] += p.bias[static_cast<size_t>(j)];
        r.magnitude[static_cast<size_t>(i * p.ldc + j)] += std::fabs(p.bias[static_cast<size_t>(j)]);
      }
    }
  }
  return r;
}

// The dtypes c may have with operands of ab_type: theirs, and fp32.
std::vector<DType> c_types(DType ab_type) {
  if (ab_type == DType::kF32) return {DType::kF32};
  return {ab_type, DType::kF32};
}

// Rounds fp32 values to dtype and back.
std::vector<float> rounded(const std::vector<float>& values, DType dtype) {
  return widen(from_values(values, {static_cast<int64_t>(values.size())}, dtype));
}

// Device copies of a problem's operands, c in c's dtype.
struct GemmOnDevice {
  explicit GemmOnDevice(const GemmProblem& p)
      : a(from_values(p.a, {static_cast<int64_t>(p.a.size())}, p.ab_type)),
        b(from_values(p.b, {static_cast<int64_t>(p.b.size())}, p.ab_type)),
        c(from_values(p.c, {static_cast<int64_t>(p.c.size())}, p.c_type)),
        bias(p.bias) {}
  std::vector<float> run(const GemmProblem& p, const cuda::GemmEpilogue& epilogue = {}) const {
    cuda::gemm(stream(), p.transpose_a, p.transpose_b, p.m, p.n, p.k, p.alpha, a.data(), p.ab_type, p.lda, b.data(),
               p.ab_type, p.ldb, p.beta, c.data(), p.c_type, p.ldc, epilogue);
    return widen(c.tensor({static_cast<int64_t>(p.c.size())}, p.c_type));
  }
  DeviceArray a, b, c, bias;
};

std::string describe(const GemmProblem& p) {
  return "m " + std::to_string(p.m) + " n " + std::to_string(p.n) + " k " + std::to_string(p.k) +
         (p.transpose_a ? " a^T" : " a") + (p.transpose_b ? " b^T" : " b") + " lda " + std::to_string(p.lda) + " ldb " +
         std::to_string(p.ldb) + " ldc " + std::to_string(p.ldc) + " alpha " + std::to_string(p.alpha) + " beta " +
         std::to_string(p.beta) + " " + dtype_name(p.ab_type) + " -> " + dtype_name(p.c_type);
}

// Tolerances over the whole (m, ldc) c: `inside(i, j)` inside the product,
// 0 in the padding columns (which must keep their bits).
template <class F>
std::vector<double> gemm_tolerance(const GemmProblem& p, F inside) {
  std::vector<double> tolerance(p.c.size(), 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j)
      tolerance[static_cast<size_t>(i * p.ldc + j)] = inside(static_cast<size_t>(i * p.ldc + j));
  }
  return tolerance;
}

// Every transpose, both scalings (alpha 1 beta 0 dense; alpha -0.75 beta 0.5
// with 3 padding columns) and every c dtype of each operand dtype given, held
// to the CPU's fp32 GEMM within the bound above.
void expect_gemms_match_the_cpu(const GemmShape& shape, std::initializer_list<DType> ab_types, Rng& rng) {
  struct Scaling {
    float alpha, beta;
    int64_t pad;
  };
  for (const Scaling scaling : {Scaling{1.0f, 0.0f, 0}, Scaling{-0.75f, 0.5f, 3}}) {
    for (const DType ab_type : ab_types) {
      for (const DType c_type : c_types(ab_type)) {
        for (const bool transpose_a : {false, true}) {
          for (const bool transpose_b : {false, true}) {
            const GemmProblem p = make_gemm(shape, transpose_a, transpose_b, scaling.pad, scaling.alpha, scaling.beta,
                                            ab_type, c_type, rng);
            SCOPED_TRACE(describe(p));
            const GemmReference reference = cpu_gemm(p, /*with_bias=*/false);
            const std::vector<float> expected = rounded(reference.value, c_type);
            const std::vector<float> got = GemmOnDevice(p).run(p);
            const double relative = gemm_relative(ab_type);
            EXPECT_TRUE(within(expected, got, gemm_tolerance(p, [&](size_t at) {
                                 return relative * reference.magnitude[at] + one_step(c_type, expected[at]);
                               })));
          }
        }
      }
    }
  }
}

TEST_F(CudaOps, GemmMatchesTheCpuInEveryTransposeAndDtype) {
  Rng rng(2);
  for (const GemmShape& s : kGemmShapes) expect_gemms_match_the_cpu(s, {DType::kF32, DType::kBF16, DType::kF16}, rng);
}

// Products of at least 2^27 multiply-adds whose stored rows are not 16-byte
// aligned (odd sizes and leading dimensions, as a 50 257-word vocabulary
// gives) run as the padded problem: the same result, and c's padding
// columns keep their bits.
TEST_F(CudaOps, LargeGemmWithUnalignedRowsMatchesTheCpu) {
  Rng rng(21);
  expect_gemms_match_the_cpu(GemmShape{520, 521, 515}, {DType::kBF16, DType::kF32}, rng);  // 139.5M multiply-adds
}

TEST_F(CudaOps, GemmWithoutKScalesC) {
  Rng rng(3);
  for (const DType dtype : kDTypes) {
    for (const float beta : {0.0f, 0.5f}) {
      GemmProblem p = make_gemm(GemmShape{5, 9, 0}, false, false, 2, 1.0f, beta, dtype, dtype, rng);
      p.c[3] = NAN;  // beta 0 overwrites even NaN, as sgemm does
      SCOPED_TRACE(describe(p));
      const std::vector<float> expected = rounded(cpu_gemm(p, false).value, dtype);
      EXPECT_TRUE(within(expected, GemmOnDevice(p).run(p), gemm_tolerance(p, [](size_t) { return 0.0; })));
    }
  }
}

// The epilogues against the CPU's fp32 GEMM + bias + GELU rounded once, for
// cuBLASLt's fused epilogue and for fedmesh's own kernel; and, for an fp32 c,
// against GEMM + add_bias + gelu_forward on the device (bit-identical for
// fedmesh's kernel).
TEST_F(CudaOps, GemmEpiloguesEqualGemmThenBiasThenGelu) {
  Rng rng(4);
  struct Variant {
    cuda::GemmEpilogueKind kind;
    bool bias, aux;
  };
  const std::array<Variant, 4> variants = {
      Variant{cuda::GemmEpilogueKind::kBias, true, false}, Variant{cuda::GemmEpilogueKind::kGeluBias, true, true},
      Variant{cuda::GemmEpilogueKind::kGeluBias, true, false}, Variant{cuda::GemmEpilogueKind::kGeluBias, false, true}};
  for (const GemmShape& s : {GemmShape{7, 13, 5}, GemmShape{33, 64, 40}, GemmShape{129, 257, 65}}) {
    for (const int64_t pad : {int64_t{0}, int64_t{3}}) {
      for (const DType ab_type : kDTypes) {
        for (const DType c_type : c_types(ab_type)) {
          for (const Variant& variant : variants) {
            for (const bool fused : {true, false}) {
              const GemmProblem p = make_gemm(s, false, true, pad, 1.25f, 0.5f, ab_type, c_type, rng);
              const bool gelu = variant.kind == cuda::GemmEpilogueKind::kGeluBias;
              SCOPED_TRACE(describe(p) + (gelu ? " gelu" : "") + (variant.bias ? " bias" : "") +
                           (variant.aux ? " aux" : "") + (fused ? " cublaslt-epilogue" : " own-epilogue"));
              const GemmReference reference = cpu_gemm(p, variant.bias);
              // GELU on the fp32 pre-activation v, row by row (not on the padding).
              std::vector<float> activated = reference.value;
              for (int64_t i = 0; gelu && i < p.m; ++i) {
                Tensor row = Tensor::view_of(activated.data() + i * p.ldc, {p.n}, DType::kF32);
                gelu_forward(row, row);
              }
              const std::vector<float> expected = rounded(activated, c_type);
              const double relative = gemm_relative(ab_type);
              const double gelu_relative = fused ? kCublasLtGeluRelative : kOwnGeluRelative;

              GemmOnDevice device(p);
              DeviceArray aux(static_cast<size_t>(p.m * p.n) * dtype_size(c_type));
              const cuda::GemmEpilogue epilogue{variant.kind, variant.bias ? device.bias.as<const float>() : nullptr,
                                                variant.aux ? aux.data() : nullptr, fused};
              const std::vector<float> got = device.run(p, epilogue);
              // cuBLASLt's epilogue may take the bias in a bf16 or fp16 c's dtype and run in
              // that precision: four roundings of c's dtype on |bias| + |v| are allowed.
              const auto bias_rounding = [&](size_t at) {
                if (!fused || !variant.bias || c_type == DType::kF32) return 0.0;
                const double bias = std::fabs(p.bias[at % static_cast<size_t>(p.ldc)]);
                return 4.0 * testing::unit_roundoff(c_type) * (bias + std::fabs(reference.value[at]));
              };
              EXPECT_TRUE(within(expected, got, gemm_tolerance(p, [&](size_t at) {
                                   const double pre = relative * reference.magnitude[at] + bias_rounding(at);
                                   if (!gelu) return pre + one_step(c_type, expected[at]);
                                   return kGeluDerivativeMax * pre + gelu_relative * std::fabs(reference.value[at]) +
                                          one_step(c_type, expected[at]);
                                 })));
              std::vector<float> expected_aux, got_aux;
              std::vector<double> aux_tolerance;
              if (variant.aux) {
                const std::vector<float> pre = rounded(reference.value, c_type);
                const std::vector<float> all_aux = widen(aux.tensor({p.m * p.n}, c_type));
                for (int64_t i = 0; i < p.m; ++i) {
                  for (int64_t j = 0; j < p.n; ++j) {
                    const size_t at = static_cast<size_t>(i * p.ldc + j);
                    expected_aux.push_back(pre[at]);
                    got_aux.push_back(all_aux[static_cast<size_t>(i * p.n + j)]);
                    aux_tolerance.push_back(relative * reference.magnitude[at] + bias_rounding(at) +
                                            one_step(c_type, pre[at]));
                  }
                }
                EXPECT_TRUE(within(expected_aux, got_aux, aux_tolerance)) << "gelu_input_out";
              }

              if (c_type != DType::kF32) continue;
              // The same on the device in separate ops.
              GemmOnDevice separate(p);
              separate.run(p);
              const int64_t rows = p.m;
              // add_bias and gelu_forward take dense rows: run them row by row over ldc.
              for (int64_t i = 0; i < rows; ++i) {
                float* row = separate.c.as<float>() + i * p.ldc;
                if (variant.bias) cuda::add_bias(stream(), row, DType::kF32, 1, p.n, separate.bias.as<const float>());
              }
              const std::vector<float> separate_pre = separate.c.values<float>();
              for (int64_t i = 0; i < rows; ++i) {
                float* row = separate.c.as<float>() + i * p.ldc;
                if (gelu) cuda::gelu_forward(stream(), row, DType::kF32, row, DType::kF32, p.n);
              }
              const std::vector<float> separate_out = separate.c.values<float>();
              if (!fused) {
                EXPECT_TRUE(same_bits(separate_out, got)) << "own epilogue vs separate ops";
                if (variant.aux) {
                  std::vector<float> dense_pre;
                  for (int64_t i = 0; i < p.m; ++i) {
                    for (int64_t j = 0; j < p.n; ++j)
                      dense_pre.push_back(separate_pre[static_cast<size_t>(i * p.ldc + j)]);
                  }
                  EXPECT_TRUE(same_bits(dense_pre, got_aux)) << "own epilogue's gelu_input_out vs separate ops";
                }
              } else {
                EXPECT_TRUE(within(separate_out, got,
                                   gemm_tolerance(p,
                                                  [&](size_t at) {
                                                    return 2.0 * relative * reference.magnitude[at] +
                                                           (gelu ? gelu_relative * std::fabs(reference.value[at])
                                                                 : 0.0);
                                                  })))
                    << "fused epilogue vs separate ops";
              }
            }
          }
        }
      }
    }
  }
}

// ---- elementwise -----------------------------------------------------------------

TEST_F(CudaOps, FillScaleAxpyAndCastAreBitIdentical) {
  Rng rng(5);
  for (const int64_t n : kSizes) {
    for (const DType type : kDTypes) {
      SCOPED_TRACE("n " + std::to_string(n) + " " + describe(type));
      for (const float value : {0.1f, -3.0e-39f, 70000.0f}) {
        expect_same_output(
            {n}, type, [&](Tensor& out) { fill(out, value); },
            [&](void* out) { cuda::fill(stream(), out, type, n, value); }, "fill " + std::to_string(value));
      }
      Tensor x = awkward_tensor(n, type, rng);
      DeviceArray device_x(x);
      scale(x, -0.3f);
      cuda::scale(stream(), device_x.data(), type, n, -0.3f);
      EXPECT_TRUE(same_bits(x, device_x.tensor({n}, type))) << "scale";
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("y " + describe(y_type));
        Tensor y = awkward_tensor(n, y_type, rng);
        const Tensor source = finite_tensor(n, type, rng);
        DeviceArray device_y(y), device_source(source);
        axpy(1.7f, source, y);
        cuda::axpy(stream(), 1.7f, device_source.data(), type, device_y.data(), y_type, n);
        EXPECT_TRUE(same_bits(y, device_y.tensor({n}, y_type))) << "axpy";
      }
    }
  }
}

// The edges of every format and random bit patterns (NaNs with payloads,
// subnormals, every exponent), in each source dtype.
TEST_F(CudaOps, CastIsBitIdenticalIncludingNaNs) {
  Rng rng(6);
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{255}, int64_t{4097}, int64_t{70000}}) {
    std::vector<float> x = awkward_values(n, rng);
    for (size_t i = 0; i < x.size(); i += 3) x[i] = std::bit_cast<float>(static_cast<uint32_t>(rng.next_u64()));
    for (const DType src_type : kDTypes) {
      // A source of each dtype: fp32 bits as they are, half bits at random.
      Tensor src = from_values(x, {n}, src_type);
      if (src_type != DType::kF32) {
        auto* bits = static_cast<uint16_t*>(src.raw());
        for (int64_t i = 0; i < n; i += 2) bits[i] = static_cast<uint16_t>(rng.next_u64());
      }
      const DeviceArray device_src(src);
      for (const DType dst_type : kDTypes) {
        expect_same_output(
            {n}, dst_type, [&](Tensor& out) { convert(src, out); },
            [&](void* out) { cuda::cast(stream(), device_src.data(), src_type, out, dst_type, n); },
            "n " + std::to_string(n) + " " + describe(src_type) + " -> " + describe(dst_type));
      }
    }
  }
}

TEST_F(CudaOps, BiasAndReluAreBitIdentical) {
  Rng rng(7);
  for (const Matrix s : {Matrix{1, 1}, Matrix{7, 13}, Matrix{255, 7}, Matrix{3, 4097}}) {
    for (const DType type : kDTypes) {
      SCOPED_TRACE(describe(s) + " " + describe(type));
      Tensor y = random_tensor({s.rows, s.columns}, type, rng, -4.0, 4.0);
      const Tensor bias = random_tensor({s.columns}, DType::kF32, rng);
      DeviceArray device_y(y);
      const DeviceArray device_bias(bias);
      add_bias(y, bias);
      cuda::add_bias(stream(), device_y.data(), type, s.rows, s.columns, device_bias.as<const float>());
      EXPECT_TRUE(same_bits(y, device_y.tensor({s.rows, s.columns}, type))) << "add_bias";
    }
  }
  for (const int64_t n : kSizes) {
    for (const DType x_type : kDTypes) {
      const Tensor x = random_tensor({n}, x_type, rng, -2.0, 2.0);
      const DeviceArray device_x(x);
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("n " + std::to_string(n) + " " + describe(x_type) + " -> " + describe(y_type));
        const BothOutputs y = expect_same_output(
            {n}, y_type, [&](Tensor& out) { relu_forward(x, out); },
            [&](void* out) { cuda::relu_forward(stream(), device_x.data(), x_type, out, y_type, n); }, "relu_forward");
        // backward with dy in x's dtype, dx in y's, and in place (dx = dy).
        Tensor dy = random_tensor({n}, x_type, rng);
        DeviceArray device_dy(dy);
        expect_same_output(
            {n}, y_type, [&](Tensor& out) { relu_backward(y.cpu, dy, out); },
            [&](void* out) {
              cuda::relu_backward(stream(), y.gpu.data(), y_type, device_dy.data(), x_type, out, y_type, n);
            },
            "relu_backward");
        relu_backward(y.cpu, dy, dy);
        cuda::relu_backward(stream(), y.gpu.data(), y_type, device_dy.data(), x_type, device_dy.data(), x_type, n);
        EXPECT_TRUE(same_bits(dy, device_dy.tensor({n}, x_type))) << "relu_backward in place";
      }
    }
  }
}

TEST_F(CudaOps, GeluMatchesWithinTanhDifferences) {
  Rng rng(8);
  for (const int64_t n : kSizes) {
    for (const DType x_type : kDTypes) {
      std::vector<float> values = random_values(n, x_type, rng, -6.0, 6.0);
      if (n > 3) {  // tanh saturated
        values[1] = 20.0f;
        values[2] = -20.0f;
      }
      const Tensor x = from_values(values, {n}, x_type);
      const std::vector<float> xs = widen(x);
      const DeviceArray device_x(x);
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("n " + std::to_string(n) + " " + describe(x_type) + " -> " + describe(y_type));
        Tensor y = Tensor::empty({n}, y_type);
        gelu_forward(x, y);
        DeviceArray device_y(y.nbytes());
        cuda::gelu_forward(stream(), device_x.data(), x_type, device_y.data(), y_type, n);
        const std::vector<float> expected = widen(y);
        std::vector<double> tolerance(expected.size());
        for (size_t i = 0; i < tolerance.size(); ++i) {
          tolerance[i] = kOwnGeluRelative * std::fabs(xs[i]) + one_step(y_type, expected[i]);
        }
        EXPECT_TRUE(within(expected, widen(device_y.tensor({n}, y_type)), tolerance)) << "gelu_forward";

        const Tensor dy = random_tensor({n}, y_type, rng);
        const std::vector<float> dys = widen(dy);
        const DeviceArray device_dy(dy);
        Tensor dx = Tensor::empty({n}, x_type);
        gelu_backward(x, dy, dx);
        DeviceArray device_dx(dx.nbytes());
        cuda::gelu_backward(stream(), device_x.data(), x_type, device_dy.data(), y_type, device_dx.data(), x_type, n);
        const std::vector<float> expected_dx = widen(dx);
        for (size_t i = 0; i < tolerance.size(); ++i) {
          const double v = std::fabs(xs[i]);
          tolerance[i] = std::fabs(dys[i]) * 0x1p-19 * (1.0 + v + 0.11 * v * v * v) + one_step(x_type, expected_dx[i]);
        }
        EXPECT_TRUE(within(expected_dx, widen(device_dx.tensor({n}, x_type)), tolerance)) << "gelu_backward";
      }
    }
  }
}

TEST_F(CudaOps, SiluMatchesWithinExpDifferences) {
  Rng rng(40);
  for (const int64_t n : kSizes) {
    for (const DType x_type : kDTypes) {
      std::vector<float> values = random_values(n, x_type, rng, -6.0, 6.0);
      if (n > 4) {  // s saturated at 1 and near 0, and exp(-x) overflowing to Inf (s = 0, y = -0)
        values[1] = 20.0f;
        values[2] = -20.0f;
        values[3] = -90.0f;
      }
      const Tensor x = from_values(values, {n}, x_type);
      const std::vector<float> xs = widen(x);
      const DeviceArray device_x(x);
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("n " + std::to_string(n) + " " + describe(x_type) + " -> " + describe(y_type));
        Tensor y = Tensor::empty({n}, y_type);
        silu_forward(x, y);
        DeviceArray device_y(y.nbytes());
        cuda::silu_forward(stream(), device_x.data(), x_type, device_y.data(), y_type, n);
        const std::vector<float> expected = widen(y);
        std::vector<double> tolerance(expected.size());
        for (size_t i = 0; i < tolerance.size(); ++i) {
          tolerance[i] = kSiluRelative * std::fabs(expected[i]) + one_step(y_type, expected[i]);
        }
        EXPECT_TRUE(within(expected, widen(device_y.tensor({n}, y_type)), tolerance)) << "silu_forward";

        const Tensor dy = random_tensor({n}, y_type, rng);
        const std::vector<float> dys = widen(dy);
        const DeviceArray device_dy(dy);
        Tensor dx = Tensor::empty({n}, x_type);
        silu_backward(x, dy, dx);
        DeviceArray device_dx(dx.nbytes());
        cuda::silu_backward(stream(), device_x.data(), x_type, device_dy.data(), y_type, device_dx.data(), x_type, n);
        const std::vector<float> expected_dx = widen(dx);
        for (size_t i = 0; i < tolerance.size(); ++i) {
          const double sigmoid = 1.0 / (1.0 + std::exp(-static_cast<double>(xs[i])));
          tolerance[i] = kSiluGradRelative * std::fabs(dys[i]) * sigmoid * (1.0 + std::fabs(xs[i])) +
                         one_step(x_type, expected_dx[i]);
        }
        EXPECT_TRUE(within(expected_dx, widen(device_dx.tensor({n}, x_type)), tolerance)) << "silu_backward";

        // In place (dx = dy, one dtype): the bits of a separate output.
        DeviceArray separate(dy.nbytes()), in_place(dy);
        cuda::silu_backward(stream(), device_x.data(), x_type, device_dy.data(), y_type, separate.data(), y_type, n);
        cuda::silu_backward(stream(), device_x.data(), x_type, in_place.data(), y_type, in_place.data(), y_type, n);
        EXPECT_TRUE(same_bits(separate.tensor({n}, y_type), in_place.tensor({n}, y_type))) << "silu_backward in place";
      }
    }
  }
}

TEST_F(CudaOps, MultiplyIsBitIdentical) {
  Rng rng(41);
  for (const int64_t n : kSizes) {
    // b as a dropout mask (0 or 1 / keep), with every third value any number.
    std::vector<float> mask(static_cast<size_t>(n));
    for (size_t i = 0; i < mask.size(); ++i) {
      mask[i] = i % 3 == 2 ? static_cast<float>(4.0 * rng.normal()) : (rng.uniform() < 0.25 ? 0.0f : 1.0f / 0.75f);
    }
    const Tensor b = from_values(mask, {n}, DType::kF32);
    const DeviceArray device_b(b);
    for (const DType a_type : kDTypes) {
      // Finite: Inf * 0 would be a NaN, whose bits x86 and CUDA choose differently.
      const Tensor a = finite_tensor(n, a_type, rng);
      const DeviceArray device_a(a);
      for (const DType out_type : kDTypes) {
        SCOPED_TRACE("n " + std::to_string(n) + " " + describe(a_type) + " -> " + describe(out_type));
        expect_same_output(
            {n}, out_type, [&](Tensor& out) { mul(a, b, out); },
            [&](void* out) {
              cuda::multiply(stream(), device_a.data(), a_type, device_b.as<const float>(), out, out_type, n);
            },
            "multiply");
      }
      Tensor product = a.clone();
      DeviceArray device_product(a);
      mul(product, b, product);
      cuda::multiply(stream(), device_product.data(), a_type, device_b.as<const float>(), device_product.data(), a_type,
                     n);
      EXPECT_TRUE(same_bits(product, device_product.tensor({n}, a_type))) << "multiply in place, " << describe(a_type);
    }
  }
}

// ---- reductions ----------------------------------------------------------------

TEST_F(CudaOps, BiasGradientsMatchWithinSummationOrder) {
  Rng rng(9);
  for (const Matrix s : {Matrix{1, 1}, Matrix{7, 13}, Matrix{4097, 7}, Matrix{3, 4097}, Matrix{255, 255}}) {
    for (const DType type : kDTypes) {
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(describe(s) + " " + describe(type) + (accumulate ? " accumulate" : ""));
        const Tensor dy = random_tensor({s.rows, s.columns}, type, rng);
        Tensor db = random_tensor({s.columns}, DType::kF32, rng);
        const std::vector<float> db0 = widen(db), dys = widen(dy);
        DeviceArray device_db(db);
        const DeviceArray device_dy(dy);
        bias_grad(dy, db, accumulate);
        cuda::bias_grad(stream(), device_dy.data(), type, s.rows, s.columns, device_db.as<float>(), accumulate);
        std::vector<double> tolerance(static_cast<size_t>(s.columns));
        for (int64_t j = 0; j < s.columns; ++j) {
          double magnitude = accumulate ? std::fabs(db0[static_cast<size_t>(j)]) : 0.0;
          for (int64_t r = 0; r < s.rows; ++r) magnitude += std::fabs(dys[static_cast<size_t>(r * s.columns + j)]);
          tolerance[static_cast<size_t>(j)] = sum_bound(static_cast<double>(s.rows), magnitude);
        }
        EXPECT_TRUE(within(widen(db), device_db.values<float>(), tolerance)) << "bias_grad";
      }
    }
  }
  struct Planes {
    int64_t batch, channels, positions;
  };
  for (const Planes s : {Planes{1, 1, 1}, Planes{2, 7, 13}, Planes{3, 5, 255}, Planes{2, 3, 4097}}) {
    for (const DType type : kDTypes) {
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE("batch " + std::to_string(s.batch) + " channels " + std::to_string(s.channels) + " positions " +
                     std::to_string(s.positions) + " " + describe(type) + (accumulate ? " accumulate" : ""));
        const Tensor dy = random_tensor({s.batch, s.channels, s.positions}, type, rng);
        Tensor db = random_tensor({s.channels}, DType::kF32, rng);
        const std::vector<float> db0 = widen(db), dys = widen(dy);
        DeviceArray device_db(db);
        const DeviceArray device_dy(dy);
        channel_bias_grad(dy, db, accumulate);
        cuda::channel_bias_grad(stream(), device_dy.data(), type, s.batch, s.channels, s.positions,
                                device_db.as<float>(), accumulate);
        std::vector<double> tolerance(static_cast<size_t>(s.channels));
        for (int64_t c = 0; c < s.channels; ++c) {
          double magnitude = accumulate ? std::fabs(db0[static_cast<size_t>(c)]) : 0.0;
          for (int64_t b = 0; b < s.batch; ++b) {
            for (int64_t i = 0; i < s.positions; ++i) {
              magnitude += std::fabs(dys[static_cast<size_t>((b * s.channels + c) * s.positions + i)]);
            }
          }
          tolerance[static_cast<size_t>(c)] = sum_bound(static_cast<double>(s.batch * s.positions), magnitude);
        }
        EXPECT_TRUE(within(widen(db), device_db.values<float>(), tolerance)) << "channel_bias_grad";
      }
    }
  }
}

TEST_F(CudaOps, SquaredNormAccumulatesInAFixedOrder) {
  Rng rng(10);
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{255}, int64_t{4097}, int64_t{1'000'003}}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const Tensor x = random_tensor({n}, DType::kF32, rng, -3.0, 3.0);
    const Tensor y = random_tensor({n / 2 + 1}, DType::kF32, rng);
    const double expected = squared_l2_norm(x) + squared_l2_norm(y);
    const DeviceArray device_x(x), device_y(y);
    DeviceArray out(sizeof(double));
    std::vector<double> runs;
    for (int run = 0; run < 2; ++run) {
      cuda::set_zero(out.data(), sizeof(double), stream());
      cuda::squared_l2_norm(stream(), device_x.as<const float>(), n, out.as<double>());
      cuda::squared_l2_norm(stream(), device_y.as<const float>(), n / 2 + 1, out.as<double>());
      runs.push_back(out.values<double>()[0]);
    }
    EXPECT_NEAR(runs[0], expected, kNormRelative * expected);
    EXPECT_TRUE(same_bits(std::vector<double>{runs[0]}, std::vector<double>{runs[1]})) << "deterministic";
  }
}

// ---- layer norm ------------------------------------------------------------------

TEST_F(CudaOps, LayerNormMatchesWithinOneStepOfItsStatistics) {
  Rng rng(11);
  for (const Matrix s : {Matrix{1, 1}, Matrix{7, 7}, Matrix{5, 255}, Matrix{3, 4097}, Matrix{129, 64}, Matrix{1500, 40},
                         Matrix{33, 768}, Matrix{9, 1024}, Matrix{4, 1032}}) {
    for (const DType x_type : kDTypes) {
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE(describe(s) + " " + describe(x_type) + " -> " + describe(y_type));
        const Tensor x = random_tensor({s.rows, s.columns}, x_type, rng, -0.5, 1.5);
        const Tensor gamma = random_tensor({s.columns}, DType::kF32, rng, 0.5, 1.5);
        const Tensor beta = random_tensor({s.columns}, DType::kF32, rng);
        Tensor y = Tensor::empty({s.rows, s.columns}, y_type), mean = Tensor::empty({s.rows}),
               rstd = Tensor::empty({s.rows});
        layernorm_forward(x, gamma, beta, y, mean, rstd);
        const DeviceArray device_x(x), device_gamma(gamma), device_beta(beta);
        DeviceArray device_y(y.nbytes()), device_mean(mean.nbytes()), device_rstd(rstd.nbytes());
        cuda::layernorm_forward(stream(), device_x.data(), x_type, device_gamma.as<const float>(),
                                device_beta.as<const float>(), device_y.data(), y_type, device_mean.as<float>(),
                                device_rstd.as<float>(), s.rows, s.columns);
        const std::vector<float> xs = widen(x), g = widen(gamma), b = widen(beta);
        const std::vector<float> mu = widen(mean), rs = widen(rstd), expected_y = widen(y);
        std::vector<double> mean_tolerance, rstd_tolerance, y_tolerance;
        for (int64_t r = 0; r < s.rows; ++r) {
          double mean_abs = 0.0;
          for (int64_t j = 0; j < s.columns; ++j)
            mean_abs += std::fabs(xs[static_cast<size_t>(r * s.columns + j)]) / s.columns;
          const auto ri = static_cast<size_t>(r);
          mean_tolerance.push_back(0x1p-22 * std::fabs(mu[ri]) + 1e-12 * mean_abs);
          rstd_tolerance.push_back(0x1p-22 * std::fabs(rs[ri]));
          for (int64_t j = 0; j < s.columns; ++j) {
            const auto at = static_cast<size_t>(r * s.columns + j);
            const auto ji = static_cast<size_t>(j);
            const double xhat = (xs[at] - mu[ri]) * rs[ri];
            y_tolerance.push_back(
                0x1p-20 * (std::fabs(xhat * g[ji]) + std::fabs(g[ji]) * rs[ri] * std::fabs(mu[ri]) + std::fabs(b[ji])) +
                one_step(y_type, expected_y[at]));
          }
        }
        EXPECT_TRUE(within(mu, device_mean.values<float>(), mean_tolerance)) << "mean";
        EXPECT_TRUE(within(rs, device_rstd.values<float>(), rstd_tolerance)) << "rstd";
        EXPECT_TRUE(within(expected_y, widen(device_y.tensor({s.rows, s.columns}, y_type)), y_tolerance)) << "y";

        // Backward from the CPU's statistics (the same inputs on both sides).
        const Tensor dy = random_tensor({s.rows, s.columns}, y_type, rng);
        Tensor dx = Tensor::empty({s.rows, s.columns}, x_type);
        Tensor dgamma = random_tensor({s.columns}, DType::kF32, rng),
               dbeta = random_tensor({s.columns}, DType::kF32, rng);
        const std::vector<float> dgamma0 = widen(dgamma), dbeta0 = widen(dbeta), dys = widen(dy);
        const DeviceArray device_dy(dy), cpu_mean(mean), cpu_rstd(rstd);
        DeviceArray device_dx(dx.nbytes()), device_dgamma(dgamma), device_dbeta(dbeta);
        layernorm_backward(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
        cuda::layernorm_backward(stream(), device_x.data(), x_type, device_dy.data(), y_type,
                                 device_gamma.as<const float>(), cpu_mean.as<const float>(), cpu_rstd.as<const float>(),
                                 device_dx.data(), x_type, device_dgamma.as<float>(), device_dbeta.as<float>(), s.rows,
                                 s.columns);
        const std::vector<float> expected_dx = widen(dx);
        std::vector<double> dx_tolerance, dgamma_tolerance(static_cast<size_t>(s.columns)),
            dbeta_tolerance(static_cast<size_t>(s.columns));
        std::vector<double> dgamma_magnitude(dgamma0.begin(), dgamma0.end()),
            dbeta_magnitude(dbeta0.begin(), dbeta0.end());
        for (double& v : dgamma_magnitude) v = std::fabs(v);
        for (double& v : dbeta_magnitude) v = std::fabs(v);
        for (int64_t r = 0; r < s.rows; ++r) {
          const auto ri = static_cast<size_t>(r);
          double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
          std::vector<double> xhat(static_cast<size_t>(s.columns)), dxhat(static_cast<size_t>(s.columns));
          for (int64_t j = 0; j < s.columns; ++j) {
            const auto at = static_cast<size_t>(r * s.columns + j);
            const auto ji = static_cast<size_t>(j);
            xhat[ji] = (xs[at] - mu[ri]) * rs[ri];
            dxhat[ji] = dys[at] * g[ji];
            sum_dxhat += dxhat[ji];
            sum_dxhat_xhat += dxhat[ji] * xhat[ji];
            dgamma_magnitude[ji] += std::fabs(dys[at] * xhat[ji]);
            dbeta_magnitude[ji] += std::fabs(dys[at]);
          }
          const double mean_dxhat = sum_dxhat / s.columns, mean_dxhat_xhat = sum_dxhat_xhat / s.columns;
          for (int64_t j = 0; j < s.columns; ++j) {
            const auto ji = static_cast<size_t>(j);
            dx_tolerance.push_back(
                0x1p-20 * rs[ri] *
                    (std::fabs(dxhat[ji]) + std::fabs(mean_dxhat) + std::fabs(xhat[ji] * mean_dxhat_xhat)) +
                one_step(x_type, expected_dx[static_cast<size_t>(r * s.columns + j)]));
          }
        }
        for (size_t j = 0; j < dgamma_tolerance.size(); ++j) {
          dgamma_tolerance[j] = sum_bound(static_cast<double>(s.rows), dgamma_magnitude[j]);
          dbeta_tolerance[j] = sum_bound(static_cast<double>(s.rows), dbeta_magnitude[j]);
        }
        EXPECT_TRUE(within(expected_dx, widen(device_dx.tensor({s.rows, s.columns}, x_type)), dx_tolerance)) << "dx";
        EXPECT_TRUE(within(widen(dgamma), device_dgamma.values<float>(), dgamma_tolerance)) << "dgamma";
        EXPECT_TRUE(within(widen(dbeta), device_dbeta.values<float>(), dbeta_tolerance)) << "dbeta";
      }
    }
  }
}

// ---- group norm ------------------------------------------------------------------

std::string describe(const GroupNormShape& s) {
  return "batch " + std::to_string(s.batch) + " channels " + std::to_string(s.channels) + " positions " +
         std::to_string(s.positions) + " groups " + std::to_string(s.groups);
}

TEST_F(CudaOps, GroupNormMatchesWithinOneStepOfItsStatistics) {
  Rng rng(42);
  // One position (a norm over channels alone), one channel per group
  // (instance norm) and one group, positions that are and are not multiples
  // of the device's 8-element vectors, and channels of more than 4096 values
  // (dgamma and dbeta summed in several chunks, the last one shorter).
  const std::array<GroupNormShape, 7> shapes = {GroupNormShape{1, 1, 1, 1},    GroupNormShape{2, 6, 1, 3},
                                                GroupNormShape{3, 8, 49, 4},   GroupNormShape{2, 32, 64, 8},
                                                GroupNormShape{4, 6, 13, 6},   GroupNormShape{2, 4, 4097, 1},
                                                GroupNormShape{16, 16, 256, 4}};
  for (const GroupNormShape& s : shapes) {
    const int64_t n = s.batch * s.channels * s.positions, stats = s.batch * s.groups, size = s.group_size();
    const int64_t per_group = s.channels / s.groups;
    const Shape shape = {s.batch, s.channels, s.positions};
    // The channel of value k of (sample, group) q.
    const auto channel = [&](int64_t q, int64_t k) {
      return static_cast<size_t>((q % s.groups) * per_group + k / s.positions);
    };
    for (const DType x_type : kDTypes) {
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE(describe(s) + " " + describe(x_type) + " -> " + describe(y_type));
        const Tensor x = random_tensor(shape, x_type, rng, -0.5, 1.5);
        const Tensor gamma = random_tensor({s.channels}, DType::kF32, rng, 0.5, 1.5);
        const Tensor beta = random_tensor({s.channels}, DType::kF32, rng);
        Tensor y = Tensor::empty(shape, y_type), mean = Tensor::empty({stats}), rstd = Tensor::empty({stats});
        groupnorm_forward(s, x, gamma, beta, y, mean, rstd);
        const DeviceArray device_x(x), device_gamma(gamma), device_beta(beta);
        DeviceArray device_y(y.nbytes()), device_mean(mean.nbytes()), device_rstd(rstd.nbytes());
        cuda::groupnorm_forward(stream(), s, device_x.data(), x_type, device_gamma.as<const float>(),
                                device_beta.as<const float>(), device_y.data(), y_type, device_mean.as<float>(),
                                device_rstd.as<float>());
        const std::vector<float> xs = widen(x), g = widen(gamma), b = widen(beta);
        const std::vector<float> mu = widen(mean), rs = widen(rstd), expected_y = widen(y);
        std::vector<double> mean_tolerance, rstd_tolerance, y_tolerance(static_cast<size_t>(n));
        for (int64_t q = 0; q < stats; ++q) {
          const auto qi = static_cast<size_t>(q);
          double mean_abs = 0.0;
          for (int64_t k = 0; k < size; ++k) mean_abs += std::fabs(xs[static_cast<size_t>(q * size + k)]) / size;
          mean_tolerance.push_back(kStatisticRelative * std::fabs(mu[qi]) +
                                   fp64_sum_bound(static_cast<double>(size), mean_abs));
          rstd_tolerance.push_back(kStatisticRelative * std::fabs(rs[qi]));
          for (int64_t k = 0; k < size; ++k) {
            const auto at = static_cast<size_t>(q * size + k);
            const size_t c = channel(q, k);
            const double xhat = (xs[at] - mu[qi]) * rs[qi];
            y_tolerance[at] =
                0x1p-20 * (std::fabs(xhat * g[c]) + std::fabs(g[c]) * rs[qi] * std::fabs(mu[qi]) + std::fabs(b[c])) +
                one_step(y_type, expected_y[at]);
          }
        }
        EXPECT_TRUE(within(mu, device_mean.values<float>(), mean_tolerance)) << "mean";
        EXPECT_TRUE(within(rs, device_rstd.values<float>(), rstd_tolerance)) << "rstd";
        EXPECT_TRUE(within(expected_y, widen(device_y.tensor(shape, y_type)), y_tolerance)) << "y";

        // Backward from the CPU's statistics (the same inputs on both sides).
        const Tensor dy = random_tensor(shape, y_type, rng);
        Tensor dx = Tensor::empty(shape, x_type);
        Tensor dgamma = random_tensor({s.channels}, DType::kF32, rng),
               dbeta = random_tensor({s.channels}, DType::kF32, rng);
        const std::vector<float> dgamma0 = widen(dgamma), dbeta0 = widen(dbeta), dys = widen(dy);
        const DeviceArray device_dy(dy), cpu_mean(mean), cpu_rstd(rstd);
        DeviceArray device_dx(dx.nbytes()), device_dgamma(dgamma), device_dbeta(dbeta);
        DeviceArray alone_dgamma(dgamma), alone_dbeta(dbeta);
        groupnorm_backward(s, x, dy, gamma, mean, rstd, &dx, dgamma, dbeta);
        cuda::groupnorm_backward(stream(), s, device_x.data(), x_type, device_dy.data(), y_type,
                                 device_gamma.as<const float>(), cpu_mean.as<const float>(), cpu_rstd.as<const float>(),
                                 device_dx.data(), x_type, device_dgamma.as<float>(), device_dbeta.as<float>());
        cuda::groupnorm_backward(stream(), s, device_x.data(), x_type, device_dy.data(), y_type,
                                 device_gamma.as<const float>(), cpu_mean.as<const float>(), cpu_rstd.as<const float>(),
                                 nullptr, DType::kF32, alone_dgamma.as<float>(), alone_dbeta.as<float>());
        const std::vector<float> expected_dx = widen(dx);
        std::vector<double> dx_tolerance(static_cast<size_t>(n)), dgamma_magnitude(dgamma0.begin(), dgamma0.end()),
            dbeta_magnitude(dbeta0.begin(), dbeta0.end());
        for (double& v : dgamma_magnitude) v = std::fabs(v);
        for (double& v : dbeta_magnitude) v = std::fabs(v);
        for (int64_t q = 0; q < stats; ++q) {
          const auto qi = static_cast<size_t>(q);
          std::vector<double> xhat(static_cast<size_t>(size)), d(static_cast<size_t>(size));
          double sum_d = 0.0, sum_d_xhat = 0.0, abs_d = 0.0, abs_d_xhat = 0.0;
          for (int64_t k = 0; k < size; ++k) {
            const auto at = static_cast<size_t>(q * size + k);
            const auto ki = static_cast<size_t>(k);
            const size_t c = channel(q, k);
            xhat[ki] = (xs[at] - mu[qi]) * rs[qi];
            d[ki] = static_cast<double>(dys[at]) * g[c];
            sum_d += d[ki];
            sum_d_xhat += d[ki] * xhat[ki];
            abs_d += std::fabs(d[ki]);
            abs_d_xhat += std::fabs(d[ki] * xhat[ki]);
            dgamma_magnitude[c] += std::fabs(dys[at] * xhat[ki]);
            dbeta_magnitude[c] += std::fabs(dys[at]);
          }
          const double mean_d = sum_d / size, mean_d_xhat = sum_d_xhat / size;
          for (int64_t k = 0; k < size; ++k) {
            const auto at = static_cast<size_t>(q * size + k);
            const auto ki = static_cast<size_t>(k);
            const double means_bound =
                fp64_sum_bound(static_cast<double>(size), (abs_d + std::fabs(xhat[ki]) * abs_d_xhat) / size);
            dx_tolerance[at] =
                rs[qi] * (0x1p-20 * (std::fabs(d[ki]) + std::fabs(mean_d) + std::fabs(xhat[ki] * mean_d_xhat)) +
                          means_bound) +
                one_step(x_type, expected_dx[at]);
          }
        }
        std::vector<double> dgamma_tolerance(dgamma_magnitude.size()), dbeta_tolerance(dbeta_magnitude.size());
        for (size_t c = 0; c < dgamma_tolerance.size(); ++c) {
          dgamma_tolerance[c] = kStatisticRelative * dgamma_magnitude[c];
          dbeta_tolerance[c] = kStatisticRelative * dbeta_magnitude[c];
        }
        EXPECT_TRUE(within(expected_dx, widen(device_dx.tensor(shape, x_type)), dx_tolerance)) << "dx";
        const std::vector<float> gpu_dgamma = device_dgamma.values<float>(), gpu_dbeta = device_dbeta.values<float>();
        EXPECT_TRUE(within(widen(dgamma), gpu_dgamma, dgamma_tolerance)) << "dgamma";
        EXPECT_TRUE(within(widen(dbeta), gpu_dbeta, dbeta_tolerance)) << "dbeta";
        EXPECT_TRUE(same_bits(gpu_dgamma, alone_dgamma.values<float>())) << "dgamma without dx";
        EXPECT_TRUE(same_bits(gpu_dbeta, alone_dbeta.values<float>())) << "dbeta without dx";
      }
    }
  }
}

// ---- cross-entropy -----------------------------------------------------------------

TEST_F(CudaOps, CrossEntropyMatchesAndAccumulatesOnTheDevice) {
  Rng rng(12);
  for (const Matrix s : {Matrix{1, 1}, Matrix{7, 10}, Matrix{255, 7}, Matrix{3, 4097}, Matrix{64, 1000}}) {
    for (const DType logits_type : kDTypes) {
      for (const DType grad_type : kDTypes) {
        for (const bool tied : {false, true}) {
          SCOPED_TRACE(describe(s) + " " + describe(logits_type) + " -> " + describe(grad_type) +
                       (tied ? " tied" : ""));
          Tensor logits = random_tensor({s.rows, s.columns}, logits_type, rng, -3.0, 3.0);
          if (tied) {  // values from {-1, 0, 1, 2}: many rows with several maxima
            std::vector<float> v(static_cast<size_t>(s.rows * s.columns));
            for (float& x : v) x = static_cast<float>(rng.below(4)) - 1.0f;
            logits = from_values(v, {s.rows, s.columns}, logits_type);
          }
          std::vector<int32_t> labels(static_cast<size_t>(s.rows));
          for (int32_t& label : labels) label = static_cast<int32_t>(rng.below(static_cast<uint64_t>(s.columns)));
          const float grad_scale = 1024.0f, normalizer = static_cast<float>(s.rows);
          Tensor dlogits = Tensor::empty({s.rows, s.columns}, grad_type);
          const CrossEntropyResult expected = softmax_cross_entropy(logits, labels, &dlogits, grad_scale, normalizer);

          const DeviceArray device_logits(logits), device_labels(labels);
          DeviceArray device_dlogits(dlogits.nbytes()), loss(sizeof(double)), correct(sizeof(int64_t));
          cuda::set_zero(loss.data(), sizeof(double), stream());
          cuda::set_zero(correct.data(), sizeof(int64_t), stream());
          for (int call = 0; call < 2; ++call) {  // accumulates: twice the sums
            cuda::softmax_cross_entropy(stream(), device_logits.data(), logits_type, device_labels.as<const int32_t>(),
                                        s.rows, s.columns, device_dlogits.data(), grad_type, grad_scale, normalizer,
                                        loss.as<double>(), correct.as<int64_t>());
          }
          const double row_bound = (static_cast<double>(s.columns) / 256.0 + 6.0) * 0x1p-23;
          EXPECT_NEAR(loss.values<double>()[0], 2.0 * expected.loss_sum,
                      2.0 * (1e-12 * std::fabs(expected.loss_sum) + row_bound * static_cast<double>(s.rows)));
          EXPECT_EQ(correct.values<int64_t>()[0], 2 * expected.correct);
          const std::vector<float> g = widen(dlogits);
          const double factor = static_cast<double>(grad_scale) / normalizer;
          std::vector<double> tolerance(g.size());
          for (size_t i = 0; i < g.size(); ++i) {
            const bool is_label = static_cast<int64_t>(i % static_cast<size_t>(s.columns)) ==
                                  labels[i / static_cast<size_t>(s.columns)];
            const double p = g[i] / factor + (is_label ? 1.0 : 0.0);
            tolerance[i] = 0x1p-16 * std::fabs(p) * factor + 1e-15 * factor + one_step(grad_type, g[i]);
          }
          EXPECT_TRUE(within(g, widen(device_dlogits.tensor({s.rows, s.columns}, grad_type)), tolerance)) << "dlogits";
        }
      }
    }
  }
}

TEST_F(CudaOps, CrossEntropyMakesAnOutOfRangeLabelNaN) {
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, 3.0f};
  const std::vector<int32_t> labels = {2, 7};  // the second is outside 3 classes
  const DeviceArray device_logits(logits), device_labels(labels);
  DeviceArray dlogits(logits.size() * sizeof(float)), loss(sizeof(double)), correct(sizeof(int64_t));
  cuda::set_zero(loss.data(), sizeof(double), stream());
  cuda::set_zero(correct.data(), sizeof(int64_t), stream());
  cuda::softmax_cross_entropy(stream(), device_logits.data(), DType::kF32, device_labels.as<const int32_t>(), 2, 3,
                              dlogits.data(), DType::kF32, 1.0f, 2.0f, loss.as<double>(), correct.as<int64_t>());
  EXPECT_TRUE(std::isnan(loss.values<double>()[0]));
  EXPECT_EQ(correct.values<int64_t>()[0], 1) << "the valid row still counts";
  const std::vector<float> g = dlogits.values<float>();
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(g[i]));
  for (size_t i = 3; i < 6; ++i) EXPECT_TRUE(std::isnan(g[i]));
}

// ---- convolution and pooling -------------------------------------------------------

std::vector<Conv2dGeometry> conv_geometries() {
  const auto geometry = [](int64_t batch, int64_t in_channels, int64_t height, int64_t width, int64_t out_channels,
                           int64_t kernel, int64_t stride, int64_t padding) {
    return Conv2dGeometry{batch, in_channels, height, width, out_channels, kernel, stride, padding};
  };
  return {geometry(1, 1, 1, 1, 1, 1, 1, 0), geometry(2, 3, 7, 5, 4, 3, 1, 1), geometry(2, 2, 9, 8, 3, 3, 2, 0),
          geometry(3, 4, 13, 13, 5, 5, 2, 2), geometry(4, 1, 28, 28, 8, 5, 1, 2)};
}

std::string describe(const Conv2dGeometry& g) {
  return "batch " + std::to_string(g.batch) + " in " + std::to_string(g.in_channels) + " " + std::to_string(g.height) +
         "x" + std::to_string(g.width) + " out " + std::to_string(g.out_channels) + " kernel " +
         std::to_string(g.kernel) + " stride " + std::to_string(g.stride) + " padding " + std::to_string(g.padding);
}

Tensor absolute(const Tensor& t) {
  std::vector<float> v = widen(t);
  for (float& x : v) x = std::fabs(x);
  return from_values(v, t.shape(), DType::kF32);
}

TEST_F(CudaOps, Im2colAndCol2imAreBitIdentical) {
  Rng rng(13);
  for (const Conv2dGeometry& g : conv_geometries()) {
    for (const DType type : kDTypes) {
      SCOPED_TRACE(describe(g) + " " + describe(type));
      const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, type, rng);
      std::vector<float> col(static_cast<size_t>(g.patch_size() * g.columns()));
      im2col(g, x, col.data());
      const DeviceArray device_x(x);
      DeviceArray device_col(col.size() * sizeof(float));
      cuda::im2col(stream(), g, device_x.data(), type, device_col.as<float>());
      EXPECT_TRUE(same_bits(col, device_col.values<float>())) << "im2col";

      const std::vector<float> dcol = random_values(static_cast<int64_t>(col.size()), DType::kF32, rng);
      Tensor dx = Tensor::empty(x.shape(), type);
      col2im(g, dcol.data(), dx);
      const DeviceArray device_dcol(dcol);
      DeviceArray device_dx(dx.nbytes());
      cuda::col2im(stream(), g, device_dcol.as<const float>(), device_dx.data(), type);
      EXPECT_TRUE(same_bits(dx, device_dx.tensor(dx.shape(), type))) << "col2im";
    }
  }
}

TEST_F(CudaOps, Conv2dMatchesWithinGemmRounding) {
  Rng rng(14);
  for (const Conv2dGeometry& g : conv_geometries()) {
    for (const DType type : {DType::kF32, DType::kBF16}) {
      for (const DType weight_type : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(describe(g) + " activations " + describe(type) + " weight " + describe(weight_type));
        const int64_t plane = g.out_height() * g.out_width();
        const Shape y_shape = {g.batch, g.out_channels, g.out_height(), g.out_width()};
        const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, type, rng);
        const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, weight_type, rng);
        const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
        Tensor y = Tensor::empty(y_shape, type);
        std::vector<float> col;
        conv2d_forward(g, x, weight, bias, y, col);
        // Magnitudes: the same convolution of |x| and |w| (plus |bias|).
        Tensor magnitude = Tensor::empty(y_shape);
        std::vector<float> abs_col;
        conv2d_forward(g, absolute(x), absolute(weight), absolute(bias), magnitude, abs_col);

        const DeviceArray device_x(x), device_weight(weight), device_bias(bias);
        DeviceArray device_y(y.nbytes()), device_col(col.size() * sizeof(float));
        cuda::conv2d_forward(stream(), g, device_x.data(), type, device_weight.data(), weight_type,
                             device_bias.as<const float>(), device_y.data(), type, device_col.as<float>());
        EXPECT_TRUE(same_bits(col, device_col.values<float>())) << "saved columns";
        const std::vector<float> expected_y = widen(y), y_magnitude = widen(magnitude);
        std::vector<double> tolerance(expected_y.size());
        for (size_t i = 0; i < tolerance.size(); ++i) {
          tolerance[i] = kGemmRelativeF32 * y_magnitude[i] + one_step(type, expected_y[i]);
        }
        EXPECT_TRUE(within(expected_y, widen(device_y.tensor(y_shape, type)), tolerance)) << "y";

        const Tensor dy = random_tensor(y_shape, type, rng);
        Tensor dweight = random_tensor({g.out_channels, g.patch_size()}, DType::kF32, rng);
        Tensor dbias = random_tensor({g.out_channels}, DType::kF32, rng);
        Tensor dx = Tensor::empty(x.shape(), type);
        DeviceArray device_dweight(dweight), device_dbias(dbias), device_dx(dx.nbytes());
        Tensor dweight_magnitude = absolute(dweight), dbias_magnitude = absolute(dbias);
        Tensor dx_magnitude = Tensor::empty(x.shape());
        conv2d_backward(g, abs_col, absolute(weight), absolute(dy), dweight_magnitude, dbias_magnitude, &dx_magnitude);
        conv2d_backward(g, col, weight, dy, dweight, dbias, &dx);
        const DeviceArray device_dy(dy);
        cuda::conv2d_backward(stream(), g, device_col.as<const float>(), device_weight.data(), weight_type,
                              device_dy.data(), type, device_dweight.as<float>(), device_dbias.as<float>(),
                              device_dx.data(), type);
        const std::vector<float> dw = widen(dweight), dw_magnitude = widen(dweight_magnitude);
        tolerance.assign(dw.size(), 0.0);
        for (size_t i = 0; i < dw.size(); ++i) tolerance[i] = kGemmRelativeF32 * dw_magnitude[i];
        EXPECT_TRUE(within(dw, device_dweight.values<float>(), tolerance)) << "dweight";
        const std::vector<float> db = widen(dbias), db_magnitude = widen(dbias_magnitude);
        tolerance.assign(db.size(), 0.0);
        for (size_t i = 0; i < db.size(); ++i) {
          tolerance[i] = sum_bound(static_cast<double>(g.batch * plane), db_magnitude[i]);
        }
        EXPECT_TRUE(within(db, device_dbias.values<float>(), tolerance)) << "dbias";
        const std::vector<float> expected_dx = widen(dx), dx_mag = widen(dx_magnitude);
        tolerance.assign(expected_dx.size(), 0.0);
        for (size_t i = 0; i < expected_dx.size(); ++i) {
          tolerance[i] = kGemmRelativeF32 * dx_mag[i] + one_step(type, expected_dx[i]);
        }
        EXPECT_TRUE(within(expected_dx, widen(device_dx.tensor(x.shape(), type)), tolerance)) << "dx";
      }
    }
  }
}

TEST_F(CudaOps, MaxPoolIsBitIdentical) {
  Rng rng(15);
  const std::array<Pool2dGeometry, 5> geometries = {
      Pool2dGeometry{1, 1, 1, 1, 1, 1}, Pool2dGeometry{2, 3, 28, 28, 2, 2}, Pool2dGeometry{2, 2, 7, 7, 2, 2},
      Pool2dGeometry{1, 2, 7, 9, 3, 2}, Pool2dGeometry{3, 1, 6, 5, 3, 1}};
  for (const Pool2dGeometry& g : geometries) {
    for (const DType x_type : kDTypes) {
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("batch " + std::to_string(g.batch) + " channels " + std::to_string(g.channels) + " " +
                     std::to_string(g.height) + "x" + std::to_string(g.width) + " kernel " + std::to_string(g.kernel) +
                     " stride " + std::to_string(g.stride) + " " + describe(x_type) + " -> " + describe(y_type));
        // Few distinct values: ties in most windows (the first maximum wins).
        std::vector<float> values(static_cast<size_t>(g.batch * g.channels * g.height * g.width));
        for (float& v : values) v = static_cast<float>(rng.below(5)) * 0.5f - 1.0f;
        const Shape x_shape = {g.batch, g.channels, g.height, g.width};
        const Shape y_shape = {g.batch, g.channels, g.out_height(), g.out_width()};
        const Tensor x = from_values(values, x_shape, x_type);
        Tensor y = Tensor::empty(y_shape, y_type);
        std::vector<int32_t> argmax;
        maxpool2d_forward(g, x, y, argmax);
        const DeviceArray device_x(x);
        DeviceArray device_y(y.nbytes()), device_argmax(argmax.size() * sizeof(int32_t));
        cuda::maxpool2d_forward(stream(), g, device_x.data(), x_type, device_y.data(), y_type,
                                device_argmax.as<int32_t>());
        EXPECT_TRUE(same_bits(y, device_y.tensor(y_shape, y_type))) << "y";
        EXPECT_TRUE(same_bits(argmax, device_argmax.values<int32_t>())) << "argmax";

        const Tensor dy = random_tensor(y_shape, y_type, rng);
        Tensor dx = Tensor::empty(x_shape, x_type);
        maxpool2d_backward(g, argmax, dy, dx);
        const DeviceArray device_dy(dy);
        DeviceArray device_dx(dx.nbytes());
        cuda::maxpool2d_backward(stream(), g, device_argmax.as<const int32_t>(), device_dy.data(), y_type,
                                 device_dx.data(), x_type);
        EXPECT_TRUE(same_bits(dx, device_dx.tensor(x_shape, x_type))) << "dx";
      }
    }
  }
}

std::string describe(const Pool2dGeometry& g) {
  return "batch " + std::to_string(g.batch) + " channels " + std::to_string(g.channels) + " " +
         std::to_string(g.height) + "x" + std::to_string(g.width) + " kernel " + std::to_string(g.kernel) + " stride " +
         std::to_string(g.stride);
}

TEST_F(CudaOps, AvgPoolIsBitIdentical) {
  Rng rng(43);
  // Windows that tile the plane, overlap (stride < kernel: the backward pass
  // adds several windows per input) and leave gaps (stride > kernel: inputs
  // no window holds get 0).
  const std::array<Pool2dGeometry, 6> geometries = {
      Pool2dGeometry{1, 1, 1, 1, 1, 1}, Pool2dGeometry{2, 3, 28, 28, 2, 2}, Pool2dGeometry{2, 2, 7, 7, 2, 2},
      Pool2dGeometry{1, 2, 7, 9, 3, 2}, Pool2dGeometry{3, 1, 6, 5, 3, 1},   Pool2dGeometry{2, 2, 11, 10, 2, 3}};
  for (const Pool2dGeometry& g : geometries) {
    const Shape x_shape = {g.batch, g.channels, g.height, g.width};
    const Shape y_shape = {g.batch, g.channels, g.out_height(), g.out_width()};
    for (const DType x_type : kDTypes) {
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE(describe(g) + " " + describe(x_type) + " -> " + describe(y_type));
        const Tensor x = random_tensor(x_shape, x_type, rng, -2.0, 2.0);
        const DeviceArray device_x(x);
        expect_same_output(
            y_shape, y_type, [&](Tensor& out) { avgpool2d_forward(g, x, out); },
            [&](void* out) { cuda::avgpool2d_forward(stream(), g, device_x.data(), x_type, out, y_type); }, "y");
        const Tensor dy = random_tensor(y_shape, y_type, rng, -2.0, 2.0);
        const DeviceArray device_dy(dy);
        expect_same_output(
            x_shape, x_type, [&](Tensor& out) { avgpool2d_backward(g, dy, out); },
            [&](void* out) { cuda::avgpool2d_backward(stream(), g, device_dy.data(), y_type, out, x_type); }, "dx");
      }
    }
  }
}

TEST_F(CudaOps, PlaneMeanMatchesWithinItsSumAndItsBackwardIsBitIdentical) {
  Rng rng(44);
  struct Planes {
    int64_t planes, area;
  };
  for (const Planes s : {Planes{1, 1}, Planes{7, 13}, Planes{96, 49}, Planes{5, 4097}, Planes{2, 70001}}) {
    for (const DType x_type : kDTypes) {
      for (const DType y_type : kDTypes) {
        SCOPED_TRACE("planes " + std::to_string(s.planes) + " area " + std::to_string(s.area) + " " + describe(x_type) +
                     " -> " + describe(y_type));
        const Tensor x = random_tensor({s.planes, s.area}, x_type, rng, -0.5, 1.5);
        Tensor y = Tensor::empty({s.planes}, y_type);
        plane_mean_forward(x, y);
        const DeviceArray device_x(x);
        DeviceArray device_y(y.nbytes());
        cuda::plane_mean_forward(stream(), device_x.data(), x_type, device_y.data(), y_type, s.planes, s.area);
        const std::vector<float> xs = widen(x), expected = widen(y);
        std::vector<double> tolerance(expected.size());
        for (size_t p = 0; p < expected.size(); ++p) {
          const auto area = static_cast<size_t>(s.area);
          double mean_abs = 0.0;
          for (size_t k = 0; k < area; ++k) mean_abs += std::fabs(xs[p * area + k]) / s.area;
          tolerance[p] = kStatisticRelative * std::fabs(expected[p]) +
                         fp64_sum_bound(static_cast<double>(s.area), mean_abs) + one_step(y_type, expected[p]);
        }
        EXPECT_TRUE(within(expected, widen(device_y.tensor({s.planes}, y_type)), tolerance)) << "y";

        const Tensor dy = random_tensor({s.planes}, y_type, rng);
        const DeviceArray device_dy(dy);
        expect_same_output(
            {s.planes, s.area}, x_type, [&](Tensor& out) { plane_mean_backward(dy, out); },
            [&](void* out) {
              cuda::plane_mean_backward(stream(), device_dy.data(), y_type, out, x_type, s.planes, s.area);
            },
            "dx");
      }
    }
  }
}

// ---- embedding -----------------------------------------------------------------------

TEST_F(CudaOps, EmbeddingGathersBitIdenticallyAndScattersWithinSummationOrder) {
  Rng rng(16);
  struct Case {
    int64_t vocabulary, dim, count;
  };
  for (const Case c : {Case{1, 1, 1}, Case{7, 13, 7}, Case{255, 7, 4097}, Case{50, 64, 255}}) {
    for (const DType table_type : kDTypes) {
      for (const DType out_type : kDTypes) {
        SCOPED_TRACE("vocabulary " + std::to_string(c.vocabulary) + " dim " + std::to_string(c.dim) + " ids " +
                     std::to_string(c.count) + " " + describe(table_type) + " -> " + describe(out_type));
        const Tensor table = random_tensor({c.vocabulary, c.dim}, table_type, rng);
        std::vector<int32_t> ids(static_cast<size_t>(c.count));
        for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocabulary)));
        Tensor out = Tensor::empty({c.count, c.dim}, out_type);
        embedding_forward(table, ids, out);
        const DeviceArray device_table(table), device_ids(ids);
        DeviceArray device_out(out.nbytes());
        cuda::embedding_forward(stream(), device_table.data(), table_type, c.vocabulary, c.dim,
                                device_ids.as<const int32_t>(), c.count, device_out.data(), out_type);
        EXPECT_TRUE(same_bits(out, device_out.tensor({c.count, c.dim}, out_type))) << "forward";

        const Tensor dout = random_tensor({c.count, c.dim}, out_type, rng);
        Tensor dtable = random_tensor({c.vocabulary, c.dim}, DType::kF32, rng);
        std::vector<double> magnitude(static_cast<size_t>(c.vocabulary * c.dim)), hits(magnitude.size(), 0.0);
        const std::vector<float> dtable0 = widen(dtable), douts = widen(dout);
        for (size_t i = 0; i < magnitude.size(); ++i) magnitude[i] = std::fabs(dtable0[i]);
        for (int64_t i = 0; i < c.count; ++i) {
          for (int64_t j = 0; j < c.dim; ++j) {
            const auto at = static_cast<size_t>(ids[static_cast<size_t>(i)] * c.dim + j);
            magnitude[at] += std::fabs(douts[static_cast<size_t>(i * c.dim + j)]);
            hits[at] += 1.0;
          }
        }
        DeviceArray device_dtable(dtable);
        const DeviceArray device_dout(dout);
        embedding_backward(ids, dout, dtable);
        cuda::embedding_backward(stream(), device_ids.as<const int32_t>(), c.count, device_dout.data(), out_type,
                                 device_dtable.as<float>(), c.vocabulary, c.dim);
        std::vector<double> tolerance(magnitude.size());
        for (size_t i = 0; i < tolerance.size(); ++i) tolerance[i] = sum_bound(hits[i], magnitude[i]);
        EXPECT_TRUE(within(widen(dtable), device_dtable.values<float>(), tolerance)) << "backward";
      }
    }
  }
}

// Attention on the device's default path (device_ops.cpp: the fused kernels
// for bf16/fp16 with head_dim 64 or 128, else cuBLASLt's batched products
// around cuda::causal_softmax) against the CPU's, by relative L2 distance
// over each output: fp32 within 1e-5 (fp32 products, sums in another
// order); bf16 and fp16 within 2e-2, since the probabilities and their
// gradients are rounded to the operands' dtype for the products (the CPU
// keeps them in fp32). The log-sum-exps are fp32 arithmetic on rounded
// scores: 1e-5 in fp32, 1e-2 otherwise. First estimates: the test has not
// yet run on a GPU.
TEST_F(CudaOps, CausalAttentionMatchesTheCpuWithinRounding) {
  Rng rng(21);
  for (const AttentionShape s : {AttentionShape{1, 1, 1, 4}, AttentionShape{2, 17, 3, 8}, AttentionShape{2, 64, 2, 64},
                                 AttentionShape{1, 40, 1, 128}, AttentionShape{2, 131, 3, 64},
                                 AttentionShape{1, 1024, 2, 64}}) {
    for (const DType dtype : kDTypes) {
      const int64_t width = s.heads * s.head_dim;
      SCOPED_TRACE("batch " + std::to_string(s.batch) + " seq " + std::to_string(s.seq) + " heads " +
                   std::to_string(s.heads) + " head_dim " + std::to_string(s.head_dim) + " " + describe(dtype));
      const double tolerance = dtype == DType::kF32 ? 1e-5 : 2e-2;
      const Tensor qkv = random_tensor({s.batch, s.seq, 3 * width}, dtype, rng);
      const Tensor dout = random_tensor({s.batch, s.seq, width}, dtype, rng);
      const AttentionPass cpu = attention_pass(s, qkv, dout);
      const AttentionPass gpu = attention_pass(s, qkv.to(Device::kCuda), dout.to(Device::kCuda));
      EXPECT_LE(relative_l2(gpu.out, cpu.out), tolerance) << "out";
      EXPECT_LE(relative_l2(gpu.saved, cpu.saved), dtype == DType::kF32 ? 1e-5 : 1e-2) << "log-sum-exp";
      EXPECT_LE(relative_l2(gpu.dqkv, cpu.dqkv), tolerance) << "dqkv";
    }
  }
}

// ---- fused (flash) attention ----------------------------------------------------

std::string describe(const AttentionShape& s) {
  return "batch " + std::to_string(s.batch) + " seq " + std::to_string(s.seq) + " heads " + std::to_string(s.heads) +
         " head_dim " + std::to_string(s.head_dim);
}

// The scale of each fused attention result's error, from the same rounded
// inputs in fp64: every output written as a sum of terms, the sum of their
// absolute values, with |dP_tj| replaced by A_tj = Σ_c |dO_tc| |v_jc| (a
// bound on it and the scale of its fp32 error), delta_t by
// Σ_j P_tj A_tj = Σ_c |dO_tc| out_tc (out_tc the magnitude below), and dS_tj
// by P_tj (A_tj + 2 delta_t):
//   out_tc: Σ_j P_tj |v_jc|          dV_jc: Σ_t P_tj |dO_tc|
//   dQ_tc:  scale Σ_j dS_tj |k_jc|   dK_jc: scale Σ_t dS_tj |q_tc|
// The second delta_t is for the fused kernels' delta, rowsum(dO ∘ O) from
// their rounded O rather than the CPU's rowsum(dP ∘ P): with O within
// rho out_tc of the CPU's (the bound the test holds out to; its absolute
// floor, a subnormal's size, is negligible beside these inputs' delta_t),
// that delta is off by at most Σ_c |dO_tc| rho out_tc = rho delta_t, plus
// the fp32 error of a D-term sum (~D 2^-24 delta_t, inside the fp32
// allowance below), and P_tj times that enters dS_tj.
// lse_error is an absolute bound on the log-sum-exp's fp32 differences:
// the scores' (8 D 2^-24 scale Σ_c |q_tc| |k_jc|, dot products of D terms
// summed in another order, tensor cores possibly truncating), the sum of the
// row's t + 1 exponentials (2^-22 (t + 8)), and a few ulps of exp, log and
// the result (2^-22 |L|).
struct AttentionMagnitudes {
  std::vector<double> out, dqkv, lse_error;  // out's, qkv's and saved's shapes
};

AttentionMagnitudes attention_magnitudes(const AttentionShape& s, const Tensor& qkv, const Tensor& dout) {
  const std::vector<float> x = widen(qkv), g = widen(dout);
  const int64_t T = s.seq, D = s.head_dim, width = s.heads * D, row = 3 * width;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  AttentionMagnitudes m{std::vector<double>(static_cast<size_t>(s.batch * T * width)),
                        std::vector<double>(static_cast<size_t>(s.batch * T * row)),
                        std::vector<double>(static_cast<size_t>(s.batch * s.heads * T))};
  std::vector<double> p(static_cast<size_t>(T * T)), ds(static_cast<size_t>(T * T)), a(static_cast<size_t>(T));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const auto q = [&](int64_t t, int64_t c) {
        return double{x[static_cast<size_t>((b * T + t) * row + h * D + c)]};
      };
      const auto k = [&](int64_t t, int64_t c) { return q(t, c + width); };
      const auto v = [&](int64_t t, int64_t c) { return q(t, c + 2 * width); };
      const auto d = [&](int64_t t, int64_t c) {
        return double{g[static_cast<size_t>((b * T + t) * width + h * D + c)]};
      };
      for (int64_t t = 0; t < T; ++t) {
        double max_score = -std::numeric_limits<double>::infinity(), max_abs = 0.0;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0.0, abs_dot = 0.0;
          for (int64_t c = 0; c < D; ++c) {
            dot += q(t, c) * k(j, c);
            abs_dot += std::fabs(q(t, c) * k(j, c));
          }
          p[t * T + j] = scale * dot;
          max_score = std::max(max_score, scale * dot);
          max_abs = std::max(max_abs, abs_dot);
        }
        double total = 0.0;
        for (int64_t j = 0; j <= t; ++j) total += std::exp(p[t * T + j] - max_score);
        const double lse = max_score + std::log(total);
        m.lse_error[static_cast<size_t>((b * s.heads + h) * T + t)] =
            8.0 * static_cast<double>(D) * 0x1p-24 * scale * max_abs + 0x1p-22 * static_cast<double>(t + 8) +
            0x1p-22 * std::fabs(lse);
        double delta = 0.0;
        for (int64_t j = 0; j <= t; ++j) {
          p[t * T + j] = std::exp(p[t * T + j] - lse);
          a[j] = 0.0;
          for (int64_t c = 0; c < D; ++c) a[j] += std::fabs(d(t, c) * v(j, c));
          delta += p[t * T + j] * a[j];
        }
        for (int64_t j = 0; j <= t; ++j) ds[t * T + j] = p[t * T + j] * (a[j] + 2.0 * delta);
        for (int64_t c = 0; c < D; ++c) {
          double out = 0.0, dq = 0.0;
          for (int64_t j = 0; j <= t; ++j) {
            out += p[t * T + j] * std::fabs(v(j, c));
            dq += ds[t * T + j] * std::fabs(k(j, c));
          }
          m.out[static_cast<size_t>((b * T + t) * width + h * D + c)] = out;
          m.dqkv[static_cast<size_t>((b * T + t) * row + h * D + c)] = scale * dq;
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        for (int64_t c = 0; c < D; ++c) {
          double dk = 0.0, dv = 0.0;
          for (int64_t t = j; t < T; ++t) {
            dk += ds[t * T + j] * std::fabs(q(t, c));
            dv += p[t * T + j] * std::fabs(d(t, c));
          }
          m.dqkv[static_cast<size_t>((b * T + j) * row + width + h * D + c)] = scale * dk;
          m.dqkv[static_cast<size_t>((b * T + j) * row + 2 * width + h * D + c)] = dv;
        }
      }
    }
  }
  return m;
}

// How many elements of `actual` lie farther than relative * scale[i] +
// absolute from `expected` (NaN counts); the first few are reported with
// their row (the tensor's leading index) and column.
int64_t count_outside(const Tensor& actual, const Tensor& expected, const std::vector<double>& scale, double relative,
                      double absolute, const std::string& what) {
  const std::vector<float> x = widen(actual.to(Device::kCpu)), y = widen(expected.to(Device::kCpu));
  EXPECT_EQ(x.size(), y.size()) << what;
  EXPECT_EQ(scale.size(), y.size()) << what;
  if (x.size() != y.size() || scale.size() != y.size()) return static_cast<int64_t>(y.size());
  const int64_t columns = expected.dim(expected.rank() - 1);
  int64_t outside = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double error = std::fabs(double{x[i]} - double{y[i]}), bound = relative * scale[i] + absolute;
    if (error <= bound) continue;  // false for NaN
    if (++outside <= 5) {
      ADD_FAILURE() << what << " at row " << static_cast<int64_t>(i) / columns << " column "
                    << static_cast<int64_t>(i) % columns << ": " << x[i] << " vs " << y[i] << " (bound " << bound
                    << ")";
    }
  }
  return outside;
}

// What the process's FEDMESH_ATTENTION makes AttentionPath::kAuto take where
// the fused kernels apply.
device::AttentionPath fused_unless_forced() {
  const char* forced = std::getenv("FEDMESH_ATTENTION");
  return forced != nullptr && std::string(forced) == "gemm" ? device::AttentionPath::kGemm
                                                            : device::AttentionPath::kFlash;
}

std::vector<double> scaled(const std::vector<double>& v, double factor) {
  std::vector<double> r(v);
  for (double& x : r) x *= factor;
  return r;
}

// The fused kernels (AttentionPath::kFlash) against the CPU's fp32 attention
// on the same rounded inputs, element by element, for shapes with whole and
// partial 64-row tiles, a single position, and head_dim 128:
// - out, dV: |gpu - cpu| <= 4 u M, u the dtype's unit roundoff and M the
//   magnitude of attention_magnitudes: one rounding of P to the dtype for the
//   tensor cores (u M), one of the result (u |value| <= u M), and 2 u M for
//   the fp32 differences (scores and sums in another order, CUDA's expf),
//   which are ~1e-6 relative for these inputs, far below u.
// - dQ, dK: the same with dS's rounding in place of P's, and dS's
//   magnitude holding a second delta_t for the fused kernels' delta taken
//   from their rounded out (attention_magnitudes).
// - the log-sum-exps: within lse_error (above), both sides in fp32.
// The GEMM path (AttentionPath::kGemm, which rounds P and dS to the dtype
// as well) is held to the fused one within twice these bounds. Two launches
// of the fused kernels give the same bits.
TEST_F(CudaOps, FlashAttentionMatchesTheCpuAndTheGemmPathAndRepeatsItsBits) {
  Rng rng(34);
  for (const AttentionShape s : {AttentionShape{2, 128, 2, 64}, AttentionShape{1, 200, 3, 64},
                                 AttentionShape{1, 1, 1, 64}, AttentionShape{2, 96, 2, 128}}) {
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(describe(s) + " " + describe(dtype));
      if (!cuda::flash_attention_supported(s, dtype)) {
        // Every device of compute capability 8.0+ has the shared memory head_dim 64 needs.
        EXPECT_NE(s.head_dim, 64) << "the fused kernels refused head_dim 64";
        std::printf("note: this device does not run the fused attention kernels for %s\n", describe(s).c_str());
        continue;
      }
      EXPECT_EQ(device::attention_path(s, dtype), fused_unless_forced());
      const int64_t width = s.heads * s.head_dim;
      const Tensor qkv = random_tensor({s.batch, s.seq, 3 * width}, dtype, rng);
      const Tensor dout = random_tensor({s.batch, s.seq, width}, dtype, rng);
      const Tensor qkv32 = to_dtype(qkv, DType::kF32), dout32 = to_dtype(dout, DType::kF32);
      const AttentionPass cpu = attention_pass(s, qkv32, dout32);
      const AttentionMagnitudes m = attention_magnitudes(s, qkv32, dout32);
      const Tensor qkv_gpu = qkv.to(Device::kCuda), dout_gpu = dout.to(Device::kCuda);

      const auto run = [&](device::AttentionPath path) {
        AttentionPass r{Tensor::empty(dout.shape(), dtype, Device::kCuda), Tensor(),
                        Tensor::empty(qkv.shape(), dtype, Device::kCuda)};
        device::causal_attention_forward(s, qkv_gpu, r.out, r.saved, device::kAttentionWorkspaceBytes, path);
        device::causal_attention_backward(s, qkv_gpu, r.out, r.saved, dout_gpu, r.dqkv,
                                          device::kAttentionWorkspaceBytes, path);
        return AttentionPass{r.out.to(Device::kCpu), r.saved.to(Device::kCpu), r.dqkv.to(Device::kCpu)};
      };
      const AttentionPass flash = run(device::AttentionPath::kFlash);
      const double rho = 4.0 * testing::unit_roundoff(dtype), floor = 2.0 * testing::subnormal_floor(dtype);
      EXPECT_EQ(count_outside(flash.out, cpu.out, m.out, rho, floor, "out"), 0);
      EXPECT_EQ(count_outside(flash.saved, cpu.saved, m.lse_error, 1.0, 0.0, "log-sum-exp"), 0);
      EXPECT_EQ(count_outside(flash.dqkv, cpu.dqkv, m.dqkv, rho, floor, "dqkv"), 0);

      const AttentionPass gemm = run(device::AttentionPath::kGemm);
      EXPECT_EQ(count_outside(gemm.out, flash.out, m.out, 2.0 * rho, 2.0 * floor, "gemm out"), 0);
      EXPECT_EQ(count_outside(gemm.saved, flash.saved, scaled(m.lse_error, 2.0), 1.0, 0.0, "gemm log-sum-exp"), 0);
      EXPECT_EQ(count_outside(gemm.dqkv, flash.dqkv, m.dqkv, 2.0 * rho, 2.0 * floor, "gemm dqkv"), 0);

      const AttentionPass again = run(device::AttentionPath::kFlash);
      const auto same_bits = [](const Tensor& a, const Tensor& b) {
        return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
      };
      EXPECT_TRUE(same_bits(flash.out, again.out)) << "out differs between two launches";
      EXPECT_TRUE(same_bits(flash.saved, again.saved)) << "log-sum-exp differs between two launches";
      EXPECT_TRUE(same_bits(flash.dqkv, again.dqkv)) << "dqkv differs between two launches";
    }
  }
}

// The path the device takes by default: the fused kernels for GPT-2's
// attention in bf16 and fp16 (unless FEDMESH_ATTENTION=gemm), the GEMMs for
// fp32 and for head dimensions the fused kernels have no instance of.
TEST_F(CudaOps, AttentionPathPicksTheFusedKernelsWhereTheyApply) {
  const AttentionShape gpt2{16, 1024, 12, 64};
  const device::AttentionPath fused = fused_unless_forced();
  EXPECT_EQ(device::attention_path(gpt2, DType::kBF16), fused);
  EXPECT_EQ(device::attention_path(gpt2, DType::kF16), fused);
  EXPECT_EQ(device::attention_path(gpt2, DType::kF32), device::AttentionPath::kGemm);
  EXPECT_EQ(device::attention_path(AttentionShape{1, 17, 3, 8}, DType::kBF16), device::AttentionPath::kGemm);
  EXPECT_STREQ(device::attention_path_name(device::attention_path(gpt2, DType::kBF16)),
               fused == device::AttentionPath::kGemm ? "gemm" : "flash");
}

// The strided batched product against a double reference, with leading
// dimensions past the columns and gaps between the batch's operands (as
// attention's views of qkv have), in every transpose and operand dtype.
TEST_F(CudaOps, StridedBatchedGemmMatchesTheReference) {
  Rng rng(22);
  const int64_t m = 19, n = 13, k = 37, batch = 3, pad = 5;
  for (const DType dtype : kDTypes) {
    for (const bool transpose_a : {false, true}) {
      for (const bool transpose_b : {false, true}) {
        SCOPED_TRACE(describe(dtype) + (transpose_a ? " a^T" : "") + (transpose_b ? " b^T" : ""));
        const int64_t a_rows = transpose_a ? k : m, a_cols = transpose_a ? m : k;
        const int64_t b_rows = transpose_b ? n : k, b_cols = transpose_b ? k : n;
        const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
        const int64_t stride_a = a_rows * lda + pad, stride_b = b_rows * ldb + pad, stride_c = m * ldc + pad;
        const std::vector<float> a = rounded(random_values(batch * stride_a, dtype, rng), dtype);
        const std::vector<float> b = rounded(random_values(batch * stride_b, dtype, rng), dtype);
        const DeviceArray device_a(from_values(a, {static_cast<int64_t>(a.size())}, dtype));
        const DeviceArray device_b(from_values(b, {static_cast<int64_t>(b.size())}, dtype));
        DeviceArray device_c(std::vector<float>(static_cast<size_t>(batch * stride_c), 7.0f));
        cuda::gemm_strided_batched(stream(), transpose_a, transpose_b, m, n, k, 0.5f, device_a.data(), dtype, lda,
                                   stride_a, device_b.data(), dtype, ldb, stride_b, 0.0f, device_c.data(), DType::kF32,
                                   ldc, stride_c, batch);
        const std::vector<float> c = device_c.values<float>();
        for (int64_t i = 0; i < batch; ++i) {
          for (int64_t row = 0; row < m; ++row) {
            for (int64_t column = 0; column < ldc; ++column) {
              const float got = c[static_cast<size_t>(i * stride_c + row * ldc + column)];
              if (column >= n) {
                ASSERT_EQ(got, 7.0f) << "written past the columns at " << i << ", " << row << ", " << column;
                continue;
              }
              double expected = 0.0, magnitude = 0.0;
              for (int64_t p = 0; p < k; ++p) {
                const double x = a[static_cast<size_t>(i * stride_a + (transpose_a ? p * lda + row : row * lda + p))];
                const double y = b[static_cast<size_t>(i * stride_b + (transpose_b ? column * ldb + p : p * ldb + column))];
                expected += x * y;
                magnitude += std::fabs(x * y);
              }
              // fp32 sums of k terms: within k * 2^-24 of the terms' magnitude.
              ASSERT_NEAR(got, 0.5 * expected, 0.5 * 1e-5 * magnitude + 1e-7)
                  << "batch " << i << " (" << row << ", " << column << ")";
            }
          }
        }
      }
    }
  }
}

TEST_F(CudaOps, TokenIdsRoundTripAndMarkBadOnes) {
  const std::vector<float> x = {0.0f, 5.0f, 255.0f, 256.0f, -1.0f, 2.5f};
  const DeviceArray device_x(x);
  DeviceArray ids(x.size() * sizeof(int32_t));
  cuda::token_ids(stream(), device_x.as<const float>(), static_cast<int64_t>(x.size()), 256, ids.as<int32_t>());
  EXPECT_EQ(ids.values<int32_t>(), (std::vector<int32_t>{0, 5, 255, -1, -1, -1}));
}

TEST_F(CudaOps, EmbeddingGivesNaNForAnIdOutsideTheVocabulary) {
  const std::vector<float> table = {1.0f, 2.0f, 3.0f, 4.0f};  // (2, 2)
  const std::vector<int32_t> ids = {1, 2, -1};
  const DeviceArray device_table(table), device_ids(ids);
  DeviceArray out(6 * sizeof(float)), dtable(std::vector<float>(4, 0.0f));
  cuda::embedding_forward(stream(), device_table.data(), DType::kF32, 2, 2, device_ids.as<const int32_t>(), 3,
                          out.data(), DType::kF32);
  const std::vector<float> rows = out.values<float>();
  EXPECT_EQ(rows[0], 3.0f);
  EXPECT_EQ(rows[1], 4.0f);
  for (size_t i = 2; i < 6; ++i) EXPECT_TRUE(std::isnan(rows[i]));
  const DeviceArray dout(std::vector<float>(6, 1.0f));
  cuda::embedding_backward(stream(), device_ids.as<const int32_t>(), 3, dout.data(), DType::kF32, dtable.as<float>(), 2,
                           2);
  EXPECT_EQ(dtable.values<float>(), (std::vector<float>{0.0f, 0.0f, 1.0f, 1.0f})) << "bad ids are skipped";
}

// ---- optimizers ----------------------------------------------------------------------

// The parameter state on both sides: CPU vectors and device arrays.
struct OptimizerState {
  OptimizerState(int64_t n, Rng& rng)
      : weights(random_values(n, DType::kF32, rng)),
        grads(random_values(n, DType::kF32, rng, -4.0, 4.0)),
        first(random_values(n, DType::kF32, rng, -0.1, 0.1)),
        second(random_values(n, DType::kF32, rng, 0.0, 0.01)),
        device_weights(weights),
        device_grads(grads),
        device_first(first),
        device_second(second) {}
  std::vector<float> weights, grads, first, second;
  DeviceArray device_weights, device_grads, device_first, device_second;
};

// The device's weights, state and compute copy equal the CPU's bit for bit.
void expect_same_state(const OptimizerState& s, const DeviceArray& compute, DType compute_type, bool second_moment) {
  EXPECT_TRUE(same_bits(s.weights, s.device_weights.values<float>())) << "weights";
  EXPECT_TRUE(same_bits(s.first, s.device_first.values<float>())) << "momentum / first moment";
  if (second_moment) {
    EXPECT_TRUE(same_bits(s.second, s.device_second.values<float>())) << "second moment";
  }
  const int64_t n = static_cast<int64_t>(s.weights.size());
  EXPECT_TRUE(same_bits(from_values(s.weights, {n}, compute_type), compute.tensor({n}, compute_type)))
      << "compute copy";
}

// Three steps on both sides from one state, the CPU unscaling its gradients
// by `factor` first when the device gets grad_scale_inverse; then the device
// holds the CPU's bits. cpu_step(state, grads, step), gpu_step(state, compute, step).
template <class CpuStep, class GpuStep>
void expect_same_steps(int64_t n, DType compute_type, float factor, bool unscale, bool second_moment, Rng& rng,
                       CpuStep cpu_step, GpuStep gpu_step) {
  OptimizerState s(n, rng);
  DeviceArray compute(static_cast<size_t>(n) * dtype_size(compute_type));
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<float> grads = s.grads;
    if (unscale) {
      Tensor g = Tensor::view_of(grads.data(), {n}, DType::kF32);
      scale(g, factor);  // the CPU trainer's unscale before its step
    }
    cpu_step(s, grads, step);
    gpu_step(s, compute, step);
  }
  expect_same_state(s, compute, compute_type, second_moment);
}

TEST_F(CudaOps, SgdAndAdamWStepsAreBitIdentical) {
  Rng rng(17);
  const std::array<SgdOptions, 3> sgd_options = {SgdOptions{}, SgdOptions{0.9f, false, 1e-4f},
                                                 SgdOptions{0.9f, true, 0.01f}};
  const std::array<AdamWOptions, 2> adamw_options = {AdamWOptions{}, AdamWOptions{0.8f, 0.99f, 1e-6f, 0.1f}};
  const float factor = 1.0f / 1024.0f;
  const DeviceArray device_factor(std::vector<float>{factor});
  for (const int64_t n : kSizes) {
    for (const DType compute_type : kDTypes) {
      for (const bool unscale : {false, true}) {
        const float* grad_scale_inverse = unscale ? device_factor.as<const float>() : nullptr;
        const std::string what =
            "n " + std::to_string(n) + " compute " + describe(compute_type) + (unscale ? " unscaled" : "");
        for (const SgdOptions& options : sgd_options) {
          SCOPED_TRACE("sgd momentum " + std::to_string(options.momentum) + " " + what);
          expect_same_steps(
              n, compute_type, factor, unscale, /*second_moment=*/false, rng,
              [&](OptimizerState& s, std::vector<float>& grads, int64_t) {
                sgd_step(s.weights.data(), grads.data(), s.first.data(), n, 0.05f, options);
              },
              [&](OptimizerState& s, DeviceArray& compute, int64_t) {
                cuda::sgd_step(stream(), s.device_weights.as<float>(), s.device_grads.as<const float>(),
                               s.device_first.as<float>(), compute.data(), compute_type, n, 0.05f, options,
                               grad_scale_inverse);
              });
        }
        for (const AdamWOptions& options : adamw_options) {
          SCOPED_TRACE("adamw beta1 " + std::to_string(options.beta1) + " " + what);
          expect_same_steps(
              n, compute_type, factor, unscale, /*second_moment=*/true, rng,
              [&](OptimizerState& s, std::vector<float>& grads, int64_t step) {
                adamw_step(s.weights.data(), grads.data(), s.first.data(), s.second.data(), n, step, 1e-3f, options);
              },
              [&](OptimizerState& s, DeviceArray& compute, int64_t step) {
                cuda::adamw_step(stream(), s.device_weights.as<float>(), s.device_grads.as<const float>(),
                                 s.device_first.as<float>(), s.device_second.as<float>(), compute.data(), compute_type,
                                 n, step, 1e-3f, options, grad_scale_inverse);
              });
        }
      }
    }
  }
}

TEST_F(CudaOps, FoundInfSkipsTheOptimizerStep) {
  Rng rng(18);
  const int64_t n = 4097;
  OptimizerState s(n, rng);
  const std::vector<float> compute_before = random_values(n, DType::kBF16, rng);
  const Tensor compute_tensor = from_values(compute_before, {n}, DType::kBF16);
  const DeviceArray compute(compute_tensor);
  const DeviceArray found_inf(std::vector<int>{1});
  cuda::sgd_step(stream(), s.device_weights.as<float>(), s.device_grads.as<const float>(), s.device_first.as<float>(),
                 compute.data(), DType::kBF16, n, 0.1f, SgdOptions{0.9f, true, 0.01f}, nullptr,
                 found_inf.as<const int>());
  cuda::adamw_step(stream(), s.device_weights.as<float>(), s.device_grads.as<const float>(), s.device_first.as<float>(),
                   s.device_second.as<float>(), compute.data(), DType::kBF16, n, 1, 0.1f, AdamWOptions{}, nullptr,
                   found_inf.as<const int>());
  EXPECT_TRUE(same_bits(s.weights, s.device_weights.values<float>())) << "weights untouched";
  EXPECT_TRUE(same_bits(s.first, s.device_first.values<float>())) << "momentum untouched";
  EXPECT_TRUE(same_bits(s.second, s.device_second.values<float>())) << "second moment untouched";
  EXPECT_TRUE(same_bits(compute_tensor, compute.tensor({n}, DType::kBF16))) << "compute copy untouched";

  // A zero flag lets the step through.
  const DeviceArray clear(std::vector<int>{0});
  sgd_step(s.weights.data(), s.grads.data(), s.first.data(), n, 0.1f, SgdOptions{0.9f, true, 0.01f});
  cuda::sgd_step(stream(), s.device_weights.as<float>(), s.device_grads.as<const float>(), s.device_first.as<float>(),
                 nullptr, DType::kF32, n, 0.1f, SgdOptions{0.9f, true, 0.01f}, nullptr, clear.as<const int>());
  EXPECT_TRUE(same_bits(s.weights, s.device_weights.values<float>()));
}

// ---- loss scaling ------------------------------------------------------------------------

TEST_F(CudaOps, UnscaleAndCheckFlagsNonFiniteGradients) {
  Rng rng(19);
  for (const int64_t n : kSizes) {
    const std::vector<float> grads = random_values(n, DType::kF32, rng, -1e4, 1e4);
    struct Poison {
      const char* name;
      int64_t at;
      float value;
      float inverse_scale;
    };
    const std::array<Poison, 5> cases = {Poison{"finite", -1, 0.0f, 1.0f / 65536.0f},
                                         Poison{"inf first", 0, INFINITY, 0.5f}, Poison{"nan middle", n / 2, NAN, 0.5f},
                                         Poison{"-inf last", n - 1, -INFINITY, 0.5f},
                                         Poison{"overflow by the factor", n - 1, 3e38f, 2.0f}};
    for (const Poison& poison : cases) {
      SCOPED_TRACE(std::string(poison.name) + " n " + std::to_string(n));
      std::vector<float> x = grads;
      if (poison.at >= 0) x[static_cast<size_t>(poison.at)] = poison.value;
      DeviceArray device_x(x), flag(std::vector<int>{0});
      cuda::unscale_and_check(stream(), device_x.as<float>(), n, poison.inverse_scale, flag.as<int>());
      Tensor expected = Tensor::view_of(x.data(), {n}, DType::kF32);
      scale(expected, poison.inverse_scale);
      const std::vector<float> got = device_x.values<float>();
      if (poison.at < 0) {
        EXPECT_TRUE(same_bits(x, got));
      }
      EXPECT_EQ(flag.values<int>()[0], all_finite(expected) ? 0 : 1);
      // Never cleared by a finite tensor afterwards.
      const DeviceArray finite(grads);
      cuda::unscale_and_check(stream(), finite.as<float>(), n, 1.0f, flag.as<int>());
      EXPECT_EQ(flag.values<int>()[0], all_finite(expected) ? 0 : 1);
    }
  }
}

TEST_F(CudaOps, GradientScaleFactorIsTheTrainersFactor) {
  struct Case {
    double squared_norm;
    float loss_scale, clip;
  };
  for (const Case c :
       {Case{16.0 * 1024 * 1024, 1024.0f, 0.0f}, Case{16.0 * 1024 * 1024, 1024.0f, 1.0f}, Case{0.25, 1.0f, 1.0f},
        Case{12345.678, 3.0f, 2.5f}, Case{INFINITY, 8.0f, 1.0f}, Case{NAN, 8.0f, 0.0f}}) {
    SCOPED_TRACE("squared norm " + std::to_string(c.squared_norm) + " scale " + std::to_string(c.loss_scale) +
                 " clip " + std::to_string(c.clip));
    // train/trainer.cpp's arithmetic.
    const double norm = std::sqrt(c.squared_norm) / c.loss_scale;
    double factor = 1.0 / c.loss_scale;
    if (c.clip > 0.0f && norm > c.clip) factor *= c.clip / norm;
    const bool finite = std::isfinite(c.squared_norm);
    const DeviceArray squared(std::vector<double>{c.squared_norm});
    DeviceArray device_factor(sizeof(float)), flag(std::vector<int>{0});
    cuda::gradient_scale_factor(stream(), squared.as<const double>(), c.loss_scale, c.clip, device_factor.as<float>(),
                                flag.as<int>());
    EXPECT_EQ(flag.values<int>()[0], finite ? 0 : 1);
    if (finite) {
      EXPECT_TRUE(same_bits(std::vector<float>{static_cast<float>(factor)}, device_factor.values<float>()));
    }
  }
}

// ---- federation updates ------------------------------------------------------------------

TEST_F(CudaOps, DeltaAndWeightedAccumulateAreBitIdentical) {
  Rng rng(20);
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n " + std::to_string(n));
    const std::vector<float> a = awkward_values(n, rng), b = awkward_values(n, rng);
    std::vector<float> expected(static_cast<size_t>(n));
    for (size_t i = 0; i < expected.size(); ++i) expected[i] = a[i] - b[i];
    const DeviceArray device_a(a), device_b(b);
    DeviceArray out(expected.size() * sizeof(float));
    cuda::delta(stream(), device_a.as<const float>(), device_b.as<const float>(), out.as<float>(), n);
    std::vector<float> got = out.values<float>();
    for (size_t i = 0; i < got.size(); ++i) {  // Inf - Inf: both NaN, with whatever payload
      if (std::isnan(expected[i]) && std::isnan(got[i])) got[i] = expected[i];
    }
    EXPECT_TRUE(same_bits(expected, got)) << "delta";

    const std::vector<float> x = random_values(n, DType::kF32, rng, -10.0, 10.0);
    std::vector<double> accumulator(static_cast<size_t>(n));
    for (double& v : accumulator) v = rng.normal();
    DeviceArray device_accumulator(accumulator);
    const DeviceArray device_x(x);
    for (const double weight : {0.25, 1.0 / 3.0, 7.5}) {
      for (size_t i = 0; i < accumulator.size(); ++i) accumulator[i] += weight * static_cast<double>(x[i]);
      cuda::weighted_accumulate(stream(), device_accumulator.as<double>(), device_x.as<const float>(), weight, n);
    }
    EXPECT_TRUE(same_bits(accumulator, device_accumulator.values<double>())) << "weighted_accumulate";
  }
}

}  // namespace
}  // namespace fedmesh
