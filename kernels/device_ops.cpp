#include "kernels/device_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/convert.h"
#include "kernels/gemm.h"
#include "kernels/step_profile.h"

namespace fedmesh::device {

namespace {

cuda::Stream stream() { return cuda::default_stream(); }

}  // namespace

void require_cuda(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    FEDMESH_CHECK(t == nullptr || !t->defined() || t->device() == Device::kCuda,
                  std::string(op) + ": a CPU tensor among CUDA ones (move every operand to one device)");
  }
}

void require_host(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    FEDMESH_CHECK(t == nullptr || !t->defined() || t->device() == Device::kCpu,
                  std::string(op) + " runs on the CPU only: it was given a CUDA tensor");
  }
}

void gemm(bool transpose_a, bool transpose_b, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c,
          const Tensor* bias) {
  require_cuda("gemm", {&a, &b, &c, bias});
  const auto [m, n, k] = gemm_dims(transpose_a, transpose_b, a, b, c);
  FEDMESH_CHECK(a.dtype() == b.dtype() && (c.dtype() == a.dtype() || c.dtype() == DType::kF32),
                std::string("cuda gemm: a and b must share a dtype and c have it or fp32 (got ") +
                    dtype_name(a.dtype()) + ", " + dtype_name(b.dtype()) + ", " + dtype_name(c.dtype()) + ")");
  cuda::GemmEpilogue epilogue;
  if (bias != nullptr) {
    FEDMESH_CHECK(bias->numel() == n, "gemm: bias of " + std::to_string(bias->numel()) + " for " + std::to_string(n) +
                                          " columns");
    epilogue.kind = cuda::GemmEpilogueKind::kBias;
    epilogue.bias = bias->data<float>();
  }
  cuda::gemm(stream(), transpose_a, transpose_b, m, n, k, alpha, a.raw(), a.dtype(), a.dim(1), b.raw(), b.dtype(),
             b.dim(1), beta, c.raw(), c.dtype(), n, epilogue);
}

void fill(Tensor& x, float value) {
  require_cuda("fill", {&x});
  cuda::fill(stream(), x.raw(), x.dtype(), x.numel(), value);
}

void scale(Tensor& x, float factor) {
  require_cuda("scale", {&x});
  cuda::scale(stream(), x.raw(), x.dtype(), x.numel(), factor);
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  require_cuda("axpy", {&x, &y});
  FEDMESH_CHECK(x.numel() == y.numel(), "axpy: element counts differ");
  cuda::axpy(stream(), alpha, x.raw(), x.dtype(), y.raw(), y.dtype(), x.numel());
}

void convert(const Tensor& src, Tensor& dst) {
  require_cuda("convert", {&src, &dst});
  FEDMESH_CHECK(src.numel() == dst.numel(), "convert: element counts differ");
  if (src.raw() == dst.raw() && src.dtype() == dst.dtype()) return;
  cuda::cast(stream(), src.raw(), src.dtype(), dst.raw(), dst.dtype(), src.numel());
}

void add_bias(Tensor& y, const Tensor& bias) {
  require_cuda("add_bias", {&y, &bias});
  const int64_t n = bias.numel();
  FEDMESH_CHECK(n > 0 && y.numel() % n == 0, "add_bias: bias does not divide the output");
  cuda::add_bias(stream(), y.raw(), y.dtype(), y.numel() / n, n, bias.data<float>());
}

void bias_grad(const Tensor& dy, Tensor& db, bool accumulate) {
  require_cuda("bias_grad", {&dy, &db});
  const int64_t n = db.numel();
  FEDMESH_CHECK(n > 0 && dy.numel() % n == 0, "bias_grad: shapes do not match");
  cuda::bias_grad(stream(), dy.raw(), dy.dtype(), dy.numel() / n, n, db.data<float>(), accumulate);
}

void channel_bias_grad(const Tensor& dy, Tensor& db, bool accumulate) {
  require_cuda("channel_bias_grad", {&dy, &db});
  FEDMESH_CHECK(dy.rank() >= 2 && dy.dim(1) == db.numel(), "channel_bias_grad: shapes do not match");
  const int64_t batch = dy.dim(0), channels = dy.dim(1);
  cuda::channel_bias_grad(stream(), dy.raw(), dy.dtype(), batch, channels, dy.numel() / (batch * channels),
                          db.data<float>(), accumulate);
}

