#include "aggregator/server.h"

#include "aggregator/pending_values.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <sodium.h>

#include "aggregator/dashboard_page.h"
#include "aggregator/manager_checkpoint.h"
#include "aggregator/operator_view.h"
#include "aggregator/pending_values.h"
#include "aggregator/site_report.h"
#include "aggregator/site_state.h"
#include "base/http_endpoint.h"
#include "base/prometheus.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "kernels/parallel.h"
#include "train/data/fashion_mnist.h"
#include "train/data/text_corpus.h"
#include "train/data/token_shards.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "train/lora_export.h"
#include "train/model_spec.h"
#include "train/trainer.h"
#include "privacy/dp_settings.h"
#include "privacy/ledger.h"
#include "privacy/rdp_accountant.h"
#include "protocol/model_transfer.h"
#include "protocol/secagg_wire.h"
#include "protocol/refusal_log.h"
#include "protocol/update_service.h"
#include "store/pending_payload.h"

namespace fedmesh::aggregator {

namespace {

using TimePoint = fedmesh::Clock::time_point;

struct SiteRecord {
  std::string routing_id;
  TimePoint last_contact{};
  int64_t updates_accepted = 0;
  int64_t refused = 0;  // its updates and messages refused, for any reason
  double local_loss = 0.0, local_accuracy = 0.0, train_loss = 0.0;
  std::optional<double> local_r2, local_mae;  // a regression task's, once reported
  int64_t report_round = -1;
  int64_t last_staleness = -1;  // of its last accepted update (-1: none yet)
  bool missed_round = false;    // late (aggregator/site_state.h)
};

// An update's id in the store and the round manager: "SENDER/SEQUENCE".
std::string update_id(const protocol::UpdateMetadata& m) { return m.sender + "/" + std::to_string(m.sequence); }

}  // namespace

class AggregatorServer::Impl {
 public:
  // The HTTP endpoint's thread renders pages from the members below: stop it
  // before any of them is destroyed (a race ThreadSanitizer found at shutdown).
  ~Impl() { http.reset(); }
  AggregatorConfig config;
  EventSink emit;
  crypto::SiteKeys keys;
  crypto::Roster roster;
  std::optional<store::CheckpointStore> store;
  std::optional<crypto::ReplayGuard> replay;
  // The evaluator's parameter values are the round manager's model (views),
  // so it is declared first and outlives the manager.
  std::unique_ptr<train::Sequential> evaluator_model;
  std::optional<RoundManager> manager;
  std::unique_ptr<train::data::Dataset> validation;  // null: no validation
  bool language_model = false;
  // `tokenizer`: the BPE tokenizer (none: bytes), its fingerprint as
  // announced ("" for bytes), and the held-out targets per byte they stand
  // for (val_bits_per_byte = loss * tokens_per_byte / ln 2).
  std::optional<train::data::BpeTokenizer> tokenizer;
  std::string tokenizer_fingerprint;
  // Image and table models: the schema of the validation data ("" canonical: none, not announced).
  train::data::DataSchema data_schema;
  std::string model_spec_fingerprint;  // announced: the model's spec (train/model_spec.h)
  train::ModelInput model_input;       // what the model was built for
  double tokens_per_byte = 1.0;
  bool pretokenized_validation = false;  // validation = "tokens:FILE": ids with no bytes behind them
  std::vector<crypto::Hash> chain;  // hash of every version, by version
  std::vector<protocol::TensorShape> manifest;
  std::unique_ptr<protocol::ServerChannel> socket;
  std::unique_ptr<protocol::UpdateService> service;
  protocol::ModelPublisher publisher;
  protocol::QueuedModelReplies queued_model_replies;
  protocol::ModelServingBudget serving_budget;
  std::unique_ptr<HttpEndpoint> http;
  std::atomic<const HttpEndpoint*> serving{nullptr};  // `http` once set, for the pages it renders
  std::map<std::string, SiteRecord> sites;
  // The clock, the network and the store's file system (production: the real ones).
  protocol::RuntimeEnvironment env;
  fedmesh::Clock& clock() const { return *env.clock; }
  TimePoint started{};
  TimePoint round_started{};
  std::optional<TimePoint> finished_at;
  std::string metrics_address;
  // Private mode: the round's secure aggregation; with [dp], its accounting.
  std::unique_ptr<SecureRound> secure;
  std::optional<privacy::ConstantRateAccounting> dp;
  int64_t dp_rounds = 0;          // rounds released with noise (the ledger's length)
  bool budget_exhausted = false;  // the next round would exceed dp.target_epsilon

  // What /metrics, /status and the dashboard show (its own lock).
  OperatorView view;
  // Sites taken off the roster while this process ran, with what was known
  // of them (bounded by the rosters seen): shown as revoked, never sampled.
  std::map<std::string, SiteRecord> revoked_sites;
  // Refusals reach the log at most once per peer key and reason per
  // interval (protocol/refusal_log.h); every one is counted in the metrics.
  protocol::RefusalLog refusal_log;
  std::atomic<uint64_t> refusal_log_lines_suppressed{0};
  void log_refusal(const protocol::Incoming& incoming, const std::string& code, const std::string& reason);

  double now() const { return std::chrono::duration<double>(clock().now() - started).count(); }

