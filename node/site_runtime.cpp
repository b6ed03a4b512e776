#include "node/site_runtime.h"

#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "federation/compression_checkpoint.h"
#include "federation/model_chain.h"
#include "base/random.h"
#include "base/http_endpoint.h"
#include "base/prometheus.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "base/toml_input.h"
#include "kernels/parallel.h"
#include "train/data/fashion_mnist.h"
#include "train/data/partition.h"
#include "train/model.h"
#include "train/model_spec.h"
#include "node/secure_upload.h"
#include "node/site_ranks.h"
#include "protocol/compressor.h"
#include "protocol/model_transfer.h"
#include "protocol/retransmit_timer.h"
#include "protocol/sealed_update.h"
#include "protocol/update_upload.h"
#include "store/checkpoint_store.h"

namespace fedmesh::node {

namespace {

using TimePoint = fedmesh::Clock::time_point;

struct Announcement {
  uint64_t round = 0, version = 0;
  crypto::Hash hash{};
  uint32_t local_steps = 0;
  bool selected = false, open = false, asynchronous = false, finished = false, secure = false;
  std::string tokenizer;  // the federation's BPE tokenizer fingerprint; "": bytes
  std::string data_schema;  // the federation's data schema fingerprint; "": not announced
  std::string model_spec;   // the federation's model spec fingerprint; "": not announced
  uint16_t protocol_version = 0;  // the aggregator's, from the announcement's envelope
};

// How long a tokenizer fingerprint from the aggregator may be in a message
// (a real one is 24 characters: "fnv1a64:" and 16 hex digits).
constexpr size_t kMaxShownFingerprint = 80;
// How long a site whose key the aggregator refuses at every handshake keeps
// trying before it stops (exit 3, as when told it is revoked).
constexpr double kRefusedHandshakeSeconds = 60.0;
// An update refused as BUSY is offered again this many times, the waits
// growing from 250 ms to 2 s (about two minutes in all), before the round
// is left to the next poll.
constexpr int kBusyRetries = 64;

// A tokenizer as the refusal below names it: the aggregator's, or this
// site's (`ours`, read from `path`).
std::string tokenizer_name(const std::string& fingerprint, bool ours, const std::string& path) {
  if (fingerprint.empty()) return ours ? "the byte tokenizer (no data.tokenizer)" : "the byte tokenizer (no `tokenizer`)";
  const std::string shown =
      fingerprint.size() > kMaxShownFingerprint ? fingerprint.substr(0, kMaxShownFingerprint) + "..." : fingerprint;
  return "the BPE tokenizer " + shown + (ours ? " (data.tokenizer = " + path + ")" : "");
}

protocol::RetransmitOptions retransmit_options(std::chrono::microseconds cap) {
  protocol::RetransmitOptions options;
  options.max_timeout = cap;
  return options;
}

// The phase of `round` at which SecureUploadFaults::exit_at asks this process to die.
std::optional<crypto::SecAggPhase> exit_phase(const std::string& schedule, uint64_t round) {
  size_t start = 0;
  while (start < schedule.size()) {
    const size_t comma = std::min(schedule.find(',', start), schedule.size());
    const std::string item = schedule.substr(start, comma - start);
    start = comma + 1;
    const size_t colon = item.find(':');
    if (colon == std::string::npos) continue;
    if (std::strtoull(item.substr(0, colon).c_str(), nullptr, 10) != round) continue;
    Result<crypto::SecAggPhase> phase = crypto::parse_secagg_phase(item.substr(colon + 1));
    if (phase.is_ok()) return *phase;
  }
  return std::nullopt;
}

}  // namespace

class SiteRuntime::Impl {
 public:
  SiteConfig config;
  SecureUploadFaults faults;
  SiteEventSink emit;
  crypto::SiteKeys keys;
  crypto::Roster roster;
  crypto::BoxPublicKey aggregator_key{};
  std::optional<store::CheckpointStore> store;
  std::unique_ptr<train::Sequential> worker;
  std::unique_ptr<SiteRanks> ranks;  // --ranks N > 1: the ranks training with this process
  std::vector<std::string> names;
  std::vector<protocol::TensorShape> manifest;
  std::optional<protocol::UpdateCompressor> compressor;
  std::vector<Tensor> global;  // the global model held
  uint64_t held_version = 0;
  crypto::Hash held_hash{};
  crypto::Hash held_parent{};
  uint64_t last_sequence = 0;
  int64_t last_sent_round = -1, last_sent_version = -1;
  int64_t commits = 0;
  SiteData data;  // shard, holdout
  std::string tokenizer;  // data.tokenizer's fingerprint ("": bytes), compared with every announcement's
  std::string model_spec;  // config.model's spec fingerprint, likewise
  // Private mode: the update of a round whose secure aggregation did not
  // finish yet, kept so that a new session of the same round needs no retraining.
  struct TrainedUpdate {
    uint64_t round = 0, version = 0;
    std::vector<float> delta;
    double train_loss = 0.0, local_accuracy = 0.0;
    int64_t steps = 0;
  };
  std::optional<TrainedUpdate> trained;
  bool mode_warned = false;
  // The clock, the network and the store's file system (production: the real ones).
  protocol::RuntimeEnvironment env;
  fedmesh::Clock& clock() const { return *env.clock; }
  std::unique_ptr<protocol::ClientChannel> socket;
  std::unique_ptr<HttpEndpoint> http;
  std::string metrics_address;
  TimePoint last_heard{};
  TimePoint last_heartbeat{};
  // How long to wait for the aggregator's answers, learnt from its round
  // trips, one timer per kind of exchange (an Ack{complete} waits for a
  // store commit, a RoundAnnounce for nothing): Heartbeat -> RoundAnnounce,
  // ModelRequest -> ModelChunk, UpdateHeader/UpdateChunk -> Ack. Each one's
  // cap is the fixed wait it replaces, so a silent aggregator is asked no
  // less patiently than that.
  protocol::RetransmitTimer poll_timer{retransmit_options(std::chrono::seconds(2))};
  protocol::RetransmitTimer fetch_timer{retransmit_options(std::chrono::seconds(5))};
  protocol::RetransmitTimer upload_timer{retransmit_options(std::chrono::seconds(5))};
  bool poll_timed_out = false;  // the last poll() waited its timer out
  // The aggregator said this site's key was revoked: the site stops.
  std::string revoked_reason;
  Status stop_revoked(const std::string& how) const {
    return revoked("the aggregator at " + config.aggregator + " " + how + "; this site stops, and restarting it "
                   "will not help: ask the admin of federation " + config.federation + " to put a key of this site "
                   "on the roster (`fedmesh roster add`)");
  }