void relu_forward(const Tensor& x, Tensor& y) {
  require_cuda("relu_forward", {&x, &y});
  FEDMESH_CHECK(x.numel() == y.numel(), "relu_forward: element counts differ");
  cuda::relu_forward(stream(), x.raw(), x.dtype(), y.raw(), y.dtype(), x.numel());
}

void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  require_cuda("relu_backward", {&y, &dy, &dx});
  FEDMESH_CHECK(y.numel() == dy.numel() && dy.numel() == dx.numel(), "relu_backward: element counts differ");
  cuda::relu_backward(stream(), y.raw(), y.dtype(), dy.raw(), dy.dtype(), dx.raw(), dx.dtype(), y.numel());
}

void gelu_forward(const Tensor& x, Tensor& y) {
  require_cuda("gelu_forward", {&x, &y});
  FEDMESH_CHECK(x.numel() == y.numel(), "gelu_forward: element counts differ");
  cuda::gelu_forward(stream(), x.raw(), x.dtype(), y.raw(), y.dtype(), x.numel());
}

void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  require_cuda("gelu_backward", {&x, &dy, &dx});
  FEDMESH_CHECK(x.numel() == dy.numel() && dy.numel() == dx.numel(), "gelu_backward: element counts differ");
  cuda::gelu_backward(stream(), x.raw(), x.dtype(), dy.raw(), dy.dtype(), dx.raw(), dx.dtype(), x.numel());
}

void silu_forward(const Tensor& x, Tensor& y) {
  require_cuda("silu_forward", {&x, &y});
  FEDMESH_CHECK(x.numel() == y.numel(), "silu_forward: element counts differ");
  cuda::silu_forward(stream(), x.raw(), x.dtype(), y.raw(), y.dtype(), x.numel());
}

void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  require_cuda("silu_backward", {&x, &dy, &dx});
  FEDMESH_CHECK(x.numel() == dy.numel() && dy.numel() == dx.numel(), "silu_backward: element counts differ");
  cuda::silu_backward(stream(), x.raw(), x.dtype(), dy.raw(), dy.dtype(), dx.raw(), dx.dtype(), x.numel());
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  require_cuda("mul", {&a, &b, &out});
  FEDMESH_CHECK(a.numel() == b.numel() && b.numel() == out.numel(), "mul: element counts differ");
  FEDMESH_CHECK(b.dtype() == DType::kF32, "mul on the device: the second factor must be fp32");
  cuda::multiply(stream(), a.raw(), a.dtype(), b.data<float>(), out.raw(), out.dtype(), a.numel());
}

void add_squared_l2_norm(const Tensor& x, double* sum) {
  require_cuda("squared_l2_norm", {&x});
  cuda::squared_l2_norm(stream(), x.data<float>(), x.numel(), sum);
}

double squared_l2_norm(const Tensor& x) {
  cuda::DeviceBuffer sum(sizeof(double), stream());
  cuda::set_zero(sum.data(), sizeof(double), stream());
  add_squared_l2_norm(x, sum.as<double>());
  double host = 0.0;
  cuda::copy_to_host(sum.data(), &host, sizeof(double), stream());
  return host;
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  require_cuda("add", {&a, &b, &out});
  FEDMESH_CHECK(a.numel() == b.numel() && b.numel() == out.numel(), "add: element counts differ");
  // out = a, then out += 1 · b: the product is exact, so the sum is rounded
  // once as the CPU rounds it.
  const Tensor& first = out.raw() == b.raw() ? b : a;
  const Tensor& second = out.raw() == b.raw() ? a : b;
  device::convert(first, out);
  axpy(1.0f, second, out);
}