  Status open(AggregatorConfig c, EventSink sink);
  Status restore();
  Status step_past_quarantine_rounds(int64_t resumed_round);
  Status publish();
  Status run(const std::atomic<bool>& stop);
  void handle(const protocol::Incoming& incoming);
  bool handle_other(const protocol::Incoming& incoming, const protocol::ParsedMessage& message,
                    std::optional<protocol::OutgoingMessage>& reply, protocol::Rejection& rejection);
  // The receiver's store hook: the update and its replay counter in one
  // transaction, then queued in stored_updates for take_completed().
  Status store_update(protocol::ReceivedUpdate received);
  std::vector<SiteUpdate> stored_updates;
  void take_completed();
  void submit(SiteUpdate update, bool from_store);
  // An asynchronous server step that could not be committed: the model in
  // memory is then ahead of the store, so run() stops with this error (and
  // a restart resumes from the store, the step's updates still pending)
  // rather than serve, announce or finish on a step that is not durable.
  Status failed_step;
  Status maybe_start_round();
  // Submits the updates in the store's pending table not applied yet (after
  // a restart), one decoded at a time, those `wanted` picks: at most one
  // update's values are in memory beside the round's sum.
  Status submit_unapplied_pending(const std::function<bool(const SiteUpdate&)>& wanted);
  Status finish_step(const RoundRecord& record, std::optional<store::PrivacyEntry> privacy = std::nullopt);
  train::EvalResult evaluate_held_model(nlohmann::json& metrics);
  Status finish_secure_round(const SecureResult& result);
  Status open_privacy();
  std::vector<std::string> available_sites() const;
  // Sites a synchronous round needs before it opens: min_sites, or every
  // site on the roster when fewer remain (a revoked member does not stall
  // the federation). Said once per change when a round waits for them.
  int64_t sites_needed() const;
  std::string waiting_said;
  void say_waiting(const std::vector<std::string>& available, int64_t needed);
  // The open round's sample and when it opened, stored so that a restart
  // reopens the same round with the same deadline.
  uint64_t round_opened_unix_ms = 0;
  Status save_open_round();
  // Revoked sites leave the open round's sample at once (not in private
  // mode: there a revoked member is a dropout of the secure session).
  void drop_from_open_round(const std::vector<std::string>& removed);
  // `rounds` counts server steps, the steps the model took: a version that
  // restores an earlier model past a quarantined round is no step.
  bool finished() const {
    return (budget_exhausted || (config.rounds > 0 && manager->server_steps() >= config.rounds)) &&
           !manager->round_open();
  }
  void set_service_round();
  protocol::OutgoingMessage announce(const std::string& site) const;
  void refresh_status();
  // Sync: the sites sampled for the round just closed that sent nothing in it are late.
  void note_round_closed(const std::vector<std::string>& delivered);
  // A re-signed roster on disk (`fedmesh roster revoke`, a site added) is
  // taken without a restart: checked like the one at start-up, then new
  // handshakes and every message are held to it.
  void reload_roster_if_changed();
  std::filesystem::file_time_type roster_mtime{};
  TimePoint last_roster_check{};
  // What the view needs from the process itself when it renders.
  OperatorContext operator_context() const;
  int64_t unauthorized_requests() const {
    const HttpEndpoint* endpoint = serving.load();
    return endpoint ? endpoint->unauthorized_requests() : 0;
  }
};

Status AggregatorServer::Impl::open(AggregatorConfig c, EventSink sink) {
  config = std::move(c);
  emit = std::move(sink);
  started = round_started = clock().now();
  FEDMESH_RETURN_IF_ERROR(config.validate());
  Result<crypto::Membership> membership =
      crypto::load_membership(config.keys, config.name, config.roster, config.admin_public, config.federation);
  if (!membership.is_ok()) return membership.status();
  keys = std::move(membership->keys);
  roster = std::move(membership->roster);
  std::error_code mtime_error;
  roster_mtime = std::filesystem::last_write_time(config.roster, mtime_error);

  if (!config.tokenizer.empty()) {
    Result<train::data::BpeTokenizer> loaded = train::data::BpeTokenizer::load(config.tokenizer);
    if (!loaded.is_ok()) return Status(loaded.status().code(), "tokenizer: " + loaded.status().message());
    tokenizer.emplace(std::move(*loaded));
    tokenizer_fingerprint = tokenizer->fingerprint();
  }
  const train::data::BpeTokenizer* text_tokenizer = tokenizer ? &*tokenizer : nullptr;
  Result<std::string> spec = train::model_fingerprint(config.model);
  if (!spec.is_ok()) return spec.status();
  model_spec_fingerprint = std::move(*spec);

  // Own validation data: its schema decides the model's input and classes.
  train::data::DataSource validation_source = config.data;
  validation_source.source = config.validation;
  if (validation_source.own()) {
    validation_source.test = config.validation;  // all of it is evaluated
    Result<train::data::LoadedData> loaded = train::data::load_own_data(validation_source, 0, config.validation_limit);
    if (!loaded.is_ok()) return Status(loaded.status().code(), "validation: " + loaded.status().message());
    validation = std::move(loaded->test);
    data_schema = std::move(loaded->schema);
  }

  // The model: version 0 is the seeded initial model every site can rebuild
  // (with the tokenizer's vocabulary, as the sites make it), or the weights
  // of `init`, which every site loads too.
  model_input = train::ModelInput{tokenizer ? tokenizer->vocabulary() : 0, data_schema.sample_shape,
                                  data_schema.classes, data_schema.regression};
  Result<std::unique_ptr<train::Sequential>> model =
      train::make_initial_model(config.model, config.seed, model_input, config.init);
  if (!model.is_ok()) return model.status();
  evaluator_model = std::move(*model);
  // LoRA: the frozen weights and A factors are announced by fingerprint
  // (node/site_runtime.cpp compares them); the rounds hold the B factors.
  if (evaluator_model->lora().enabled()) model_spec_fingerprint += " lora " + evaluator_model->frozen_fingerprint();
  // One copy of the model: the round manager steps the evaluator's own
  // parameter values (views of them), and the evaluator, which never trains
  // here, keeps no gradients.
  std::vector<std::string> names;
  std::vector<Tensor> tensors;
  for (Parameter* p : evaluator_model->parameters()) {
    names.push_back(p->name);
    p->grad = Tensor();
    tensors.push_back(Tensor::view_of(p->value.raw(), p->value.shape(), DType::kF32));
    manifest.push_back({p->name, std::vector<int64_t>(p->value.shape().begin(), p->value.shape().end())});
  }
  Result<RoundManager> created = RoundManager::create(config.rounds_options, std::move(names), std::move(tensors));
  if (!created.is_ok()) return created.status();
  manager.emplace(std::move(*created));
  chain = {manager->link().hash};

  const std::optional<train::TransformerConfig> language = train::language_model_config(config.model);
  language_model = language.has_value();
  if (language && train::data::is_token_shard(config.validation)) {
    // Ids tokenized elsewhere: every window of the file is evaluated (the
    // file is read in place), with no bytes behind them (no bits per byte).
    train::data::TokenSpec tokens;
    tokens.path = tokens.test_path = train::data::DataSource{config.validation}.path();
    tokens.context = language->context;
    tokens.vocabulary = tokenizer ? tokenizer->vocabulary() : language->vocabulary;
    tokens.train_limit = 1;
    tokens.test_limit = config.validation_limit;
    Result<train::data::LoadedTokens> loaded = train::data::load_token_data(tokens);
    if (!loaded.is_ok()) return Status(loaded.status().code(), "validation: " + loaded.status().message());
    validation = std::make_unique<train::data::TokenWindows>(std::move(loaded->test));
    pretokenized_validation = true;
  } else if (!config.validation.empty() && language) {
    // Every document's held-out tail, which no site trains on.
    Result<train::data::TextCorpus> corpus = train::data::load_text_corpus(train::data::text_source(config.validation));
    if (!corpus.is_ok()) return corpus.status();
    Result<train::data::TextWindows> windows =
        train::data::held_out_windows(*corpus, language->context, config.validation_limit, text_tokenizer);
    if (!windows.is_ok()) return windows.status();
    tokens_per_byte =
        train::data::tokens_per_byte(train::data::scored_targets(windows->tokens(), language->context), text_tokenizer);
    validation = std::make_unique<train::data::TextWindows>(std::move(*windows));
  } else if (!config.validation.empty() && !validation_source.own()) {
    Result<train::data::FashionMnistSplits> splits = train::data::load_fashion_mnist_splits(config.validation, 1, config.validation_limit);
    if (!splits.is_ok()) return splits.status();
    data_schema = train::data::idx_schema(splits->test);
    validation = std::make_unique<train::data::ImageSet>(std::move(splits->test));
  }

  store::StoreOptions store_options = config.store_options;
  store_options.vfs = env.store_vfs;
  store_options.background_maintenance = store_options.background_maintenance && env.store_background_maintenance;
  Result<store::CheckpointStore> opened = store::CheckpointStore::open(config.store, store_options);
  if (!opened.is_ok()) return opened.status();
  store.emplace(std::move(*opened));
  FEDMESH_RETURN_IF_ERROR(restore());
  FEDMESH_RETURN_IF_ERROR(open_privacy());

  // Counters are kept by signing key: those a store from before kept by name
  // go to the key each name has on the roster now.
  std::map<std::string, std::string> key_of_name;
  for (const crypto::RosterEntry& e : roster.sites) {
    key_of_name[e.identity.name] = crypto::replay_key(e.identity.sign_public);
  }
  FEDMESH_RETURN_IF_ERROR(store->adopt_named_replay_counters(key_of_name));
  Result<std::map<std::string, uint64_t>> counters = store->replay_counters();
  if (!counters.is_ok()) return counters.status();
  replay.emplace(crypto::ReplayGuard::persisted_by(
      std::move(*counters),
      [this](const std::string& sender, uint64_t sequence) { return store->record_replay_counter(sender, sequence); }));

  protocol::TransportOptions transport;
  Result<protocol::FaultPlan> faults = protocol::parse_fault_plan(config.faults);
  if (!faults.is_ok()) return faults.status();
  transport.faults = *faults;
  Result<std::unique_ptr<protocol::ServerChannel>> bound = env.network->bind(
      config.listen, protocol::CurveKeys::from(keys), protocol::allowlist_from_roster(roster), transport);
  if (!bound.is_ok()) return bound.status();
  socket = std::move(*bound);
  protocol::ReceiverPolicy policy;
  policy.clock = [clock = env.clock] { return clock->now(); };
  policy.unix_micros = [clock = env.clock] { return clock->unix_micros(); };
  policy.federation = config.federation;
  policy.self = config.name;
  policy.manifest = manifest;
  policy.decode_runner = parallel_each;
  // Updates in flight are staged whole, on disk unless told otherwise (the
  // aggregator then holds one chunk's decode, whatever the model's size),
  // and a bounded number at once, so that the staged bytes stay flat however
  // many sites send.
  const bool large_model = protocol::staged_bytes(manifest) >= kStageOnDiskFromBytes;
  if (!config.staging_dir.empty() ? config.staging_dir != "memory" : large_model) {
    policy.spill_dir = config.staging_dir.empty() ? std::filesystem::path(config.store).parent_path()
                                                   : std::filesystem::path(config.staging_dir);
    if (policy.spill_dir.empty()) policy.spill_dir = ".";
    std::error_code error;
    if (!std::filesystem::is_directory(policy.spill_dir, error)) {
      return invalid_argument("staging_dir " + policy.spill_dir.string() +
                              " is not a directory (updates being received are staged there; \"memory\" stages them "
                              "in memory)");
    }
  }
  policy.staging_budget_bytes = config.staging_mb > 0
                                    ? static_cast<uint64_t>(config.staging_mb) << 20
                                    : std::max<uint64_t>(uint64_t{256} << 20, 2 * protocol::staged_bytes(manifest));
  serving_budget = protocol::ModelServingBudget(config.serving_mb > 0 ? static_cast<uint64_t>(config.serving_mb) << 20
                                                                       : protocol::kDefaultModelServingBytes);
  // Refused at the header, before any chunk is taken or acknowledged.
  policy.max_sample_count = static_cast<uint64_t>(config.rounds_options.max_sample_count);
  policy.max_round_lag = config.rounds_options.asynchronous ? std::numeric_limits<uint64_t>::max() / 2
                                                             : (config.rounds_options.fold_late_updates ? 1 : 0);
  service = std::make_unique<protocol::UpdateService>(policy, roster, *replay, protocol::RateLimits{},
                                                      socket->counters());
  service->receiver().set_store_update(
      [this](protocol::ReceivedUpdate received) { return store_update(std::move(received)); });
  // An update the round manager would refuse (its site already reported for
  // the round, a round not open) is refused before it is stored, never
  // acknowledged and then dropped.
  service->receiver().set_admit_update([this](const protocol::UpdateMetadata& m) -> std::optional<std::string> {
    SiteUpdate probe;
    probe.id = update_id(m);
    probe.site = m.sender;
    probe.round = static_cast<int64_t>(m.round);
    probe.base_version = static_cast<int64_t>(m.base_version);
    if (Status s = manager->admissible(probe); !s.is_ok()) return s.message();
    return std::nullopt;
  });
  service->set_other_handler([this](const protocol::Incoming& in, const protocol::ParsedMessage& message,
                                    std::optional<protocol::OutgoingMessage>& reply, protocol::Rejection& rejection) {
    return handle_other(in, message, reply, rejection);
  });
  if (secure) {
    service->refuse_plain_updates("this federation runs in private mode: updates go through secure aggregation "
                                  "(set privacy.mode = \"private\" in the site's config)");
  }
  set_service_round();
  FEDMESH_RETURN_IF_ERROR(publish());

  if (!config.metrics.empty()) {
    // With a token, /metrics needs it too (Prometheus sends it: a scrape
    // job's `authorization`): the counters tell who is active and when.
    // /healthz stays open for liveness probes.
    std::map<std::string, HttpPage> pages =
        metrics_and_status_pages([this] { return view.render_metrics(operator_context()); },
                                 [this] { return view.render_status(operator_context()); });
    const HttpPage dashboard{"text/html; charset=utf-8", [] { return std::string(dashboard_page()); }};
    pages["/dashboard"] = dashboard;
    pages["/"] = dashboard;
    Result<std::unique_ptr<HttpEndpoint>> endpoint =
        HttpEndpoint::start(config.metrics, std::move(pages), HttpEndpointOptions{config.metrics_token});
    if (!endpoint.is_ok()) return endpoint.status();
    http = std::move(*endpoint);
    serving.store(http.get());
    metrics_address = http->address();
  }
  return Status::ok();
}

Status AggregatorServer::Impl::restore() {
  // Damaged items go into quarantine before anything reads them: a pending
  // update that fails its checksum is never applied, and a damaged newest
  // round leaves the newest intact one to resume from.
  const auto quarantined = [this](const store::QuarantineNotice& n) {
    nlohmann::json event = {{"event", "warning"}, {"message", n.message}, {"reason", n.reason}};
    if (n.round) event["quarantined_round"] = *n.round;
    if (!n.update_id.empty()) event["quarantined_update"] = store::update_id_text(n.update_id);
    emit(event);
  };
  FEDMESH_RETURN_IF_ERROR(store->quarantine_damaged_pending_updates(quarantined));
  Result<std::vector<store::RoundInfo>> committed = store->rounds();
  if (!committed.is_ok()) return committed.status();
  Result<std::vector<store::QuarantinedRound>> in_quarantine = store->quarantined_rounds();
  if (!in_quarantine.is_ok()) return in_quarantine.status();
  nlohmann::json fingerprint = {{"federation", config.federation}, {"model", config.model},
                                {"seed", config.seed}, {"asynchronous", config.rounds_options.asynchronous},
                                {"strategy", config.rounds_options.server.name}};
  // A BPE run records its tokenizer; a byte run has no key, as its stores
  // had before tokenizers existed, so that they still resume.
  if (tokenizer) fingerprint["tokenizer"] = tokenizer_fingerprint;
  // Own data records its schema (the demo sets, as before, none).
  if (train::data::is_own_data(config.validation)) fingerprint["data_schema"] = data_schema.fingerprint();
  // A run started from a file records its version 0 (a seeded run, as before, none).
  if (!config.init.path.empty()) fingerprint["initial_model"] = federation::hash_hex(chain.front());
  // A LoRA run records its adapters and the frozen weights under them: its
  // rounds hold B factors that mean something only on that base.
  if (evaluator_model->lora().enabled()) {
    fingerprint["lora"] = config.init.lora.to_json();
    fingerprint["lora"]["frozen"] = evaluator_model->frozen_fingerprint();
  }
  // A model from a spec file records the spec (a built-in, as before, its name only).
  if (train::is_model_spec_file(config.model)) {
    if (Result<train::ModelSpec> spec = train::read_model_spec(config.model); spec.is_ok()) {
      fingerprint["model_spec"] = spec->to_toml();
    }
  }
  // How the frozen weights under a LoRA run's B factors are rebuilt, for
  // `checkpoint export --merge-lora`: rewritten at every start of the same
  // run (the init file may have moved; its fingerprint is compared).
  const auto record_lora_base = [&] {
    return train::record_lora_base(*store, config.model, config.seed, model_input, config.init, *evaluator_model);
  };
  Result<std::optional<std::string>> stored = store->meta("aggregator_config");
  if (!stored.is_ok()) return stored.status();
  if (committed->empty() && in_quarantine->empty() && !stored->has_value()) {
    FEDMESH_RETURN_IF_ERROR(record_lora_base());
    // How the validation data becomes samples, for exports (not compared: data_schema above is).
    FEDMESH_RETURN_IF_ERROR(store->set_meta("data_schema", data_schema.canonical));
    return store->set_meta("aggregator_config", fingerprint.dump());
  }
  if (stored->has_value() && nlohmann::json::parse(**stored, nullptr, false) != fingerprint) {
    return invalid_argument(config.store + " holds a federation run with different settings (" + **stored +
                            "); point `store` at a new file to start another");
  }
  FEDMESH_RETURN_IF_ERROR(record_lora_base());
  if (committed->empty() && in_quarantine->empty()) return Status::ok();
  Result<store::LoadedCheckpoint> latest = store->resume_latest(quarantined);
  if (!latest.is_ok() && latest.status().code() != StatusCode::kNotFound) return latest.status();
  // Every round quarantined: the initial model (version 0 of this seed) is the newest intact state.
  int64_t resumed_round = 0;
  std::string committed_at;
  if (latest.is_ok()) {
    Result<nlohmann::json> state = restore_manager(*latest, *manager);
    if (!state.is_ok()) return state.status();
    try {
      chain.clear();
      for (const auto& hex : state->at("chain")) {
        Result<crypto::Hash> hash = federation::parse_hash_hex(hex.get<std::string>());
        if (!hash.is_ok()) return hash.status();
        chain.push_back(*hash);
      }
    } catch (const nlohmann::json::exception& error) {
      return corrupt(std::string("the aggregator state in the checkpoint is malformed: ") + error.what());
    }
    if (chain.size() != static_cast<size_t>(manager->version()) + 1 || chain.back() != manager->link().hash) {
      return corrupt("the checkpoint's hash chain does not end at its model (version " +
                     std::to_string(manager->version()) + ")");
    }
    resumed_round = latest->round.round;
    committed_at = latest->round.wall_time;
  }
  FEDMESH_RETURN_IF_ERROR(step_past_quarantine_rounds(resumed_round));
  // The dashboard's history goes back past this start: the store's round log.
  Result<std::vector<store::RoundLogEntry>> log = store->round_log(static_cast<int64_t>(kRoundHistoryShown));
  if (!log.is_ok()) return log.status();
  const size_t history = view.restore_history(*log);
  emit({{"event", "resume"}, {"store", config.store}, {"round", manager->round()}, {"version", manager->version()},
        {"committed", committed_at}, {"history", history}});
  return Status::ok();
}

// Round numbers and versions never go back past a quarantined round: the
// restored model is committed as the next version, in the round after the
// newest quarantined one, before anything is announced (see
// step_past_quarantine in aggregator/manager_checkpoint.h).
Status AggregatorServer::Impl::step_past_quarantine_rounds(int64_t resumed_round) {
  const int64_t restored_version = manager->version();
  Result<std::optional<RoundRecord>> step = step_past_quarantine(
      *store, *manager, resumed_round, config.rounds_options.asynchronous, chain,
      [this](const std::string& warning) { emit({{"event", "warning"}, {"message", warning}}); });
  if (!step.is_ok()) return step.status();
  if (!step->has_value()) return Status::ok();
  const RoundRecord& record = **step;
  nlohmann::json metrics = {{"restored_from_round", resumed_round}, {"restored_from_version", restored_version}};
  nlohmann::json chain_hex = nlohmann::json::array();
  for (const crypto::Hash& h : chain) chain_hex.push_back(federation::hash_hex(h));
  FEDMESH_RETURN_IF_ERROR(commit_manager_round(*store, *manager, record, metrics, nlohmann::json{{"chain", chain_hex}}));
  emit({{"event", "warning"},
        {"message", "rounds above round " + std::to_string(resumed_round) + " are in quarantine: the model of round " +
                        std::to_string(resumed_round) + " (version " + std::to_string(restored_version) +
                        ") goes on as version " + std::to_string(record.version) + " in round " +
                        std::to_string(record.round) + ", so that versions never go back"},
        {"restored_round", record.round}, {"restored_version", record.version}});
  return Status::ok();
}

Status AggregatorServer::Impl::open_privacy() {
  if (!config.is_private()) return Status::ok();
  size_t roster_sites = 0;
  for (const crypto::RosterEntry& e : roster.sites) roster_sites += e.role == crypto::Role::kSite ? 1 : 0;
  FEDMESH_RETURN_IF_ERROR(config.secure.validate(roster_sites));
  secure = std::make_unique<SecureRound>(config.secure, roster, config.federation,
                                         static_cast<uint64_t>(manager->parameter_count()), emit);
  if (config.dp_noise_multiplier <= 0.0) return Status::ok();
  dp.emplace();
  dp->sigma = config.dp_noise_multiplier;
  dp->delta = config.dp_delta;
  const int64_t per_round = config.rounds_options.sites_per_round;
  dp->q = per_round > 0 && roster_sites > 0 ? std::min(1.0, static_cast<double>(per_round) / static_cast<double>(roster_sites))
                                            : 1.0;
  Result<std::vector<store::PrivacyEntry>> ledger = store->privacy_ledger();
  if (!ledger.is_ok()) return ledger.status();
  dp_rounds = static_cast<int64_t>(ledger->size());
  const int64_t planned = config.rounds > 0 ? config.rounds : 100;
  const int64_t per_round_sites = per_round > 0 ? std::min<int64_t>(per_round, static_cast<int64_t>(roster_sites))
                                                : static_cast<int64_t>(roster_sites);
  const double n = static_cast<double>(std::max<int64_t>(per_round_sites, 1));
  emit({{"event", "dp_plan"}, {"mechanism", "dp-fedavg"}, {"noise", "csprng"}, {"sites_per_round", per_round_sites},
        {"noise_stddev_per_clip", config.dp_noise_multiplier / n}, {"planned_rounds", planned},
        {"epsilon_after_planned_rounds", dp->after(planned).epsilon}, {"delta", config.dp_delta},
        {"message", "DP-FedAvg over " + std::to_string(per_round_sites) + " sites a round: the mean gets noise of "
                    "standard deviation " + std::to_string(config.dp_noise_multiplier / n) + " x clip per coordinate, "
                    "epsilon after " + std::to_string(planned) + " rounds is " +
                    std::to_string(dp->after(planned).epsilon) + " at delta " + std::to_string(config.dp_delta)}});
  const privacy::DpFedAvgNoiseScale scale = privacy::dp_fedavg_noise_scale(
      config.dp_noise_multiplier, per_round_sites, manager->parameter_count(), planned);
  if (scale.swamps()) {
    emit({{"event", "warning"}, {"kind", "dp_noise_swamps_signal"}, {"noise_to_signal", scale.noise_to_signal},
          {"sites_per_round", per_round_sites}, {"sites_needed", scale.sites_needed}, {"message", scale.message()}});
    std::fprintf(stderr, "fedmesh aggregator: warning: %s\n", scale.message().c_str());
  }
  return Status::ok();
}

Status AggregatorServer::Impl::publish() {
  std::vector<std::span<const float>> spans;
  for (const Tensor& t : manager->model()) spans.emplace_back(t.data<float>(), static_cast<size_t>(t.numel()));
  return publisher.publish(static_cast<uint64_t>(manager->version()), chain, manifest, spans);
}

void AggregatorServer::Impl::set_service_round() {
  const auto version = static_cast<uint64_t>(manager->version());
  const auto round = config.rounds_options.asynchronous ? version : static_cast<uint64_t>(manager->round());
  service->set_round(round, version);
}

int64_t AggregatorServer::Impl::sites_needed() const {
  int64_t on_roster = 0;
  for (const crypto::RosterEntry& e : roster.sites) on_roster += e.role == crypto::Role::kSite ? 1 : 0;
  return std::max<int64_t>(1, std::min<int64_t>(config.min_sites, on_roster));
}

void AggregatorServer::Impl::say_waiting(const std::vector<std::string>& available, int64_t needed) {
  int64_t on_roster = 0;
  for (const crypto::RosterEntry& e : roster.sites) on_roster += e.role == crypto::Role::kSite ? 1 : 0;
  std::string message = "round " + std::to_string(manager->round() + 1) + " waits for " + std::to_string(needed) +
                        " connected site" + (needed == 1 ? "" : "s") + " (min_sites " + std::to_string(config.min_sites) +
                        ", " + std::to_string(on_roster) + " on the roster); connected: " +
                        std::to_string(available.size());
  for (size_t i = 0; i < available.size(); ++i) message += (i == 0 ? " (" : ", ") + available[i];
  if (!available.empty()) message += ")";
  if (message == waiting_said) return;
  waiting_said = message;
  emit({{"event", "waiting"}, {"round", manager->round() + 1}, {"needed", needed}, {"connected", available},
        {"min_sites", config.min_sites}, {"on_roster", on_roster}, {"message", message}});
}

Status AggregatorServer::Impl::save_open_round() {
  return store->set_meta("open_round", nlohmann::json({{"round", manager->round()},
                                                       {"sampled", manager->sampled()},
                                                       {"opened_unix_ms", round_opened_unix_ms}})
                                           .dump());
}

void AggregatorServer::Impl::drop_from_open_round(const std::vector<std::string>& removed) {
  if (secure || config.rounds_options.asynchronous || !manager->round_open()) return;
  std::vector<std::string> dropped;
  for (const std::string& name : removed) {
    if (roster.find(name) == nullptr && manager->drop_from_sample(name)) dropped.push_back(name);
  }
  if (dropped.empty()) return;
  if (Status s = save_open_round(); !s.is_ok()) {
    emit({{"event", "warning"}, {"message", "the open round's new sample is not stored (" + s.message() +
                                                "): after a restart the round waits for the revoked sites again"}});
  }
  emit({{"event", "sample"}, {"round", manager->round()}, {"dropped", dropped}, {"sampled", manager->sampled()},
        {"message", "revoked sites leave round " + std::to_string(manager->round()) + ": it now waits for " +
                        std::to_string(manager->sampled().size()) + " site(s)"}});
}

std::vector<std::string> AggregatorServer::Impl::available_sites() const {
  std::vector<std::string> names;
  const auto cutoff = clock().now() - std::chrono::duration_cast<fedmesh::Clock::duration>(
                                         std::chrono::duration<double>(config.site_timeout_seconds));
  for (const auto& [name, site] : sites) {
    if (site.last_contact >= cutoff) names.push_back(name);
  }
  return names;
}

protocol::OutgoingMessage AggregatorServer::Impl::announce(const std::string& site) const {
  capnp::MallocMessageBuilder builder;
  auto a = builder.initRoot<wire::Message>().initRoundAnnounce();
  const bool async = config.rounds_options.asynchronous;
  a.setRound(async ? static_cast<uint64_t>(manager->version()) : static_cast<uint64_t>(manager->round()));
  a.setModelVersion(static_cast<uint64_t>(manager->version()));
  a.setModelHash(kj::arrayPtr(manager->link().hash.data(), manager->link().hash.size()));
  a.setParentHash(kj::arrayPtr(manager->link().parent.data(), manager->link().parent.size()));
  a.setLocalSteps(static_cast<uint32_t>(config.local_steps));
  a.setAsynchronous(async);
  a.setSecureAggregation(config.is_private());
  a.setTokenizer(tokenizer_fingerprint);
  a.setModelSpec(model_spec_fingerprint);
  if (!data_schema.canonical.empty()) a.setDataSchema(data_schema.fingerprint());
  const bool done = finished();
  a.setFinished(done);
  const bool open = !done && (async || manager->round_open());
  a.setRoundOpen(open);
  const auto& sampled = manager->sampled();
  a.setSelected(open && (async || std::find(sampled.begin(), sampled.end(), site) != sampled.end()));
  if (!async && open) {
    const double left = std::max(0.0, config.rounds_options.round_deadline_seconds -
                                          std::chrono::duration<double>(clock().now() - round_started).count());
    a.setDeadlineUnixMs(clock().unix_ms() + static_cast<uint64_t>(left * 1000.0));
  }
  return protocol::serialize(builder);
}

bool AggregatorServer::Impl::handle_other(const protocol::Incoming& incoming, const protocol::ParsedMessage& message,
                                          std::optional<protocol::OutgoingMessage>& reply,
                                          protocol::Rejection& rejection) {
  const auto root = message.root();
  switch (root.which()) {
    case wire::Message::HEARTBEAT:
      reply = announce(incoming.peer);
      return true;
    case wire::Message::MODEL_REQUEST: {
      // Sent here, in order, without a copy (every queued reply shares the
      // published chunks), at most two windows queued per peer (one that
      // does not read its replies is refused, not queued for:
      // docs/security-model.md), and at most serving_mb of chunk copies for
      // all downloads together (protocol/model_serving.h), whatever the
      // number of sites.
      // (Insecure: no transport identity; each connection is its own peer.)
      const std::string& peer = incoming.peer.empty() ? incoming.routing_id : incoming.peer;
      const auto admit = [&](size_t replies, uint64_t new_bytes, protocol::Rejection& refused) {
        if (!queued_model_replies.has_room(peer, replies)) {
          refused = {wire::RejectCode::BUSY,
                     std::to_string(queued_model_replies.queued(peer)) + " model chunks to '" + peer +
                         "' are still queued (at most " + std::to_string(queued_model_replies.max_per_peer()) +
                         "); ask again once they are read"};
          return false;
        }
        if (!serving_budget.admit(peer, publisher.live_bytes(), new_bytes, clock().now())) {
          refused = {wire::RejectCode::BUSY,
                     "the model's downloads hold " + std::to_string(publisher.live_bytes() >> 20) + " MB of chunks (at most " +
                         std::to_string(serving_budget.max_bytes() >> 20) + " MB, serving_mb); '" + peer + "' is " +
                         std::to_string(serving_budget.position(peer) + 1) + " of " +
                         std::to_string(serving_budget.waiting()) + " in line: ask again shortly"};
          return false;
        }
        return true;
      };
      std::vector<protocol::SharedMessage> chunks;
      if (!publisher.answer(root.getModelRequest(), protocol::kDefaultModelWindow, chunks, rejection, admit)) {
        return false;
      }
      for (const protocol::SharedMessage& chunk : chunks) {
        if (Status s = socket->send(incoming.routing_id, queued_model_replies.track(peer, chunk)); !s.is_ok()) {
          rejection = {wire::RejectCode::BUSY, "cannot send the model now: " + s.message()};
          return false;
        }
      }
      return true;
    }
    case wire::Message::SEC_AGG_UP: {
      if (!secure) {
        rejection = {wire::RejectCode::MALFORMED, "secure aggregation: this federation runs in trusted mode"};
        return false;
      }
      protocol::SecAggUpMessage up;
      if (!protocol::decode_secagg_up(root.getSecAggUp(), up, rejection)) return false;
      return secure->handle(incoming.peer, up, reply, rejection);
    }
    case wire::Message::SITE_REPORT: {
      const auto report = root.getSiteReport();
      const double values[3] = {report.getTrainLoss(), report.getLocalLoss(), report.getLocalAccuracy()};
      const auto version = static_cast<uint64_t>(manager->version());
      const auto current_round = config.rounds_options.asynchronous ? version : static_cast<uint64_t>(manager->round());
      const SiteReportCheck checked =
          check_site_report({report.getRound(), report.getBaseVersion(), values[0], values[1], values[2],
                             report.getRegression(), report.getLocalR2(), report.getLocalMae()},
                            current_round, version);
      if (!checked.ok()) {
        rejection = {checked.problem == SiteReportProblem::kNonFinite ? wire::RejectCode::NON_FINITE
                                                                      : wire::RejectCode::OUT_OF_RANGE,
                     checked.reason};
        return false;
      }
      SiteRecord& site = sites[incoming.peer];
      site.train_loss = values[0];
      site.local_loss = values[1];
      site.local_accuracy = values[2];
      site.report_round = static_cast<int64_t>(report.getRound());
      nlohmann::json event = {{"event", "site_report"}, {"site", incoming.peer}, {"round", report.getRound()},
                              {"train_loss", values[0]}, {"local_loss", values[1]}, {"local_accuracy", values[2]}};
      if (report.getRegression()) {
        site.local_r2 = report.getLocalR2();
        site.local_mae = report.getLocalMae();
        event["local_r2"] = *site.local_r2;
        event["local_mae"] = *site.local_mae;
      }
      emit(event);
      return true;
    }
    default:
      rejection = {wire::RejectCode::MALFORMED, "message kind " + std::to_string(static_cast<int>(root.which())) +
                                                    " is not one the aggregator takes"};
      return false;
  }
}

void AggregatorServer::Impl::submit(SiteUpdate update, bool from_store) {
  const std::string id = update.id, site = update.site;
  const int64_t tau = manager->version() - update.base_version;
  Result<std::optional<RoundRecord>> submitted = manager->submit(std::move(update), now());
  SiteRecord& state = sites[site];
  if (!manager->failed_step().is_ok()) {
    // The model in memory is between versions: stop, and resume from the store.
    emit({{"event", "error"}, {"message", manager->failed_step().message() + "; stopping"}});
    if (failed_step.is_ok()) failed_step = manager->failed_step();
    return;
  }
  if (!submitted.is_ok()) {
    ++state.refused;
    view.rejection(site, "round-manager", submitted.status().message());
    emit({{"event", "update"}, {"site", site}, {"id", id}, {"accepted", false}, {"from_store", from_store},
          {"reason", submitted.status().message()}});
    return;
  }
  ++state.updates_accepted;
  state.last_staleness = tau;
  state.missed_round = false;
  view.update_accepted(tau);
  emit({{"event", "update"}, {"site", site}, {"id", id}, {"accepted", true}, {"staleness", tau},
        {"from_store", from_store}});
  if (submitted->has_value()) {
    if (Status s = finish_step(**submitted); !s.is_ok()) {
      emit({{"event", "error"}, {"message", "server step " + std::to_string((**submitted).version) +
                                                 " not committed: " + s.message() + "; stopping"}});
      if (failed_step.is_ok()) failed_step = s;
    }
  }
}

Status AggregatorServer::Impl::store_update(protocol::ReceivedUpdate received) {
  SiteUpdate update;
  update.id = update_id(received.metadata);
  update.site = received.metadata.sender;
  update.round = static_cast<int64_t>(received.metadata.round);
  update.base_version = static_cast<int64_t>(received.metadata.base_version);
  update.sample_count = static_cast<int64_t>(std::min<uint64_t>(received.metadata.sample_count, INT64_MAX));
  const SiteRecord& site = sites[update.site];
  update.local_loss = site.local_loss;
  update.local_accuracy = site.local_accuracy;
  // Durable with its replay counter, in one transaction, before its Ack
  // leaves: a crash from here on cannot lose it, and a failure refuses it
  // (notStored) so that the site sends it again. The payload is written
  // from the decoded tensors where they lie, and the round manager reads it
  // back from the store a slice at a time: once the tensors are freed here,
  // the aggregator holds none of this update's values.
  store::PendingUpdate pending;
  pending.update_id.assign(update.id.begin(), update.id.end());
  pending.sender = update.site;
  pending.base_version = update.base_version;
  pending.sample_count = update.sample_count;
  pending.replay_sequence = received.metadata.sequence;
  pending.replay_key = received.replay_key;
  uint64_t values = received.spilled ? received.spilled->size() / sizeof(float) : 0;
  for (const std::vector<float>& t : received.tensors) values += t.size();
  const std::vector<uint8_t> header = store::encode_pending_header(
      {update.round, update.base_version, update.sample_count, update.local_loss, update.local_accuracy}, values);
  Status stored;
  if (received.spilled) {
    // Staged on disk as it arrived (fp32 in this machine's order, which the
    // payload's little-endian values are: store::pending_value_bytes).
    store::SpillSource source(header, *received.spilled);
    stored = store->add_pending_update_from(pending, source);
  } else {
    std::vector<std::span<const uint8_t>> pieces{header};
    for (const std::vector<float>& t : received.tensors) pieces.push_back(store::pending_value_bytes(t));
    stored = store->add_pending_update_in_pieces(pending, pieces);
  }
  Result<std::shared_ptr<PendingValues>> reader =
      stored.is_ok() ? PendingValues::open(*store, pending.update_id, manager->parameter_count())
                     : Result<std::shared_ptr<PendingValues>>(stored);
  if (!reader.is_ok()) {
    emit({{"event", "error"}, {"message", "cannot record update " + update.id + ": " + reader.status().message() +
                                              "; refused as not stored, the site sends it again"}});
    return reader.status();
  }
  // The manager checks it at once (take_completed) from these tensors (or
  // the file they were staged in), then they are freed; the step reads it
  // back from the store.
  if (received.spilled) {
    (*reader)->read_first_pass_from(std::shared_ptr<const SpillFile>(std::move(received.spilled)));
  } else {
    (*reader)->read_first_pass_from(std::move(received.tensors));
  }
  update.stored = std::move(*reader);
  stored_updates.push_back(std::move(update));
  return Status::ok();
}

void AggregatorServer::Impl::take_completed() {
  for (SiteUpdate& update : std::exchange(stored_updates, {})) submit(std::move(update), false);
}

void AggregatorServer::Impl::reload_roster_if_changed() {
  if (clock().now() - last_roster_check < std::chrono::seconds(1)) return;
  last_roster_check = clock().now();
  std::error_code error;
  const auto mtime = std::filesystem::last_write_time(config.roster, error);
  if (error || mtime == roster_mtime) return;
  roster_mtime = mtime;
  Result<crypto::Membership> membership =
      crypto::load_membership(config.keys, config.name, config.roster, config.admin_public, config.federation);
  if (!membership.is_ok()) {
    emit({{"event", "warning"}, {"message", "the changed roster " + config.roster + " is not taken: " +
                                                membership.status().message() + "; the one in force stays"}});
    return;
  }
  std::vector<std::string> removed, added;
  for (const crypto::RosterEntry& e : roster.sites) {
    const crypto::RosterEntry* now = membership->roster.find(e.identity.name);
    if (now == nullptr || now->identity != e.identity) removed.push_back(e.identity.name);
  }
  for (const crypto::RosterEntry& e : membership->roster.sites) {
    const crypto::RosterEntry* before = roster.find(e.identity.name);
    if (before == nullptr || before->identity != e.identity) added.push_back(e.identity.name);
  }
  roster = std::move(membership->roster);  // the service and the secure round read this object
  socket->set_allowlist(protocol::allowlist_from_roster(roster));
  for (const std::string& name : removed) {
    const auto known = sites.find(name);
    if (roster.find(name) == nullptr) {  // not a new key: gone
      revoked_sites[name] = known == sites.end() ? SiteRecord{} : known->second;
    }
    if (known != sites.end()) sites.erase(known);
  }
  for (const std::string& name : added) revoked_sites.erase(name);
  emit({{"event", "roster"}, {"roster", config.roster}, {"sites", roster.sites.size()}, {"removed", removed},
        {"added", added}});
  drop_from_open_round(removed);
}

void AggregatorServer::Impl::handle(const protocol::Incoming& incoming) {
  if (roster.find(incoming.peer) == nullptr) {
    // Connected before its key was revoked: refused by name from now on.
    if (const auto revoked = revoked_sites.find(incoming.peer); revoked != revoked_sites.end()) {
      revoked->second.last_contact = clock().now();
      ++revoked->second.refused;
    }
    const std::string reason = "the key of " + incoming.peer + " was taken off the roster of federation " +
                               config.federation + " (revoked by its admin)";
    view.rejection(incoming.peer, "revoked", reason);
    socket->counters().count_rejection(wire::RejectCode::REVOKED);
    log_refusal(incoming, "revoked", reason);
    capnp::MallocMessageBuilder builder;
    auto reject = builder.initRoot<wire::Message>().initReject();
    reject.setCode(wire::RejectCode::REVOKED);
    reject.setText(reason);
    (void)socket->send(incoming.routing_id, protocol::serialize(builder));
    return;
  }
  SiteRecord& site = sites[incoming.peer];
  site.last_contact = clock().now();
  site.routing_id = incoming.routing_id;
  std::optional<protocol::OutgoingMessage> reply = service->handle(incoming);
  take_completed();  // before the reply: the Ack{complete} follows the durable write
  if (const auto& refused = service->last_rejection()) {
    // An update for a round that has closed: the site is late.
    if (refused->code == wire::RejectCode::WRONG_ROUND) site.missed_round = true;
    ++site.refused;
    view.rejection(incoming.peer, protocol::reject_code_name(refused->code), refused->reason);
    log_refusal(incoming, protocol::reject_code_name(refused->code), refused->reason);
  }
  if (reply) {
    if (Status s = socket->send(incoming.routing_id, std::move(*reply)); !s.is_ok()) {
      emit({{"event", "warning"}, {"message", "reply to " + incoming.peer + " not sent: " + s.message()}});
    }
  }
}

void AggregatorServer::Impl::log_refusal(const protocol::Incoming& incoming, const std::string& code,
                                        const std::string& reason) {
  const std::string& key = incoming.peer_key.empty() ? incoming.peer : incoming.peer_key;
  const std::optional<uint64_t> suppressed = refusal_log.admit(key + " " + code, clock().now());
  if (!suppressed) {
    refusal_log_lines_suppressed.fetch_add(1);
    return;
  }
  nlohmann::json event = {{"event", "rejected"}, {"peer", incoming.peer}, {"code", code}, {"reason", reason}};
  if (!incoming.peer_key.empty()) event["peer_key"] = incoming.peer_key;
  if (*suppressed > 0) {
    event["suppressed"] = *suppressed;
    event["message"] = "suppressed " + std::to_string(*suppressed) + " similar (" + code +
                       " from this key) since its last logged refusal";
  }
  emit(event);
}

Status AggregatorServer::Impl::maybe_start_round() {
  if (config.rounds_options.asynchronous || manager->round_open() || finished()) return Status::ok();
  // A round that was open when the process stopped reopens with its sample.
  std::vector<std::string> candidates;
  Result<std::optional<std::string>> open_round = store->meta("open_round");
  if (!open_round.is_ok()) return open_round.status();
  bool reopening = false;
  // When the round opened (wall clock): a reopened round keeps its deadline,
  // so restarts faster than the deadline cannot hold a round open for ever.
  const uint64_t now_unix_ms = clock().unix_ms();
  uint64_t opened_unix_ms = now_unix_ms;
  if (open_round->has_value()) {
    const nlohmann::json saved = nlohmann::json::parse(**open_round, nullptr, false);
    if (saved.is_object() && saved.value("round", int64_t{-1}) == manager->round() + 1 && saved.contains("sampled")) {
      // Less those revoked meanwhile; with none left, a new sample.
      if (saved["sampled"].is_array()) {
        for (const nlohmann::json& name : saved["sampled"]) {
          if (name.is_string() && roster.find(name.get<std::string>()) != nullptr) candidates.push_back(name);
        }
      }
      reopening = !candidates.empty();
      const auto opened = saved.find("opened_unix_ms");
      // A clock that went back leaves the whole deadline to run.
      if (reopening && opened != saved.end() && opened->is_number_unsigned()) {
        opened_unix_ms = std::min(opened->get<uint64_t>(), now_unix_ms);
      }
    }
  }
  const double elapsed_seconds = static_cast<double>(now_unix_ms - opened_unix_ms) / 1000.0;
  if (!reopening) {
    candidates = available_sites();
    if (const int64_t needed = sites_needed(); static_cast<int64_t>(candidates.size()) < needed) {
      say_waiting(candidates, needed);
      return Status::ok();
    }
  }
  waiting_said.clear();
  if (dp && config.dp_target_epsilon > 0.0 && dp->after(dp_rounds + 1).epsilon > config.dp_target_epsilon) {
    budget_exhausted = true;
    emit({{"event", "privacy_budget"}, {"rounds", dp_rounds}, {"epsilon", dp->after(dp_rounds).epsilon},
          {"next_epsilon", dp->after(dp_rounds + 1).epsilon}, {"target_epsilon", config.dp_target_epsilon},
          {"delta", config.dp_delta}, {"message", "the next round would exceed the privacy budget: the federation ends"}});
    return Status::ok();
  }
  FEDMESH_RETURN_IF_ERROR(manager->start_round(candidates, now() - elapsed_seconds));
  if (secure) secure->open(manager->round(), manager->version(), manager->sampled(), clock().now());
  round_started = clock().now() - std::chrono::duration_cast<fedmesh::Clock::duration>(std::chrono::duration<double>(elapsed_seconds));
  round_opened_unix_ms = opened_unix_ms;
  FEDMESH_RETURN_IF_ERROR(save_open_round());
  set_service_round();
  const double deadline_seconds = config.rounds_options.round_deadline_seconds;
  emit({{"event", "round_open"}, {"round", manager->round()}, {"version", manager->version()},
        {"sampled", manager->sampled()}, {"deadline_seconds", deadline_seconds},
        {"opened_unix_ms", opened_unix_ms},
        {"deadline_unix_ms", opened_unix_ms + static_cast<uint64_t>(deadline_seconds * 1000.0)},
        {"reopened", reopening}});
  // Updates for this round that arrived before a restart.
  const int64_t round = manager->round();
  return submit_unapplied_pending([round](const SiteUpdate& update) { return update.round == round; });
}

Status AggregatorServer::Impl::submit_unapplied_pending(
    const std::function<bool(const SiteUpdate&)>& wanted) {
  Result<std::vector<store::PendingUpdate>> pending = store->pending_updates();
  if (!pending.is_ok()) return pending.status();
  for (const store::PendingUpdate& p : *pending) {
    Result<std::optional<int64_t>> applied = store->applied_round(p.update_id);
    if (!applied.is_ok()) return applied.status();
    if (applied->has_value()) continue;
    // Read through once to check it (a chunk row at a time), then left in
    // the store for the round manager to read.
    Result<std::shared_ptr<PendingValues>> values = PendingValues::open(*store, p.update_id, manager->parameter_count());
    const Status checked = values.is_ok() ? (*values)->finish() : values.status();
    if (checked.code() == StatusCode::kCorrupt) {
      // Damaged since the store was opened: moved aside, never applied.
      FEDMESH_RETURN_IF_ERROR(store->quarantine_pending_update(p.update_id, checked.message()));
      emit({{"event", "warning"},
            {"message", "quarantined pending update " + store::update_id_text(p.update_id) + " from " + p.sender +
                            " (it fails its checks: " + checked.message() + "); it is not applied"},
            {"quarantined_update", store::update_id_text(p.update_id)}, {"reason", checked.message()}});
      continue;
    }
    if (!checked.is_ok()) return checked;
    SiteUpdate update;
    update.id.assign(p.update_id.begin(), p.update_id.end());
    update.site = p.sender;
    const store::PendingHeader& header = (*values)->header();
    update.round = header.round;
    update.base_version = header.base_version;
    update.sample_count = header.sample_count;
    update.local_loss = header.local_loss;
    update.local_accuracy = header.local_accuracy;
    update.stored = std::move(*values);
    if (wanted(update)) submit(std::move(update), true);
  }
  return Status::ok();
}

Status AggregatorServer::Impl::finish_secure_round(const SecureResult& result) {
  std::vector<float> mean = result.mean(config.secure.fraction_bits);
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), reinterpret_cast<const uint8_t*>(result.sum.data()),
                     result.sum.size() * sizeof(uint32_t), nullptr, 0);
  emit({{"event", "secure_aggregate"}, {"round", result.round}, {"session", result.session},
        {"contributors", result.contributors}, {"words", result.sum.size()}, {"sum_blake2b", crypto::to_hex(digest)}});
  std::optional<store::PrivacyEntry> entry;
  if (dp) {
    // N(0, (σ C)²) on the sum is N(0, (σ C / k)²) on the mean; the noise
    // comes from the CSPRNG (it must not be predictable).
    crypto::SecureNoiseSource noise;
    add_dp_fedavg_noise(mean, config.dp_noise_multiplier, config.secure.clip, result.contributors.size(), noise);
    entry = privacy::ledger_entry(*dp, "dp-fedavg", manager->round(), dp_rounds + 1);
  }
  Result<RoundRecord> record = manager->close_round_with_mean(std::move(mean), result.contributors);
  if (!record.is_ok()) return record.status();
  note_round_closed(result.contributors);
  FEDMESH_RETURN_IF_ERROR(finish_step(*record, entry));
  if (entry) ++dp_rounds;
  return Status::ok();
}