  mutable std::mutex metrics_mutex;
  int64_t sent_total = 0, rejected_total = 0, models_fetched = 0, refused_models = 0;
  uint64_t shown_round = 0;
  double last_train_loss = -1.0, last_local_accuracy = -1.0;

  Status open(SiteConfig c, SiteEventSink sink);
  Status restore();
  Status commit(const nlohmann::json& metrics);
  Status make_compressor();
  Status connect();
  std::optional<Announcement> poll();
  Status adopt(const Announcement& a);
  Status check_initial_model(const Announcement& a) const;
  Status train_and_send(const Announcement& a);
  Status check_tokenizer(const Announcement& a) const;
  Status send_secure(const Announcement& a, const TrainedUpdate& update, TimePoint started);
  // What /metrics and /status show of the round's update.
  void note_update(bool accepted, double train_loss, double local_accuracy, uint64_t round) {
    std::lock_guard lock(metrics_mutex);
    (accepted ? sent_total : rejected_total) += 1;
    last_train_loss = train_loss;
    last_local_accuracy = local_accuracy;
    shown_round = round;
  }
  void heartbeat_if_due();
  std::string render_metrics() const;
  std::string render_status() const;
};

Status SiteRuntime::Impl::open(SiteConfig c, SiteEventSink sink) {
  config = std::move(c);
  emit = std::move(sink);
  if (config.store.empty()) config.store = config.name + ".db";
  FEDMESH_RETURN_IF_ERROR(config.validate());
  set_cpu_threads(config.threads);
  Result<Device> device = train::training_device(config.device, /*dp_sgd=*/false, config.data.regression());
  if (!device.is_ok()) return device.status();
  Result<crypto::Membership> membership =
      crypto::load_membership(config.keys, config.name, config.roster, config.admin_public, config.federation);
  if (!membership.is_ok()) return membership.status();
  keys = std::move(membership->keys);
  roster = std::move(membership->roster);
  const crypto::RosterEntry* aggregator = roster.find(config.aggregator_name);
  if (aggregator == nullptr || aggregator->role != crypto::Role::kAggregator) {
    return invalid_argument("the roster has no aggregator named '" + config.aggregator_name + "'");
  }
  aggregator_key = aggregator->identity.box_public;

  // The data first: a tokenizer (data.tokenizer) sets the model's vocabulary.
  Result<SiteData> site_data = load_site_data(config);
  if (!site_data.is_ok()) return site_data.status();
  data = std::move(*site_data);
  tokenizer = data.tokenizer_fingerprint();
  Result<std::string> spec = train::model_fingerprint(config.model);
  if (!spec.is_ok()) return spec.status();
  model_spec = std::move(*spec);

  Result<std::unique_ptr<train::Sequential>> model =
      train::make_initial_model(config.model, config.seed, data.model_input(), config.init);
  if (!model.is_ok()) return model.status();
  worker = std::move(*model);
  // LoRA: the frozen weights and the A factors are never sent, so they are
  // compared by fingerprint with the spec (the chain covers the B factors).
  if (worker->lora().enabled()) model_spec += " lora " + worker->frozen_fingerprint();
  for (Parameter* p : worker->parameters()) {
    names.push_back(p->name);
    global.push_back(p->value.clone());  // the held model stays on the host; only the worker moves
    manifest.push_back({p->name, std::vector<int64_t>(p->value.shape().begin(), p->value.shape().end())});
  }
  if (const std::string problem = worker->device_problem(*device); !problem.empty()) return invalid_argument(problem);
  worker->to_device(*device);
  FEDMESH_RETURN_IF_ERROR(make_compressor());
  // Version 0 is the seeded model (or `init`'s): its hash is the first one a site trusts.
  held_hash = federation::model_version_hash(0, crypto::Hash{}, names, global);

  store::StoreOptions store_options;
  store_options.vfs = env.store_vfs;
  store_options.background_maintenance = env.store_background_maintenance;
  store_options.keep_last = config.keep_last;
  Result<store::CheckpointStore> opened = store::CheckpointStore::open(config.store, store_options);
  if (!opened.is_ok()) return opened.status();
  store.emplace(std::move(*opened));
  FEDMESH_RETURN_IF_ERROR(restore());

  Result<std::unique_ptr<HttpEndpoint>> endpoint =
      serve_metrics_and_status(config.metrics, [this] { return render_metrics(); }, [this] { return render_status(); });
  if (!endpoint.is_ok()) return endpoint.status();
  http = std::move(*endpoint);
  if (http) metrics_address = http->address();
  train::RankFlags layout;
  layout.ranks = config.ranks;
  layout.tensor_parallel = config.tensor_parallel;
  if (layout.processes() > 1) {
    Result<std::unique_ptr<SiteRanks>> launched = SiteRanks::launch(layout, *worker, site_parallel_options(config));
    if (!launched.is_ok()) return launched.status();
    ranks = std::move(*launched);
  }
  nlohmann::json event = {{"event", "site"}, {"site", config.name}, {"shard_images", data.shard->size()},
                          {"holdout_images", data.holdout->size()}, {"store", config.store},
                          {"metrics", metrics_address}, {"version", held_version}, {"ranks", config.ranks},
                          {"tensor_parallel", config.tensor_parallel}};
  if (data.tokenizer) {
    event["tokenizer"] = tokenizer;
    event["vocab_size"] = data.vocabulary;
  }
  emit(event);
  return Status::ok();
}

Status SiteRuntime::Impl::make_compressor() {
  Result<protocol::CompressionPlan> plan =
      protocol::make_compression_plan(config.compress, config.compress_overrides, config.dense_below);
  if (!plan.is_ok()) return plan.status();
  Result<kernels::CompressionKernels*> backend = kernels::compression_kernels_named(config.compress_device);
  if (!backend.is_ok()) return backend.status();
  Result<protocol::UpdateCompressor> made = protocol::UpdateCompressor::create(
      *plan, manifest, mix_seed(config.data_seed, 0xc0de + static_cast<uint64_t>(config.index)), **backend);
  if (!made.is_ok()) return made.status();
  compressor.emplace(std::move(*made));
  return Status::ok();
}

Status SiteRuntime::Impl::restore() {
  Result<std::vector<store::RoundInfo>> rounds = store->rounds();
  if (!rounds.is_ok()) return rounds.status();
  if (rounds->empty()) return Status::ok();
  // A damaged newest round is moved into quarantine: the site goes on from
  // the round before (or from the start when none is intact) and fetches the
  // aggregator's current model.
  Result<store::LoadedCheckpoint> latest = store->resume_latest([this](const store::QuarantineNotice& n) {
    emit({{"event", "warning"}, {"message", n.message}, {"quarantined_round", n.round.value_or(-1)}, {"reason", n.reason}});
  });
  if (latest.status().code() == StatusCode::kNotFound) return Status::ok();
  if (!latest.is_ok()) return latest.status();
  try {
    const nlohmann::json state = nlohmann::json::parse(latest->round.state_json);
    held_version = state.at("held_version").get<uint64_t>();
    Result<crypto::Hash> hash = federation::parse_hash_hex(state.at("held_hash").get<std::string>());
    Result<crypto::Hash> parent = federation::parse_hash_hex(state.at("held_parent").get<std::string>());
    if (!hash.is_ok()) return hash.status();
    if (!parent.is_ok()) return parent.status();
    last_sequence = state.at("last_sequence").get<uint64_t>();
    last_sent_round = state.at("last_sent_round").get<int64_t>();
    last_sent_version = state.at("last_sent_version").get<int64_t>();
    std::vector<Tensor> restored;
    for (size_t i = 0; i < names.size(); ++i) {
      const store::StoredTensor* t = latest->find("model", names[i]);
      if (t == nullptr || t->value.shape() != global[i].shape() || t->value.dtype() != DType::kF32) {
        return corrupt(config.store + ": no model tensor " + names[i] + " of the model's shape (a store of another "
                       "model, or of another data.tokenizer's vocabulary?)");
      }
      restored.push_back(t->value.clone());
    }
    // The stored model must still be the version it claims to be.
    FEDMESH_RETURN_IF_ERROR(federation::verify_model({static_cast<int64_t>(held_version), *parent, *hash}, names, restored));
    global = std::move(restored);
    held_hash = *hash;
    held_parent = *parent;
    commits = latest->round.round;
    // The error-feedback residual; one written under another compression plan
    // (or none) is dropped with a warning rather than misapplied.
    if (Status s = federation::restore_compression_tensors(*compressor, "", *latest); !s.is_ok()) {
      emit({{"event", "warning"}, {"message", "starting with an empty compression residual: " + s.message()}});
      FEDMESH_RETURN_IF_ERROR(make_compressor());
    } else {
      compressor->set_rounds(state.value("compressor_rounds", int64_t{0}));
    }
  } catch (const nlohmann::json::exception& error) {
    return corrupt(config.store + ": the site state is malformed: " + error.what());
  }
  emit({{"event", "resume"}, {"store", config.store}, {"version", held_version}, {"last_sent_round", last_sent_round},
        {"committed", latest->round.wall_time}});
  return Status::ok();
}

Status SiteRuntime::Impl::commit(const nlohmann::json& metrics) {
  store::RoundToCommit round;
  round.round = ++commits;
  round.model_version = static_cast<int64_t>(held_version);
  round.metrics_json = metrics.dump();
  round.state_json = nlohmann::json({{"held_version", held_version}, {"held_hash", federation::hash_hex(held_hash)},
                                     {"held_parent", federation::hash_hex(held_parent)},
                                     {"last_sequence", last_sequence}, {"last_sent_round", last_sent_round},
                                     {"last_sent_version", last_sent_version},
                                     {"compressor_rounds", compressor->rounds()}})
                         .dump();
  for (size_t i = 0; i < names.size(); ++i) round.tensors.push_back({"model", names[i], &global[i]});
  std::deque<Tensor> views;
  federation::add_compression_tensors(*compressor, "", views, round.tensors);
  return store->commit_round(round);
}

Status SiteRuntime::Impl::connect() {
  protocol::TransportOptions transport;
  Result<protocol::FaultPlan> faults = protocol::parse_fault_plan(config.faults);
  if (!faults.is_ok()) return faults.status();
  transport.faults = *faults;
  Result<std::unique_ptr<protocol::ClientChannel>> connected =
      env.network->connect(config.aggregator, protocol::CurveKeys::from(keys), aggregator_key, transport);
  if (!connected.is_ok()) return connected.status();
  socket = std::move(*connected);
  return Status::ok();
}

// Sends a Heartbeat and reads the RoundAnnounce that answers it.
// The wait is poll_timer's: a lost Heartbeat (or its answer) costs about
// one measured round trip, and the caller asks again at once.
std::optional<Announcement> SiteRuntime::Impl::poll() {
  poll_timed_out = false;
  // Late answers to earlier Heartbeats (those sent while training) are
  // stale; read them off first so that they do not pass for this one's.
  for (int i = 0; i < protocol::kDefaultHighWaterMark; ++i) {
    Result<std::optional<protocol::Incoming>> stale = socket->receive(std::chrono::milliseconds(0));
    if (!stale.is_ok() || !stale->has_value()) break;
  }
  capnp::MallocMessageBuilder builder;
  auto heartbeat = builder.initRoot<wire::Message>().initHeartbeat();
  heartbeat.setSentUnixMs(clock().unix_ms());
  heartbeat.setModelVersion(held_version);
  if (!socket->send(protocol::serialize(builder), std::chrono::milliseconds(1000)).is_ok()) return std::nullopt;
  last_heartbeat = clock().now();
  poll_timer.sent(last_heartbeat);
  const auto until = last_heartbeat + poll_timer.timeout();
  while (true) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - clock().now());
    if (left.count() <= 0) break;
    Result<std::optional<protocol::Incoming>> incoming = socket->receive(left);
    if (!incoming.is_ok() || !incoming->has_value()) continue;
    std::unique_ptr<protocol::ParsedMessage> parsed;
    protocol::Rejection rejection;
    if (!protocol::parse_message((*incoming)->bytes, protocol::kDefaultMaxMessageBytes, (*incoming)->frame, parsed,
                                 rejection)) {
      emit({{"event", "warning"}, {"message", "unreadable message from the aggregator: " + rejection.reason}});
      continue;
    }
    try {
      const auto root = parsed->root();
      if (root.isReject()) {
        if (root.getReject().getCode() == wire::RejectCode::REVOKED) {
          revoked_reason = root.getReject().getText().cStr();
          return std::nullopt;
        }
        // A late answer to something earlier, not to this heartbeat: a
        // refusal naming an update (a chunk resent after its transfer
        // ended), or BUSY (the aggregator answers a heartbeat with an
        // announcement, never BUSY: a model request asked again after its
        // fetch ended).
        if (root.getReject().getSequence() != 0 || root.getReject().getCode() == wire::RejectCode::BUSY) continue;
        emit({{"event", "warning"}, {"message", std::string("the aggregator refused a heartbeat: ") +
                                                    root.getReject().getText().cStr()}});
        poll_timer.answered(clock().now());
        return std::nullopt;
      }
      if (!root.isRoundAnnounce()) continue;  // a late reply to something earlier
      const auto r = root.getRoundAnnounce();
      Announcement a;
      a.round = r.getRound();
      a.version = r.getModelVersion();
      if (r.getModelHash().size() != crypto::kHashBytes) continue;
      std::memcpy(a.hash.data(), r.getModelHash().begin(), a.hash.size());
      a.local_steps = r.getLocalSteps();
      a.selected = r.getSelected();
      a.open = r.getRoundOpen();
      a.asynchronous = r.getAsynchronous();
      a.finished = r.getFinished();
      a.secure = r.getSecureAggregation();
      a.tokenizer = r.getTokenizer().cStr();
      a.data_schema = r.getDataSchema().cStr();
      a.model_spec = r.getModelSpec().cStr();
      a.protocol_version = parsed->envelope().version;
      last_heard = clock().now();
      poll_timer.answered(last_heard);
      return a;
    } catch (const kj::Exception& e) {
      emit({{"event", "warning"}, {"message", std::string("malformed announcement: ") + e.getDescription().cStr()}});
    }
  }
  poll_timer.timed_out();
  poll_timed_out = true;
  return std::nullopt;
}

