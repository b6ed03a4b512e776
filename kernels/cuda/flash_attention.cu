// Fused causal attention on the device (kernels/cuda_ops.h), FlashAttention-2
// style: the (seq, seq) scores never reach global memory. Tensor cores with
// bf16/fp16 operands and fp32 accumulation.
//
// Tiles are 64 query rows by 64 keys, one block of 4 warps per tile, each
// warp 16 rows (or keys).
//
// Masking: query t sees key j when j <= t and j < seq. Query tile i meets key
// tiles 0..i (the diagonal tile i last, partly masked); rows and keys past seq
// of a partial last tile are loaded as zeros, masked like the causal ones and
// never stored. Every query row t < seq has key 0 visible in key tile 0, so
// its running maximum is finite from the first step on.
//
// Forward (one block per query tile): the online softmax of FA2 with every
// tile in registers (mma.sync and ldmatrix, described above the kernel); the
// row's log-sum-exp L = m + log(l) goes to `lse`, the same quantity
// attention.h defines and the CPU and GEMM paths save.
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
// each of the dq and dkdv kernels. All three matrix kernels keep their tiles
// in registers (mma.sync, ldmatrix, cp.async: described above the forward).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/ops_common.cuh"

namespace fedmesh::cuda {
namespace {

constexpr int kTile = 64;                // query rows and keys per tile
constexpr int kFlashThreads = 128;       // 4 warps, 16 rows (or keys) each
constexpr int64_t kMaxTiles = 65535;     // gridDim.y

template <int D>
struct Layout {
  static_assert(D % 16 == 0 && D <= 128, "head_dim: a multiple of 16 up to 128");
  static constexpr int kHalfLd = D + 8;  // 16-bit (64, D) tiles of q, k, v, dout
  static constexpr size_t kHalfTile = size_t{kTile} * kHalfLd * 2;
  static constexpr size_t kRowStats = size_t{kTile} * sizeof(float);
  // q; k and v, two buffers each.
  static constexpr size_t kForwardBytes = 5 * kHalfTile;
  // q, dO; k and v, two buffers each.
  static constexpr size_t kDqBytes = 6 * kHalfTile;
  // k, v; q, dO, L and delta, two buffers each.
  static constexpr size_t kDkDvBytes = 6 * kHalfTile + 4 * kRowStats;
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

// ---- raw tensor-core instructions (sm_80+) ----------------------------------------
//
// mma.sync m16n8k16 with 16-bit operands and fp32 accumulators. With
// g = lane / 4 and c = lane % 4 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), each thread holds:
// - A (16 x 16, row-major), 4 registers of 2 elements, the lower-numbered
//   column in the low half: a[0] = (g, 2c..2c+1), a[1] = (g + 8, 2c..2c+1),
//   a[2] = (g, 2c+8..2c+9), a[3] = (g + 8, 2c+8..2c+9).
// - B (16 x 8, k by n), 2 registers: b[0] = (k 2c..2c+1, n g),
//   b[1] = (k 2c+8..2c+9, n g).
// - C/D (16 x 8 fp32): d[0], d[1] = (g, 2c..2c+1); d[2], d[3] = (g + 8, 2c..2c+1).
// ldmatrix .x4 loads four 8 x 8 16-bit matrices; lanes 8m..8m+7 give the
// row addresses of matrix m (16 bytes each) and register m of lane l holds
// row l / 4, elements 2 (l % 4)..+1 of matrix m (of its transpose with
// .trans: memory rows 2 (l % 4)..+1, column l / 4).

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
#endif
}

// d (16 x 8, fp32) += a (16 x 16) · b (16 x 8).
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "bf16 or fp16 operands");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// Two values rounded to T, lo in the low half (the lower-numbered column).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof bits);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof bits);
  }
  return bits;
}