// The held model (manager->model()) on the validation data, its metrics
// added to `metrics`.
train::EvalResult AggregatorServer::Impl::evaluate_held_model(nlohmann::json& metrics) {
  // The manager's model is the evaluator's parameter values (see start):
  // only the compute copies (mixed precision) need refreshing.
  evaluator_model->refresh_compute();
  train::Trainer evaluator(*evaluator_model, train::TrainOptions{});
  const train::EvalResult result = evaluator.evaluate(*validation);
  metrics["test_accuracy"] = result.accuracy;
  metrics["test_loss"] = result.loss;
  if (result.regression) {
    metrics["test_r2"] = result.r2;
    metrics["test_mae"] = result.mae;
    metrics["test_rmse"] = result.rmse;
  }
  if (language_model) {
    metrics["val_loss"] = result.loss;
    metrics["val_perplexity"] = std::exp(result.loss);
    if (!pretokenized_validation) metrics["val_bits_per_byte"] = train::data::bits_per_byte(result.loss, tokens_per_byte);
  }
  return result;
}

Status AggregatorServer::Impl::finish_step(const RoundRecord& record, std::optional<store::PrivacyEntry> privacy) {
  const double seconds = std::chrono::duration<double>(clock().now() - round_started).count();
  nlohmann::json metrics = {{"closed_by_deadline", record.closed_by_deadline}, {"seconds", seconds}};
  double accuracy = -1.0, loss = -1.0;
  if (record.version != static_cast<int64_t>(chain.size()) - 1) {
    chain.push_back(record.link.hash);
    if (validation && validation->size() > 0) {
      const train::EvalResult result = evaluate_held_model(metrics);
      accuracy = result.accuracy;
      loss = result.loss;
    }
  }
  nlohmann::json site_metrics = nlohmann::json::object();
  for (const AppliedUpdateRecord& applied : record.applied) {
    // Looked up, never added: a site revoked since it sent, or private
    // mode's one "secure-aggregate", is no site to show.
    const auto known = sites.find(applied.site);
    const auto revoked = revoked_sites.find(applied.site);
    const SiteRecord site = known != sites.end()           ? known->second
                            : revoked != revoked_sites.end() ? revoked->second
                                                             : SiteRecord{};
    site_metrics[applied.site] = {{"local_loss", site.local_loss}, {"local_accuracy", site.local_accuracy}};
    if (site.local_r2) {
      site_metrics[applied.site]["local_r2"] = *site.local_r2;
      site_metrics[applied.site]["local_mae"] = *site.local_mae;
    }
  }
  metrics["sites"] = site_metrics;
  nlohmann::json state = nlohmann::json::object();
  nlohmann::json chain_hex = nlohmann::json::array();
  for (const crypto::Hash& h : chain) chain_hex.push_back(federation::hash_hex(h));
  state["chain"] = chain_hex;
  if (privacy) {
    metrics["epsilon"] = privacy->epsilon;
    metrics["delta"] = privacy->delta;
  }
  const double epsilon = privacy ? privacy->epsilon : -1.0;  // -1: no privacy accounting
  // Commit (the privacy ledger's entry in the same transaction), then announce.
  FEDMESH_RETURN_IF_ERROR(commit_manager_round(*store, *manager, record, metrics, state, {}, {}, std::move(privacy)));
  // The buffer is empty after a step: every update still pending was refused.
  FEDMESH_RETURN_IF_ERROR(store->clear_pending_updates());
  FEDMESH_RETURN_IF_ERROR(publish());
  set_service_round();
  nlohmann::json staleness = nlohmann::json::array();
  for (const AppliedUpdateRecord& applied : record.applied) staleness.push_back(applied.staleness);
  nlohmann::json event = {{"event", "round"}, {"round", record.round}, {"version", record.version},
                          {"updates", record.applied.size()}, {"staleness", staleness},
                          {"closed_by_deadline", record.closed_by_deadline}, {"seconds", seconds},
                          {"model_hash", federation::hash_hex(record.link.hash)},
                          {"bytes_received", socket->counters().bytes_received.load()},
                          {"bytes_sent", socket->counters().bytes_sent.load()}};
  if (epsilon >= 0.0) {
    event["epsilon"] = epsilon;
    event["delta"] = config.dp_delta;
  }
  if (accuracy >= 0.0) {
    event["test_accuracy"] = accuracy;
    event["test_loss"] = loss;
    for (const char* key : {"test_r2", "test_mae", "test_rmse"}) {
      if (metrics.contains(key)) event[key] = metrics[key];
    }
    if (language_model) {
      for (const char* key : {"val_loss", "val_perplexity", "val_bits_per_byte"}) {
        if (metrics.contains(key)) event[key] = metrics[key];
      }
    }
  }
  view.round_closed(event);
  emit(event);
  round_started = clock().now();
  refresh_status();
  return Status::ok();
}