// Sites and the aggregator must read text with one tokenizer: another
// vocabulary gives other tensor shapes (refused update by update, as
// wrongShape, with no word of why), and another tokenizer of the same size
// would go unnoticed while its token ids mean other text. So the
// aggregator announces its tokenizer's fingerprint with every round (an
// added RoundAnnounce field, which peers of older builds skip; their
// announcements read as "" = bytes, which is what they use), and a site
// that reads text with another refuses to take part: a config to fix, so
// the node exits naming both.
Status SiteRuntime::Impl::check_tokenizer(const Announcement& a) const {
  // Image and table models: the data must be read into the same samples
  // (the same columns and encoding, classes, image size and channels).
  if (!a.data_schema.empty() && !data.schema.canonical.empty() && a.data_schema != data.schema.fingerprint()) {
    return invalid_argument("the aggregator's model is built for data of schema " +
                            a.data_schema.substr(0, kMaxShownFingerprint) + ", and this site's data (" +
                            config.data.source + ") has schema " + data.schema.fingerprint() + ": " +
                            data.schema.canonical + ". The columns and their encoding, the classes, or the image size "
                            "and channels differ: give every site and the aggregator the same data.* keys");
  }
  // The model: built from the same spec (a built-in, or the same spec file's layers).
  const auto lora_part = [](const std::string& spec) {
    const size_t at = spec.find(" lora ");
    return at == std::string::npos ? std::string() : spec.substr(at + 6);
  };
  const auto spec_part = [](const std::string& spec) { return spec.substr(0, spec.find(" lora ")); };
  if (!a.model_spec.empty() && spec_part(a.model_spec) == spec_part(model_spec) &&
      lora_part(a.model_spec) != lora_part(model_spec)) {
    const auto said = [](const std::string& part) { return part.empty() ? std::string("no LoRA") : "LoRA " + part; };
    return invalid_argument("the aggregator fine-tunes with " + said(lora_part(a.model_spec).substr(0, kMaxShownFingerprint)) +
                            ", and this site with " + said(lora_part(model_spec)) + " (" +
                            (config.init.lora.enabled() ? config.init.lora.describe() : std::string("training.lora unset")) +
                            "): the adapters or the frozen weights under them differ. Give every site and the "
                            "aggregator the same init file, seed and training.lora");
  }
  if (!a.model_spec.empty() && a.model_spec != model_spec) {
    return invalid_argument("the aggregator's model is built from spec " + a.model_spec.substr(0, kMaxShownFingerprint) +
                            ", and this site's (" + config.model + ") from " + model_spec +
                            ": the layers differ. Give every site and the aggregator the same model (the same "
                            "built-in name, or spec files with the same layers: `fedmesh model show FILE` prints the "
                            "fingerprint)");
  }
  if (a.tokenizer == tokenizer) return Status::ok();
  return invalid_argument("the aggregator's federation reads its text with " + tokenizer_name(a.tokenizer, false, "") +
                          ", and this site with " + tokenizer_name(tokenizer, true, config.tokenizer) +
                          ": the tokenizers differ, so the models' vocabularies and token ids would not match. Set "
                          "data.tokenizer to the aggregator's tokenizer file (its `tokenizer` key), or leave both out "
                          "to use bytes");
}

