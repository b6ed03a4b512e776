// Fused causal attention on the device (kernels/cuda_ops.h), FlashAttention-2
// style: the (seq, seq) scores never reach global memory. Tensor cores through
// nvcuda::wmma (bf16/fp16 operands, fp32 accumulation); the softmax and its
// gradient in fp32 on tiles staged in shared memory.
//
// Tiles are 64 query rows by 64 keys, one block of 4 warps per tile. Every
// product a warp makes is 16 rows (its own) by 16 columns, written to shared
// memory as fp32 and read back by the same warp, so inside a tile's step only
// the loads of the shared operand tiles need a block barrier; a warp's own
// phases are ordered by __syncwarp.
//
// Masking: query t sees key j when j <= t and j < seq. Query tile i meets key
// tiles 0..i (the diagonal tile i last, partly masked); rows and keys past seq
// of a partial last tile are loaded as zeros, masked like the causal ones and
// never stored. Every query row t < seq has key 0 visible in key tile 0, so
// its running maximum is finite from the first step on.
//
// Forward (one block per query tile): the online softmax of FA2, the output
// accumulator kept fp32 in shared memory and rescaled row by row; the row's
// log-sum-exp L = m + log(l) goes to `lse`, the same quantity attention.h
// defines and the CPU and GEMM paths save.
//
// Backward, deterministic (no atomics, fixed loop orders: a launch always
// gives the same bits), in three kernels:
// - delta: one warp per query row, delta_t = Σ_c dO_tc O_tc summed in fp32
//   from the dtype's values of dO and of the forward pass's rounded output O,
//   into a scratch buffer. It equals the CPU's rowsum(dP ∘ P) in exact
//   arithmetic (O = P v); numerically it carries O's rounding.
// - dq: one block per query tile, over key tiles 0..i: recomputes
//   P = exp(scale s - L) and dP = dO vᵀ, forms dS = P ∘ (dP − delta) and
//   accumulates dQ = scale dS k in registers.
// - dkdv: one block per key tile j, over query tiles j..last: dV += Pᵀ dO,
//   dK += scale dSᵀ q in registers, with the same delta.
// The price of determinism is that S and dP are computed twice, once in
// each of the dq and dkdv kernels.
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/ops_common.cuh"

namespace fedmesh::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;                // query rows and keys per tile
constexpr int kFlashThreads = 128;       // 4 warps, 16 rows (or keys) each
constexpr int kScoreLd = kTile + 4;      // fp32 (64, 64) tiles: padded rows
constexpr int kProbLd = kTile + 8;       // 16-bit (64, 64) tiles
constexpr int64_t kMaxTiles = 65535;     // gridDim.y

template <int D>
struct Layout {
  static_assert(D % 16 == 0 && D <= 128, "head_dim: a multiple of 16 up to 128");
  static constexpr int kHalfLd = D + 8;  // 16-bit (64, D) tiles of q, k, v, dout
  static constexpr int kOutLd = D + 4;   // fp32 (64, D) tiles
  static constexpr size_t kHalfTile = size_t{kTile} * kHalfLd * 2;
  static constexpr size_t kScoreTile = size_t{kTile} * kScoreLd * sizeof(float);
  static constexpr size_t kProbTile = size_t{kTile} * kProbLd * 2;
  static constexpr size_t kOutTile = size_t{kTile} * kOutLd * sizeof(float);
  static constexpr size_t kRowStats = size_t{kTile} * sizeof(float);
  // q, k, v; S; P; O.
  static constexpr size_t kForwardBytes = 3 * kHalfTile + kScoreTile + kProbTile + kOutTile;
  // q, dO, k, v; S, dP (then the dQ staging tile); dS.
  static constexpr size_t kDqBytes = 4 * kHalfTile + 2 * kScoreTile + kProbTile;
  // k, v, q, dO; S, dP (then the dK/dV staging tile); P, dS; L, delta.
  static constexpr size_t kDkDvBytes = 4 * kHalfTile + 2 * kScoreTile + 2 * kProbTile + 2 * kRowStats;
  static_assert(kOutTile <= 2 * kScoreTile, "the staging tile reuses S and dP");
  static constexpr size_t kMaxBytes = std::max({kForwardBytes, kDqBytes, kDkDvBytes});
};

