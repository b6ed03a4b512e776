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
#include <span>
#include <vector>

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

// How one tensor of a whole block lies over the n ranks of tensor
// parallelism (fp32, host memory):
// - replicated: whole on every rank;
// - rows: `parts` equal groups of rows (c_attn's q, k and v: 3), each
//   split in n: rank r holds rows [r m / n, (r + 1) m / n) of every group
//   of m rows, the groups one after the other (a vector: its elements);
// - columns: rank r holds columns [r c / n, (r + 1) c / n) of a matrix;
// - owner: whole on rank 0, zeros elsewhere (a row-parallel layer's bias:
//   added once to the sum of the partial outputs).
struct Split {
  enum Kind { kReplicated, kRows, kColumns, kOwner } kind = kReplicated;
  int64_t parts = 1;  // kRows only
};
// The shape of rank's slice of a whole tensor of `shape` (kInvalidArgument
// when it does not divide over the ranks).
Result<Shape> split_shape(const Shape& shape, Split split, int ranks);
// Writes rank's slice of `whole` into `slice` (of split_shape's shape).
void slice_for_rank(const Tensor& whole, Split split, int rank, int ranks, Tensor& slice);
// The inverse: `gathered` holds every rank's slice, rank 0's first (an
// all-gather), and `whole` is written from them.
void assemble_slices(std::span<const float> gathered, Split split, int ranks, Tensor& whole);
// The splits of a transformer block's parameters, in
// TransformerBlock::parameters() order: ln_1 (weight, bias), c_attn,
// attn.c_proj, ln_2, c_fc, mlp.c_proj.
const std::vector<Split>& transformer_block_splits();

// The same for a transformer block: rank r of n holds heads
// [r H / n, (r + 1) H / n) of the attention (their rows of c_attn's q, k
// and v, their columns of attn.c_proj) and the same slice of the MLP's
// features (rows of c_fc, columns of mlp.c_proj); the layer norms are
// whole on every rank, and rank 0 alone holds the two output projections'
// biases. Two all-reduces forward (after each output projection), two
// backward (the input gradients of c_attn and c_fc); activations in bf16 or
// fp16 (mixed precision) are summed in fp32 and rounded once. A block on the
// CUDA device needs a communicator of device memory (NCCL), one on the host
// a host one (Gloo). The shard is a
// TransformerBlock, a Layer, so a model of shards trains like any model;
// its reduction_status() says whether every all-reduce went through.
// Each rank's layer-norm gradients equal the whole block's; its other
// gradients are its slices of the whole block's
// (tests/train/test_tensor_parallel.cpp, a tiny transformer on 2 ranks).
Result<std::unique_ptr<TransformerBlock>> shard_transformer_block(TransformerBlock& whole, Communicator& communicator);

}  // namespace fedmesh::train