// Keeps the aggregator aware of us during long local training; replies are
// read and dropped by the next poll.
void SiteRuntime::Impl::heartbeat_if_due() {
  if (clock().now() - last_heartbeat < std::chrono::seconds(1)) return;
  capnp::MallocMessageBuilder builder;
  auto heartbeat = builder.initRoot<wire::Message>().initHeartbeat();
  heartbeat.setSentUnixMs(clock().unix_ms());
  heartbeat.setModelVersion(held_version);
  (void)socket->send(protocol::serialize(builder), std::chrono::milliseconds(10));
  last_heartbeat = clock().now();
}

// Version 0 is built by every process from model, seed and init: another
// one than the aggregator's is a misconfiguration no retry mends, so the
// site stops (exit 2) naming both hashes, before training on it.
Status SiteRuntime::Impl::check_initial_model(const Announcement& a) const {
  if (a.version != 0 || held_version != 0 || a.hash == held_hash) return Status::ok();
  return invalid_argument("the aggregator's version 0 (hash " + federation::hash_hex(a.hash).substr(0, 16) +
                          ") is not this site's (hash " + federation::hash_hex(held_hash).substr(0, 16) +
                          "): version 0 is built from model, seed and init, and this site's differ from the "
                          "aggregator's; give it the aggregator's (the same init file, in init and init_format)");
}