// ---- causal attention -----------------------------------------------------------
//
// Two paths (device_ops.h's AttentionPath). The fused kernels
// (cuda::flash_attention_*, kernels/cuda/flash_attention.cu) take bf16/fp16
// with head_dim 64 or 128 when qkv, out, dout and dqkv share the dtype; their
// backward pass takes delta = rowsum(dout ∘ out) from the forward pass's
// rounded out. Everything else takes the GEMM path (which, like the CPU,
// takes delta = rowsum(P dP) and does not read out):
//
// Batched GEMMs (cuBLASLt) around two row kernels, head by head: for head h
// and a chunk of sequences, q, k and v are strided views of qkv (row stride
// 3 * width, one sequence every seq rows), so no permutation is copied.
//   forward:  S = q kᵀ (fp32), P = causal softmax(scale S) and each row's
//             log-sum-exp (saved), out = P v.
//   backward: S = q kᵀ again and P = exp(scale S - lse) (O(seq) saved per
//             head, as on the CPU), dv = Pᵀ dout, dP = dout vᵀ (fp32, into
//             S's buffer), dS = scale P (dP - rowsum(P dP)) (over P),
//             dq = dS k, dk = dSᵀ q.
// P and dS are in qkv's dtype (the GEMMs' operands share one), the products
// accumulate in fp32. The scores of a chunk take (chunk, seq, seq) fp32 plus
// the same in P's dtype; chunks are as many sequences as the workspace
// bound holds (at least one). The masked half of each
// product is computed and discarded.
namespace {

struct AttentionGeometry {
  AttentionShape s;
  DType dtype;                  // qkv's, and P's
  int64_t width, qkv_row;       // heads * head_dim, and 3 * width
  int64_t scores, chunk;        // seq * seq, sequences per pass
  float scale;

