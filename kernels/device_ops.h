// The Tensor-level kernels (gemm.h, elementwise.h, convert.h, layernorm.h,
// conv.h, loss.h) for tensors on the CUDA device: each CPU kernel hands a
// call whose tensors live on Device::kCuda to its counterpart here, which
// enqueues kernels/cuda_ops.h's op on cuda::default_stream() (where every
// device tensor's storage belongs) and returns without waiting, so the same
// layers and trainer run on either device. Shapes are checked as the CPU
// kernels check them; mixing devices in one call aborts naming the op.
//
// The CPU kernels' buffers that are not Tensors (conv's column matrix, the
// pooling argmax, labels, the step's scalars) have device forms here: a Tensor
// for the columns, DeviceBuffers for the integers and scalars.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/cuda_ops.h"
#include "kernels/tensor.h"

namespace fedmesh::device {

inline bool on_cuda(const Tensor& t) { return t.device() == Device::kCuda; }
// Aborts unless every tensor is on the CUDA device (names `op`).
void require_cuda(const char* op, std::initializer_list<const Tensor*> tensors);
// Aborts when any tensor is on the CUDA device: for the CPU kernels that have
// no device form here (they would read device memory on the host).
void require_host(const char* op, std::initializer_list<const Tensor*> tensors);

// bias (n, fp32), when given, is added to every row of c in the GEMM's
// epilogue (cuBLASLt's where it takes it).
void gemm(bool transpose_a, bool transpose_b, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c,
          const Tensor* bias = nullptr);

void fill(Tensor& x, float value);
void scale(Tensor& x, float factor);
void axpy(float alpha, const Tensor& x, Tensor& y);
void convert(const Tensor& src, Tensor& dst);
void add_bias(Tensor& y, const Tensor& bias);
void bias_grad(const Tensor& dy, Tensor& db, bool accumulate);
void channel_bias_grad(const Tensor& dy, Tensor& db, bool accumulate);
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void silu_forward(const Tensor& x, Tensor& y);
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
// out = a * b, b fp32.
void mul(const Tensor& a, const Tensor& b, Tensor& out);
// Adds x's squared L2 norm (fp32 x) to the device scalar *sum (fp64).
void add_squared_l2_norm(const Tensor& x, double* sum);
// The squared L2 norm read back to the host (waits for the device).
double squared_l2_norm(const Tensor& x);

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                       float epsilon);
void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                        Tensor& dx, Tensor& dgamma, Tensor& dbeta);

// col: an fp32 device tensor, made (patch_size, columns) here.
void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                    Tensor& col);
void conv2d_backward(const Conv2dGeometry& g, const Tensor& col, const Tensor& weight, const Tensor& dy,
                     Tensor& dweight, Tensor& dbias, Tensor* dx);
// argmax: a device buffer of y.numel() int32, grown here when too small.
void maxpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y, cuda::DeviceBuffer& argmax);
void maxpool2d_backward(const Pool2dGeometry& g, const cuda::DeviceBuffer& argmax, const Tensor& dy, Tensor& dx);
void avgpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y);
void avgpool2d_backward(const Pool2dGeometry& g, const Tensor& dy, Tensor& dx);
void plane_mean_forward(const Tensor& x, Tensor& y);
void plane_mean_backward(const Tensor& dy, Tensor& dx);
void groupnorm_forward(const GroupNormShape& s, const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                       Tensor& mean, Tensor& rstd, float epsilon);
void groupnorm_backward(const GroupNormShape& s, const Tensor& x, const Tensor& dy, const Tensor& gamma,
                        const Tensor& mean, const Tensor& rstd, Tensor* dx, Tensor& dgamma, Tensor& dbeta);

// out = a + b (each element rounded once, as the CPU's add).
void add(const Tensor& a, const Tensor& b, Tensor& out);

