#include "train/parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "kernels/convert.h"
#include "kernels/cuda_ops.h"

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

// A tensor as (rows, columns): a vector is a column of rows.
int64_t rows_of(const Tensor& t) { return t.dim(0); }
int64_t columns_of(const Tensor& t) { return t.rank() == 1 ? 1 : t.numel() / t.dim(0); }

}  // namespace

Result<Shape> split_shape(const Shape& shape, Split split, int ranks) {
  Shape out = shape;
  if (split.kind == Split::kRows) {
    if (shape.empty() || split.parts < 1 || shape[0] % (split.parts * ranks) != 0) {
      return invalid_argument("tensor parallel: " + shape_to_string(shape) + " does not split by rows into " +
                              std::to_string(split.parts) + " x " + std::to_string(ranks) + " parts");
    }
    out[0] /= ranks;
  } else if (split.kind == Split::kColumns) {
    if (shape.size() != 2 || shape[1] % ranks != 0) {
      return invalid_argument("tensor parallel: " + shape_to_string(shape) + " does not split by columns over " +
                              std::to_string(ranks) + " ranks");
    }
    out[1] /= ranks;
  }
  return out;
}

void slice_for_rank(const Tensor& whole, Split split, int rank, int ranks, Tensor& slice) {
  const float* from = whole.data<float>();
  float* to = slice.data<float>();
  switch (split.kind) {
    case Split::kReplicated:
      std::memcpy(to, from, whole.nbytes());
      return;
    case Split::kOwner:
      if (rank == 0) std::memcpy(to, from, whole.nbytes());
      else std::fill(to, to + slice.numel(), 0.0f);
      return;
    case Split::kRows: {
      const int64_t columns = columns_of(whole), group = rows_of(whole) / split.parts, mine = group / ranks;
      for (int64_t part = 0; part < split.parts; ++part) {
        std::memcpy(to + part * mine * columns, from + (part * group + rank * mine) * columns,
                    static_cast<size_t>(mine * columns) * sizeof(float));
      }
      return;
    }
    case Split::kColumns: {
      const int64_t rows = whole.dim(0), columns = whole.dim(1), mine = columns / ranks;
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(to + r * mine, from + r * columns + rank * mine, static_cast<size_t>(mine) * sizeof(float));
      }
      return;
    }
  }
}

void assemble_slices(std::span<const float> gathered, Split split, int ranks, Tensor& whole) {
  const int64_t n = whole.numel();
  FEDMESH_CHECK(split.kind == Split::kReplicated || split.kind == Split::kOwner
                    ? static_cast<int64_t>(gathered.size()) == n * ranks
                    : static_cast<int64_t>(gathered.size()) == n,
                "assemble_slices: the gathered slices do not make the whole tensor");
  float* to = whole.data<float>();
  switch (split.kind) {
    case Split::kReplicated:
    case Split::kOwner:  // rank 0's slice is the whole
      std::memcpy(to, gathered.data(), static_cast<size_t>(n) * sizeof(float));
      return;
    case Split::kRows: {
      const int64_t columns = columns_of(whole), group = rows_of(whole) / split.parts, mine = group / ranks;
      for (int rank = 0; rank < ranks; ++rank) {
        const float* from = gathered.data() + rank * (n / ranks);
        for (int64_t part = 0; part < split.parts; ++part) {
          std::memcpy(to + (part * group + rank * mine) * columns, from + part * mine * columns,
                      static_cast<size_t>(mine * columns) * sizeof(float));
        }
      }
      return;
    }
    case Split::kColumns: {
      const int64_t rows = whole.dim(0), columns = whole.dim(1), mine = columns / ranks;
      for (int rank = 0; rank < ranks; ++rank) {
        const float* from = gathered.data() + rank * (n / ranks);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(to + r * columns + rank * mine, from + r * mine, static_cast<size_t>(mine) * sizeof(float));
        }
      }
      return;
    }
  }
}

const std::vector<Split>& transformer_block_splits() {
  static const std::vector<Split> splits = {
      {Split::kReplicated}, {Split::kReplicated},  // ln_1
      {Split::kRows, 3},    {Split::kRows, 3},     // c_attn: q, k and v, by heads
      {Split::kColumns},    {Split::kOwner},       // attn.c_proj
      {Split::kReplicated}, {Split::kReplicated},  // ln_2
      {Split::kRows, 1},    {Split::kRows, 1},     // c_fc, by features
      {Split::kColumns},    {Split::kOwner},       // mlp.c_proj
  };
  return splits;
}

namespace {

// Sums a block's partial activations over the ranks: fp32 in place; bf16
// and fp16 widened to fp32, summed and rounded once. On the CUDA device
// through a communicator that reads device memory (NCCL), after the kernels
// that computed them.
Status sum_partials(Communicator& communicator, Tensor& partial) {
  const bool on_device = partial.device() == Device::kCuda;
  if (on_device != communicator.device_memory()) {
    return invalid_argument(std::string("tensor parallel: activations on the ") + (on_device ? "CUDA device" : "host") +
                            " and a " + communicator.backend() + " communicator of " +
                            (communicator.device_memory() ? "device" : "host") + " memory");
  }
  const auto reduce = [&](Tensor& values) {
    if (on_device) cuda::synchronize(cuda::default_stream());
    return communicator.all_reduce_sum({values.data<float>(), static_cast<size_t>(values.numel())});
  };
  if (partial.dtype() == DType::kF32) return reduce(partial);
  Tensor wide = Tensor::empty(partial.shape(), DType::kF32, partial.device());
  convert(partial, wide);
  FEDMESH_RETURN_IF_ERROR(reduce(wide));
  convert(wide, partial);
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<TransformerBlock>> shard_transformer_block(TransformerBlock& whole, Communicator& communicator) {
  const int ranks = communicator.size(), rank = communicator.rank();
  if (whole.heads() % ranks != 0 || whole.hidden() % ranks != 0) {
    return invalid_argument("tensor parallel: " + std::to_string(whole.heads()) + " heads and " +
                            std::to_string(whole.hidden()) + " MLP features do not split over " + std::to_string(ranks) +
                            " ranks");
  }
  for (Parameter* p : whole.parameters()) {
    if (p->value.dtype() != DType::kF32) return invalid_argument("tensor parallel: fp32 master weights only");
  }
  const std::string name = whole.ln_1().parameters()[0]->name.substr(0, whole.ln_1().parameters()[0]->name.find(".ln_1"));
  auto shard = std::make_unique<TransformerBlock>(name, whole.width(), whole.heads() / ranks, whole.head_dim(),
                                                  whole.hidden() / ranks);
  const std::vector<Parameter*> from = whole.parameters(), to = shard->parameters();
  const std::vector<Split>& splits = transformer_block_splits();
  for (size_t i = 0; i < from.size(); ++i) {
    slice_for_rank(from[i]->value.host(), splits[i], rank, ranks, to[i]->value);
    to[i]->refresh_compute();
    to[i]->to_device(from[i]->value.device());  // the shard lives where the whole block does
  }
  Communicator* comm = &communicator;
  shard->set_reduction([comm](Tensor& partial) { return sum_partials(*comm, partial); }, rank == 0);
  return shard;
}

}  // namespace fedmesh::train
