// The training ops on a CUDA device: the device-resident counterparts of the
// CPU kernels (gemm.h, elementwise.h, loss.h, layernorm.h, conv.h,
// embedding.h, optimizer.h, convert.h), a caching device allocator, and the
// federation's update kernels. Host header without CUDA includes: a build
// without the CUDA backend compiles it too (cuda_ops_cpu_only.cpp), where
// available() says why there is no backend and every op aborts.
//
// Conventions (implementation in kernels/cuda/*.cu):
// - Pointers are device pointers unless named `host`; a (pointer, DType)
//   pair is a buffer of fp32, bf16 or fp16. Arithmetic is fp32 (fp64 where
//   the CPU kernel uses fp64), and every op computes what its CPU kernel
//   computes: tests/kernels/test_cuda_ops.cpp holds each to it and states the
//   tolerances (bit-identical for most elementwise ops, the casts and the
//   optimizers).
// - Every op takes the stream it enqueues on and returns without waiting for
//   the device: only copy_to_host and synchronize wait. Scalars an op reports
//   (a loss, a norm, an overflow flag) go to device memory, so a training step
//   needs no host synchronization until a value is read for logging.
// - One device per process: the device current when the backend is first
//   used (device 0 unless the caller chose another). Shapes and sizes are
//   checked on the host and abort on a mismatch (FEDMESH_CHECK); data errors
//   found on the device (an out-of-range label or id) give NaN, not a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "base/status.h"
#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/layernorm.h"
#include "kernels/optimizer.h"
#include "kernels/tensor.h"