template <class T>
__device__ __forceinline__ float to_fp32(T v);
template <>
__device__ __forceinline__ float to_fp32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_fp32<__half>(__half v) {
  return __half2float(v);
}

template <class T>
__device__ __forceinline__ T from_fp32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_fp32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_fp32<__half>(float v) {
  return __float2half_rn(v);
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Bump allocation of the dynamic shared memory (every piece a multiple of
// 16 bytes long, so each stays 16-byte aligned; wmma needs 32 bytes at each
// fragment's start, which the 128-aligned base and the tile sizes give).
struct SharedCarver {
  unsigned char* next;
  template <class U>
  __device__ U* take(size_t bytes) {
    U* p = reinterpret_cast<U*>(next);
    next += bytes;
    return p;
  }
};

// rows [row0, row0 + 64) of a (seq, D) head slice whose rows are `stride`
// elements apart, into a (64, D) tile with leading dimension ld; rows at or
// past seq become zeros. 16-byte vectors (D is a multiple of 8 and every
// slice starts 16-byte aligned: checked on the host).
template <class T, int D>
__device__ void load_tile(T* tile, const T* slice, int64_t stride, int64_t row0, int64_t seq) {
  constexpr int kChunks = D / 8;
  constexpr int kLd = Layout<D>::kHalfLd;
  for (int i = threadIdx.x; i < kTile * kChunks; i += kFlashThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < seq) v = *reinterpret_cast<const uint4*>(slice + (row0 + r) * stride + c);
    *reinterpret_cast<uint4*>(tile + r * kLd + c) = v;
  }
}

using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using RowA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using ColA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using RowB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using ColB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// out (16, 16) fp32 at out_ld = a (16, D) · bᵀ, a and b row-major (16, D)
// blocks of 16-bit tiles with leading dimension ld (b read as a col-major
// (D, 16) matrix: the product of rows with rows).
template <class T, int D>
__device__ void rows_times_rows(const T* a, const T* b, int ld, float* out, int out_ld) {
  Accumulator acc;
  wmma::fill_fragment(acc, 0.0f);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    RowA<T> fa;
    ColB<T> fb;
    wmma::load_matrix_sync(fa, a + kk * 16, ld);
    wmma::load_matrix_sync(fb, b + kk * 16, ld);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(out, acc, out_ld, wmma::mem_row_major);
}

// ---- forward ---------------------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(const T* qkv, T* out, float* lse, int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd, kOutLd = L::kOutLd;
  extern __shared__ __align__(128) unsigned char shared[];
  SharedCarver carve{shared};
  T* sq = carve.take<T>(L::kHalfTile);
  T* sk = carve.take<T>(L::kHalfTile);
  T* sv = carve.take<T>(L::kHalfTile);
  float* ss = carve.take<float>(L::kScoreTile);
  T* sp = carve.take<T>(L::kProbTile);
  float* so = carve.take<float>(L::kOutTile);

  const int64_t b = blockIdx.x / heads, h = blockIdx.x % heads;
  const int64_t tile = gridDim.y - 1 - blockIdx.y;  // the longest rows first
  const int64_t q0 = tile * kTile;
  const int64_t width = heads * D, stride = 3 * width;
  const T* q_slice = qkv + b * seq * stride + h * D;
  const T* k_slice = q_slice + width;
  const T* v_slice = q_slice + 2 * width;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, r0 = warp * 16;

  load_tile<T, D>(sq, q_slice, stride, q0, seq);
  for (int i = lane; i < 16 * D; i += kWarp) so[(r0 + i / D) * kOutLd + i % D] = 0.0f;
  float row_max[16], row_sum[16];  // the warp's rows, the same in every lane
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    row_max[rr] = -INFINITY;
    row_sum[rr] = 0.0f;
  }

  for (int64_t kt = 0; kt <= tile; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();  // the last step's reads of sk and sv are done (and sq is loaded)
    load_tile<T, D>(sk, k_slice, stride, k0, seq);
    load_tile<T, D>(sv, v_slice, stride, k0, seq);
    __syncthreads();

    for (int n = 0; n < kTile / 16; ++n) {
      rows_times_rows<T, D>(sq + r0 * kLd, sk + n * 16 * kLd, kLd, ss + r0 * kScoreLd + n * 16, kScoreLd);
    }
    __syncwarp();

#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int r = r0 + rr;
      const int64_t t = q0 + r, j0 = k0 + lane, j1 = j0 + kWarp;
      const bool v0 = j0 <= t && j0 < seq, v1 = j1 <= t && j1 < seq;
      const float s0 = ss[r * kScoreLd + lane] * scale, s1 = ss[r * kScoreLd + lane + kWarp] * scale;
      const float tile_max = warp_max(fmaxf(v0 ? s0 : -INFINITY, v1 ? s1 : -INFINITY));
      const float new_max = fmaxf(row_max[rr], tile_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float p0 = v0 ? expf(s0 - base) : 0.0f, p1 = v1 ? expf(s1 - base) : 0.0f;
      const float alpha = expf(row_max[rr] - base);  // 0 while the row had no key
      row_sum[rr] = row_sum[rr] * alpha + warp_sum(p0 + p1);
      row_max[rr] = new_max;
      sp[r * kProbLd + lane] = from_fp32<T>(p0);
      sp[r * kProbLd + lane + kWarp] = from_fp32<T>(p1);
      // alpha is the same in every lane; multiplying by 1 changes no bit, so
      // the usual case of an unchanged maximum skips the shared memory pass.
      if (alpha != 1.0f) {
        for (int c = lane; c < D; c += kWarp) so[r * kOutLd + c] *= alpha;
      }
    }
    __syncwarp();

    for (int n = 0; n < D / 16; ++n) {  // O (16, D) += P (16, 64) · V (64, D)
      Accumulator acc;
      wmma::load_matrix_sync(acc, so + r0 * kOutLd + n * 16, kOutLd, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        RowA<T> fa;
        RowB<T> fb;
        wmma::load_matrix_sync(fa, sp + r0 * kProbLd + kk * 16, kProbLd);
        wmma::load_matrix_sync(fb, sv + kk * 16 * kLd + n * 16, kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(so + r0 * kOutLd + n * 16, acc, kOutLd, wmma::mem_row_major);
    }
    __syncwarp();
  }

#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int r = r0 + rr;
    const int64_t t = q0 + r;
    if (t >= seq) continue;
    const float inverse = 1.0f / row_sum[rr];
    T* row = out + (b * seq + t) * width + h * D;
    for (int c = lane; c < D; c += kWarp) row[c] = from_fp32<T>(so[r * kOutLd + c] * inverse);
    if (lane == 0) lse[(b * heads + h) * seq + t] = row_max[rr] + logf(row_sum[rr]);
  }
#else
  __trap();  // never launched: the host checks the compute capability
#endif
}

