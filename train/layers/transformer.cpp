#include "train/layers/transformer.h"

#include <cmath>
#include <cstring>

#include "kernels/device_ops.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"

namespace fedmesh::train {

namespace {

void normal_fill(Tensor& t, Rng& rng, double deviation) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(rng.normal() * deviation);
}

void zero_fill(Tensor& t) { std::memset(t.raw(), 0, t.nbytes()); }

}  // namespace

int64_t TransformerConfig::parameters() const {
  const int64_t per_block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width) +
                            (4 * width * width + 4 * width) + (4 * width * width + width);
  return vocabulary * width + context * width + layers * per_block + 2 * width;
}

// ---- TokenEmbedding -------------------------------------------------------------

TokenEmbedding::TokenEmbedding(int64_t vocabulary, int64_t context, int64_t width)
    : vocabulary_(vocabulary),
      context_(context),
      width_(width),
      tokens_("wte.weight", {vocabulary, width}),
      positions_("wpe.weight", {context, width}) {}

void TokenEmbedding::initialize(Rng& rng) {
  normal_fill(tokens_.value, rng, 0.02);
  normal_fill(positions_.value, rng, 0.01);
  tokens_.refresh_compute();
  positions_.refresh_compute();
}

Shape TokenEmbedding::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 2 && input[1] >= 1 && input[1] <= context_,
                "embedding expects (batch, seq) token ids with seq in [1, " + std::to_string(context_) + "], got " +
                    shape_to_string(input));
  return {input[0], input[1], width_};
}

Tensor TokenEmbedding::forward(const Tensor& x, bool training) {
  FEDMESH_CHECK(x.dtype() == DType::kF32, "embedding expects token ids held in fp32");
  const Shape shape = output_shape(x.shape());
  const int64_t batch = shape[0], seq = shape[1];
  if (device::on_cuda(x)) {
    // The ids become int32 on the device (a bad one gives a NaN row, not an
    // abort), and the positions are added from the fp32 master table.
    device::token_ids(x, vocabulary_, device_ids_);
    Tensor& y = Tensor::reuse(output_, shape, tokens_.compute.dtype(), Device::kCuda);
    device::embedding_forward(tokens_.compute, device_ids_, y);
    Tensor rows = y.reshape({batch, seq * width_});
    add_bias(rows, positions_.value.slice_rows(0, seq).reshape({seq * width_}));
    if (training) input_shape_ = x.shape();
    return y;
  }
  ids_.resize(static_cast<size_t>(x.numel()));
  const float* id = x.data<float>();
  for (size_t i = 0; i < ids_.size(); ++i) {
    const float v = id[i];
    FEDMESH_CHECK(v >= 0.0f && v < static_cast<float>(vocabulary_) && v == std::floor(v),
                  "token id " + std::to_string(v) + " outside a vocabulary of " + std::to_string(vocabulary_));
    ids_[i] = static_cast<int32_t>(v);
  }
  const Tensor& table = tokens_.compute;
  Tensor& y = Tensor::reuse(output_, shape, table.dtype());
  embedding_forward(table, ids_, y);
  visit_dtype(y.dtype(), [&]<class T>() {
    T* out = y.data<T>();
    const T* position = positions_.compute.data<T>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < seq; ++t) {
        T* row = out + (b * seq + t) * width_;
        const T* p = position + t * width_;
        for (int64_t j = 0; j < width_; ++j) row[j] = from_float<T>(to_float(row[j]) + to_float(p[j]));
      }
    }
  });
  if (training) input_shape_ = x.shape();
  return y;
}