// How causal attention runs on the device:
// - kFlash: the fused kernels (cuda::flash_attention_forward/backward), no
//   (seq, seq) buffer;
// - kGemm: batched GEMMs around cuda::causal_softmax, head by head over
//   chunks of as many sequences as workspace_bytes of scores hold (at least
//   one; tests pass a small bound to run several chunks);
// - kAuto: attention_path's choice.
enum class AttentionPath : uint8_t { kAuto, kGemm, kFlash };
// kAuto's choice for qkv of `dtype` (out, dout and dqkv of it too; any other
// dtype among them, or a buffer not 16-byte aligned, takes kGemm at the
// call): kFlash where cuda::flash_attention_supported (bf16/fp16, head_dim
// 64 or 128, compute capability 8.0+), else kGemm. The environment variable
// FEDMESH_ATTENTION=gemm forces kGemm; "flash", "auto" and unset are the
// default; it is read once per process and any other value aborts.
AttentionPath attention_path(const AttentionShape& s, DType dtype);
const char* attention_path_name(AttentionPath path);  // "auto", "gemm", "flash"

// attention.h's pair; saved made (batch, heads, seq) fp32 on the device.
// `path` kFlash aborts where the fused kernels do not apply. The backward
// pass's `out` is the forward pass's output: the fused kernels take delta =
// rowsum(dout ∘ out) from it (so it must then have qkv's dtype; an fp32 out
// sends kAuto to kGemm); the GEMM path takes delta from dP and P and does
// not read it.
inline constexpr size_t kAttentionWorkspaceBytes = size_t{256} << 20;
void causal_attention_forward(const AttentionShape& s, const Tensor& qkv, Tensor& out, Tensor& saved,
                              size_t workspace_bytes = kAttentionWorkspaceBytes,
                              AttentionPath path = AttentionPath::kAuto);
void causal_attention_backward(const AttentionShape& s, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                               const Tensor& dout, Tensor& dqkv, size_t workspace_bytes = kAttentionWorkspaceBytes,
                               AttentionPath path = AttentionPath::kAuto);

// Token ids held in fp32 (x, on the device) as int32 in `ids` (grown as
// needed); a value outside [0, vocabulary) becomes -1 (a NaN embedding row).
void token_ids(const Tensor& x, int64_t vocabulary, cuda::DeviceBuffer& ids);
// embedding.h's pair with the ids on the device (count = out's rows).
void embedding_forward(const Tensor& table, const cuda::DeviceBuffer& ids, Tensor& out);
void embedding_backward(const cuda::DeviceBuffer& ids, const Tensor& dout, Tensor& dtable);

// The scalars of a training step (or an evaluation), kept on the device in
// one buffer so that the host reads them with one wait: the loss and
// correct sums the micro-batches add to, the squared gradient norm, the
// gradient factor (loss scale and clipping) and the found-inf flag the
// optimizer is gated by.
class StepScalars {
 public:
  void clear();  // zeroes them all (allocates on first use)
  double* loss_sum() { return at<double>(kLossSum); }
  int64_t* correct() { return at<int64_t>(kCorrect); }
  double* squared_norm() { return at<double>(kSquaredNorm); }
  float* factor() { return at<float>(kFactor); }
  int* found_inf() { return at<int>(kFoundInf); }
  struct Values {
    double loss_sum = 0.0;
    int64_t correct = 0;
    double squared_norm = 0.0;
    int found_inf = 0;
  };
  Values read() const;  // waits for the device

 private:
  static constexpr size_t kLossSum = 0, kCorrect = 8, kSquaredNorm = 16, kFactor = 24, kFoundInf = 28, kBytes = 32;
  template <class T>
  T* at(size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(buffer_.data()) + offset);
  }
  cuda::DeviceBuffer buffer_;
};

// Labels copied to the device for softmax_cross_entropy (grown as needed).
class DeviceLabels {
 public:
  const int32_t* upload(const int32_t* host, int64_t count);

 private:
  cuda::DeviceBuffer buffer_;
};

// loss.h's softmax_cross_entropy on device logits: adds to sums.loss_sum()
// and sums.correct() instead of returning them.
void softmax_cross_entropy(const Tensor& logits, const int32_t* labels, Tensor* dlogits, float grad_scale,
                           float normalizer, StepScalars& sums);

}  // namespace fedmesh::device