__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared_dst)),
               "l"(__cvta_generic_to_global(global_src))
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Rows [row0, row0 + 64) of a (seq, D) head slice whose rows are `stride`
// elements apart into a (64, D) tile with leading dimension kHalfLd, through
// cp.async in 16-byte vectors (D is a multiple of 8 and every slice starts
// 16-byte aligned: checked on the host). The copies stay in flight until
// cp_async_wait_all (then a barrier makes every thread's copies visible);
// rows at or past seq are zeroed by ordinary stores.
template <class T, int D>
__device__ void copy_tile_async(T* tile, const T* slice, int64_t stride, int64_t row0, int64_t seq) {
  constexpr int kChunks = D / 8;
  constexpr int kLd = Layout<D>::kHalfLd;
  for (int i = threadIdx.x; i < kTile * kChunks; i += kFlashThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    if (row0 + r < seq) {
      cp_async_16(tile + r * kLd + c, slice + (row0 + r) * stride + c);
    } else {
      *reinterpret_cast<uint4*>(tile + r * kLd + c) = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---- forward ---------------------------------------------------------------------
//
// FA2's register-resident loop. Warp w owns query rows r0 = 16 w .. r0 + 15
// of the tile; lane l holds rows r0 + g and r0 + g + 8 (g = l / 4) of every
// accumulator, at columns 2c, 2c + 1 of each 8-wide piece (c = l % 4), so a
// row's four holders are the quad 4g .. 4g + 3 and row reductions are two
// shuffles (xor 1, xor 2), which leave the same bits in all four lanes.
// Per key tile (64 keys): S (16 x 64) = 8 accumulators of q kᵀ, q's
// A fragments loaded once, k's B fragments by ldmatrix from k's rows; the
// mask and the online softmax on the registers; P rounded to T and packed as
// the A fragments of P · V (S accumulators 2j and 2j + 1 are exactly the A
// fragment of keys 16j .. 16j + 15: a[0] = d[0..1] of 2j, a[1] = d[2..3] of 2j,
// a[2] = d[0..1] of 2j + 1, a[3] = d[2..3] of 2j + 1); V's B fragments by
// ldmatrix .trans from v's rows; O (16 x D) in D / 8 accumulators, rescaled
// in place. k and v are double-buffered: tile kt + 1 is copied (cp.async)
// while tile kt is multiplied. Shared rows are D + 8 elements long, so the
// eight 16-byte rows of an ldmatrix matrix fall in distinct banks.
template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(const T* qkv, T* out, float* lse, int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd;
  constexpr int kTileElements = kTile * kLd;
  extern __shared__ __align__(128) unsigned char shared[];
  T* sq = reinterpret_cast<T*>(shared);
  T* sk = sq + kTileElements;      // two buffers
  T* sv = sk + 2 * kTileElements;  // two buffers

  const int64_t b = blockIdx.x / heads, h = blockIdx.x % heads;
  const int64_t tile = gridDim.y - 1 - blockIdx.y;  // the longest rows first
  const int64_t q0 = tile * kTile;
  const int64_t width = heads * D, stride = 3 * width;
  const T* q_slice = qkv + b * seq * stride + h * D;
  const T* k_slice = q_slice + width;
  const T* v_slice = q_slice + 2 * width;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, r0 = warp * 16;
  const int g = lane / 4, c = lane % 4;
  const int64_t t_row[2] = {q0 + r0 + g, q0 + r0 + g + 8};  // this lane's two query rows

  copy_tile_async<T, D>(sq, q_slice, stride, q0, seq);
  copy_tile_async<T, D>(sk, k_slice, stride, 0, seq);
  copy_tile_async<T, D>(sv, v_slice, stride, 0, seq);
  cp_async_commit();

  uint32_t qa[D / 16][4];  // q's A fragments, k-step kk = columns 16 kk .. 16 kk + 15
  float o[D / 8][4];       // O, accumulator n = columns 8n .. 8n + 7
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  for (int64_t kt = 0; kt <= tile; ++kt) {
    const int64_t k0 = kt * kTile;
    // Tile kt has landed, and every warp is done with tile kt - 1, whose
    // buffers the next copy overwrites.
    cp_async_wait_all();
    __syncthreads();
    const T* kb = sk + (kt & 1) * kTileElements;
    const T* vb = sv + (kt & 1) * kTileElements;
    if (kt < tile) {
      copy_tile_async<T, D>(sk + ((kt + 1) & 1) * kTileElements, k_slice, stride, k0 + kTile, seq);
      copy_tile_async<T, D>(sv + ((kt + 1) & 1) * kTileElements, v_slice, stride, k0 + kTile, seq);
      cp_async_commit();
    }
    if (kt == 0) {
      // Matrices: rows 0-7 / 8-15 (lanes 0-7 / 8-15) by columns 0-7, then
      // the same rows by columns 8-15 (lanes 16-31): a[0..3] in order.
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], sq + (r0 + lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
    }

    // S = q kᵀ: accumulator j = keys 8j .. 8j + 7. B (k = head column,
    // n = key) is k's rows read as they are; one x4 covers keys 16p .. 16p + 15:
    // matrices (keys +0-7, columns +0-7), (keys +0-7, columns +8-15),
    // (keys +8-15, columns +0-7), (keys +8-15, columns +8-15) =
    // b[0], b[1] of accumulator 2p and b[0], b[1] of accumulator 2p + 1.
    float s[kTile / 8][4];
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int p = 0; p < kTile / 16; ++p) {
        uint32_t kf[4];
        ldmatrix_x4(kf, kb + (16 * p + (lane / 16) * 8 + lane % 8) * kLd + kk * 16 + ((lane / 8) % 2) * 8);
        mma_16816<T>(s[2 * p], qa[kk], kf[0], kf[1]);
        mma_16816<T>(s[2 * p + 1], qa[kk], kf[2], kf[3]);
      }
    }

    // Scale and mask: s[j][e] is row t_row[e / 2], key k0 + 8j + 2c + e % 2.
    // Only the diagonal tile (and a tile reaching past seq, which is the
    // diagonal one) has keys a row must not see.
    const bool edge = kt == tile || k0 + kTile > seq;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = k0 + 8 * j + 2 * c + e % 2;
        const bool visible = !edge || (key <= t_row[e / 2] && key < seq);
        s[j][e] = visible ? s[j][e] * scale : -INFINITY;
      }
    }

    // Online softmax, row half hh = rows g (e = 0, 1) and g + 8 (e = 2, 3).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * hh], s[j][2 * hh + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float new_max = fmaxf(row_max[hh], tile_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = expf(row_max[hh] - base);  // 0 while the row had no key
      float tile_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
        // expf(-inf) = 0: masked keys get p = 0.
        s[j][2 * hh] = expf(s[j][2 * hh] - base);
        s[j][2 * hh + 1] = expf(s[j][2 * hh + 1] - base);
        tile_sum += s[j][2 * hh] + s[j][2 * hh + 1];
      }
      tile_sum += __shfl_xor_sync(kFullMask, tile_sum, 1);
      tile_sum += __shfl_xor_sync(kFullMask, tile_sum, 2);
      row_sum[hh] = row_sum[hh] * alpha + tile_sum;
      row_max[hh] = new_max;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * hh] *= alpha;
        o[n][2 * hh + 1] *= alpha;
      }
    }

    // O += P · V over k-steps kk = keys 16 kk .. 16 kk + 15. B (k = key,
    // n = head column) is v's rows transposed; one x4 .trans covers columns
    // 16 np .. 16 np + 15: matrices (keys +0-7, columns +0-7),
    // (keys +8-15, columns +0-7), (keys +0-7, columns +8-15),
    // (keys +8-15, columns +8-15) = b[0], b[1] of accumulator 2 np and
    // b[0], b[1] of accumulator 2 np + 1.
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, vb + (16 * kk + lane % 16) * kLd + 16 * np + (lane / 16) * 8);
        mma_16816<T>(o[2 * np], pa, vf[0], vf[1]);
        mma_16816<T>(o[2 * np + 1], pa, vf[2], vf[3]);
      }
    }
  }

  // O / l, rounded to T, through the warp's own rows of sq (only this warp
  // read them, into qa, before its first product), then 16-byte row stores.
  float inverse[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) inverse[hh] = 1.0f / row_sum[hh];
  T* so = sq + r0 * kLd;
  __syncwarp();  // every lane's ldmatrix reads of these rows are done before any lane overwrites them
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      *reinterpret_cast<uint32_t*>(so + (g + 8 * hh) * kLd + 8 * n + 2 * c) =
          pack2<T>(o[n][2 * hh] * inverse[hh], o[n][2 * hh + 1] * inverse[hh]);
    }
  }
  if (c == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (t_row[hh] < seq) lse[(b * heads + h) * seq + t_row[hh]] = row_max[hh] + logf(row_sum[hh]);
    }
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int i = lane; i < 16 * kChunks; i += kWarp) {
    const int rr = i / kChunks, col = (i % kChunks) * 8;
    const int64_t t = q0 + r0 + rr;
    if (t < seq) {
      *reinterpret_cast<uint4*>(out + (b * seq + t) * width + h * D + col) =
          *reinterpret_cast<const uint4*>(so + rr * kLd + col);
    }
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
//
// The forward's register layout (see flash_forward_kernel): warp w owns query
// rows 16 w .. 16 w + 15, q's and dO's A fragments are loaded once. Per
// 16 keys (16p .. 16p + 15 of key tile kt): S = q kᵀ and dP = dO vᵀ in two
// accumulators each (k's and v's rows read as they are, like k in the
// forward), dS = P ∘ (dP − delta) on the registers, rounded to T and packed
// as the A fragment of those 16 keys (as P in the forward), then
// dQ (16 x D) += dS · k with k's B fragments by ldmatrix .trans (like v in
// the forward). k and v are double-buffered through cp.async.
template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_dq_kernel(const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv,
                             int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd;
  constexpr int kTileElements = kTile * kLd;
  extern __shared__ __align__(128) unsigned char shared[];
  T* sq = reinterpret_cast<T*>(shared);
  T* sdo = sq + kTileElements;
  T* sk = sdo + kTileElements;     // two buffers
  T* sv = sk + 2 * kTileElements;  // two buffers

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
  const int g = lane / 4, c = lane % 4;
  const int64_t t_row[2] = {q0 + r0 + g, q0 + r0 + g + 8};  // this lane's two query rows

  copy_tile_async<T, D>(sq, q_slice, stride, q0, seq);
  copy_tile_async<T, D>(sdo, do_slice, width, q0, seq);
  copy_tile_async<T, D>(sk, k_slice, stride, 0, seq);
  copy_tile_async<T, D>(sv, v_slice, stride, 0, seq);
  cp_async_commit();

  float row_lse[2], row_delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_lse[hh] = t_row[hh] < seq ? lse_row[t_row[hh]] : 0.0f;
    row_delta[hh] = t_row[hh] < seq ? delta_row[t_row[hh]] : 0.0f;
  }
  uint32_t qa[D / 16][4], da[D / 16][4];  // q's and dO's A fragments
  float dq[D / 8][4];                     // dQ / scale, accumulator n = columns 8n .. 8n + 7
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
  }

  for (int64_t kt = 0; kt <= tile; ++kt) {
    const int64_t k0 = kt * kTile;
    cp_async_wait_all();
    __syncthreads();  // tile kt has landed; every warp is done with tile kt - 1
    const T* kb = sk + (kt & 1) * kTileElements;
    const T* vb = sv + (kt & 1) * kTileElements;
    if (kt < tile) {
      copy_tile_async<T, D>(sk + ((kt + 1) & 1) * kTileElements, k_slice, stride, k0 + kTile, seq);
      copy_tile_async<T, D>(sv + ((kt + 1) & 1) * kTileElements, v_slice, stride, k0 + kTile, seq);
      cp_async_commit();
    }
    if (kt == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(qa[kk], sq + (r0 + lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
        ldmatrix_x4(da[kk], sdo + (r0 + lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
      }
    }
    // Only the diagonal tile and the last query tile (rows past seq) have
    // pairs to mask.
    const bool edge = kt == tile || q0 + kTile > seq || k0 + kTile > seq;

#pragma unroll
    for (int p = 0; p < kTile / 16; ++p) {
      // s[jj], dp[jj]: keys 16p + 8jj .. 16p + 8jj + 7.
      float s[2][4], dp[2][4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[jj][e] = dp[jj][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int at = (16 * p + (lane / 16) * 8 + lane % 8) * kLd + kk * 16 + ((lane / 8) % 2) * 8;
        uint32_t kf[4], vf[4];
        ldmatrix_x4(kf, kb + at);
        mma_16816<T>(s[0], qa[kk], kf[0], kf[1]);
        mma_16816<T>(s[1], qa[kk], kf[2], kf[3]);
        ldmatrix_x4(vf, vb + at);
        mma_16816<T>(dp[0], da[kk], vf[0], vf[1]);
        mma_16816<T>(dp[1], da[kk], vf[2], vf[3]);
      }
      // dS: s[jj][e] is row t_row[e / 2], key k0 + 16p + 8jj + 2c + e % 2.
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = k0 + 16 * p + 8 * jj + 2 * c + e % 2, t = t_row[e / 2];
          const bool visible = !edge || (key <= t && key < seq && t < seq);
          s[jj][e] = visible ? expf(s[jj][e] * scale - row_lse[e / 2]) * (dp[jj][e] - row_delta[e / 2]) : 0.0f;
        }
      }
      const uint32_t sa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                              pack2<T>(s[1][2], s[1][3])};
      // dQ += dS (16 x 16 keys) · k (16 keys x D).
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t kf[4];
        ldmatrix_x4_trans(kf, kb + (16 * p + lane % 16) * kLd + 16 * np + (lane / 16) * 8);
        mma_16816<T>(dq[2 * np], sa, kf[0], kf[1]);
        mma_16816<T>(dq[2 * np + 1], sa, kf[2], kf[3]);
      }
    }
  }

  // scale dQ, rounded to T, through the warp's own rows of sq (only this
  // warp read them, before its first product), then 16-byte row stores.
  T* so = sq + r0 * kLd;
  __syncwarp();  // every lane's ldmatrix reads of these rows are done before any lane overwrites them
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      *reinterpret_cast<uint32_t*>(so + (g + 8 * hh) * kLd + 8 * n + 2 * c) =
          pack2<T>(dq[n][2 * hh] * scale, dq[n][2 * hh + 1] * scale);
    }
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int i = lane; i < 16 * kChunks; i += kWarp) {
    const int rr = i / kChunks, col = (i % kChunks) * 8;
    const int64_t t = q0 + r0 + rr;
    if (t < seq) {
      *reinterpret_cast<uint4*>(dqkv + (b * seq + t) * stride + h * D + col) =
          *reinterpret_cast<const uint4*>(so + rr * kLd + col);
    }
  }