Tensor TokenEmbedding::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(!input_shape_.empty(), "TokenEmbedding::backward before a training forward");
  FEDMESH_CHECK(!need_input_grad, "token ids have no gradient");
  const int64_t batch = input_shape_[0], seq = input_shape_[1];
  if (device::on_cuda(dy)) {
    device::embedding_backward(device_ids_, dy, tokens_.grad);
    Tensor positions = positions_.grad.slice_rows(0, seq).reshape({seq * width_});
    bias_grad(dy.reshape({batch, seq * width_}), positions, /*accumulate=*/true);
    return {};
  }
  embedding_backward(ids_, dy, tokens_.grad);
  float* dp = positions_.grad.data<float>();
  visit_dtype(dy.dtype(), [&]<class T>() {
    const T* g = dy.data<T>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < seq; ++t) {
        const T* row = g + (b * seq + t) * width_;
        float* out = dp + t * width_;
        for (int64_t j = 0; j < width_; ++j) out[j] += to_float(row[j]);
      }
    }
  });
  return {};
}

// ---- TransformerBlock -----------------------------------------------------------

TransformerBlock::TransformerBlock(const std::string& name, int64_t width, int64_t heads)
    : TransformerBlock(name, width, heads, heads >= 1 ? width / heads : 0, 4 * width) {
  FEDMESH_CHECK(heads >= 1 && width % heads == 0, "block width " + std::to_string(width) +
                                                      " is not a multiple of its " + std::to_string(heads) + " heads");
}

TransformerBlock::TransformerBlock(const std::string& name, int64_t width, int64_t heads, int64_t head_dim,
                                   int64_t hidden)
    : width_(width),
      heads_(heads),
      head_dim_(head_dim),
      hidden_(hidden),
      ln_1_(name + ".ln_1", width),
      ln_2_(name + ".ln_2", width),
      attention_in_(name + ".attn.c_attn", width, 3 * heads * head_dim),
      attention_out_(name + ".attn.c_proj", heads * head_dim, width),
      mlp_in_(name + ".mlp.c_fc", width, hidden),
      mlp_out_(name + ".mlp.c_proj", hidden, width) {
  FEDMESH_CHECK(heads >= 1 && head_dim >= 1 && hidden >= 1, "a block needs heads, a head size and MLP features");
}

void TransformerBlock::set_reduction(Reduce reduce, bool owns_output_biases) {
  reduce_ = std::move(reduce);
  owns_output_biases_ = owns_output_biases;
}

void TransformerBlock::reduce(Tensor partial) {
  if (!reduce_ || !reduction_status_.is_ok()) return;
  reduction_status_ = reduce_(partial);
}

std::vector<Parameter*> TransformerBlock::parameters() {
  std::vector<Parameter*> all;
  for (Layer* layer : std::initializer_list<Layer*>{&ln_1_, &attention_in_, &attention_out_, &ln_2_, &mlp_in_, &mlp_out_}) {
    for (Parameter* p : layer->parameters()) all.push_back(p);
  }
  return all;
}

void TransformerBlock::initialize(Rng& rng, int64_t layers) {
  const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  for (auto [linear, deviation] : {std::pair{&attention_in_, 0.02}, std::pair{&attention_out_, residual},
                                   std::pair{&mlp_in_, 0.02}, std::pair{&mlp_out_, residual}}) {
    normal_fill(linear->weight().value, rng, deviation);
    zero_fill(linear->bias().value);
    linear->weight().refresh_compute();
    linear->bias().refresh_compute();
  }
}

Tensor TransformerBlock::forward(const Tensor& x, bool training) {
  FEDMESH_CHECK(x.rank() == 3 && x.dim(2) == width_, "block expects (batch, seq, " + std::to_string(width_) +
                                                         "), got " + shape_to_string(x.shape()));
  const int64_t batch = x.dim(0), seq = x.dim(1), rows = batch * seq, attention = heads_ * head_dim_;
  shape_ = AttentionShape{batch, seq, heads_, head_dim_};
  // Attention branch (a shard: its heads, then the sum over the ranks).
  const Tensor a = ln_1_.forward(x, training);
  const Tensor qkv = attention_in_.forward(a.reshape({rows, width_}), training);
  Tensor& attended = Tensor::reuse(attended_, {batch, seq, attention}, x.dtype(), x.device());
  causal_attention_forward(shape_, qkv.reshape({batch, seq, 3 * attention}), attended, saved_);
  const Tensor projected = attention_out_.forward(attended.reshape({rows, attention}), training);
  reduce(projected);
  Tensor& residual = Tensor::reuse(residual_, x.shape(), x.dtype(), x.device());
  add(x, projected, residual);
  // MLP branch (a shard: its features, then the sum over the ranks).
  const Tensor m = ln_2_.forward(residual, training);
  const Tensor hidden = gelu_.forward(mlp_in_.forward(m.reshape({rows, width_}), training), training);
  const Tensor back = mlp_out_.forward(hidden, training);
  reduce(back);
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  add(residual, back, y);
  return y;
}