// ---- backward: delta -------------------------------------------------------------

constexpr int kDeltaThreads = 256;  // 8 warps, one query row each

// delta[(b * heads + h) * seq + t] = Σ_c dout_tc out_tc over head h's D
// columns of row b * seq + t of out and dout (rows heads * D apart), the
// products and their sum in fp32 in a fixed order. Each lane loads D / 32
// consecutive elements of each (one 4- or 8-byte vector: rows start 16-byte
// aligned, checked on the host, and D * 2 bytes is a multiple of 16).
template <class T, int D>
__global__ void __launch_bounds__(kDeltaThreads)
    flash_delta_kernel(const T* out, const T* dout, float* delta, int64_t rows, int64_t seq, int64_t heads) {
  static_assert(D % (2 * kWarp) == 0 && D / kWarp <= 4, "head_dim: 64 or 128");
  constexpr int kPer = D / kWarp;
  struct alignas(sizeof(T) * kPer) Chunk {
    T x[kPer];
  };
  const int lane = threadIdx.x % kWarp;
  const int64_t width = heads * D;
  const int64_t warps = grid_stride() / kWarp;
  for (int64_t row = grid_start() / kWarp; row < rows; row += warps) {  // row = (b * heads + h) * seq + t
    const int64_t t = row % seq, bh = row / seq;
    const int64_t b = bh / heads, h = bh % heads;
    const int64_t at = (b * seq + t) * width + h * D + lane * kPer;
    const Chunk o = *reinterpret_cast<const Chunk*>(out + at);
    const Chunk g = *reinterpret_cast<const Chunk*>(dout + at);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) sum += to_fp32(g.x[i]) * to_fp32(o.x[i]);
    sum = warp_sum(sum);
    if (lane == 0) delta[row] = sum;
  }
}