  AttentionGeometry(const AttentionShape& shape, DType qkv_dtype, size_t workspace_bytes)
      : s(shape), dtype(qkv_dtype), width(shape.heads * shape.head_dim), qkv_row(3 * width),
        scores(shape.seq * shape.seq), chunk(1), scale(1.0f / std::sqrt(static_cast<float>(shape.head_dim))) {
    const size_t per_sequence = static_cast<size_t>(scores) * (sizeof(float) + dtype_size(dtype));
    chunk = std::clamp<int64_t>(static_cast<int64_t>(workspace_bytes / std::max<size_t>(per_sequence, 1)), 1,
                                std::max<int64_t>(s.batch, 1));
  }
  // Element offsets of head h of sequence b: its q in qkv (k and v follow at
  // + width and + 2 width), and its slice of out (or dout).
  int64_t qkv_at(int64_t b, int64_t h) const { return b * s.seq * qkv_row + h * s.head_dim; }
  int64_t out_at(int64_t b, int64_t h) const { return b * s.seq * width + h * s.head_dim; }
};

const char* at(const Tensor& t, int64_t elements) {
  return static_cast<const char*>(t.raw()) + static_cast<size_t>(elements) * dtype_size(t.dtype());
}
char* at(Tensor& t, int64_t elements) {
  return static_cast<char*>(t.raw()) + static_cast<size_t>(elements) * dtype_size(t.dtype());
}

// c_i = a_i op(b_i) over the chunk's sequences (stride: one sequence).
struct HeadOperand {
  const void* data;
  DType dtype;
  int64_t ld, stride;
};

void batched_product(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const HeadOperand& a,
                     const HeadOperand& b, void* c, DType c_type, int64_t ldc, int64_t stride_c, int64_t count) {
  cuda::gemm_strided_batched(stream(), transpose_a, transpose_b, m, n, k, 1.0f, a.data, a.dtype, a.ld, a.stride,
                             b.data, b.dtype, b.ld, b.stride, 0.0f, c, c_type, ldc, stride_c, count);
}

// One pass of the head-by-head walk: head h of sequences [b, b + count),
// their q, k, v views, and the pass's workspace with S = q kᵀ (fp32) in it.
struct HeadChunk {
  int64_t h, b, count;
  HeadOperand q, k, v;
  float* scores;        // (count, seq, seq) fp32
  void* probabilities;  // (count, seq, seq) in qkv's dtype
  int64_t lse_offset;   // of (b, h, position 0) in the (batch, heads, seq) log-sum-exps
};

template <class Pass>
void for_each_head_chunk(const AttentionGeometry& g, const Tensor& qkv, Pass pass) {
  const int64_t T = g.s.seq;
  cuda::DeviceBuffer scores(static_cast<size_t>(g.chunk * g.scores) * sizeof(float), stream());
  cuda::DeviceBuffer probabilities(static_cast<size_t>(g.chunk * g.scores) * dtype_size(g.dtype), stream());
  for (int64_t h = 0; h < g.s.heads; ++h) {
    for (int64_t b = 0; b < g.s.batch; b += g.chunk) {
      const int64_t q_at = g.qkv_at(b, h), stride = T * g.qkv_row;
      const HeadChunk c{h,
                        b,
                        std::min(g.chunk, g.s.batch - b),
                        {at(qkv, q_at), g.dtype, g.qkv_row, stride},
                        {at(qkv, q_at + g.width), g.dtype, g.qkv_row, stride},
                        {at(qkv, q_at + 2 * g.width), g.dtype, g.qkv_row, stride},
                        scores.as<float>(),
                        probabilities.data(),
                        (b * g.s.heads + h) * T};
      batched_product(false, true, T, T, g.s.head_dim, c.q, c.k, c.scores, DType::kF32, T, g.scores, c.count);
      pass(c);
    }
  }
}

// The environment's choice, read once: true for FEDMESH_ATTENTION=gemm.
bool gemm_forced_by_environment() {
  static const bool forced = [] {
    const char* value = std::getenv("FEDMESH_ATTENTION");
    const std::string v = value == nullptr ? "" : value;
    FEDMESH_CHECK(v.empty() || v == "auto" || v == "flash" || v == "gemm",
                  "FEDMESH_ATTENTION=" + v + ": expected gemm, flash or auto");
    return v == "gemm";
  }();
  return forced;
}

bool aligned_for_flash(std::initializer_list<const Tensor*> tensors) {
  constexpr uintptr_t kAlignment = 16;  // the fused kernels' vector loads
  return std::all_of(tensors.begin(), tensors.end(),
                     [](const Tensor* t) { return reinterpret_cast<uintptr_t>(t->raw()) % kAlignment == 0; });
}

// kAuto resolved for these tensors (every one of qkv's dtype and aligned, or
// kGemm); an explicit kFlash that does not apply aborts.
AttentionPath resolve_attention_path(const char* op, AttentionPath path, const AttentionShape& s, const Tensor& qkv,
                                     std::initializer_list<const Tensor*> others) {
  if (path == AttentionPath::kGemm) return path;
  const bool same_dtype =
      std::all_of(others.begin(), others.end(), [&](const Tensor* t) { return t->dtype() == qkv.dtype(); });
  const bool fits = same_dtype && aligned_for_flash({&qkv}) && aligned_for_flash(others) &&
                    cuda::flash_attention_supported(s, qkv.dtype());
  if (path == AttentionPath::kFlash) {
    FEDMESH_CHECK(fits, std::string(op) + ": the fused attention kernels do not apply to head_dim " +
                            std::to_string(s.head_dim) + " in " + dtype_name(qkv.dtype()) +
                            " (or mixed dtypes, or unaligned buffers, or this device)");
    return path;
  }
  return fits && attention_path(s, qkv.dtype()) == AttentionPath::kFlash ? AttentionPath::kFlash
                                                                         : AttentionPath::kGemm;
}

void check_attention_tensors(const char* op, const AttentionShape& s, const Tensor& qkv, const Tensor& out) {
  const int64_t width = s.heads * s.head_dim;
  FEDMESH_CHECK(qkv.numel() == s.batch * s.seq * 3 * width && out.numel() == s.batch * s.seq * width,
                std::string(op) + ": qkv " + shape_to_string(qkv.shape()) + " and out " + shape_to_string(out.shape()) +
                    " do not fit the attention shape");
  FEDMESH_CHECK(out.dtype() == qkv.dtype() || out.dtype() == DType::kF32,
                std::string(op) + ": the output must have qkv's dtype or fp32 (got " + dtype_name(qkv.dtype()) +
                    " and " + dtype_name(out.dtype()) + ")");
}

}  // namespace

AttentionPath attention_path(const AttentionShape& s, DType dtype) {
  if (gemm_forced_by_environment()) return AttentionPath::kGemm;
  return cuda::flash_attention_supported(s, dtype) ? AttentionPath::kFlash : AttentionPath::kGemm;
}

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kAuto: return "auto";
    case AttentionPath::kGemm: return "gemm";
    case AttentionPath::kFlash: return "flash";
  }
  return "?";
}