Tensor TransformerBlock::backward(const Tensor& dy, bool need_input_grad) {
  const int64_t batch = shape_.batch, seq = shape_.seq, rows = batch * seq, attention = heads_ * head_dim_;
  const Shape activations = {batch, seq, width_};
  // MLP branch: d residual = dy + d(mlp(ln_2(residual))).
  const Tensor dhidden = mlp_out_.backward(dy.reshape({rows, width_}), true);
  const Tensor dm = mlp_in_.backward(gelu_.backward(dhidden, true), true);
  reduce(dm);
  const Tensor dln_2 = ln_2_.backward(dm.reshape(activations), true);
  Tensor& dresidual = Tensor::reuse(residual_grad_, activations, dy.dtype(), dy.device());
  add(dy, dln_2, dresidual);
  // Attention branch: dx = d residual + d(attention(ln_1(x))).
  const Tensor dattended = attention_out_.backward(dresidual.reshape({rows, width_}), true);
  Tensor& dqkv = Tensor::reuse(qkv_grad_, {batch, seq, 3 * attention}, dy.dtype(), dy.device());
  const Tensor qkv = attention_in_.last_output().reshape({batch, seq, 3 * attention});
  // attended_ still holds the forward pass's attention output (the input the
  // output projection saved, the same storage): no copy is kept for this.
  causal_attention_backward(shape_, qkv, attended_, saved_, dattended.reshape({batch, seq, attention}), dqkv);
  const Tensor da = attention_in_.backward(dqkv.reshape({rows, 3 * attention}), true);
  reduce(da);
  const Tensor dln_1 = ln_1_.backward(da.reshape(activations), true);
  if (!owns_output_biases_) {
    for (Linear* projection : {&attention_out_, &mlp_out_}) fill(projection->bias().grad, 0.0f);
  }
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, activations, dy.dtype(), dy.device());
  add(dresidual, dln_1, dx);
  return dx;
}

// ---- TiedProjection ---------------------------------------------------------------

Shape TiedProjection::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 3 && input[2] == width_, "tied projection expects (batch, seq, " +
                                                             std::to_string(width_) + "), got " + shape_to_string(input));
  return {input[0] * input[1], vocabulary_};
}

Tensor TiedProjection::forward(const Tensor& x, bool training) {
  const Shape shape = output_shape(x.shape());
  const Tensor input = x.reshape({shape[0], width_});
  Tensor& logits = Tensor::reuse(output_, shape, x.dtype(), x.device());
  gemm(false, true, 1.0f, input, embedding_.token_table().compute, 0.0f, logits);  // (rows, V) = x · wteᵀ
  if (training) {
    input_ = input;
    input_shape_ = x.shape();
  }
  return logits;
}

Tensor TiedProjection::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(input_.defined(), "TiedProjection::backward before a training forward");
  Parameter& table = embedding_.token_table();
  gemm(true, false, 1.0f, dy, input_, 1.0f, table.grad);  // (V, width) += dyᵀ · x
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, input_.shape(), dy.dtype(), dy.device());
  gemm(false, false, 1.0f, dy, table.compute, 0.0f, dx);  // (rows, width) = dy · wte
  return dx.reshape(input_shape_);
}

}  // namespace fedmesh::train