#else
  __trap();
#endif
}

// ---- backward: dk and dv -------------------------------------------------------
//
// The dq kernel with the roles of queries and keys swapped: warp w owns keys
// c0 = 16 w .. c0 + 15 of key tile `tile`, k's and v's A fragments are
// loaded once, and the block walks query tiles tile .. last. Per 16 queries
// (16p .. 16p + 15 of query tile qt): Sᵀ = k qᵀ and dPᵀ = v dOᵀ in two
// accumulators each (q's and dO's rows read as they are, like k in the
// forward); Pᵀ = exp(scale Sᵀ − L) and dSᵀ = Pᵀ ∘ (dPᵀ − delta) on the
// registers with L and delta of the accumulator's query column, each rounded
// to T and packed as the A fragment of those 16 queries (as P in the
// forward); then dV (16 x D) += Pᵀ · dO and dK (16 x D) += dSᵀ · q with dO's
// and q's B fragments by ldmatrix .trans (like v in the forward). q, dO and
// their rows' L and delta are double-buffered (cp.async for the tiles).
// On the diagonal tile, warp w's keys are past every query of chunks p < w:
// those chunks add nothing and are skipped.
template <class T, int D>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_dkdv_kernel(const T* qkv, const T* dout, const float* lse, const float* delta, T* dqkv,
                               int64_t seq, int64_t heads, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<D>;
  constexpr int kLd = L::kHalfLd;
  constexpr int kTileElements = kTile * kLd;
  extern __shared__ __align__(128) unsigned char shared[];
  T* sk = reinterpret_cast<T*>(shared);
  T* sv = sk + kTileElements;
  T* sq = sv + kTileElements;       // two buffers
  T* sdo = sq + 2 * kTileElements;  // two buffers
  float* slse = reinterpret_cast<float*>(sdo + 2 * kTileElements);  // two buffers of kTile
  float* sdelta = slse + 2 * kTile;                                   // two buffers of kTile

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
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, c0 = warp * 16;
  const int g = lane / 4, c = lane % 4;
  const int64_t j_row[2] = {k0 + c0 + g, k0 + c0 + g + 8};  // this lane's two keys

  // Rows q0 .. q0 + 63 of L and delta into buffer `buffer` (zeros past seq).
  const auto load_stats = [&](int buffer, int64_t q0) {
    for (int i = threadIdx.x; i < 2 * kTile; i += kFlashThreads) {
      const int r = i % kTile;
      const float* from = i < kTile ? lse_row : delta_row;
      float* to = (i < kTile ? slse : sdelta) + buffer * kTile;
      to[r] = q0 + r < seq ? from[q0 + r] : 0.0f;
    }
  };

  copy_tile_async<T, D>(sk, k_slice, stride, k0, seq);
  copy_tile_async<T, D>(sv, v_slice, stride, k0, seq);
  copy_tile_async<T, D>(sq, q_slice, stride, k0, seq);
  copy_tile_async<T, D>(sdo, do_slice, width, k0, seq);
  cp_async_commit();
  load_stats(0, k0);

  uint32_t ka[D / 16][4], va[D / 16][4];  // k's and v's A fragments (the warp's 16 keys)
  float dk[D / 8][4], dv[D / 8][4];       // dK / scale and dV, accumulator n = columns 8n .. 8n + 7
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  }

  for (int64_t qt = tile; qt < tiles; ++qt) {
    const int64_t q0 = qt * kTile;
    const int buffer = static_cast<int>((qt - tile) & 1);
    cp_async_wait_all();
    __syncthreads();  // tile qt and its statistics have landed; every warp is done with tile qt - 1
    const T* qb = sq + buffer * kTileElements;
    const T* dob = sdo + buffer * kTileElements;
    const float* lb = slse + buffer * kTile;
    const float* db = sdelta + buffer * kTile;
    if (qt + 1 < tiles) {
      copy_tile_async<T, D>(sq + (buffer ^ 1) * kTileElements, q_slice, stride, q0 + kTile, seq);
      copy_tile_async<T, D>(sdo + (buffer ^ 1) * kTileElements, do_slice, width, q0 + kTile, seq);
      cp_async_commit();
      load_stats(buffer ^ 1, q0 + kTile);
    }
    if (qt == tile) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(ka[kk], sk + (c0 + lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
        ldmatrix_x4(va[kk], sv + (c0 + lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
      }
    }
    // Only the diagonal tile and the last tiles (queries or keys past seq)
    // have pairs to mask.
    const bool edge = qt == tile || q0 + kTile > seq || k0 + kTile > seq;

#pragma unroll
    for (int p = 0; p < kTile / 16; ++p) {
      if (qt == tile && p < warp) continue;  // every query of the chunk precedes the warp's keys
      // st[jj], dpt[jj]: queries 16p + 8jj .. 16p + 8jj + 7.
      float st[2][4], dpt[2][4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[jj][e] = dpt[jj][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int at = (16 * p + (lane / 16) * 8 + lane % 8) * kLd + kk * 16 + ((lane / 8) % 2) * 8;
        uint32_t qf[4], df[4];
        ldmatrix_x4(qf, qb + at);
        mma_16816<T>(st[0], ka[kk], qf[0], qf[1]);
        mma_16816<T>(st[1], ka[kk], qf[2], qf[3]);
        ldmatrix_x4(df, dob + at);
        mma_16816<T>(dpt[0], va[kk], df[0], df[1]);
        mma_16816<T>(dpt[1], va[kk], df[2], df[3]);
      }
      // st[jj][e] is key j_row[e / 2], query q0 + 16p + 8jj + 2c + e % 2:
      // st becomes Pᵀ and dpt dSᵀ.
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * p + 8 * jj + 2 * c + e % 2;
          const int64_t t = q0 + r, key = j_row[e / 2];
          const bool visible = !edge || (key <= t && key < seq && t < seq);
          const float pt = visible ? expf(st[jj][e] * scale - lb[r]) : 0.0f;
          dpt[jj][e] = visible ? pt * (dpt[jj][e] - db[r]) : 0.0f;
          st[jj][e] = pt;
        }
      }
      const uint32_t pa[4] = {pack2<T>(st[0][0], st[0][1]), pack2<T>(st[0][2], st[0][3]),
                              pack2<T>(st[1][0], st[1][1]), pack2<T>(st[1][2], st[1][3])};
      const uint32_t sa[4] = {pack2<T>(dpt[0][0], dpt[0][1]), pack2<T>(dpt[0][2], dpt[0][3]),
                              pack2<T>(dpt[1][0], dpt[1][1]), pack2<T>(dpt[1][2], dpt[1][3])};
      // dV += Pᵀ (16 keys x 16 queries) · dO (16 queries x D); dK likewise with dSᵀ and q.
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        const int at = (16 * p + lane % 16) * kLd + 16 * np + (lane / 16) * 8;
        uint32_t df[4], qf[4];
        ldmatrix_x4_trans(df, dob + at);
        mma_16816<T>(dv[2 * np], pa, df[0], df[1]);
        mma_16816<T>(dv[2 * np + 1], pa, df[2], df[3]);
        ldmatrix_x4_trans(qf, qb + at);
        mma_16816<T>(dk[2 * np], sa, qf[0], qf[1]);
        mma_16816<T>(dk[2 * np + 1], sa, qf[2], qf[3]);
      }
    }
  }

  // scale dK and dV, rounded to T, through the warp's own rows of sk and sv
  // (only this warp read them, into ka and va, before its first product),
  // then 16-byte row stores.
  T* sok = sk + c0 * kLd;
  T* sov = sv + c0 * kLd;
  __syncwarp();  // every lane's ldmatrix reads of these rows are done before any lane overwrites them
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      *reinterpret_cast<uint32_t*>(sok + (g + 8 * hh) * kLd + 8 * n + 2 * c) =
          pack2<T>(dk[n][2 * hh] * scale, dk[n][2 * hh + 1] * scale);
      *reinterpret_cast<uint32_t*>(sov + (g + 8 * hh) * kLd + 8 * n + 2 * c) =
          pack2<T>(dv[n][2 * hh], dv[n][2 * hh + 1]);
    }
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int i = lane; i < 16 * kChunks; i += kWarp) {
    const int rr = i / kChunks, col = (i % kChunks) * 8;
    const int64_t j = k0 + c0 + rr;
    if (j < seq) {
      T* row = dqkv + (b * seq + j) * stride + h * D + col;
      *reinterpret_cast<uint4*>(row + width) = *reinterpret_cast<const uint4*>(sok + rr * kLd + col);
      *reinterpret_cast<uint4*>(row + 2 * width) = *reinterpret_cast<const uint4*>(sov + rr * kLd + col);
    }
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