void causal_attention_forward(const AttentionShape& s, const Tensor& qkv, Tensor& out, Tensor& saved,
                              size_t workspace_bytes, AttentionPath path) {
  require_cuda("causal_attention_forward", {&qkv, &out});
  check_attention_tensors("causal_attention_forward", s, qkv, out);
  Tensor::reuse(saved, {s.batch, s.heads, s.seq}, DType::kF32, Device::kCuda);
  if (s.batch == 0 || s.seq == 0) return;
  if (resolve_attention_path("causal_attention_forward", path, s, qkv, {&out}) == AttentionPath::kFlash) {
    cuda::flash_attention_forward(stream(), s, qkv.dtype(), qkv.raw(), out.raw(), saved.data<float>());
    return;
  }
  const AttentionGeometry g(s, qkv.dtype(), workspace_bytes);
  const int64_t T = s.seq;
  for_each_head_chunk(g, qkv, [&](const HeadChunk& c) {
    cuda::causal_softmax(stream(), c.scores, c.count, T, g.scale, saved.data<float>() + c.lse_offset, s.heads * T,
                         c.probabilities, g.dtype);
    const HeadOperand p{c.probabilities, g.dtype, T, g.scores};
    batched_product(false, false, T, s.head_dim, T, p, c.v, at(out, g.out_at(c.b, c.h)), out.dtype(), g.width,
                    T * g.width, c.count);
  });
}

void causal_attention_backward(const AttentionShape& s, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                               const Tensor& dout, Tensor& dqkv, size_t workspace_bytes, AttentionPath path) {
  require_cuda("causal_attention_backward", {&qkv, &out, &saved, &dout, &dqkv});
  check_attention_tensors("causal_attention_backward", s, qkv, out);
  check_attention_tensors("causal_attention_backward", s, qkv, dout);
  FEDMESH_CHECK(dqkv.numel() == qkv.numel() && saved.numel() == s.batch * s.heads * s.seq &&
                    saved.dtype() == DType::kF32 && (dqkv.dtype() == qkv.dtype() || dqkv.dtype() == DType::kF32),
                "causal_attention_backward: shapes or dtypes do not fit the attention shape (or no training forward)");
  if (s.batch == 0 || s.seq == 0) return;
  // dout meets P and v in the products (GEMMs or the fused kernels' tensor
  // cores), so it takes their dtype.
  const Tensor dout_cast = dout.dtype() == qkv.dtype() ? Tensor() : fedmesh::to_dtype(dout, qkv.dtype());
  const Tensor& g_out = dout.dtype() == qkv.dtype() ? dout : dout_cast;
  if (resolve_attention_path("causal_attention_backward", path, s, qkv, {&out, &g_out, &dqkv}) ==
      AttentionPath::kFlash) {
    FEDMESH_CHECK(dqkv.raw() != qkv.raw() && dqkv.raw() != g_out.raw(),
                  "causal_attention_backward: dqkv must not be qkv or dout");
    cuda::flash_attention_backward(stream(), s, qkv.dtype(), qkv.raw(), out.raw(), saved.data<float>(), g_out.raw(),
                                   dqkv.raw());
    return;
  }
  // The GEMM path takes delta from dP and P, as the CPU does: out is not read.
  const AttentionGeometry g(s, qkv.dtype(), workspace_bytes);
  const int64_t T = s.seq;
  for_each_head_chunk(g, qkv, [&](const HeadChunk& c) {
    cuda::causal_probabilities(stream(), c.scores, c.count, T, g.scale, saved.data<float>() + c.lse_offset,
                               s.heads * T, c.probabilities, g.dtype);
    const HeadOperand p{c.probabilities, g.dtype, T, g.scores};
    const HeadOperand d{at(g_out, g.out_at(c.b, c.h)), g.dtype, g.width, T * g.width};
    const auto into = [&](int64_t offset) { return at(dqkv, g.qkv_at(c.b, c.h) + offset); };
    const int64_t D = s.head_dim, ld = g.qkv_row, stride = T * g.qkv_row;
    batched_product(true, false, T, D, T, p, d, into(2 * g.width), dqkv.dtype(), ld, stride, c.count);  // dv = Pᵀ dout
    batched_product(false, true, T, T, D, d, c.v, c.scores, DType::kF32, T, g.scores, c.count);  // dP = dout vᵀ
    cuda::causal_softmax_backward(stream(), c.probabilities, g.dtype, c.scores, c.count, T, g.scale);
    const HeadOperand& ds = p;  // P's buffer now holds dS
    batched_product(false, false, T, D, T, ds, c.k, into(0), dqkv.dtype(), ld, stride, c.count);        // dq = dS k
    batched_product(true, false, T, D, T, ds, c.q, into(g.width), dqkv.dtype(), ld, stride, c.count);   // dk = dSᵀ q
  });
}

