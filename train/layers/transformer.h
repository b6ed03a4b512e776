// The layers of a decoder-only (GPT-2 style) transformer: token and learned
// position embeddings, pre-norm blocks (layer norm, causal multi-head
// self-attention, residual; layer norm, GELU MLP, residual), and the output
// projection tied to the token embedding. Activations are (batch, seq,
// width) in the model's compute dtype; the logits are (batch * seq,
// vocabulary), one row per position, so the trainer's cross-entropy over
// rows is the next-token loss.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/attention.h"
#include "kernels/cuda_ops.h"
#include "train/layers/layer.h"
#include "train/layers/layers.h"

namespace fedmesh::train {

struct TransformerConfig {
  int64_t vocabulary = 256;
  int64_t context = 128;  // positions (the learned position table's rows)
  int64_t width = 192;
  int64_t heads = 6;
  int64_t layers = 4;
  int64_t parameters() const;  // with the tied projection counted once
};

// (batch, seq) token ids, held in fp32 -> (batch, seq, width): wte[id] + wpe[position].
class TokenEmbedding final : public Layer {
 public:
  TokenEmbedding(int64_t vocabulary, int64_t context, int64_t width);
  std::string kind() const override { return "embedding"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override { return {&tokens_, &positions_}; }
  void initialize(Rng& rng);  // N(0, 0.02) tokens, N(0, 0.01) positions, as GPT-2
  Parameter& token_table() { return tokens_; }

 private:
  int64_t vocabulary_, context_, width_;
  Parameter tokens_, positions_;
  std::vector<int32_t> ids_;
  cuda::DeviceBuffer device_ids_;  // the same on the CUDA device
  Shape input_shape_;
  Tensor output_;
};

// x + attention(ln_1(x)), then that + mlp(ln_2(that)), with the heads' core
// in kernels/attention.h and the four projections as Linear layers.
//
// A block may also be one rank's shard of a block under tensor parallelism
// (train/parallel/tensor_parallel.h): some of the heads and some of the MLP
// features, with a reduction that sums the partial outputs of the two
// output projections over the ranks in the forward pass and the partial
// input gradients of the two input projections in the backward pass.
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(const std::string& name, int64_t width, int64_t heads);
  // `heads` heads of `head_dim` and `hidden` MLP features (a whole block:
  // width / heads and 4 * width).
  TransformerBlock(const std::string& name, int64_t width, int64_t heads, int64_t head_dim, int64_t hidden);
  std::string kind() const override { return "block"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override;
  // N(0, 0.02) weights, zero biases; the projections back into the
  // residual stream N(0, 0.02 / sqrt(2 * layers)), as GPT-2.
  void initialize(Rng& rng, int64_t layers);

  // Tensor parallelism: `reduce` sums a tensor over the ranks in place. A
  // rank that does not own the output projections' biases (all but one)
  // keeps their gradients at zero. The first failed reduction is kept in
  // reduction_status() (the block's results are then meaningless).
  using Reduce = std::function<Status(Tensor& partial)>;
  void set_reduction(Reduce reduce, bool owns_output_biases);
  const Status& reduction_status() const { return reduction_status_; }

  int64_t width() const { return width_; }
  int64_t heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t hidden() const { return hidden_; }
  LayerNorm& ln_1() { return ln_1_; }
  LayerNorm& ln_2() { return ln_2_; }
  Linear& attention_in() { return attention_in_; }
  Linear& attention_out() { return attention_out_; }
  Linear& mlp_in() { return mlp_in_; }
  Linear& mlp_out() { return mlp_out_; }

 private:
  void reduce(Tensor partial);
  int64_t width_, heads_, head_dim_, hidden_;
  Reduce reduce_;
  bool owns_output_biases_ = true;
  Status reduction_status_;
  LayerNorm ln_1_, ln_2_;
  Linear attention_in_, attention_out_, mlp_in_, mlp_out_;
  Gelu gelu_;
  AttentionShape shape_{};
  Tensor attended_, saved_, residual_, output_, attended_grad_, qkv_grad_, residual_grad_, input_grad_;
};

// (batch, seq, width) -> (batch * seq, vocabulary) = x · wteᵀ with the
// token embedding's table (its gradient lands there; this layer owns no
// parameter).
class TiedProjection final : public Layer {
 public:
  TiedProjection(TokenEmbedding& embedding, int64_t vocabulary, int64_t width)
      : embedding_(embedding), vocabulary_(vocabulary), width_(width) {}
  std::string kind() const override { return "tied-projection"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  TokenEmbedding& embedding_;
  int64_t vocabulary_, width_;
  Shape input_shape_;
  Tensor input_, output_, input_grad_;
};

}  // namespace fedmesh::train