namespace fedmesh::cuda {

// ---- device and streams ------------------------------------------------------

// Ok when this build has the CUDA backend and the device can run its kernels;
// otherwise kUnavailable saying why ("this build has no CUDA backend ...",
// "no CUDA device (0 found)", the driver's error). Decided once per process.
Status available();

// In-site GPU ranks: makes device `rank` modulo the device count this
// process's device (cudaSetDevice) and returns its index. Call it before
// anything else of the backend (available() included), so that the process
// makes its context on that device only.
Result<int> use_device_for_rank(int rank);

// A cudaStream_t. nullptr is CUDA's legacy default stream.
using Stream = void*;
// A non-blocking stream created once per process (never destroyed).
Stream default_stream();
Stream create_stream();  // non-blocking
// Waits for the stream's work first: the blocks it freed may then serve a
// later stream that gets the same handle.
void destroy_stream(Stream stream);
void synchronize(Stream stream);  // waits for everything enqueued on stream

// ---- memory ------------------------------------------------------------------
// A caching allocator over cudaMalloc. Sizes round up to a class (multiples
// of 512 bytes up to 1 MiB, of 2 MiB above); a freed block is kept in a pool
// and handed out again for the same class, so a training step that allocates
// the same sizes every time calls cudaMalloc only in its first step. When
// cudaMalloc fails the pool is released (cudaFree) and the call retried once;
// a second failure aborts with the request and the pool's statistics.
//
// Blocks belong to a stream, as in PyTorch: a block freed after work on
// stream S was enqueued is reused only for allocations on S, whose work runs
// after that work. Using a block on another stream than the one it was
// allocated for needs the caller's own synchronization. Thread-safe.

struct AllocatorStats {
  uint64_t bytes_in_use = 0;    // size classes of live blocks
  uint64_t bytes_cached = 0;    // size classes of freed blocks kept for reuse
  uint64_t peak_bytes = 0;      // the largest bytes_in_use so far
  uint64_t device_mallocs = 0;  // successful cudaMalloc calls so far
};

// The fedmesh::Allocator view (device() == Device::kCuda): its blocks belong
// to default_stream(). allocate(0) returns nullptr.
Allocator& device_allocator();
// A block of at least `bytes` for work on `stream` (nullptr for 0 bytes).
void* allocate(size_t bytes, Stream stream);
// Returns a block from either interface to its stream's pool (nullptr: no-op).
void deallocate(void* pointer);
AllocatorStats allocator_stats();
// Waits for the device, then cudaFree's every cached block.
void empty_cache();

// An owned block from the caching allocator (move-only).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, Stream stream) : data_(allocate(bytes, stream)), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { deallocate(data_); }

  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Host to device: returns once `host` may be reused, without waiting for
// the copy to land. From pageable memory CUDA stages the bytes and may first
// wait for the stream's earlier work; page-locked memory avoids that.
void copy_to_device(const void* host, void* device, size_t bytes, Stream stream);
// Device to host: waits for the stream, so `host` holds the bytes on return.
void copy_to_host(const void* device, void* host, size_t bytes, Stream stream);
void copy_on_device(const void* source, void* destination, size_t bytes, Stream stream);
void set_zero(void* device, size_t bytes, Stream stream);

// ---- GEMM (cuBLASLt) ---------------------------------------------------------

enum class GemmEpilogueKind : uint8_t {
  kNone,
  kBias,      // c = product + bias
  kGeluBias,  // c = gelu(product + bias), GELU's tanh approximation (bias may be null: gelu(product))
};

struct GemmEpilogue {
  GemmEpilogueKind kind = GemmEpilogueKind::kNone;
  // (n) fp32, added to every row of c: the fp32 master bias, as the CPU's
  // add_bias takes it.
  const float* bias = nullptr;
  // kGeluBias only, optional: (m, n) dense, c's dtype, receives the values
  // GELU was applied to (product + bias), for gelu_backward.
  void* gelu_input_out = nullptr;
  // false: always the plain GEMM followed by fedmesh's own epilogue kernel
  // (for tests and benchmarks of the fused path).
  bool use_cublaslt_epilogue = true;
};

// c(m, n) = epilogue(alpha * op(a)(m, k) · op(b)(k, n) + beta * c), row-major
// with leading dimensions lda, ldb, ldc: fedmesh::sgemm's semantics
// (kernels/gemm.h). a and b have one dtype (fp32, bf16 or fp16); c has theirs
// or fp32. Products accumulate in fp32 (CUBLAS_COMPUTE_32F, never TF32), and
// the epilogue works on the fp32 result before the single rounding to c's
// dtype. The epilogue is cuBLASLt's where it takes the combination (c dense,
// i.e. ldc == n; n a multiple of 8 for gelu_input_out; dtypes and alignment
// its heuristic accepts), else the plain GEMM and fedmesh's kernel. One
// cuBLASLt handle per process, and a 32 MiB workspace per stream from the
// device allocator, both made on first use.
void gemm(Stream stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, DType a_type, int64_t lda, const void* b, DType b_type, int64_t ldb, float beta, void* c,
          DType c_type, int64_t ldc, const GemmEpilogue& epilogue = {});
// `batch` independent products c_i = alpha * op(a_i) · op(b_i) + beta * c_i,
// with a_i = a + i * stride_a elements (b_i and c_i alike): gemm's semantics
// and dtype rules without an epilogue, in one strided-batched cuBLASLt call.
void gemm_strided_batched(Stream stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const void* a, DType a_type, int64_t lda, int64_t stride_a, const void* b,
                          DType b_type, int64_t ldb, int64_t stride_b, float beta, void* c, DType c_type, int64_t ldc,
                          int64_t stride_c, int64_t batch);

// ---- elementwise and reductions (elementwise.h, convert.h) ------------------

void fill(Stream stream, void* x, DType x_type, int64_t n, float value);
void scale(Stream stream, void* x, DType x_type, int64_t n, float factor);  // x *= factor
// y += alpha * x
void axpy(Stream stream, float alpha, const void* x, DType x_type, void* y, DType y_type, int64_t n);
// dst = src, rounded to nearest even (kernels/half.h's conversions, NaN bits included).
void cast(Stream stream, const void* src, DType src_type, void* dst, DType dst_type, int64_t n);

// y (rows, n) += bias (n, fp32), broadcast over rows.
void add_bias(Stream stream, void* y, DType y_type, int64_t rows, int64_t n, const float* bias);
// db (n, fp32) = [accumulate ? db : 0] + sum over rows of dy (rows, n).
void bias_grad(Stream stream, const void* dy, DType dy_type, int64_t rows, int64_t n, float* db, bool accumulate);
// db (channels, fp32) = [accumulate ? db : 0] + sum over batch and positions of dy (batch, channels, positions).
void channel_bias_grad(Stream stream, const void* dy, DType dy_type, int64_t batch, int64_t channels, int64_t positions,
                       float* db, bool accumulate);

void relu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n);
// dx = dy where y > 0 else 0 (y is the forward output; dx may alias dy).
void relu_backward(Stream stream, const void* y, DType y_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n);
// GELU, tanh approximation, with elementwise.cpp's arithmetic.
void gelu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n);
// dx = dy * gelu'(x) (x is the forward input; dx may alias dy).
void gelu_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n);