void token_ids(const Tensor& x, int64_t vocabulary, cuda::DeviceBuffer& ids) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("token_ids", {&x});
  const size_t bytes = static_cast<size_t>(x.numel()) * sizeof(int32_t);
  if (ids.bytes() < bytes) ids = cuda::DeviceBuffer(bytes, stream());
  cuda::token_ids(stream(), x.data<float>(), x.numel(), vocabulary, ids.as<int32_t>());
}

void embedding_forward(const Tensor& table, const cuda::DeviceBuffer& ids, Tensor& out) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("embedding_forward", {&table, &out});
  FEDMESH_CHECK(table.rank() == 2, "embedding table must be 2-D");
  const int64_t vocabulary = table.dim(0), dim = table.dim(1), count = out.numel() / dim;
  FEDMESH_CHECK(out.numel() == count * dim && ids.bytes() >= static_cast<size_t>(count) * sizeof(int32_t),
                "embedding_forward: output shape");
  cuda::embedding_forward(stream(), table.raw(), table.dtype(), vocabulary, dim, ids.as<int32_t>(), count, out.raw(),
                          out.dtype());
}

void embedding_backward(const cuda::DeviceBuffer& ids, const Tensor& dout, Tensor& dtable) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("embedding_backward", {&dout, &dtable});
  FEDMESH_CHECK(dtable.rank() == 2, "embedding table must be 2-D");
  const int64_t vocabulary = dtable.dim(0), dim = dtable.dim(1), count = dout.numel() / dim;
  FEDMESH_CHECK(dout.numel() == count * dim && ids.bytes() >= static_cast<size_t>(count) * sizeof(int32_t),
                "embedding_backward: dout shape");
  cuda::embedding_backward(stream(), ids.as<int32_t>(), count, dout.raw(), dout.dtype(), dtable.data<float>(),
                           vocabulary, dim);
}

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                       float epsilon) {
  require_cuda("layernorm_forward", {&x, &gamma, &beta, &y, &mean, &rstd});
  const int64_t n = gamma.numel();
  FEDMESH_CHECK(n > 0 && x.numel() % n == 0 && y.numel() == x.numel() && beta.numel() == n &&
                    mean.numel() == x.numel() / n && rstd.numel() == mean.numel(),
                "layernorm_forward: shapes do not match");
  cuda::layernorm_forward(stream(), x.raw(), x.dtype(), gamma.data<float>(), beta.data<float>(), y.raw(), y.dtype(),
                          mean.data<float>(), rstd.data<float>(), x.numel() / n, n, epsilon);
}

void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean, const Tensor& rstd,
                        Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  require_cuda("layernorm_backward", {&x, &dy, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta});
  const int64_t n = gamma.numel();
  FEDMESH_CHECK(n > 0 && x.numel() % n == 0 && dy.numel() == x.numel() && dx.numel() == x.numel() &&
                    dgamma.numel() == n && dbeta.numel() == n && mean.numel() == x.numel() / n,
                "layernorm_backward: shapes do not match");
  cuda::layernorm_backward(stream(), x.raw(), x.dtype(), dy.raw(), dy.dtype(), gamma.data<float>(),
                           mean.data<float>(), rstd.data<float>(), dx.raw(), dx.dtype(), dgamma.data<float>(),
                           dbeta.data<float>(), x.numel() / n, n);
}

void groupnorm_forward(const GroupNormShape& s, const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                       Tensor& mean, Tensor& rstd, float epsilon) {
  require_cuda("groupnorm_forward", {&x, &gamma, &beta, &y, &mean, &rstd});
  FEDMESH_CHECK(x.numel() == s.batch * s.channels * s.positions && y.numel() == x.numel() &&
                    gamma.numel() == s.channels && beta.numel() == s.channels && s.channels % s.groups == 0 &&
                    mean.numel() == s.batch * s.groups && rstd.numel() == mean.numel(),
                "groupnorm_forward: shapes do not match");
  cuda::groupnorm_forward(stream(), s, x.raw(), x.dtype(), gamma.data<float>(), beta.data<float>(), y.raw(), y.dtype(),
                          mean.data<float>(), rstd.data<float>(), epsilon);
}