// ---- backward: dq --------------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_dq_kernel(const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv,
                             int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd, kOutLd = L::kOutLd;
  extern __shared__ __align__(128) unsigned char shared[];
  SharedCarver carve{shared};
  T* sq = carve.take<T>(L::kHalfTile);
  T* sdo = carve.take<T>(L::kHalfTile);
  T* sk = carve.take<T>(L::kHalfTile);
  T* sv = carve.take<T>(L::kHalfTile);
  float* ss = carve.take<float>(L::kScoreTile);
  float* sdp = carve.take<float>(L::kScoreTile);
  T* sds = carve.take<T>(L::kProbTile);
  float* so = ss;  // the staging tile, once S and dP are done with (it spans both)

  const int64_t b = blockIdx.x / heads, h = blockIdx.x % heads;
  const int64_t tile = gridDim.y - 1 - blockIdx.y;
  const int64_t q0 = tile * kTile;
  const int64_t width = heads * D, stride = 3 * width;
  const T* q_slice = qkv + b * seq * stride + h * D;
  const T* k_slice = q_slice + width;
  const T* v_slice = q_slice + 2 * width;
  const T* do_slice = dout + b * seq * width + h * D;
  const float* lse_row = lse + (b * heads + h) * seq;
  const float* delta_row = delta + (b * heads + h) * seq;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, r0 = warp * 16;

  load_tile<T, D>(sq, q_slice, stride, q0, seq);
  load_tile<T, D>(sdo, do_slice, width, q0, seq);
  float row_lse[16], row_delta[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t t = q0 + r0 + rr;
    row_lse[rr] = t < seq ? lse_row[t] : 0.0f;
    row_delta[rr] = t < seq ? delta_row[t] : 0.0f;
  }

  // S (the warp's 16 rows, 64 keys) = q kᵀ and dP = dO vᵀ of key tile kt.
  const auto scores = [&](int64_t kt) {
    __syncthreads();  // the last step's reads of sk and sv are done (and sq, sdo are loaded)
    load_tile<T, D>(sk, k_slice, stride, kt * kTile, seq);
    load_tile<T, D>(sv, v_slice, stride, kt * kTile, seq);
    __syncthreads();
    for (int n = 0; n < kTile / 16; ++n) {
      rows_times_rows<T, D>(sq + r0 * kLd, sk + n * 16 * kLd, kLd, ss + r0 * kScoreLd + n * 16, kScoreLd);
      rows_times_rows<T, D>(sdo + r0 * kLd, sv + n * 16 * kLd, kLd, sdp + r0 * kScoreLd + n * 16, kScoreLd);
    }
    __syncwarp();
  };
  // P_tj of row r0 + rr and column c (0 where masked).
  const auto probability = [&](int rr, int c, int64_t k0) {
    const int r = r0 + rr;
    const int64_t t = q0 + r, j = k0 + c;
    return j <= t && j < seq && t < seq ? expf(ss[r * kScoreLd + c] * scale - row_lse[rr]) : 0.0f;
  };

  Accumulator dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t kt = 0; kt <= tile; ++kt) {
    scores(kt);
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int r = r0 + rr;
      for (int c = lane; c < kTile; c += kWarp) {
        const float ds = probability(rr, c, kt * kTile) * (sdp[r * kScoreLd + c] - row_delta[rr]);
        sds[r * kProbLd + c] = from_fp32<T>(ds);
      }
    }
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {  // dQ (16, D) += dS (16, 64) · K (64, D)
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        RowA<T> fa;
        RowB<T> fb;
        wmma::load_matrix_sync(fa, sds + r0 * kProbLd + kk * 16, kProbLd);
        wmma::load_matrix_sync(fb, sk + kk * 16 * kLd + n * 16, kLd);
        wmma::mma_sync(dq[n], fa, fb, dq[n]);
      }
    }
  }

  __syncthreads();  // every warp's reads of S and dP are done: the staging tile overwrites them
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
#pragma unroll
    for (int i = 0; i < dq[n].num_elements; ++i) dq[n].x[i] *= scale;
    wmma::store_matrix_sync(so + r0 * kOutLd + n * 16, dq[n], kOutLd, wmma::mem_row_major);
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t t = q0 + r0 + rr;
    if (t >= seq) break;
    T* row = dqkv + (b * seq + t) * stride + h * D;
    for (int c = lane; c < D; c += kWarp) row[c] = from_fp32<T>(so[(r0 + rr) * kOutLd + c]);
  }
