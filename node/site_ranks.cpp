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

Result<std::unique_ptr<SiteRanks>> SiteRanks::launch(int ranks, train::Sequential& model, const train::DataParallelOptions& parallel) {
  Result<std::unique_ptr<train::RankGroup>> group = train::RankGroup::launch(ranks, train::kRankTimeout, model.device());
  if (!group.is_ok()) return group.status();
  std::unique_ptr<SiteRanks> out(new SiteRanks());
  out->group_ = std::move(*group);
  out->sync_ = std::make_unique<train::DataParallel>(out->group_->communicator(), model, parallel);
  return out;
}

train::TrainOptions SiteRanks::options_for_rank(train::TrainOptions options) const {
  options.data_parallel_rank = 0;
  options.data_parallel_ranks = size();
  return options;
}

Result<train::TrainSummary> SiteRanks::fit(train::Trainer& trainer, const train::TrainOptions& local, const train::data::Dataset& shard,
                                    const train::TrainCallbacks& callbacks) {
  FEDMESH_RETURN_IF_ERROR(broken_);
  broken_ = group_->command(round_command(local));
  if (broken_.is_ok()) broken_ = train::broadcast_parameters(sync_->communicator(), sync_->model());
  FEDMESH_RETURN_IF_ERROR(broken_);
  Result<train::TrainSummary> summary = train::fit_data_parallel(trainer, *sync_, shard, nullptr, callbacks);
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
  train::DataParallel sync(**communicator, **model, site_parallel_options(config));
  for (;;) {
    Result<std::optional<nlohmann::json>> command = train::read_rank_command();
    if (!command.is_ok()) return command.status();
    if (!command->has_value()) return Status::ok();  // rank 0 closed the pipe
    Result<train::TrainOptions> local = round_options(**command, config.local);
    if (!local.is_ok()) return local.status();
    local->data_parallel_rank = flags.rank;
    local->data_parallel_ranks = flags.ranks;
    FEDMESH_RETURN_IF_ERROR(local->validate());
    FEDMESH_RETURN_IF_ERROR(train::broadcast_parameters(**communicator, **model));
    train::Trainer trainer(**model, *local);
    Result<train::TrainSummary> summary = train::fit_data_parallel(trainer, sync, *data->shard, nullptr, {});
    if (!summary.is_ok()) return summary.status();
  }
}

}  // namespace fedmesh::node