void groupnorm_backward(const GroupNormShape& s, const Tensor& x, const Tensor& dy, const Tensor& gamma,
                        const Tensor& mean, const Tensor& rstd, Tensor* dx, Tensor& dgamma, Tensor& dbeta) {
  require_cuda("groupnorm_backward", {&x, &dy, &gamma, &mean, &rstd, dx, &dgamma, &dbeta});
  FEDMESH_CHECK(x.numel() == s.batch * s.channels * s.positions && dy.numel() == x.numel() &&
                    (dx == nullptr || dx->numel() == x.numel()) && gamma.numel() == s.channels &&
                    dgamma.numel() == s.channels && dbeta.numel() == s.channels && mean.numel() == s.batch * s.groups,
                "groupnorm_backward: shapes do not match");
  cuda::groupnorm_backward(stream(), s, x.raw(), x.dtype(), dy.raw(), dy.dtype(), gamma.data<float>(),
                           mean.data<float>(), rstd.data<float>(), dx ? dx->raw() : nullptr,
                           dx ? dx->dtype() : DType::kF32, dgamma.data<float>(), dbeta.data<float>());
}

void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                    Tensor& col) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("conv2d_forward", {&x, &weight, &bias, &y});
  FEDMESH_CHECK(x.numel() == g.batch * g.in_channels * g.height * g.width, "conv2d: input shape");
  FEDMESH_CHECK(weight.numel() == g.out_channels * g.patch_size() && bias.numel() == g.out_channels,
                "conv2d: weight shape");
  FEDMESH_CHECK(y.numel() == g.batch * g.out_channels * g.out_height() * g.out_width(), "conv2d: output shape");
  Tensor::reuse(col, {g.patch_size(), g.columns()}, DType::kF32, Device::kCuda);
  cuda::conv2d_forward(stream(), g, x.raw(), x.dtype(), weight.raw(), weight.dtype(), bias.data<float>(), y.raw(),
                       y.dtype(), col.data<float>());
}

void conv2d_backward(const Conv2dGeometry& g, const Tensor& col, const Tensor& weight, const Tensor& dy,
                     Tensor& dweight, Tensor& dbias, Tensor* dx) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("conv2d_backward", {&col, &weight, &dy, &dweight, &dbias, dx});
  FEDMESH_CHECK(col.numel() == g.patch_size() * g.columns(), "conv2d_backward: no columns from a training forward");
  FEDMESH_CHECK(dy.numel() == g.batch * g.out_channels * g.out_height() * g.out_width(), "conv2d_backward: dy shape");
  FEDMESH_CHECK(dx == nullptr || dx->numel() == g.batch * g.in_channels * g.height * g.width,
                "conv2d_backward: dx shape");
  cuda::conv2d_backward(stream(), g, col.data<float>(), weight.raw(), weight.dtype(), dy.raw(), dy.dtype(),
                        dweight.data<float>(), dbias.data<float>(), dx ? dx->raw() : nullptr,
                        dx ? dx->dtype() : DType::kF32);
}

void maxpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y, cuda::DeviceBuffer& argmax) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("maxpool2d_forward", {&x, &y});
  FEDMESH_CHECK(x.numel() == g.batch * g.channels * g.height * g.width &&
                    y.numel() == g.batch * g.channels * g.out_height() * g.out_width(),
                "maxpool2d: shapes do not match");
  const size_t bytes = static_cast<size_t>(y.numel()) * sizeof(int32_t);
  if (argmax.bytes() < bytes) argmax = cuda::DeviceBuffer(bytes, stream());
  cuda::maxpool2d_forward(stream(), g, x.raw(), x.dtype(), y.raw(), y.dtype(), argmax.as<int32_t>());
}

void maxpool2d_backward(const Pool2dGeometry& g, const cuda::DeviceBuffer& argmax, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("maxpool2d_backward", {&dy, &dx});
  FEDMESH_CHECK(dy.numel() == g.batch * g.channels * g.out_height() * g.out_width() &&
                    dx.numel() == g.batch * g.channels * g.height * g.width &&
                    argmax.bytes() >= static_cast<size_t>(dy.numel()) * sizeof(int32_t),
                "maxpool2d_backward: shapes do not match (or no training forward)");
  cuda::maxpool2d_backward(stream(), g, argmax.as<int32_t>(), dy.raw(), dy.dtype(), dx.raw(), dx.dtype());
}

void avgpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("avgpool2d_forward", {&x, &y});
  FEDMESH_CHECK(x.numel() == g.batch * g.channels * g.height * g.width &&
                    y.numel() == g.batch * g.channels * g.out_height() * g.out_width(),
                "avgpool2d: shapes do not match");
  cuda::avgpool2d_forward(stream(), g, x.raw(), x.dtype(), y.raw(), y.dtype());
}

void avgpool2d_backward(const Pool2dGeometry& g, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("avgpool2d_backward", {&dy, &dx});
  FEDMESH_CHECK(dy.numel() == g.batch * g.channels * g.out_height() * g.out_width() &&
                    dx.numel() == g.batch * g.channels * g.height * g.width,
                "avgpool2d_backward: shapes do not match");
  cuda::avgpool2d_backward(stream(), g, dy.raw(), dy.dtype(), dx.raw(), dx.dtype());
}

void plane_mean_forward(const Tensor& x, Tensor& y) {
  require_cuda("plane_mean_forward", {&x, &y});
  FEDMESH_CHECK(y.numel() > 0 && x.numel() % y.numel() == 0, "plane_mean: the planes do not divide the input");
  cuda::plane_mean_forward(stream(), x.raw(), x.dtype(), y.raw(), y.dtype(), y.numel(), x.numel() / y.numel());
}

void plane_mean_backward(const Tensor& dy, Tensor& dx) {
  require_cuda("plane_mean_backward", {&dy, &dx});
  FEDMESH_CHECK(dy.numel() > 0 && dx.numel() % dy.numel() == 0, "plane_mean_backward: the planes do not divide the input");
  cuda::plane_mean_backward(stream(), dy.raw(), dy.dtype(), dx.raw(), dx.dtype(), dy.numel(), dx.numel() / dy.numel());
}

void StepScalars::clear() {
  if (buffer_.bytes() < kBytes) buffer_ = cuda::DeviceBuffer(kBytes, stream());
  cuda::set_zero(buffer_.data(), kBytes, stream());
}

StepScalars::Values StepScalars::read() const {
  const ProfileScope profile(StepTime::kKernels);
  FEDMESH_CHECK(buffer_.data() != nullptr, "StepScalars::read before clear");
  unsigned char bytes[kBytes];
  cuda::copy_to_host(buffer_.data(), bytes, kBytes, stream());
  Values values;
  std::memcpy(&values.loss_sum, bytes + kLossSum, sizeof(double));
  std::memcpy(&values.correct, bytes + kCorrect, sizeof(int64_t));
  std::memcpy(&values.squared_norm, bytes + kSquaredNorm, sizeof(double));
  std::memcpy(&values.found_inf, bytes + kFoundInf, sizeof(int));
  return values;
}

const int32_t* DeviceLabels::upload(const int32_t* host, int64_t count) {
  const size_t bytes = static_cast<size_t>(count) * sizeof(int32_t);
  if (buffer_.bytes() < bytes) buffer_ = cuda::DeviceBuffer(bytes, stream());
  cuda::copy_to_device(host, buffer_.data(), bytes, stream());
  return buffer_.as<int32_t>();
}

void softmax_cross_entropy(const Tensor& logits, const int32_t* labels, Tensor* dlogits, float grad_scale,
                           float normalizer, StepScalars& sums) {
  const ProfileScope profile(StepTime::kKernels);
  require_cuda("softmax_cross_entropy", {&logits, dlogits});
  FEDMESH_CHECK(logits.rank() == 2, "softmax_cross_entropy: logits must be (rows, classes)");
  FEDMESH_CHECK(dlogits == nullptr || dlogits->numel() == logits.numel(), "softmax_cross_entropy: dlogits shape");
  cuda::softmax_cross_entropy(stream(), logits.raw(), logits.dtype(), labels, logits.dim(0), logits.dim(1),
                              dlogits ? dlogits->raw() : nullptr, dlogits ? dlogits->dtype() : DType::kF32,
                              grad_scale, normalizer, sums.loss_sum(), sums.correct());
}

}  // namespace fedmesh::device