Status SiteRuntime::Impl::adopt(const Announcement& a) {
  if (a.version == held_version) {
    if (a.hash == held_hash) return Status::ok();
    // The same version number, another model (version 0 is caught before, by check_initial_model).
    std::lock_guard lock(metrics_mutex);
    ++refused_models;
    return corrupt("refusing to train on version " + std::to_string(a.version) + ": the aggregator's model has hash " +
                   federation::hash_hex(a.hash).substr(0, 16) + ", this site's " +
                   federation::hash_hex(held_hash).substr(0, 16));
  }
  if (a.version < held_version) {
    return corrupt("the aggregator announces version " + std::to_string(a.version) + ", older than the version " +
                   std::to_string(held_version) + " this site holds");
  }
  protocol::FetchOptions options;
  options.reply_timeout = std::chrono::milliseconds(5000);
  options.timer = &fetch_timer;
  Result<protocol::FetchedModel> fetched = protocol::fetch_model(*socket, a.version, held_version, manifest, options);
  if (!fetched.is_ok()) return fetched.status();
  // The chain from the hash we trust to the new version, then the bytes.
  std::vector<federation::ChainLink> links;
  crypto::Hash parent = held_hash;
  for (size_t i = 0; i < fetched->chain.size(); ++i) {
    links.push_back({static_cast<int64_t>(held_version + 1 + i), parent, fetched->chain[i]});
    parent = fetched->chain[i];
  }
  std::vector<Tensor> tensors;
  for (size_t t = 0; t < manifest.size(); ++t) {
    Tensor tensor = global[t].clone();
    std::memcpy(tensor.raw(), fetched->tensors[t].data(), tensor.nbytes());
    tensors.push_back(std::move(tensor));
  }
  Status verified = federation::verify_chain(held_hash, links);
  if (verified.is_ok() && (links.empty() || links.back().parent != fetched->parent || links.back().hash != a.hash)) {
    verified = corrupt("the model's parent or hash differs from its chain and announcement");
  }
  if (verified.is_ok()) verified = federation::verify_model(links.back(), names, tensors);
  if (!verified.is_ok()) {
    std::lock_guard lock(metrics_mutex);
    ++refused_models;
    return corrupt("refusing global model version " + std::to_string(a.version) + ": " + verified.message());
  }
  global = std::move(tensors);
  held_version = a.version;
  held_hash = fetched->hash;
  held_parent = fetched->parent;
  {
    std::lock_guard lock(metrics_mutex);
    ++models_fetched;
  }
  emit({{"event", "model"}, {"version", held_version}, {"bytes", fetched->bytes_received},
        {"hash", federation::hash_hex(held_hash).substr(0, 16)}});
  return Status::ok();
}