void AggregatorServer::Impl::refresh_status() {
  const bool asynchronous = config.rounds_options.asynchronous;
  const bool open = manager->round_open();
  std::set<std::string> delivered, sampled;
  for (const AppliedUpdateRecord& update : manager->buffered()) delivered.insert(update.site);
  if (open) sampled.insert(manager->sampled().begin(), manager->sampled().end());
  // Every site on the roster (never heard from: dropped), every one heard
  // from, and those revoked while this process ran.
  std::set<std::string> names;
  for (const auto& [name, site] : revoked_sites) names.insert(name);
  for (const crypto::RosterEntry& e : roster.sites) {
    if (e.role == crypto::Role::kSite) names.insert(e.identity.name);
  }
  for (const auto& [name, site] : sites) names.insert(name);
  nlohmann::json list = nlohmann::json::array();
  const auto now_point = clock().now();
  for (const std::string& name : names) {
    const auto known = sites.find(name);
    const auto revoked = revoked_sites.find(name);
    const SiteRecord site = known != sites.end()     ? known->second
                            : revoked != revoked_sites.end() ? revoked->second
                                                             : SiteRecord{};
    const double ago = site.last_contact.time_since_epoch().count() == 0
                           ? -1.0
                           : std::chrono::duration<double>(now_point - site.last_contact).count();
    SiteFacts facts;
    facts.on_roster = roster.find(name) != nullptr;
    facts.seconds_since_contact = ago;
    facts.asynchronous = asynchronous;
    facts.sampled_in_open_round = sampled.count(name) > 0;
    facts.delivered_this_round = delivered.count(name) > 0;
    facts.missed_last_round = site.missed_round;
    const char* state = site_state_name(classify_site(facts, config.site_timeout_seconds));
    list.push_back({{"site", name}, {"state", state}, {"last_contact_seconds", ago},
                    {"accepted", site.updates_accepted}, {"refused", site.refused},
                    {"local_accuracy", site.local_accuracy}, {"local_loss", site.local_loss},
                    {"train_loss", site.train_loss}, {"report_round", site.report_round},
                    {"staleness", site.last_staleness}, {"sampled", facts.sampled_in_open_round},
                    {"delivered", facts.delivered_this_round},
                    {"connected", facts.on_roster && ago >= 0 && ago < config.site_timeout_seconds}});
    if (site.local_r2) {
      list.back()["local_r2"] = *site.local_r2;
      list.back()["local_mae"] = *site.local_mae;
    }
  }
  // Where the round stands: updates in of those wanted, and its deadline.
  nlohmann::json progress = {{"mode", asynchronous ? "async" : "sync"}, {"open", asynchronous || open},
                             {"secure", config.is_private()}};
  if (asynchronous) {
    progress["received"] = manager->buffered().size();
    progress["wanted"] = config.rounds_options.fedasync_mixing > 0.0 ? 1 : config.rounds_options.buffer_size;
  } else {
    progress["round"] = manager->round();
    progress["sampled"] = open ? manager->sampled().size() : 0;
    // Private mode: the aggregator sees no update alone, only the sum (-1).
    progress["received"] = config.is_private() ? int64_t{-1} : static_cast<int64_t>(manager->buffered().size());
    progress["wanted"] = open ? manager->sampled().size() : 0;
    progress["min_updates"] = config.rounds_options.min_updates;
    progress["deadline_seconds"] = config.rounds_options.round_deadline_seconds;
    if (open) {
      const double left = std::max(0.0, manager->deadline() - now());
      progress["deadline_seconds_left"] = left;
      progress["deadline_unix_ms"] = clock().unix_ms() + static_cast<uint64_t>(left * 1000.0);
    }
  }
  view.set_snapshot({std::move(list), std::move(progress), manager->round(), manager->version(), open, finished()});
}

