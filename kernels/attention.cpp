#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/device_ops.h"
#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {
namespace {

// One thread's fp32 copies of a (batch, head)'s operands, kept between calls so
// that a training loop stops allocating after its first step.
struct HeadScratch {
  std::vector<float> blocks;  // (seq, head_dim) blocks: q, k, v, then out or dout, dq, dk, dv
  std::vector<float> scores;  // (seq, seq) twice: P, and dP then dS in the backward pass
};

HeadScratch& thread_scratch() {
  thread_local HeadScratch scratch;
  return scratch;
}

std::string describe(const AttentionShape& s) {
  return "batch " + std::to_string(s.batch) + ", seq " + std::to_string(s.seq) + ", heads " +
         std::to_string(s.heads) + ", head_dim " + std::to_string(s.head_dim);
}

void check_attention_shape(const char* function, const AttentionShape& s) {
  FEDMESH_CHECK(s.batch >= 0 && s.seq >= 0 && s.heads > 0 && s.head_dim > 0,
                std::string(function) + ": bad attention shape (" + describe(s) + ")");
}

// `t` must be a CPU tensor of batch * seq rows of `width` elements, its last
// axis being `width`.
void check_rows(const char* function, const char* name, const Tensor& t, const AttentionShape& s, int64_t width) {
  FEDMESH_CHECK(t.device() == Device::kCpu, std::string(function) + ": " + name + " is on " +
                                                device_name(t.device()) + "; this is the CPU kernel");
  const bool matches = t.rank() >= 1 && t.dim(t.rank() - 1) == width && t.numel() == s.batch * s.seq * width;
  FEDMESH_CHECK(matches, std::string(function) + ": " + name + " is " + shape_to_string(t.shape()) + ", expected (" +
                             std::to_string(s.batch) + ", " + std::to_string(s.seq) + ", " + std::to_string(width) +
                             ") for " + describe(s));
}

// Widens columns [column, column + width) of rows [row0, row0 + rows) of a
// row-major tensor with `stride` elements per row into dst (rows, width).
void load_block(const Tensor& t, int64_t stride, int64_t row0, int64_t rows, int64_t column, int64_t width,
                float* dst) {
  visit_dtype(t.dtype(), [&]<class T>() {
    const T* src = t.data<T>() + row0 * stride + column;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) dst[r * width + c] = to_float(src[r * stride + c]);
    }
  });
}

// The inverse of load_block: rounds src (rows, width) once into t's block.
void store_block(const float* src, int64_t stride, int64_t row0, int64_t rows, int64_t column, int64_t width,
                 Tensor& t) {
  visit_dtype(t.dtype(), [&]<class T>() {
    T* dst = t.data<T>() + row0 * stride + column;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) dst[r * stride + c] = from_float<T>(src[r * width + c]);
    }
  });
}

// Where a (batch, head)'s operands live: rows [row0, row0 + seq) of the
// (batch * seq, ..) activations, columns [column, column + head_dim) of out,
// dout and the q part of qkv (k and v one and two widths further).
struct HeadLayout {
  int64_t row0, seq, head_dim, width, column;
};

HeadLayout head_layout(const AttentionShape& s, int64_t index) {  // index = b * heads + h
  const int64_t batch_index = index / s.heads, head = index % s.heads;
  const int64_t width = s.heads * s.head_dim;
  return {batch_index * s.seq, s.seq, s.head_dim, width, head * s.head_dim};
}

void load_qkv(const Tensor& qkv, const HeadLayout& at, float* q, float* k, float* v) {
  const int64_t stride = 3 * at.width;
  load_block(qkv, stride, at.row0, at.seq, at.column, at.head_dim, q);
  load_block(qkv, stride, at.row0, at.seq, at.width + at.column, at.head_dim, k);
  load_block(qkv, stride, at.row0, at.seq, 2 * at.width + at.column, at.head_dim, v);
}

// row[0, visible) holds scores: makes them softmax probabilities (row max
// subtracted first), zeroes the masked row[visible, width), and returns the
// row's log-sum-exp.
float causal_softmax_row(float* row, int64_t visible, int64_t width) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) max_score = std::max(max_score, row[j]);
  float total = 0.0f;
  for (int64_t j = 0; j < visible; ++j) {
    row[j] = std::exp(row[j] - max_score);
    total += row[j];
  }
  for (int64_t j = 0; j < visible; ++j) row[j] /= total;
  std::fill(row + visible, row + width, 0.0f);
  return max_score + std::log(total);
}

// row[0, visible) holds scores: makes them the probabilities exp(score − lse)
// of the forward pass's log-sum-exp, zeroing the masked row[visible, width).
void recompute_probability_row(float* row, float lse, int64_t visible, int64_t width) {
  for (int64_t j = 0; j < visible; ++j) row[j] = std::exp(row[j] - lse);
  std::fill(row + visible, row + width, 0.0f);
}

// grad[0, visible) holds dP for probabilities p: makes it dS = p ∘ (dP − p·dP)
// and zeroes the masked grad[visible, width).
void causal_softmax_backward_row(const float* p, float* grad, int64_t visible, int64_t width) {
  float dot = 0.0f;
  for (int64_t j = 0; j < visible; ++j) dot += p[j] * grad[j];
  for (int64_t j = 0; j < visible; ++j) grad[j] = p[j] * (grad[j] - dot);
  std::fill(grad + visible, grad + width, 0.0f);
}

}  // namespace