Status SiteRuntime::Impl::train_and_send(const Announcement& a) {
  const auto started = clock().now();
  if (a.secure && trained && trained->round == a.round && trained->version == a.version) {
    return send_secure(a, *trained, started);  // a new session of the same round
  }
  std::vector<Parameter*> parameters = worker->parameters();
  for (size_t t = 0; t < parameters.size(); ++t) parameters[t]->value.copy_from(global[t]);
  worker->refresh_compute();
  train::TrainOptions local = config.local;
  local.max_steps = std::max<int64_t>(1, a.local_steps);
  local.epochs = 1 + local.max_steps * local.batch_size / std::max<int64_t>(1, data.shard->size());
  local.seed = mix_seed(mix_seed(config.data_seed, static_cast<uint64_t>(config.index)), a.round * 1000003ull + a.version);
  if (ranks) local = ranks->options_for_rank(local);
  train::Trainer trainer(*worker, local);
  train::TrainCallbacks callbacks;
  callbacks.on_step = [&](const train::StepProgress&) {
    if (config.step_delay_seconds > 0.0) clock().sleep_for(std::chrono::duration<double>(config.step_delay_seconds));
    heartbeat_if_due();
  };
  train::TrainSummary summary;
  if (ranks) {
    Result<train::TrainSummary> trained = ranks->fit(trainer, local, *data.shard, callbacks);
    if (!trained.is_ok()) return trained.status();
    summary = *trained;
  } else {
    summary = trainer.fit(*data.shard, nullptr, callbacks);
  }
  // Tensor parallelism put new whole blocks in the model: read its parameters again.
  parameters = worker->parameters();
  const train::EvalResult local_eval = data.holdout->size() > 0 ? trainer.evaluate(*data.holdout) : train::EvalResult{};
  std::vector<std::vector<float>> delta(parameters.size());
  for (size_t t = 0; t < parameters.size(); ++t) {
    const Tensor trained_weights = parameters[t]->value.host();
    const float* after = trained_weights.data<float>();
    const float* before = global[t].data<float>();
    delta[t].resize(static_cast<size_t>(global[t].numel()));
    for (size_t i = 0; i < delta[t].size(); ++i) delta[t][i] = after[i] - before[i];
  }
  // The report first: the aggregator files it with the update.
  {
    capnp::MallocMessageBuilder builder;
    auto report = builder.initRoot<wire::Message>().initSiteReport();
    report.setRound(a.round);
    report.setBaseVersion(a.version);
    report.setTrainLoss(std::isfinite(summary.final_train_loss) ? summary.final_train_loss : -1.0);
    report.setLocalLoss(local_eval.loss);
    report.setLocalAccuracy(local_eval.accuracy);
    report.setExamples(static_cast<uint64_t>(data.shard->size()));
    // A regression task's held-out metrics (a model that diverged has none to send).
    if (local_eval.regression && local_eval.count > 0 && std::isfinite(local_eval.r2) && std::isfinite(local_eval.mae)) {
      report.setRegression(true);
      report.setLocalR2(std::min(local_eval.r2, 1.0));
      report.setLocalMae(local_eval.mae);
    }
    FEDMESH_RETURN_IF_ERROR(socket->send(protocol::serialize(builder), std::chrono::milliseconds(2000)));
  }
  if (a.secure) {
    TrainedUpdate update{a.round, a.version, {}, summary.final_train_loss, local_eval.accuracy, summary.steps};
    for (const auto& t : delta) update.delta.insert(update.delta.end(), t.begin(), t.end());
    trained = std::move(update);
    return send_secure(a, *trained, started);
  }
  protocol::UpdateMetadata metadata;
  metadata.federation = config.federation;
  metadata.round = a.round;
  metadata.base_version = a.version;
  metadata.sender = config.name;
  metadata.recipient = config.aggregator_name;
  metadata.sequence = std::max(last_sequence + 1, clock().unix_micros());
  metadata.sample_count = static_cast<uint64_t>(data.shard->size());
  std::vector<std::span<const float>> spans(delta.begin(), delta.end());
  Result<protocol::CompressedUpdate> compressed = compressor->compress(spans, /*want_decoded=*/false);
  if (!compressed.is_ok()) return compressed.status();
  protocol::UploadOptions upload;
  upload.reply_timeout = std::chrono::milliseconds(5000);
  upload.timer = &upload_timer;
  // An aggregator that takes sealed updates gets the chunks while later
  // ones are still being serialized and hashed, and the site holds a
  // window of them, not a serialized copy of the whole update; an older
  // one, a header that signs them all first.
  Result<protocol::PreparedUpdate> prepared =
      a.protocol_version >= protocol::kSealedUpdatesVersion
          ? protocol::prepare_sealed_encoded_update(metadata, std::move(compressed->tensors), keys,
                                                    protocol::kDefaultChunkBytes,
                                                    protocol::held_limit_for_window(upload.window_chunks))
          : protocol::prepare_encoded_update(metadata, std::move(compressed->tensors), keys);
  protocol::RetryPolicy retry;
  retry.max_attempts = 4;
  int attempts = 0;
  Result<protocol::UploadOutcome> outcome = protocol::upload_with_retries(*socket, *prepared, upload, retry, &attempts);
  // BUSY: the aggregator stages a bounded number of updates at once (its
  // staging_mb, for large models). The same update is offered again after
  // a short wait (each try a message, so the site stays connected) rather
  // than trained again at the next poll.
  protocol::RetryPolicy busy_wait;
  busy_wait.first_backoff = std::chrono::milliseconds(250);
  busy_wait.max_backoff = std::chrono::milliseconds(2000);
  Rng busy_jitter(metadata.sequence);
  for (int busy = 1; busy <= kBusyRetries && outcome.is_ok() && outcome->rejection &&
                     outcome->rejection->code == wire::RejectCode::BUSY;
       ++busy) {
    clock().sleep_for(protocol::backoff_delay(busy, busy_wait, busy_jitter));
    int more = 0;
    outcome = protocol::upload_with_retries(*socket, *prepared, upload, retry, &more);
    attempts += more;
  }
  // The sequence is spent whatever happened: never reuse it.
  last_sequence = metadata.sequence;
  // Not delivered: all of it stays in the error-feedback residual.
  if (!outcome.is_ok() || !outcome->accepted) compressor->rollback();
  if (!outcome.is_ok()) return outcome.status();
  const double seconds = std::chrono::duration<double>(clock().now() - started).count();
  note_update(outcome->accepted, summary.final_train_loss, local_eval.accuracy, a.round);
  nlohmann::json event = {{"event", "update"}, {"round", a.round}, {"version", a.version},
                          {"sequence", metadata.sequence}, {"accepted", outcome->accepted}, {"train_loss", summary.final_train_loss},
                          {"local_accuracy", local_eval.accuracy}, {"steps", summary.steps},
                          {"bytes", prepared->encoded_payload_bytes}, {"wire_bytes", protocol::wire_bytes(*prepared)},
                          {"seconds", seconds}, {"attempts", attempts}};
  if (local_eval.regression) {
    event["local_r2"] = local_eval.r2;
    event["local_mae"] = local_eval.mae;
  }
  if (outcome->rejection) {
    event["code"] = protocol::reject_code_name(outcome->rejection->code);
    event["reason"] = outcome->rejection->reason;
  }
  emit(event);
  if (outcome->rejection && outcome->rejection->code == wire::RejectCode::REVOKED) {
    return stop_revoked("refused this site's update: " + outcome->rejection->reason);
  }
  if (outcome->rejection && outcome->rejection->code == wire::RejectCode::REPLAYED &&
      outcome->rejection->last_accepted >= metadata.sequence) {
    // The aggregator holds a later sequence of ours than we knew (a crash
    // lost the last we used, and our clock went back): sign it again above.
    last_sequence = std::max(last_sequence, outcome->rejection->last_accepted);
    return unavailable("the aggregator has accepted sequence " + std::to_string(outcome->rejection->last_accepted) +
                       " of ours, above this update's " + std::to_string(metadata.sequence) + ": sending it again above");
  }
  if (outcome->rejection && protocol::reject_is_retryable(outcome->rejection->code)) {
    // Nothing of it was kept (the residual holds it all again): the round
    // stays unanswered and the next poll trains and sends it again.
    return unavailable("the aggregator did not take the update of round " + std::to_string(a.round) + " (" +
                       protocol::reject_code_name(outcome->rejection->code) + "): sending it again");
  }
  last_sent_round = static_cast<int64_t>(a.round);
  last_sent_version = static_cast<int64_t>(a.version);
  return commit({{"round", a.round}, {"version", a.version}, {"train_loss", summary.final_train_loss},
                 {"local_accuracy", local_eval.accuracy}, {"accepted", outcome->accepted}});
}