#else
  __trap();
#endif
}

// ---- backward: dk and dv -------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_dkdv_kernel(const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv,
                               int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd, kOutLd = L::kOutLd;
  extern __shared__ __align__(128) unsigned char shared[];
  SharedCarver carve{shared};
  T* sk = carve.take<T>(L::kHalfTile);
  T* sv = carve.take<T>(L::kHalfTile);
  T* sq = carve.take<T>(L::kHalfTile);
  T* sdo = carve.take<T>(L::kHalfTile);
  float* ss = carve.take<float>(L::kScoreTile);
  float* sdp = carve.take<float>(L::kScoreTile);
  T* sp = carve.take<T>(L::kProbTile);
  T* sds = carve.take<T>(L::kProbTile);
  float* slse = carve.take<float>(L::kRowStats);
  float* sdelta = carve.take<float>(L::kRowStats);
  float* so = ss;  // the staging tile, once S and dP are done with (it spans both)

  const int64_t b = blockIdx.x / heads, h = blockIdx.x % heads;
  const int64_t tile = blockIdx.y;  // key tile; the first ones meet the most query tiles
  const int64_t k0 = tile * kTile;
  const int64_t tiles = (seq + kTile - 1) / kTile;
  const int64_t width = heads * D, stride = 3 * width;
  const T* q_slice = qkv + b * seq * stride + h * D;
  const T* k_slice = q_slice + width;
  const T* v_slice = q_slice + 2 * width;
  const T* do_slice = dout + b * seq * width + h * D;
  const float* lse_row = lse + (b * heads + h) * seq;
  const float* delta_row = delta + (b * heads + h) * seq;
  // Warp w owns keys c0 .. c0 + 16 of the tile: their columns of S, dP, P
  // and dS, and their rows of dK and dV.
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, c0 = warp * 16;

  load_tile<T, D>(sk, k_slice, stride, k0, seq);
  load_tile<T, D>(sv, v_slice, stride, k0, seq);
  Accumulator dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }

  for (int64_t qt = tile; qt < tiles; ++qt) {
    const int64_t q0 = qt * kTile;
    __syncthreads();  // the last step's reads of sq, sdo, slse, sdelta are done (and sk, sv are loaded)
    load_tile<T, D>(sq, q_slice, stride, q0, seq);
    load_tile<T, D>(sdo, do_slice, width, q0, seq);
    for (int i = threadIdx.x; i < kTile; i += kFlashThreads) {
      slse[i] = q0 + i < seq ? lse_row[q0 + i] : 0.0f;
      sdelta[i] = q0 + i < seq ? delta_row[q0 + i] : 0.0f;
    }
    __syncthreads();

    for (int m = 0; m < kTile / 16; ++m) {  // S and dP (64 queries, the warp's 16 keys)
      rows_times_rows<T, D>(sq + m * 16 * kLd, sk + c0 * kLd, kLd, ss + m * 16 * kScoreLd + c0, kScoreLd);
      rows_times_rows<T, D>(sdo + m * 16 * kLd, sv + c0 * kLd, kLd, sdp + m * 16 * kScoreLd + c0, kScoreLd);
    }
    __syncwarp();
    for (int i = lane; i < kTile * 16; i += kWarp) {
      const int r = i / 16, c = c0 + i % 16;
      const int64_t t = q0 + r, j = k0 + c;
      const bool visible = j <= t && j < seq && t < seq;
      const float p = visible ? expf(ss[r * kScoreLd + c] * scale - slse[r]) : 0.0f;
      const float ds = visible ? p * (sdp[r * kScoreLd + c] - sdelta[r]) : 0.0f;
      sp[r * kProbLd + c] = from_fp32<T>(p);
      sds[r * kProbLd + c] = from_fp32<T>(ds);
    }
    __syncwarp();

#pragma unroll
    for (int n = 0; n < D / 16; ++n) {  // dV (16, D) += Pᵀ (16, 64) · dO (64, D); dK likewise with dS and q
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        ColA<T> fa;
        RowB<T> fb;
        wmma::load_matrix_sync(fa, sp + kk * 16 * kProbLd + c0, kProbLd);
        wmma::load_matrix_sync(fb, sdo + kk * 16 * kLd + n * 16, kLd);
        wmma::mma_sync(dv[n], fa, fb, dv[n]);
        wmma::load_matrix_sync(fa, sds + kk * 16 * kProbLd + c0, kProbLd);
        wmma::load_matrix_sync(fb, sq + kk * 16 * kLd + n * 16, kLd);
        wmma::mma_sync(dk[n], fa, fb, dk[n]);
      }
    }
  }

  // The warp's 16 keys: dK then dV through its own rows of the staging tile.
  __syncthreads();  // every warp's reads of S and dP are done: the staging tile overwrites them
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
#pragma unroll
    for (int i = 0; i < dk[n].num_elements; ++i) dk[n].x[i] *= scale;
    wmma::store_matrix_sync(so + c0 * kOutLd + n * 16, dk[n], kOutLd, wmma::mem_row_major);
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t j = k0 + c0 + rr;
    if (j >= seq) break;
    T* row = dqkv + (b * seq + j) * stride + width + h * D;
    for (int c = lane; c < D; c += kWarp) row[c] = from_fp32<T>(so[(c0 + rr) * kOutLd + c]);
  }
  __syncwarp();
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(so + c0 * kOutLd + n * 16, dv[n], kOutLd, wmma::mem_row_major);
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t j = k0 + c0 + rr;
    if (j >= seq) break;
    T* row = dqkv + (b * seq + j) * stride + 2 * width + h * D;
    for (int c = lane; c < D; c += kWarp) row[c] = from_fp32<T>(so[(c0 + rr) * kOutLd + c]);
  }