// SiLU with elementwise.cpp's arithmetic: y = x * (1 / (1 + expf(-x))).
void silu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n);
// dx = dy * s * (1 + x * (1 - s)), s = 1 / (1 + expf(-x)) (dx may alias dy).
void silu_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n);
// out = a * b elementwise in fp32, b fp32 (a dropout mask); out may alias a.
void multiply(Stream stream, const void* a, DType a_type, const float* b, void* out, DType out_type, int64_t n);

// *out += sum of x^2, accumulated in fp64 in a fixed order (the same bits on
// every run). Zero *out first (set_zero) for a fresh sum; several tensors
// accumulate into one scalar.
void squared_l2_norm(Stream stream, const float* x, int64_t n, double* out);

// ---- layer norm (layernorm.h) ------------------------------------------------

// x, y (rows, n) any dtype; gamma, beta (n) fp32; mean, rstd (rows) fp32 outputs.
void layernorm_forward(Stream stream, const void* x, DType x_type, const float* gamma, const float* beta, void* y,
                       DType y_type, float* mean, float* rstd, int64_t rows, int64_t n,
                       float epsilon = kLayerNormEpsilon);
// dx (rows, n) any dtype, overwritten (may not alias dy); dgamma, dbeta (n)
// fp32, accumulated into.
void layernorm_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, const float* gamma,
                        const float* mean, const float* rstd, void* dx, DType dx_type, float* dgamma, float* dbeta,
                        int64_t rows, int64_t n);

// Group norm with layernorm.h's arithmetic (groupnorm_forward/backward
// there): x, y (batch, channels, positions) any dtype; gamma, beta
// (channels), mean, rstd (batch * groups) fp32. The fp64 sums may be added
// in another order than the CPU's (the results agree to rounding).
void groupnorm_forward(Stream stream, const GroupNormShape& s, const void* x, DType x_type, const float* gamma,
                       const float* beta, void* y, DType y_type, float* mean, float* rstd,
                       float epsilon = kGroupNormEpsilon);
// dx (may be null) overwritten; dgamma, dbeta (channels) fp32 accumulated into.
void groupnorm_backward(Stream stream, const GroupNormShape& s, const void* x, DType x_type, const void* dy,
                        DType dy_type, const float* gamma, const float* mean, const float* rstd, void* dx, DType dx_type,
                        float* dgamma, float* dbeta);

// ---- softmax cross-entropy (loss.h) ------------------------------------------

// logits (rows, classes) any dtype; labels (rows) int32 on the device. Adds
// sum over rows of -log softmax(logits)[label] to *loss_sum and the rows whose
// argmax (first maximum) equals the label to *correct (either may be null);
// dlogits (same shape, any dtype, may be null) receives
// grad_scale / normalizer * (softmax - onehot), as loss.h defines it. A label
// outside [0, classes) makes the loss NaN and that row's dlogits NaN.
// loss_sum is added to with one atomicAdd per row: its last bits may depend
// on the order rows finish; dlogits and correct do not. Unlike the CPU
// kernel (fp64), exp is taken in fp32: the losses and gradients agree to
// about 2^-16 relative (the bounds are stated with the test).
void softmax_cross_entropy(Stream stream, const void* logits, DType logits_type, const int32_t* labels, int64_t rows,
                           int64_t classes, void* dlogits, DType dlogits_type, float grad_scale, float normalizer,
                           double* loss_sum, int64_t* correct);

// ---- convolution and pooling (conv.h), NCHW ----------------------------------

// col (patch_size, batch*out_h*out_w) fp32 from x (batch, in_channels, height, width).
void im2col(Stream stream, const Conv2dGeometry& g, const void* x, DType x_type, float* col);
// dx (batch, in_channels, height, width) overwritten with the scatter-add of dcol.
void col2im(Stream stream, const Conv2dGeometry& g, const float* dcol, void* dx, DType dx_type);
// y (batch, out_channels, out_h, out_w) = conv(x, weight (out_channels,
// patch_size)) + bias (out_channels, fp32); col (patch_size, columns) fp32
// receives the column matrix for the backward pass. A weight that is not fp32
// is widened first (the GEMM multiplies fp32 columns).
void conv2d_forward(Stream stream, const Conv2dGeometry& g, const void* x, DType x_type, const void* weight,
                    DType weight_type, const float* bias, void* y, DType y_type, float* col);