void causal_attention_forward(const AttentionShape& s, const Tensor& qkv, Tensor& out, Tensor& saved) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(out)) return device::causal_attention_forward(s, qkv, out, saved);
  constexpr const char* kFunction = "causal_attention_forward";
  check_attention_shape(kFunction, s);
  check_rows(kFunction, "qkv", qkv, s, 3 * s.heads * s.head_dim);
  check_rows(kFunction, "out", out, s, s.heads * s.head_dim);
  Tensor::reuse(saved, {s.batch, s.heads, s.seq}, DType::kF32);
  float* log_sum_exp = saved.data<float>();
  const int64_t seq = s.seq, head_dim = s.head_dim, block = seq * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  parallel_for(s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    HeadScratch& scratch = thread_scratch();
    scratch.blocks.resize(static_cast<size_t>(4 * block));
    scratch.scores.resize(static_cast<size_t>(seq * seq));
    float* q = scratch.blocks.data();
    float* k = q + block;
    float* v = k + block;
    float* o = v + block;
    float* p = scratch.scores.data();  // (seq, seq)
    for (int64_t index = begin; index < end; ++index) {
      const HeadLayout at = head_layout(s, index);
      load_qkv(qkv, at, q, k, v);
      float* lse = log_sum_exp + index * seq;
      sgemm(false, true, seq, seq, head_dim, scale, q, head_dim, k, head_dim, 0.0f, p, seq);
      for (int64_t t = 0; t < seq; ++t) lse[t] = causal_softmax_row(p + t * seq, t + 1, seq);
      sgemm(false, false, seq, head_dim, seq, 1.0f, p, seq, v, head_dim, 0.0f, o, head_dim);
      store_block(o, at.width, at.row0, seq, at.column, head_dim, out);
    }
  });
}

void causal_attention_backward(const AttentionShape& s, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                               const Tensor& dout, Tensor& dqkv) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dqkv)) return device::causal_attention_backward(s, qkv, out, saved, dout, dqkv);
  constexpr const char* kFunction = "causal_attention_backward";
  check_attention_shape(kFunction, s);
  check_rows(kFunction, "qkv", qkv, s, 3 * s.heads * s.head_dim);
  // out is checked but not read: delta = rowsum(dP ∘ P) below, in fp32 from
  // P and dP, as the reference the device paths are held to.
  check_rows(kFunction, "out", out, s, s.heads * s.head_dim);
  check_rows(kFunction, "dout", dout, s, s.heads * s.head_dim);
  check_rows(kFunction, "dqkv", dqkv, s, 3 * s.heads * s.head_dim);
  const Shape saved_shape = {s.batch, s.heads, s.seq};
  FEDMESH_CHECK(saved.device() == Device::kCpu && saved.dtype() == DType::kF32 && saved.shape() == saved_shape,
                std::string(kFunction) + ": saved is " + dtype_name(saved.dtype()) + " " +
                    shape_to_string(saved.shape()) + " on " + device_name(saved.device()) + ", expected fp32 " +
                    shape_to_string(saved_shape) + " on cpu from causal_attention_forward");
  const float* log_sum_exp = saved.data<float>();
  const int64_t seq = s.seq, head_dim = s.head_dim, block = seq * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  parallel_for(s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    HeadScratch& scratch = thread_scratch();
    scratch.blocks.resize(static_cast<size_t>(7 * block));
    scratch.scores.resize(static_cast<size_t>(2 * seq * seq));
    float* q = scratch.blocks.data();
    float* k = q + block;
    float* v = k + block;
    float* g = v + block;  // dout
    float* dq = g + block;
    float* dk = dq + block;
    float* dv = dk + block;
    float* p = scratch.scores.data();
    float* ds = p + seq * seq;
    for (int64_t index = begin; index < end; ++index) {
      const HeadLayout at = head_layout(s, index);
      load_qkv(qkv, at, q, k, v);
      load_block(dout, at.width, at.row0, seq, at.column, head_dim, g);
      // P again, from the scores and the forward pass's log-sum-exps.
      const float* lse = log_sum_exp + index * seq;
      sgemm(false, true, seq, seq, head_dim, scale, q, head_dim, k, head_dim, 0.0f, p, seq);
      for (int64_t t = 0; t < seq; ++t) recompute_probability_row(p + t * seq, lse[t], t + 1, seq);
      sgemm(true, false, seq, head_dim, seq, 1.0f, p, seq, g, head_dim, 0.0f, dv, head_dim);  // dV = Pᵀ·dout
      sgemm(false, true, seq, seq, head_dim, 1.0f, g, head_dim, v, head_dim, 0.0f, ds, seq);  // dP = dout·vᵀ
      for (int64_t t = 0; t < seq; ++t) causal_softmax_backward_row(p + t * seq, ds + t * seq, t + 1, seq);
      sgemm(false, false, seq, head_dim, seq, scale, ds, seq, k, head_dim, 0.0f, dq, head_dim);  // dS·k
      sgemm(true, false, seq, head_dim, seq, scale, ds, seq, q, head_dim, 0.0f, dk, head_dim);   // dSᵀ·q
      const int64_t stride = 3 * at.width;
      store_block(dq, stride, at.row0, seq, at.column, head_dim, dqkv);
      store_block(dk, stride, at.row0, seq, at.width + at.column, head_dim, dqkv);
      store_block(dv, stride, at.row0, seq, 2 * at.width + at.column, head_dim, dqkv);
    }
  });
}

}  // namespace fedmesh
