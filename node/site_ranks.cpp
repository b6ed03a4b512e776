#include "node/site_ranks.h"

#include "kernels/parallel.h"
#include "train/model.h"

namespace fedmesh::node {

namespace {

// The round's options as rank 0 sends them: what differs between rounds
// (the rest is the config every rank read).
nlohmann::json round_command(const train::TrainOptions& local) {
  return {{"command", "train"}, {"max_steps", local.max_steps}, {"epochs", local.epochs}, {"seed", local.seed}};
}

Result<train::TrainOptions> round_options(const nlohmann::json& command, train::TrainOptions local) {
  if (command.value("command", "") != "train" || !command["max_steps"].is_number_integer() ||
      !command["epochs"].is_number_integer() || !command["seed"].is_number_unsigned()) {
    return invalid_argument("rank 0 sent an unknown command: " + command.dump().substr(0, 120));
  }
  local.max_steps = command["max_steps"].get<int64_t>();
  local.epochs = command["epochs"].get<int64_t>();
  local.seed = command["seed"].get<uint64_t>();
  return local;
}

}  // namespace

train::DataParallelOptions site_parallel_options(const SiteConfig& config) {
  train::DataParallelOptions options;
  options.zero_one = config.zero_one;
  return options;
}

namespace {

// Every process of a node's group, once: its part in the training, and the
// model whole again until the first round (the ranks broadcast whole
// weights every round).
Result<std::unique_ptr<train::ParallelTraining>> start_training(train::Communicator& world, const train::RankFlags& flags,
                                                                 train::Sequential& model,
                                                                 const train::DataParallelOptions& parallel) {
  Result<std::unique_ptr<train::ParallelTraining>> training = train::ParallelTraining::start(world, flags, model, nullptr, parallel);
  if (!training.is_ok()) return training.status();
  FEDMESH_RETURN_IF_ERROR((*training)->gather());
  return training;
}

// One round on every process: the weights rank 0 holds, sharded where the
// blocks are split, trained, and the whole model gathered again.
Result<train::TrainSummary> train_round(train::Communicator& world, train::ParallelTraining& training,
                                        train::Sequential& model, train::Trainer& trainer,
                                        const train::data::Dataset& shard, const train::TrainCallbacks& callbacks) {
  FEDMESH_RETURN_IF_ERROR(train::broadcast_parameters(world, model));
  training.scatter();
  Result<train::TrainSummary> summary =
      train::fit_synced(trainer, training.hook(), training.data_parallel(), shard, nullptr, callbacks);
  if (!summary.is_ok()) return summary;
  FEDMESH_RETURN_IF_ERROR(training.gather());
  return summary;
}

}  // namespace

Result<std::unique_ptr<SiteRanks>> SiteRanks::launch(const train::RankFlags& layout, train::Sequential& model,
                                                     const train::DataParallelOptions& parallel) {
  Result<std::unique_ptr<train::RankGroup>> group =
      train::RankGroup::launch(layout.processes(), train::kRankTimeout, model.device());
  if (!group.is_ok()) return group.status();
  std::unique_ptr<SiteRanks> out(new SiteRanks());
  out->layout_ = layout;
  out->layout_.rank = 0;
  out->layout_.rendezvous = (*group)->directory();
  out->model_ = &model;
  out->group_ = std::move(*group);
  Result<std::unique_ptr<train::ParallelTraining>> training =
      start_training(out->group_->communicator(), out->layout_, model, parallel);
  if (!training.is_ok()) return training.status();
  out->training_ = std::move(*training);
  return out;
}

train::TrainOptions SiteRanks::options_for_rank(train::TrainOptions options) const {
  options.data_parallel_rank = 0;
  options.data_parallel_ranks = layout_.ranks;
  return options;
}

Result<train::TrainSummary> SiteRanks::fit(train::Trainer& trainer, const train::TrainOptions& local, const train::data::Dataset& shard,
                                    const train::TrainCallbacks& callbacks) {
  FEDMESH_RETURN_IF_ERROR(broken_);
  broken_ = group_->command(round_command(local));
  FEDMESH_RETURN_IF_ERROR(broken_);
  Result<train::TrainSummary> summary = train_round(group_->communicator(), *training_, *model_, trainer, shard, callbacks);
  if (!summary.is_ok()) {
    const Status exited = group_->check_ranks();
    broken_ = exited.is_ok() ? summary.status() : exited;
    return broken_;
  }
  return summary;
}

Status run_site_rank(const SiteConfig& config, const train::RankFlags& flags) {
  set_cpu_threads(config.threads);
  Result<SiteData> data = load_site_data(config);
  if (!data.is_ok()) return data.status();
  // The whole initial model, init and LoRA adapters included: a rank that
  // trains adapters computes with the same frozen weights as rank 0.
  Result<std::unique_ptr<train::Sequential>> model =
      train::make_initial_model(config.model, config.seed, data->model_input(), config.init);
  if (!model.is_ok()) return model.status();
  // GPU ranks: joining picks this rank's device, then the model moves there.
  const Device device = config.device == "cuda" ? Device::kCuda : Device::kCpu;
  if (const std::string problem = (*model)->device_problem(device); !problem.empty()) return invalid_argument(problem);
  Result<std::unique_ptr<train::Communicator>> communicator = train::join_rank_group(flags, train::kRankTimeout, device);
  if (!communicator.is_ok()) return communicator.status();
  (*model)->to_device(device);
  train::RankFlags layout = flags;
  layout.tensor_parallel = config.tensor_parallel;
  Result<std::unique_ptr<train::ParallelTraining>> training =
      start_training(**communicator, layout, **model, site_parallel_options(config));
  if (!training.is_ok()) return training.status();
  for (;;) {
    Result<std::optional<nlohmann::json>> command = train::read_rank_command();
    if (!command.is_ok()) return command.status();
    if (!command->has_value()) return Status::ok();  // rank 0 closed the pipe
    Result<train::TrainOptions> local = round_options(**command, config.local);
    if (!local.is_ok()) return local.status();
    local->data_parallel_rank = layout.data_rank();
    local->data_parallel_ranks = layout.ranks;
    FEDMESH_RETURN_IF_ERROR(local->validate());
    train::Trainer trainer(**model, *local);
    Result<train::TrainSummary> summary = train_round(**communicator, **training, **model, trainer, *data->shard, {});
    if (!summary.is_ok()) return summary.status();
  }
}

}  // namespace fedmesh::node