// Accumulates dweight (out_channels, patch_size) and dbias (out_channels),
// both fp32; writes dx when it is not null.
void conv2d_backward(Stream stream, const Conv2dGeometry& g, const float* col, const void* weight, DType weight_type,
                     const void* dy, DType dy_type, float* dweight, float* dbias, void* dx, DType dx_type);
// y (batch, channels, out_h, out_w); argmax (same count) the flat index of the
// chosen input in its (height*width) plane: the first maximum in row-major
// window order.
void maxpool2d_forward(Stream stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type,
                       int32_t* argmax);
// dx overwritten: dy routed to the positions chosen in the forward pass.
void maxpool2d_backward(Stream stream, const Pool2dGeometry& g, const int32_t* argmax, const void* dy, DType dy_type,
                        void* dx, DType dx_type);
// Average pooling with conv.h's arithmetic (bit-identical to it): y is each
// window's fp32 sum in row-major order times 1 / kernel²; dx, overwritten,
// gathers per input the dy * (1 / kernel²) of the windows holding it, in
// row-major window order.
void avgpool2d_forward(Stream stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type);
void avgpool2d_backward(Stream stream, const Pool2dGeometry& g, const void* dy, DType dy_type, void* dx, DType dx_type);
// Global average pooling, conv.h's plane_mean: y (planes) = each plane's
// fp64 sum / area, rounded once (the sum's order may differ from the CPU's);
// dx (planes, area) = dy[plane] / area in fp32 (bit-identical).
void plane_mean_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t planes, int64_t area);
void plane_mean_backward(Stream stream, const void* dy, DType dy_type, void* dx, DType dx_type, int64_t planes,
                         int64_t area);

// ---- embedding (embedding.h) -------------------------------------------------

// out (count, dim) = table (vocabulary, dim)[ids]; an id outside the
// vocabulary gives a NaN row.
void embedding_forward(Stream stream, const void* table, DType table_type, int64_t vocabulary, int64_t dim,
                       const int32_t* ids, int64_t count, void* out, DType out_type);
// dtable (vocabulary, dim) fp32 += scatter of dout (count, dim) by ids, by
// atomicAdd (rows hit by several ids sum in no fixed order); ids outside the
// vocabulary are skipped.
void embedding_backward(Stream stream, const int32_t* ids, int64_t count, const void* dout, DType dout_type,
                        float* dtable, int64_t vocabulary, int64_t dim);

// ---- causal attention (attention.h) and token ids -----------------------------

// Causal attention itself (device::causal_attention_forward/backward in
// device_ops.cpp) is the fused kernels below where they apply, else batched
// GEMMs through gemm_strided_batched and these two row kernels, head by head
// over as many sequences as a workspace holds.
//
// scores (batch, seq, seq) fp32: the products q_t · k_j of `batch` (sequence,
// head) pairs. Row t keeps keys j <= t. probabilities (same shape, p_type)
// receive exp(scale * s_tj - lse_t) for j <= t and 0 past it, where lse_t is
// the log-sum-exp of the row's kept scale * s_tj, written to
// log_sum_exp[i * lse_stride + t] for pair i. Arithmetic in fp32, one
// rounding to p_type.
void causal_softmax(Stream stream, const float* scores, int64_t batch, int64_t seq, float scale, float* log_sum_exp,
                    int64_t lse_stride, void* probabilities, DType p_type);
// The same probabilities from the log-sum-exps causal_softmax wrote (the
// backward pass recomputing them).
void causal_probabilities(Stream stream, const float* scores, int64_t batch, int64_t seq, float scale,
                          const float* log_sum_exp, int64_t lse_stride, void* probabilities, DType p_type);