Status SiteRuntime::Impl::send_secure(const Announcement& a, const TrainedUpdate& update, TimePoint started) {
  SecureUploadOptions options;
  options.exit_at = exit_phase(faults.exit_at, a.round);
  if (!faults.dump_dir.empty()) {
    options.dump_input = faults.dump_dir + "/" + config.name + "-round-" + std::to_string(a.round) + ".u32";
  }
  Result<SecureUploadOutcome> outcome =
      secure_upload(*socket, keys, roster, a.round, a.version, update.delta, options, emit);
  if (!outcome.is_ok()) return outcome.status();
  const double seconds = std::chrono::duration<double>(clock().now() - started).count();
  note_update(outcome->contributed, update.train_loss, update.local_accuracy, a.round);
  nlohmann::json event = {{"event", "update"}, {"round", a.round}, {"version", a.version}, {"secure", true},
                          {"accepted", outcome->contributed}, {"session", outcome->session},
                          {"sessions", outcome->sessions}, {"train_loss", update.train_loss},
                          {"local_accuracy", update.local_accuracy}, {"steps", update.steps},
                          {"words", outcome->words}, {"seconds", seconds}};
  if (!outcome->contributed) event["reason"] = outcome->reason;
  emit(event);
  // The round is answered either way: its session finished (with or without
  // this site) or the round moved on.
  last_sent_round = static_cast<int64_t>(a.round);
  last_sent_version = static_cast<int64_t>(a.version);
  Status committed = commit({{"round", a.round}, {"version", a.version}, {"train_loss", update.train_loss},
                             {"local_accuracy", update.local_accuracy}, {"accepted", outcome->contributed},
                             {"secure", true}});
  trained.reset();  // `update` may be *trained: last
  return committed;
}

