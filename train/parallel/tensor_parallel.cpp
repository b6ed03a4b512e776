#include "train/parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

namespace fedmesh::train {

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

namespace {

void copy_values(const Tensor& from, Parameter& to) {
  std::memcpy(to.value.raw(), from.raw(), to.value.nbytes());
}

// Rows [begin, begin + count) of a (rows, columns) fp32 matrix into `out` at row `at`.
void copy_rows(const Tensor& from, int64_t begin, int64_t count, Tensor& out, int64_t at) {
  const int64_t columns = from.dim(1);
  std::memcpy(out.data<float>() + at * columns, from.data<float>() + begin * columns,
              static_cast<size_t>(count * columns) * sizeof(float));
}

// Columns [begin, begin + count) of a (rows, columns) fp32 matrix into `out` (rows, count).
void copy_columns(const Tensor& from, int64_t begin, int64_t count, Tensor& out) {
  const int64_t rows = from.dim(0), columns = from.dim(1);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data<float>() + r * count, from.data<float>() + r * columns + begin, static_cast<size_t>(count) * sizeof(float));
  }
}

}  // namespace

Result<std::unique_ptr<TransformerBlock>> shard_transformer_block(TransformerBlock& whole, Communicator& communicator) {
  const int64_t ranks = communicator.size(), rank = communicator.rank();
  if (whole.heads() % ranks != 0 || whole.hidden() % ranks != 0) {
    return invalid_argument("tensor parallel: " + std::to_string(whole.heads()) + " heads and " +
                            std::to_string(whole.hidden()) + " MLP features do not split over " + std::to_string(ranks) +
                            " ranks");
  }
  for (Parameter* p : whole.parameters()) {
    if (p->value.dtype() != DType::kF32) return invalid_argument("tensor parallel: fp32 weights only");
  }
  const int64_t width = whole.width(), head_dim = whole.head_dim();
  const int64_t heads = whole.heads() / ranks, hidden = whole.hidden() / ranks;
  const int64_t attention = heads * head_dim, all_attention = whole.heads() * head_dim;
  const std::string name = whole.ln_1().parameters()[0]->name.substr(0, whole.ln_1().parameters()[0]->name.find(".ln_1"));
  auto shard = std::make_unique<TransformerBlock>(name, width, heads, head_dim, hidden);
  // Layer norms: whole on every rank.
  for (auto [from, to] : {std::pair{&whole.ln_1(), &shard->ln_1()}, std::pair{&whole.ln_2(), &shard->ln_2()}}) {
    for (size_t i = 0; i < 2; ++i) copy_values(from->parameters()[i]->value, *to->parameters()[i]);
  }
  // c_attn: this rank's rows of each of q, k and v (weight and bias).
  for (int64_t part = 0; part < 3; ++part) {
    const int64_t begin = part * all_attention + rank * attention;
    copy_rows(whole.attention_in().weight().value, begin, attention, shard->attention_in().weight().value, part * attention);
    std::memcpy(shard->attention_in().bias().value.data<float>() + part * attention,
                whole.attention_in().bias().value.data<float>() + begin, static_cast<size_t>(attention) * sizeof(float));
  }
  // c_fc: this rank's rows; the output projections: its columns.
  copy_rows(whole.mlp_in().weight().value, rank * hidden, hidden, shard->mlp_in().weight().value, 0);
  std::memcpy(shard->mlp_in().bias().value.data<float>(), whole.mlp_in().bias().value.data<float>() + rank * hidden,
              static_cast<size_t>(hidden) * sizeof(float));
  copy_columns(whole.attention_out().weight().value, rank * attention, attention, shard->attention_out().weight().value);
  copy_columns(whole.mlp_out().weight().value, rank * hidden, hidden, shard->mlp_out().weight().value);
  for (Linear* projection : {&shard->attention_out(), &shard->mlp_out()}) {
    Tensor& bias = projection->bias().value;
    std::fill(bias.data<float>(), bias.data<float>() + bias.numel(), 0.0f);
  }
  if (rank == 0) {
    copy_values(whole.attention_out().bias().value, shard->attention_out().bias());
    copy_values(whole.mlp_out().bias().value, shard->mlp_out().bias());
  }
  for (Parameter* p : shard->parameters()) p->refresh_compute();
  Communicator* comm = &communicator;
  shard->set_reduction(
      [comm](Tensor& partial) -> Status {
        if (partial.dtype() != DType::kF32) return invalid_argument("tensor parallel: fp32 activations only");
        return comm->all_reduce_sum({partial.data<float>(), static_cast<size_t>(partial.numel())});
      },
      rank == 0);
  return shard;
}

}  // namespace fedmesh::train