// The softmax's backward pass, in place: probabilities (batch, seq, seq,
// p_type) become scale * p_tj * (dp_tj - sum_k p_tk dp_tk) for j <= t (0 past
// it), the gradient with respect to the unscaled scores q_t · k_j, from
// dprobabilities (same shape, fp32).
void causal_softmax_backward(Stream stream, void* probabilities, DType p_type, const float* dprobabilities,
                             int64_t batch, int64_t seq, float scale);
// Fused causal attention (kernels/cuda/flash_attention.cu: FlashAttention-2
// tiles on tensor cores, no (seq, seq) buffer): qkv, out, dout and dqkv all
// of `dtype`, laid out as attention.h says; log_sum_exp (batch, heads, seq)
// fp32 is attention.h's `saved`. True when the fused kernels take this shape
// and dtype on this device: bf16 or fp16, head_dim 64 or 128, a device of
// compute capability 8.0 or newer with the shared memory they need (read
// once). The caller also needs every pointer 16-byte aligned.
bool flash_attention_supported(const AttentionShape& s, DType dtype);
void flash_attention_forward(Stream stream, const AttentionShape& s, DType dtype, const void* qkv, void* out,
                             float* log_sum_exp);
// dqkv is overwritten; it must not overlap qkv or dout. out is the forward
// pass's output (delta = rowsum(dout ∘ out) is taken from it). Deterministic.
void flash_attention_backward(Stream stream, const AttentionShape& s, DType dtype, const void* qkv, const void* out,
                              const float* log_sum_exp, const void* dout, void* dqkv);
// ids[i] = x[i] for token ids held in fp32 (the transformer's input); a value
// that is not an integer in [0, vocabulary) gives -1, which
// embedding_forward turns into a NaN row.
void token_ids(Stream stream, const float* x, int64_t n, int64_t vocabulary, int32_t* ids);

// ---- optimizers over fp32 master weights (optimizer.h) ----------------------
// optimizer.cpp's arithmetic, operation for operation, so a step is
// bit-identical to the CPU's. Each also:
// - multiplies every gradient by *grad_scale_inverse first when that device
//   scalar is given (loss-scale and clipping factor: the CPU trainer's
//   scale(grad, factor) fused into the step; grads itself is not written);
// - does nothing when found_inf is given and *found_inf != 0 (a skipped
//   step; the caller's step count for AdamW must skip it too);
// - writes the updated weights rounded to compute_type into compute_copy
//   when it is given (the low-precision copy the layers read).

void sgd_step(Stream stream, float* weights, const float* grads, float* momentum, void* compute_copy,
              DType compute_type, int64_t n, float lr, const SgdOptions& options,
              const float* grad_scale_inverse = nullptr, const int* found_inf = nullptr);
// `step` counts from 1 (bias correction).
void adamw_step(Stream stream, float* weights, const float* grads, float* first_moment, float* second_moment,
                void* compute_copy, DType compute_type, int64_t n, int64_t step, float lr, const AdamWOptions& options,
                const float* grad_scale_inverse = nullptr, const int* found_inf = nullptr);

// ---- loss scaling and clipping -----------------------------------------------

// grads *= inverse_scale; sets *found_inf = 1 when any product is not finite
// (never clears it: zero it before the first tensor of a step).
void unscale_and_check(Stream stream, float* grads, int64_t n, float inverse_scale, int* found_inf);
// The CPU trainer's factor from the squared gradient norm (squared_l2_norm
// over every gradient, still loss-scaled): norm = sqrt(*squared_norm) /
// loss_scale; *factor = 1 / loss_scale, times clip_grad_norm / norm when
// clip_grad_norm > 0 and norm exceeds it (computed in fp64, stored as fp32).
// A non-finite squared norm sets *found_inf = 1 (when given). Feed factor to
// the optimizer's grad_scale_inverse.
void gradient_scale_factor(Stream stream, const double* squared_norm, float loss_scale, float clip_grad_norm,
                           float* factor, int* found_inf);

// ---- federation updates ------------------------------------------------------
// (top-k, quantization and error feedback: kernels/cuda/compression_kernels.cu.)

// out = a - b (the delta w_local - w_base), fp32.
void delta(Stream stream, const float* a, const float* b, float* out, int64_t n);
// accumulator (fp64) += weight * x: the product and the sum each rounded once
// in fp64.
void weighted_accumulate(Stream stream, double* accumulator, const float* x, double weight, int64_t n);

}  // namespace fedmesh::cuda
