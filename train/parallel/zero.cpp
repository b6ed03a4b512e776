#include "train/parallel/zero.h"

#include <algorithm>
#include <cstring>

namespace fedmesh::train {

ShardedOptimizer::ShardedOptimizer(const TrainOptions& options, Communicator& communicator)
    : options_(options), communicator_(communicator) {}

std::string ShardedOptimizer::name() const { return options_.optimizer + " (ZeRO-1)"; }

void ShardedOptimizer::shape_for(const std::vector<Parameter*>& parameters) {
  int64_t total = 0;
  for (const Parameter* p : parameters) total += p->value.numel();
  if (total == total_) return;
  total_ = total;
  const int64_t ranks = communicator_.size();
  block_ = (total + ranks - 1) / ranks;
  begin_ = std::min(total, block_ * communicator_.rank());
  end_ = std::min(total, begin_ + block_);
  const size_t tensors = options_.optimizer == "adamw" ? 2 : (options_.momentum > 0.0f ? 1 : 0);
  state_.clear();
  for (size_t i = 0; i < tensors; ++i) state_.push_back(Tensor::zeros({std::max<int64_t>(1, end_ - begin_)}));
  gathered_.assign(static_cast<size_t>(block_ * ranks), 0.0f);
}

void ShardedOptimizer::step(std::vector<Parameter*>& parameters, float lr) {
  shape_for(parameters);
  ++steps_;
  SgdOptions sgd;
  sgd.momentum = options_.momentum;
  sgd.nesterov = options_.nesterov;
  sgd.weight_decay = options_.weight_decay;
  AdamWOptions adamw;
  adamw.weight_decay = options_.weight_decay;
  // Step the part of every parameter that falls in [begin_, end_).
  int64_t offset = 0;
  for (Parameter* p : parameters) {
    const int64_t n = p->value.numel();
    const int64_t lo = std::max(begin_, offset), hi = std::min(end_, offset + n);
    if (lo < hi) {
      float* w = p->value.data<float>() + (lo - offset);
      const float* g = p->grad.data<float>() + (lo - offset);
      const int64_t at = lo - begin_;
      if (options_.optimizer == "adamw") {
        adamw_step(w, g, state_[0].data<float>() + at, state_[1].data<float>() + at, hi - lo, steps_, lr, adamw);
      } else {
        sgd_step(w, g, state_.empty() ? nullptr : state_[0].data<float>() + at, hi - lo, lr, sgd);
      }
    }
    offset += n;
  }
  // Every rank's part to every rank: my block of the flat parameters, then
  // the all-gather, then the flat parameters back.
  std::vector<float> mine(static_cast<size_t>(block_), 0.0f);
  offset = 0;
  for (Parameter* p : parameters) {
    const int64_t n = p->value.numel();
    const int64_t lo = std::max(begin_, offset), hi = std::min(end_, offset + n);
    if (lo < hi) {
      std::memcpy(mine.data() + (lo - begin_), p->value.data<float>() + (lo - offset), static_cast<size_t>(hi - lo) * sizeof(float));
    }
    offset += n;
  }
  Status gathered = communicator_.all_gather(mine, gathered_);
  if (!gathered.is_ok()) {
    if (status_.is_ok()) status_ = gathered;
    return;
  }
  offset = 0;
  for (Parameter* p : parameters) {
    std::memcpy(p->value.raw(), gathered_.data() + offset, p->value.nbytes());
    offset += p->value.numel();
  }
}

std::vector<OptimizerStateTensor> ShardedOptimizer::state_tensors(const std::vector<Parameter*>& parameters) {
  shape_for(parameters);
  std::vector<OptimizerStateTensor> out;
  const char* names[2] = {options_.optimizer == "adamw" ? "zero1.exp_avg" : "zero1.momentum", "zero1.exp_avg_sq"};
  for (size_t i = 0; i < state_.size(); ++i) out.push_back({names[i], &state_[i]});
  return out;
}

}  // namespace fedmesh::train
