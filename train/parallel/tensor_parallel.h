// Megatron-style tensor parallelism for an MLP block, Linear -> ReLU ->
// Linear, across the ranks of a site (Shoeybi et al. 2019): the first Linear
// is split by output features (column-parallel: rank r holds rows
// [r h / n, (r + 1) h / n) of its weight and bias), the second by input
// features (row-parallel: the same slice of its weight's columns; its bias
// lives on rank 0). Forward: each rank computes its slice of the hidden
// layer with no communication, multiplies it by its rows of the second
// weight, and one all-reduce sums the partial outputs. Backward mirrors it:
// one all-reduce sums the partial input gradients. Each rank's parameter
// gradients are then exactly its slices of the full block's gradients
// (tests/train/test_tensor_parallel.cpp, 2 ranks against 1). Rank 0 holds
// the second bias; the others hold zeros there and zero its gradient.
#pragma once

#include <memory>

#include "train/layers/layers.h"
#include "train/layers/transformer.h"
#include "train/parallel/communicator.h"

namespace fedmesh::train {

class TensorParallelMlp {
 public:
  // This rank's shard of the block `first` -> ReLU -> `second` (first:
  // in -> hidden, second: hidden -> out; hidden divisible by the ranks).
  static Result<std::unique_ptr<TensorParallelMlp>> shard(Linear& first, Linear& second, Communicator& communicator);

  Result<Tensor> forward(const Tensor& x);
  // dz: the gradient of the block's output (the same on every rank); returns
  // the gradient of its input, accumulating the shard's parameter gradients.
  Result<Tensor> backward(const Tensor& dz);

  Linear& column() { return *column_; }
  Linear& row() { return *row_; }
  int64_t hidden_begin() const { return begin_; }
  int64_t hidden_end() const { return end_; }

 private:
  TensorParallelMlp() = default;
  Communicator* communicator_ = nullptr;
  std::unique_ptr<Linear> column_, row_;
  ReLU relu_;
  int64_t begin_ = 0, end_ = 0;
};

// The same for a transformer block: rank r of n holds heads
// [r H / n, (r + 1) H / n) of the attention (their rows of c_attn's q, k
// and v, their columns of attn.c_proj) and the same slice of the MLP's
// features (rows of c_fc, columns of mlp.c_proj); the layer norms are
// whole on every rank, and rank 0 alone holds the two output projections'
// biases. Two all-reduces forward (after each output projection), two
// backward (the input gradients of c_attn and c_fc). The shard is a
// TransformerBlock, a Layer, so a model of shards trains like any model;
// its reduction_status() says whether every all-reduce went through.
// Each rank's layer-norm gradients equal the whole block's; its other
// gradients are its slices of the whole block's
// (tests/train/test_tensor_parallel.cpp, a tiny transformer on 2 ranks).
Result<std::unique_ptr<TransformerBlock>> shard_transformer_block(TransformerBlock& whole, Communicator& communicator);

}  // namespace fedmesh::train