std::string SiteRuntime::Impl::render_metrics() const {
  PrometheusText out;
  std::lock_guard lock(metrics_mutex);
  out.gauge("fedmesh_site_round", "The last round this site answered", static_cast<double>(shown_round));
  out.counter("fedmesh_site_updates_accepted_total", "Updates the aggregator accepted", static_cast<double>(sent_total));
  out.counter("fedmesh_site_updates_rejected_total", "Updates the aggregator refused", static_cast<double>(rejected_total));
  out.counter("fedmesh_site_models_fetched_total", "Global models fetched and verified", static_cast<double>(models_fetched));
  out.counter("fedmesh_site_models_refused_total", "Global models refused (hash chain)", static_cast<double>(refused_models));
  if (last_local_accuracy >= 0.0) out.gauge("fedmesh_site_local_accuracy", "Accuracy on the local held-out images", last_local_accuracy);
  return out.text();
}

std::string SiteRuntime::Impl::render_status() const {
  std::lock_guard lock(metrics_mutex);
  return nlohmann::json({{"role", "site"}, {"site", config.name}, {"federation", config.federation},
                         {"round", shown_round}, {"updates_accepted", sent_total}, {"updates_rejected", rejected_total},
                         {"local_accuracy", last_local_accuracy}})
      .dump();
}

SiteRuntime::~SiteRuntime() = default;

Result<std::unique_ptr<SiteRuntime>> SiteRuntime::start(SiteConfig config, SiteEventSink emit,
                                                        SecureUploadFaults faults,
                                                        protocol::RuntimeEnvironment environment) {
  std::unique_ptr<SiteRuntime> runtime(new SiteRuntime());
  runtime->impl_ = std::make_unique<Impl>();
  runtime->impl_->env = std::move(environment);
  runtime->impl_->faults = std::move(faults);
  FEDMESH_RETURN_IF_ERROR(runtime->impl_->open(std::move(config), std::move(emit)));
  return runtime;
}

const std::string& SiteRuntime::metrics_address() const { return impl_->metrics_address; }

Status SiteRuntime::run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  FEDMESH_RETURN_IF_ERROR(s.connect());
  bool waiting_reported = false;
  s.last_heard = s.clock().now();
  while (!stop.load()) {
    std::optional<Announcement> a = s.poll();
    if (!a) {
      if (!s.revoked_reason.empty()) return s.stop_revoked("says: " + s.revoked_reason);
      const double silent = std::chrono::duration<double>(s.clock().now() - s.last_heard).count();
      // A key the aggregator refuses at every handshake: revoked while this
      // site was not connected (or never added). Not at once: a roster that
      // adds this site may be on its way to the aggregator.
      if (silent > kRefusedHandshakeSeconds && s.socket->handshake_refused()) {
        return s.stop_revoked("refused this site's key at every handshake for " +
                              std::to_string(static_cast<int>(silent)) + " s: the key is not on its roster (revoked, "
                              "or not added yet)");
      }
      if (!waiting_reported && silent > 3.0) {
        s.emit({{"event", "waiting"}, {"message", "no answer from the aggregator at " + s.config.aggregator + "; retrying"}});
        waiting_reported = true;
      }
      if (s.config.give_up_seconds > 0.0 && silent > s.config.give_up_seconds) {
        return unavailable("no answer from the aggregator for " + std::to_string(static_cast<int>(silent)) + " s");
      }
      // A poll that waited its timer out asks again at once (the timer backs
      // off); one that could not even send waits the poll interval.
      if (!s.poll_timed_out) s.clock().sleep_for(std::chrono::duration<double>(s.config.poll_seconds));
      continue;
    }
    if (waiting_reported) s.emit({{"event", "connected"}, {"aggregator", s.config.aggregator}});
    waiting_reported = false;
    FEDMESH_RETURN_IF_ERROR(s.check_tokenizer(*a));
    FEDMESH_RETURN_IF_ERROR(s.check_initial_model(*a));
    if (a->finished) {
      if (Status adopted = s.adopt(*a); !adopted.is_ok()) s.emit({{"event", "warning"}, {"message", adopted.message()}});
      s.emit({{"event", "finished"}, {"version", s.held_version}});
      return s.store->settle();
    }
    // Synchronous rounds take one update per site; asynchronous sites train
    // continuously from whatever version is current.
    const bool answered = !a->asynchronous && s.last_sent_round == static_cast<int64_t>(a->round) &&
                          s.last_sent_version == static_cast<int64_t>(a->version);
    if (a->open && a->selected && !answered && a->secure != (s.config.privacy_mode == "private")) {
      if (!s.mode_warned) {
        s.emit({{"event", "warning"},
                {"message", a->secure ? "the aggregator runs in private mode (secure aggregation) and this site is "
                                        "configured trusted: set privacy.mode = \"private\" to take part"
                                      : "this site is configured for private mode and the aggregator announces plain "
                                        "rounds: refusing to send its update in the clear"}});
        s.mode_warned = true;
      }
      s.clock().sleep_for(std::chrono::duration<double>(s.config.poll_seconds));
      continue;
    }
    if (!a->selected || !a->open || answered) {
      s.clock().sleep_for(std::chrono::duration<double>(s.config.poll_seconds));
      continue;
    }
    Status step = s.adopt(*a);
    if (step.is_ok()) step = s.train_and_send(*a);
    if (!step.is_ok()) {
      if (step.code() == StatusCode::kIoError) return step;  // our own disk: stop rather than lose state
      if (s.ranks && !s.ranks->broken().is_ok()) return step;  // a rank is gone: restart the node
      if (step.code() == StatusCode::kRevoked) return step;
      s.emit({{"event", "warning"}, {"message", step.message()}});
      s.clock().sleep_for(std::chrono::duration<double>(s.config.poll_seconds));
    }
  }
  return s.store->settle();
}

}  // namespace fedmesh::node