#else
  __trap();
#endif
}

// ---- host side -------------------------------------------------------------------

// Raises a kernel's dynamic shared memory limit (callers do it once per
// instantiation, in a function-local static).
template <class Kernel>
bool allow_shared_bytes(Kernel kernel, size_t bytes) {
  const int limit = static_cast<int>(bytes);
  FEDMESH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  return true;
}

template <class T, int D>
void forward(Stream stream, const AttentionShape& s, const void* qkv, void* out, float* lse) {
  using L = Layout<D>;
  const auto kernel = flash_forward_kernel<T, D>;
  [[maybe_unused]] static const bool allowed = allow_shared_bytes(kernel, L::kForwardBytes);
  const dim3 grid(static_cast<unsigned>(s.batch * s.heads), static_cast<unsigned>((s.seq + kTile - 1) / kTile));
  kernel<<<grid, kFlashThreads, L::kForwardBytes, to_cuda(stream)>>>(
      static_cast<const T*>(qkv), static_cast<T*>(out), lse, s.seq, s.heads, 1.0f / std::sqrt(static_cast<float>(D)));
  FEDMESH_CUDA_CHECK_LAUNCH();
}

template <class T, int D>
void backward(Stream stream, const AttentionShape& s, const void* qkv, const void* out, const float* lse,
              const void* dout, void* dqkv) {
  using L = Layout<D>;
  const auto dq_kernel = flash_backward_dq_kernel<T, D>;
  const auto dkdv_kernel = flash_backward_dkdv_kernel<T, D>;
  [[maybe_unused]] static const bool allowed =
      allow_shared_bytes(dq_kernel, L::kDqBytes) && allow_shared_bytes(dkdv_kernel, L::kDkDvBytes);
  const int64_t rows = s.batch * s.heads * s.seq;
  const DeviceBuffer delta(static_cast<size_t>(rows) * sizeof(float), stream);
  const dim3 grid(static_cast<unsigned>(s.batch * s.heads), static_cast<unsigned>((s.seq + kTile - 1) / kTile));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const T* q = static_cast<const T*>(qkv);
  const T* g = static_cast<const T*>(dout);
  T* dq = static_cast<T*>(dqkv);
  launch(flash_delta_kernel<T, D>, grid_for(rows * kWarp, kDeltaThreads), kDeltaThreads, stream,
         static_cast<const T*>(out), g, delta.as<float>(), rows, s.seq, s.heads);
  dq_kernel<<<grid, kFlashThreads, L::kDqBytes, to_cuda(stream)>>>(q, g, lse, delta.as<float>(), dq, s.seq, s.heads,
                                                                   scale);
  FEDMESH_CUDA_CHECK_LAUNCH();
  dkdv_kernel<<<grid, kFlashThreads, L::kDkDvBytes, to_cuda(stream)>>>(q, g, lse, delta.as<float>(), dq, s.seq,
                                                                       s.heads, scale);
  FEDMESH_CUDA_CHECK_LAUNCH();
}

