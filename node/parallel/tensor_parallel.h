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
// (tests/node/test_tensor_parallel.cpp, 2 ranks against 1). Rank 0 holds
// the second bias; the others hold zeros there and zero its gradient.
#pragma once

#include <memory>

#include "node/layers/layers.h"
#include "node/parallel/communicator.h"

namespace fedmesh::node {

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

}  // namespace fedmesh::node
