// In-site data parallelism for a node (`fedmesh node --ranks N`): rank 0 is
// the node that speaks to the federation; ranks 1..N-1 are processes it
// launched (train/parallel/rank_group.h) that load the same shard and model
// and wait for rounds. In every round rank 0 sends the round's training
// options over the command pipe, broadcasts the weights the round starts
// from, and all ranks train data parallel (each 1/N of every batch, the
// gradients all-reduced), so the ranks end with the same weights: the full
// model, from which rank 0 computes the update it sends. Whatever the
// layout inside the site, the federation sees one site and one delta.
//
// With tensor parallelism (`training.tensor_parallel`, `--tensor-parallel
// N`, a GPT), the ranks are N x ranks processes: each round the ranks
// shard the blocks of the weights they were sent, train, and gather the
// whole model again (train/parallel/parallel_training.h), so between
// rounds every rank holds the whole model and rank 0 reads it.
#pragma once

#include <memory>

#include "base/status.h"
#include "train/parallel/data_parallel.h"
#include "train/parallel/parallel_training.h"
#include "train/parallel/rank_group.h"
#include "node/site_config.h"
#include "train/trainer.h"

namespace fedmesh::node {

class SiteRanks {
 public:
  // Rank 0: launches the other processes of layout (layout.processes() >=
  // 2) for `model`, the node's training model.
  static Result<std::unique_ptr<SiteRanks>> launch(const train::RankFlags& layout, train::Sequential& model,
                                                   const train::DataParallelOptions& parallel);
  int size() const { return group_->size(); }
  // Sets the data-parallel rank and ranks of round options.
  train::TrainOptions options_for_rank(train::TrainOptions options) const;
  // Trains the model from the weights it holds with every rank: `trainer`
  // is rank 0's, built on the model with options_for_rank(local). A failure
  // (a rank died or left) is also kept in broken(): the node cannot train
  // again until restarted.
  Result<train::TrainSummary> fit(train::Trainer& trainer, const train::TrainOptions& local, const train::data::Dataset& shard,
                           const train::TrainCallbacks& callbacks);
  const Status& broken() const { return broken_; }

 private:
  SiteRanks() = default;
  train::RankFlags layout_;
  train::Sequential* model_ = nullptr;
  std::unique_ptr<train::RankGroup> group_;
  std::unique_ptr<train::ParallelTraining> training_;
  Status broken_;
};

// The data parallelism a node's config asks for (--zero-1).
train::DataParallelOptions site_parallel_options(const SiteConfig& config);

// A launched rank of a node: loads the node's shard and model from its
// config, joins the group and trains every round rank 0 sends until rank 0
// closes the pipe (ok) or something fails (the error).
Status run_site_rank(const SiteConfig& config, const train::RankFlags& flags);

}  // namespace fedmesh::node