// The device's opt-in shared memory per block and compute capability, read once.
struct DeviceLimits {
  int major = 0;
  size_t shared_bytes = 0;
};

const DeviceLimits& device_limits() {
  static const DeviceLimits limits = [] {
    DeviceLimits l;
    int device = 0, shared = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      cudaGetLastError();  // clear it: the GEMM path is used instead
      return DeviceLimits{};
    }
    l.shared_bytes = static_cast<size_t>(shared);
    return l;
  }();
  return limits;
}

size_t max_shared_bytes(int64_t head_dim) {
  switch (head_dim) {
    case 64: return Layout<64>::kMaxBytes;
    case 128: return Layout<128>::kMaxBytes;
    default: return 0;
  }
}

template <class Body>
void dispatch(const char* op, const AttentionShape& s, DType dtype, Body body) {
  FEDMESH_CHECK(flash_attention_supported(s, dtype),
                std::string("cuda::") + op + ": unsupported (head_dim " + std::to_string(s.head_dim) + ", " +
                    dtype_name(dtype) + ", seq " + std::to_string(s.seq) + "); ask flash_attention_supported first");
  const auto with_dim = [&]<class T>() {
    if (s.head_dim == 64) {
      body.template operator()<T, 64>();
    } else {
      body.template operator()<T, 128>();
    }
  };
  if (dtype == DType::kBF16) {
    with_dim.template operator()<__nv_bfloat16>();
  } else {
    with_dim.template operator()<__half>();
  }
}

}  // namespace

bool flash_attention_supported(const AttentionShape& s, DType dtype) {
  const size_t bytes = max_shared_bytes(s.head_dim);
  if (bytes == 0 || (dtype != DType::kBF16 && dtype != DType::kF16)) return false;
  if (s.batch < 0 || s.seq < 0 || s.heads <= 0 || s.batch * s.heads > INT32_MAX ||
      (s.seq + kTile - 1) / kTile > kMaxTiles) {
    return false;
  }
  const DeviceLimits& limits = device_limits();
  return limits.major >= 8 && limits.shared_bytes >= bytes;
}

void flash_attention_forward(Stream stream, const AttentionShape& s, DType dtype, const void* qkv, void* out,
                             float* log_sum_exp) {
  if (s.batch == 0 || s.seq == 0) return;
  dispatch("flash_attention_forward", s, dtype,
           [&]<class T, int D>() { forward<T, D>(stream, s, qkv, out, log_sum_exp); });
}

void flash_attention_backward(Stream stream, const AttentionShape& s, DType dtype, const void* qkv, const void* out,
                              const float* log_sum_exp, const void* dout, void* dqkv) {
  if (s.batch == 0 || s.seq == 0) return;
  dispatch("flash_attention_backward", s, dtype,
           [&]<class T, int D>() { backward<T, D>(stream, s, qkv, out, log_sum_exp, dout, dqkv); });
}

}  // namespace fedmesh::cuda