void AggregatorServer::Impl::note_round_closed(const std::vector<std::string>& delivered) {
  for (const std::string& name : manager->sampled()) {
    const auto site = sites.find(name);  // gone if revoked meanwhile
    if (site != sites.end() && std::find(delivered.begin(), delivered.end(), name) == delivered.end()) {
      site->second.missed_round = true;
    }
  }
}

OperatorContext AggregatorServer::Impl::operator_context() const {
  OperatorContext c;
  c.federation = config.federation;
  c.name = config.name;
  c.mode = config.rounds_options.asynchronous ? "async" : "sync";
  c.privacy_mode = config.privacy_mode;
  c.rounds = config.rounds;
  c.site_timeout_seconds = config.site_timeout_seconds;
  c.bytes_sent = socket->counters().bytes_sent.load();
  c.bytes_received = socket->counters().bytes_received.load();
  for (int code = 0; code < protocol::kRejectCodeCount; ++code) {
    const auto reject = static_cast<wire::RejectCode>(code);
    c.transport_rejections.emplace_back(protocol::reject_code_name(reject),
                                        static_cast<double>(socket->counters().rejections(reject)));
  }
  c.transfers_expired = service->receiver().transfers_expired();
  c.http_unauthorized = unauthorized_requests();
  if (const HttpEndpoint* endpoint = serving.load()) c.http_refused = endpoint->refused_connections();
  c.refusal_log_lines_suppressed = refusal_log_lines_suppressed.load();
  c.uptime_seconds = now();
  return c;
}

