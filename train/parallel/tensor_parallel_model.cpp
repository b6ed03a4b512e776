#include "train/parallel/tensor_parallel_model.h"

#include <cstring>
#include <utility>

#include "kernels/cuda_ops.h"
#include "kernels/device_ops.h"
#include "kernels/elementwise.h"
#include "train/parallel/tensor_parallel.h"

namespace fedmesh::train {

namespace {

// The optimizer's state tensors of one parameter (none for plain SGD).
std::vector<OptimizerStateTensor> state_of(Optimizer* optimizer, Parameter* p) {
  if (optimizer == nullptr) return {};
  return optimizer->state_tensors({p});
}

// Re-rounds a block's compute copies at the model's precision.
void set_precision(TransformerBlock& block, DType dtype) {
  for (Parameter* p : block.parameters()) p->set_compute_dtype(dtype);
}

// A host tensor moved to `device` (an optimizer's state tensor, whose
// shape changes between whole and slice).
Tensor placed(Tensor host, Device device) { return device == Device::kCpu ? host : host.to(device); }

}  // namespace

Result<std::unique_ptr<TensorParallelModel>> TensorParallelModel::shard(Sequential& model, Communicator& tensor_ranks,
                                                                        Optimizer* optimizer) {
  if ((model.device() == Device::kCuda) != tensor_ranks.device_memory()) {
    return invalid_argument(std::string("tensor parallelism: a model on the ") +
                            (model.device() == Device::kCuda ? "CUDA device" : "host") + " and a " +
                            tensor_ranks.backend() + " communicator");
  }
  if (model.lora().enabled()) {
    return invalid_argument("tensor parallelism with LoRA is not supported yet: drop one of them");
  }
  std::unique_ptr<TensorParallelModel> out(new TensorParallelModel(model, tensor_ranks));
  for (size_t i = 0; i < model.layer_count(); ++i) {
    if (dynamic_cast<TransformerBlock*>(&model.layer(i)) != nullptr) out->slots_.push_back({i, nullptr});
  }
  if (out->slots_.empty()) {
    return invalid_argument("tensor parallelism splits the transformer blocks of a GPT; model " + model.name() +
                            " has none (use data-parallel --ranks instead)");
  }
  for (Slot& slot : out->slots_) {
    auto& whole = dynamic_cast<TransformerBlock&>(model.layer(slot.layer));
    Result<std::unique_ptr<TransformerBlock>> shard = shard_transformer_block(whole, tensor_ranks);
    if (!shard.is_ok()) return shard.status();
    const std::vector<Split>& splits = transformer_block_splits();
    const std::vector<Parameter*> parameters = (*shard)->parameters();
    for (size_t k = 0; k < parameters.size(); ++k) {
      if (splits[k].kind != Split::kReplicated) out->split_.insert(parameters[k]);
    }
    slot.held = std::move(*shard);  // the whole block stays in the model until scatter puts this in its place
  }
  out->scatter(optimizer);
  return out;
}

TransformerBlock& TensorParallelModel::shard_of(Slot& slot) {
  return dynamic_cast<TransformerBlock&>(sharded_ ? model_.layer(slot.layer) : *slot.held);
}

void TensorParallelModel::scatter(Optimizer* optimizer) {
  if (sharded_) return;
  const int ranks = communicator_.size(), rank = communicator_.rank();
  const std::vector<Split>& splits = transformer_block_splits();
  const Device device = model_.device();
  for (Slot& slot : slots_) {
    TransformerBlock& shard = shard_of(slot);
    auto& whole = dynamic_cast<TransformerBlock&>(model_.layer(slot.layer));
    const std::vector<Parameter*> from = whole.parameters(), to = shard.parameters();
    // Cut on the host (a device's tensors copied over and back).
    for (size_t k = 0; k < from.size(); ++k) {
      Tensor slice = Tensor::zeros(to[k]->value.shape());
      slice_for_rank(from[k]->value.host(), splits[k], rank, ranks, slice);
      to[k]->value.copy_from(slice);
      // The whole block's gradients are not carried: a step starts from zero.
      fill(to[k]->grad, 0.0f);
      // The optimizer keeps its state by parameter name: the whole tensor is
      // replaced by this rank's slice of it.
      for (const OptimizerStateTensor& state : state_of(optimizer, from[k])) {
        Tensor state_slice = Tensor::zeros(to[k]->value.shape());
        slice_for_rank(state.tensor->host(), splits[k], rank, ranks, state_slice);
        *state.tensor = placed(std::move(state_slice), device);
      }
    }
    set_precision(shard, model_.compute_dtype());
    // The shard in; the whole block out and freed (the slot is empty while
    // the shard is in the model).
    model_.replace_layer(slot.layer, std::move(slot.held));
  }
  sharded_ = true;
}

Status TensorParallelModel::gather(Optimizer* optimizer) {
  if (!sharded_) return Status::ok();
  const int ranks = communicator_.size();
  const std::vector<Split>& splits = transformer_block_splits();
  // Every slice this rank holds (weights, then their optimizer state), in
  // one buffer; every rank's buffer has the same layout and length.
  struct Piece {
    Tensor* slice;
    Split split;
    size_t offset;
  };
  std::vector<Piece> pieces;
  size_t total = 0;
  const Device device = model_.device();
  for (Slot& slot : slots_) {
    TransformerBlock& shard = shard_of(slot);
    const std::vector<Parameter*> parameters = shard.parameters();
    for (size_t k = 0; k < parameters.size(); ++k) {
      pieces.push_back({&parameters[k]->value, splits[k], total});
      total += static_cast<size_t>(parameters[k]->value.numel());
      for (const OptimizerStateTensor& state : state_of(optimizer, parameters[k])) {
        pieces.push_back({state.tensor, splits[k], total});
        total += static_cast<size_t>(state.tensor->numel());
      }
    }
  }
  std::vector<float> mine(total), all(total * static_cast<size_t>(ranks));
  for (const Piece& piece : pieces) {
    const Tensor host = piece.slice->host();
    std::memcpy(mine.data() + piece.offset, host.raw(), host.nbytes());
  }
  if (communicator_.device_memory()) {
    // NCCL gathers device memory: the buffers go over and back.
    Tensor mine_on_device = Tensor::view_of(mine.data(), {static_cast<int64_t>(total)}, DType::kF32).to(device);
    Tensor all_on_device = Tensor::empty({static_cast<int64_t>(all.size())}, DType::kF32, device);
    cuda::synchronize(cuda::default_stream());
    FEDMESH_RETURN_IF_ERROR(communicator_.all_gather({mine_on_device.data<float>(), total},
                                                     {all_on_device.data<float>(), all.size()}));
    const Tensor back = all_on_device.host();
    std::memcpy(all.data(), back.raw(), back.nbytes());
  } else {
    FEDMESH_RETURN_IF_ERROR(communicator_.all_gather(mine, all));
  }
  // Every piece's slices side by side (rank 0's first), then the whole.
  const auto whole_of = [&](const Piece& piece, Tensor& whole) {
    const size_t n = static_cast<size_t>(piece.slice->numel());
    std::vector<float> gathered(n * static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      std::memcpy(gathered.data() + r * n, all.data() + r * total + piece.offset, n * sizeof(float));
    }
    assemble_slices(gathered, piece.split, ranks, whole);
  };
  size_t next = 0;
  for (Slot& slot : slots_) {
    TransformerBlock& shard = shard_of(slot);
    const std::string name = shard.ln_1().parameters()[0]->name;
    auto whole = std::make_unique<TransformerBlock>(name.substr(0, name.find(".ln_1")), shard.width(),
                                                    shard.heads() * ranks, shard.head_dim(), shard.hidden() * ranks);
    const std::vector<Parameter*> parameters = whole->parameters();
    for (Parameter* p : parameters) {
      whole_of(pieces[next++], p->value);
      p->to_device(device);
      for (const OptimizerStateTensor& state : state_of(optimizer, p)) {
        Tensor full = Tensor::zeros(p->value.shape());
        whole_of(pieces[next++], full);
        *state.tensor = placed(std::move(full), device);  // by name: the slice's entry becomes the whole tensor
      }
    }
    set_precision(*whole, model_.compute_dtype());
    slot.held = model_.replace_layer(slot.layer, std::move(whole));  // the shard out, kept for scatter
  }
  sharded_ = false;
  return Status::ok();
}

Status TensorParallelModel::reduction_status() {
  if (!sharded_) return Status::ok();
  for (Slot& slot : slots_) {
    const Status& status = shard_of(slot).reduction_status();
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

void TensorParallelSync::before_last_backward(const StepResult& step) {
  if (inner_ != nullptr) inner_->before_last_backward(step);
}

void TensorParallelSync::after_layer(size_t layer) {
  if (inner_ != nullptr) inner_->after_layer(layer);
}

namespace {

// The split parameters' squares summed over the ranks (as fp32: every rank
// gets the same bits), plus the replicated ones' (the same on every rank,
// counted once): the whole gradient's squared norm, identical on every rank.
Result<double> whole_norm(Communicator& communicator, double split, double replicated) {
  float sum = static_cast<float>(split);
  if (communicator.device_memory()) {
    cuda::DeviceBuffer on_device(sizeof(float), cuda::default_stream());
    cuda::copy_to_device(&sum, on_device.data(), sizeof(float), cuda::default_stream());
    cuda::synchronize(cuda::default_stream());
    FEDMESH_RETURN_IF_ERROR(communicator.all_reduce_sum({on_device.as<float>(), 1}));
    cuda::copy_to_host(on_device.data(), &sum, sizeof(float), cuda::default_stream());
  } else {
    FEDMESH_RETURN_IF_ERROR(communicator.all_reduce_sum({&sum, 1}));
  }
  return static_cast<double>(sum) + replicated;
}

}  // namespace

Status TensorParallelSync::finish(std::span<Parameter* const> parameters, StepResult& step) {
  whole_squared_norm_.reset();
  FEDMESH_RETURN_IF_ERROR(model_.reduction_status());
  if (inner_ != nullptr) FEDMESH_RETURN_IF_ERROR(inner_->finish(parameters, step));
  if (model_.model().device() == Device::kCuda) return Status::ok();  // device_squared_norm does the rest
  double split = 0.0, replicated = 0.0;
  for (Parameter* p : parameters) (model_.is_split(p) ? split : replicated) += squared_l2_norm(p->grad);
  Result<double> whole = whole_norm(model_.communicator(), split, replicated);
  if (!whole.is_ok()) return whole.status();
  whole_squared_norm_ = *whole;
  return Status::ok();
}

Result<bool> TensorParallelSync::device_squared_norm(std::span<Parameter* const> parameters, double* squared_norm) {
  const cuda::Stream stream = cuda::default_stream();
  cuda::DeviceBuffer sums(2 * sizeof(double), stream);
  cuda::set_zero(sums.data(), 2 * sizeof(double), stream);
  for (Parameter* p : parameters) device::add_squared_l2_norm(p->grad, sums.as<double>() + (model_.is_split(p) ? 0 : 1));
  double host[2] = {0.0, 0.0};
  cuda::copy_to_host(sums.data(), host, sizeof(host), stream);
  Result<double> whole = whole_norm(model_.communicator(), host[0], host[1]);
  if (!whole.is_ok()) return whole.status();
  cuda::copy_to_device(&*whole, squared_norm, sizeof(double), stream);
  cuda::synchronize(stream);  // the value leaves this frame
  return true;
}

}  // namespace fedmesh::train
