#include "node/parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

namespace fedmesh::node {

Result<std::unique_ptr<TensorParallelMlp>> TensorParallelMlp::shard(Linear& first, Linear& second,
                                                                   Communicator& communicator) {
  const Tensor& w1 = first.weight().value;   // [hidden, in]
  const Tensor& w2 = second.weight().value;  // [out, hidden]
  if (w1.dtype() != DType::kF32 || w2.dtype() != DType::kF32) return invalid_argument("tensor parallel: fp32 weights only");
  const int64_t hidden = w1.dim(0), in = w1.dim(1), out = w2.dim(0);
  if (w2.dim(1) != hidden) return invalid_argument("tensor parallel: the second Linear does not take the first's output");
  const int64_t ranks = communicator.size();
  if (hidden % ranks != 0) {
    return invalid_argument("tensor parallel: " + std::to_string(hidden) + " hidden features do not split over " +
                            std::to_string(ranks) + " ranks");
  }
  std::unique_ptr<TensorParallelMlp> block(new TensorParallelMlp());
  block->communicator_ = &communicator;
  const int64_t slice = hidden / ranks;
  block->begin_ = slice * communicator.rank();
  block->end_ = block->begin_ + slice;
  block->column_ = std::make_unique<Linear>(first.weight().name.substr(0, first.weight().name.rfind('.')), in, slice);
  block->row_ = std::make_unique<Linear>(second.weight().name.substr(0, second.weight().name.rfind('.')), slice, out);
  // Column-parallel: rows [begin, end) of w1 and b1.
  std::memcpy(block->column_->weight().value.data<float>(), w1.data<float>() + block->begin_ * in,
              static_cast<size_t>(slice * in) * sizeof(float));
  std::memcpy(block->column_->bias().value.data<float>(), first.bias().value.data<float>() + block->begin_,
              static_cast<size_t>(slice) * sizeof(float));
  // Row-parallel: columns [begin, end) of w2; b2 on rank 0 only.
  float* w2_shard = block->row_->weight().value.data<float>();
  for (int64_t o = 0; o < out; ++o) {
    std::memcpy(w2_shard + o * slice, w2.data<float>() + o * hidden + block->begin_, static_cast<size_t>(slice) * sizeof(float));
  }
  float* b2 = block->row_->bias().value.data<float>();
  if (communicator.rank() == 0) std::memcpy(b2, second.bias().value.data<float>(), static_cast<size_t>(out) * sizeof(float));
  else std::fill(b2, b2 + out, 0.0f);
  for (Parameter* p : {&block->column_->weight(), &block->column_->bias(), &block->row_->weight(), &block->row_->bias()}) {
    p->refresh_compute();
  }
  return block;
}

Result<Tensor> TensorParallelMlp::forward(const Tensor& x) {
  const Tensor hidden = relu_.forward(column_->forward(x, true), true);
  Tensor z = row_->forward(hidden, true).clone();
  FEDMESH_RETURN_IF_ERROR(communicator_->all_reduce_sum({z.data<float>(), static_cast<size_t>(z.numel())}));
  return z;
}

Result<Tensor> TensorParallelMlp::backward(const Tensor& dz) {
  const Tensor dhidden = relu_.backward(row_->backward(dz, true), true);
  Tensor dx = column_->backward(dhidden, true).clone();
  FEDMESH_RETURN_IF_ERROR(communicator_->all_reduce_sum({dx.data<float>(), static_cast<size_t>(dx.numel())}));
  if (communicator_->rank() != 0) {
    Tensor& db = row_->bias().grad;
    std::fill(db.data<float>(), db.data<float>() + db.numel(), 0.0f);
  }
  return dx;
}

}  // namespace fedmesh::node