Status AggregatorServer::Impl::run(const std::atomic<bool>& stop) {
  emit({{"event", "listening"}, {"endpoint", socket->endpoint()}, {"metrics", metrics_address},
        {"dashboard", metrics_address.empty() ? "" : "http://" + metrics_address + "/dashboard"},
        {"token_required", !config.metrics_token.empty()},
        {"store", config.store}, {"round", manager->round()}, {"version", manager->version()},
        {"mode", config.rounds_options.asynchronous ? "async" : "sync"}});
  if (tokenizer) {
    emit({{"event", "tokenizer"}, {"tokenizer", tokenizer_fingerprint}, {"vocab_size", tokenizer->vocabulary()},
          {"held_out_bytes_per_token", 1.0 / tokens_per_byte}});
  }
  // Fine-tuning from a file: the starting point's validation metrics, the
  // baseline every round is compared with.
  if (manager->version() == 0 && !config.init.path.empty() && validation && validation->size() > 0) {
    nlohmann::json event = {{"event", "initial_model"}, {"version", 0}, {"init", config.init.path}};
    evaluate_held_model(event);
    emit(event);
  }
  if (config.rounds_options.asynchronous) {
    // Updates received but not applied before a restart rejoin the buffer.
    FEDMESH_RETURN_IF_ERROR(submit_unapplied_pending([](const SiteUpdate&) { return true; }));
    if (!failed_step.is_ok()) return failed_step;
  }
  auto last_refresh = clock().now();
  while (!stop.load()) {
    reload_roster_if_changed();
    FEDMESH_RETURN_IF_ERROR(maybe_start_round());
    Result<std::optional<protocol::Incoming>> incoming = socket->receive(std::chrono::milliseconds(50));
    if (!incoming.is_ok()) return incoming.status();
    if (incoming->has_value()) handle(**incoming);
    if (!failed_step.is_ok()) return failed_step;
    if (secure && manager->round_open()) {
      if (std::optional<SecureResult> result = secure->tick(clock().now())) {
        if (Status s = finish_secure_round(*result); !s.is_ok()) {
          emit({{"event", "error"}, {"message", "secure round " + std::to_string(result->round) + ": " + s.message()}});
          if (s.code() == StatusCode::kIoError) return s;
        }
      }
    }
    if (!config.rounds_options.asynchronous && manager->round_open() && manager->ready_to_close(now())) {
      if (secure) secure->close();
      Result<RoundRecord> record = manager->close_round(now());
      if (!record.is_ok()) return record.status();
      std::vector<std::string> delivered;
      for (const AppliedUpdateRecord& applied : record->applied) delivered.push_back(applied.site);
      note_round_closed(delivered);
      FEDMESH_RETURN_IF_ERROR(finish_step(*record));
    }
    if (clock().now() - last_refresh > std::chrono::milliseconds(250)) {
      refresh_status();
      last_refresh = clock().now();
    }
    if (finished()) {
      if (!finished_at) {
        finished_at = clock().now();
        emit({{"event", "finished"}, {"round", manager->round()}, {"version", manager->version()},
              {"test_accuracy", view.last_accuracy()}, {"store", config.store}});
      } else if (clock().now() - *finished_at > std::chrono::duration<double>(config.linger_seconds)) {
        break;
      }
    }
  }
  return store->settle();
}

AggregatorServer::~AggregatorServer() = default;

Result<std::unique_ptr<AggregatorServer>> AggregatorServer::start(AggregatorConfig config, EventSink emit,
                                                                   protocol::RuntimeEnvironment environment) {
  std::unique_ptr<AggregatorServer> server(new AggregatorServer());
  server->impl_ = std::make_unique<Impl>();
  server->impl_->env = std::move(environment);
  FEDMESH_RETURN_IF_ERROR(server->impl_->open(std::move(config), std::move(emit)));
  return server;
}

Status AggregatorServer::run(const std::atomic<bool>& stop) { return impl_->run(stop); }
const std::string& AggregatorServer::endpoint() const { return impl_->socket->endpoint(); }
const std::string& AggregatorServer::metrics_address() const { return impl_->metrics_address; }

}  // namespace fedmesh::aggregator
