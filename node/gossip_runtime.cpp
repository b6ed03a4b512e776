#include "node/gossip_runtime.h"

#include <capnp/message.h>
#include <sodium.h>
#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "federation/compression_checkpoint.h"
#include "federation/staleness.h"
#include "base/http_endpoint.h"
#include "base/prometheus.h"
#include "base/random.h"
#include "crypto/dp_noise.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "gossip/catch_up.h"
#include "gossip/exchange.h"
#include "gossip/topology.h"
#include "kernels/parallel.h"
#include "gossip/swim_wire.h"
#include "node/peer_link.h"
#include "node/replica_sync.h"
#include "train/model.h"
#include "privacy/ledger.h"
#include "privacy/rdp_accountant.h"
#include "protocol/environment.h"
#include "protocol/refusal_log.h"
#include "protocol/transport.h"
#include "protocol/update_service.h"
#include "protocol/update_transfer.h"
#include "store/checkpoint_store.h"

namespace fedmesh::node {

namespace {

constexpr auto kSendTimeout = std::chrono::milliseconds(20);

// A received share or catch-up slice, decoded.
struct Arrival {
  std::string from;
  uint64_t sender_version = 0, base_version = 0;
  gossip::GossipUpdateKind kind = gossip::GossipUpdateKind::kShare;
  double weight = 0.0;
  uint32_t slice = 0, slices = 0;
  std::vector<std::vector<float>> values;  // model tensors only
};

}  // namespace

class GossipRuntime::Impl {
 public:
  GossipConfig config;
  GossipEventSink emit;
  // The clock, network, helper threads and store file system (production:
  // the real ones; sim/vopr: its virtual world).
  protocol::RuntimeEnvironment env;
  fedmesh::Clock& clock() const { return *env.clock; }
  crypto::SiteKeys keys;
  crypto::Roster roster;
  std::map<std::string, std::string> addresses;  // gossip members on the roster (us included) -> address
  std::unique_ptr<train::Sequential> worker;
  std::vector<protocol::TensorShape> manifest;       // the model's tensors
  std::optional<gossip::GossipState> state;    // push-sum, pairwise
  std::optional<ReplicaSync> replicas;         // replicas
  std::vector<std::vector<float>> trained;     // replicas: this round's local training
  // The model this peer holds.
  const std::vector<std::vector<float>>& model() const { return replicas ? replicas->state().model() : state->model(); }
  gossip::Topology topology = gossip::Topology::kExponential;
  federation::StalenessFunction staleness;
  std::optional<store::CheckpointStore> store;
  std::optional<crypto::ReplayGuard> replay;
  std::unique_ptr<protocol::ServerChannel> server;
  std::unique_ptr<protocol::UpdateService> service;
  // One link per member we send to: its own thread and socket, so a slow
  // link holds back only its own messages (peer_link.h).
  std::map<std::string, std::unique_ptr<PeerLink>> links;
  // Shares handed to links and not yet reported: what a link that could not
  // deliver gives back (push-sum: merged into ourselves), by share id.
  struct ShareInFlight {
    gossip::GossipShare share;
    int pending = 0;  // links that have not reported
  };
  std::map<uint64_t, ShareInFlight> shares_in_flight;
  uint64_t next_share = 1;
  protocol::TransportOptions transport;
  std::optional<gossip::Swim> swim;
  // What the store said of the membership before a restart (restore), for
  // swim->resume: our incarnation then and the members we knew.
  struct KnownMembership {
    uint64_t incarnation = 0;
    std::vector<gossip::MemberUpdate> members;
  };
  std::optional<KnownMembership> known_membership;
  Rng rng{1};
  SiteData data;
  std::string wire_federation;  // the federation name on this peer's shares (gossip_federation)
  std::unique_ptr<HttpEndpoint> http;
  std::string metrics_address;
  fedmesh::Clock::time_point started{};  // set by open()

  // Written by the peer's thread only, through set_version (under
  // metrics_mutex: the HTTP thread reads it for /metrics and /status).
  uint64_t version = 0;
  void set_version(uint64_t value) {
    std::lock_guard lock(metrics_mutex);
    version = value;
  }
  uint64_t last_sequence = 0;
  int64_t commits = 0;
  std::map<std::string, uint64_t> peer_versions;  // the latest version each member told us
  // The latest version `member` told us, 0 when none.
  uint64_t heard_version(const std::string& member) const {
    const auto known = peer_versions.find(member);
    return known == peer_versions.end() ? 0 : known->second;
  }
  std::deque<Arrival> arrivals;
  std::deque<std::pair<std::string, std::pair<uint32_t, uint32_t>>> catch_up_requests;  // requester, slice/slices
  // Replicas: a member asked for our update of a round; if it holds part
  // of a transfer of it, the transfer's sequence and the chunks it holds.
  struct UpdateRequest {
    std::string requester;
    uint64_t round = 0;
    uint64_t sequence = 0;  // 0: send it whole, signed anew
    std::vector<bool> have;
  };
  std::deque<UpdateRequest> update_requests;
  // Replicas: what each of our updates was last sent under, by (member,
  // round), so that its very header and missing chunks can be sent again
  // (signing is deterministic). Rounds below the window are forgotten.
  std::map<std::pair<std::string, uint64_t>, protocol::UpdateMetadata> updates_sent;
  // Replicas: each member's latest ReplicaHolds, the round below which it
  // holds all of our updates (what settling waits for before we leave).
  std::map<std::string, uint64_t> held_by;
  // A catch-up in progress: slice -> donor, and what has arrived.

  mutable std::mutex metrics_mutex;
  uint64_t bytes_sent = 0, shares_sent = 0, shares_undelivered = 0, merges = 0, stale_dropped = 0, refused = 0;
  uint64_t refusal_log_lines_suppressed = 0;  // refusals counted in `refused` but not logged
  protocol::RefusalLog refusal_log;            // used by handle_frame only
  uint64_t catch_ups = 0;
  uint64_t updates_requested = 0, updates_resent = 0;  // replicas
  uint64_t updates_resumed = 0, chunks_not_resent = 0;  // replicas: resends of missing chunks only
  uint64_t updates_resent_or_refused = 0;              // replicas: requests served (peer thread only)
  double last_consensus = -1.0, last_test_accuracy = -1.0, last_local_accuracy = -1.0;
  int alive = 0, suspect = 0, dead = 0;
  std::vector<double> round_distances;

  Status open(GossipConfig c, GossipEventSink sink, protocol::RuntimeEnvironment environment);
  Status restore();
  Status restore_membership(uint64_t incarnation);
  Status commit(const nlohmann::json& metrics, bool new_round = false);
  void privatize(std::vector<std::vector<float>>& trained);
  std::optional<privacy::ConstantRateAccounting> dp;  // dp.noise_multiplier > 0
  double now() const { return clock().seconds_since(started); }
  bool is_member(std::string_view name) const { return addresses.contains(std::string(name)); }
  PeerLink* link(const std::string& name);
  bool send_to(const std::string& name, const protocol::SharedMessage& message);
  bool send_to(const std::string& name, protocol::OutgoingMessage message);
  void pump(double seconds);
  void handle_frame(const protocol::Incoming& incoming);
  bool handle_other(const protocol::Incoming& in, const protocol::ParsedMessage& message, protocol::Rejection& rejection);
  void take_completed();
  void drain_links();
  void flush_swim();
  void note_events();
  std::vector<std::string> alive_members() const;
  // Alive and suspect members (us included): a suspect is only late to
  // answer, often busy with a long step (a commit of a large model), and
  // replicas still send it their updates and wait for its own.
  std::vector<std::string> reachable_members() const;
  // The longest round so far (seconds): how long a member may be busy.
  double longest_round_seconds = 0.0;
  // The alive members other than us, as far as their versions go: those
  // catch_up_lag or more versions ahead of ours, and those not heard yet.
  struct MembersHeard {
    std::vector<std::pair<uint64_t, std::string>> ahead;  // (version, name)
    size_t others = 0, unknown = 0;
    size_t heard() const { return others - unknown; }
  };
  MembersHeard members_heard() const;
  uint64_t next_sequence() { return last_sequence = std::max(last_sequence + 1, clock().unix_micros()); }
  // `round`: the update's round (shares and slices: our version).
  Result<protocol::PreparedUpdate> prepare(const std::string& to, std::vector<protocol::EncodedTensor> tensors,
                                           const gossip::GossipUpdateMeta& meta, std::optional<uint64_t> round = {});
  void serve_catch_up_requests();
  // Replicas: our update of `round` to `to` on its link (false: not kept, or
  // the link is full); to every alive member; the rounds we lack asked for.
  bool send_own_update(const std::string& to, uint64_t round, const UpdateRequest* resume = nullptr);
  void send_own_update_to_all(uint64_t round);
  void serve_update_requests();
  // `at_least`: the version every member is expected at (settle: ours).
  void request_missing_updates(uint64_t at_least = 0);
  // Replicas, after our update of `round`: the reachable members that
  // have reached `round` (their version says so) and whose update of it we
  // lack; `behind` gets how many others were further behind.
  std::vector<std::string> late_for(uint64_t round, size_t* behind = nullptr) const;
  // Replicas: tell every reachable member below which of its rounds we hold
  // all its updates (ReplicaHolds).
  void send_holds();
  // `unacknowledged`: the members that had not said they hold all our
  // updates when settling ended (empty unless it timed out).
  Status settle(const std::atomic<bool>& stop, std::vector<std::string>& unacknowledged);
  Status catch_up_if_behind(const std::atomic<bool>& stop);
  Status merge_arrivals();
  // Copies the model we hold into the worker (to train or evaluate it).
  void load_worker();
  Result<double> train_round(double& train_loss);
  Status share();
  std::string render_metrics() const;
  std::string render_status() const;
};

Status GossipRuntime::Impl::open(GossipConfig c, GossipEventSink sink, protocol::RuntimeEnvironment environment) {
  config = std::move(c);
  emit = std::move(sink);
  env = environment;
  started = clock().now();
  FEDMESH_RETURN_IF_ERROR(config.validate());
  const SiteConfig& site = config.site;
  set_cpu_threads(site.threads);
  if (config.dp_noise_multiplier > 0.0) {
    dp.emplace();
    dp->q = 1.0;  // every round releases the node's delta
    dp->sigma = config.dp_noise_multiplier;
    dp->delta = config.dp_delta;
  }
  Result<crypto::Membership> membership =
      crypto::load_membership(site.keys, site.name, site.roster, site.admin_public, site.federation);
  if (!membership.is_ok()) return membership.status();
  keys = std::move(membership->keys);
  roster = std::move(membership->roster);
  for (const crypto::RosterEntry& entry : roster.sites) {
    if (entry.role != crypto::Role::kAggregator && !entry.address.empty()) addresses[entry.identity.name] = entry.address;
  }
  if (config.listen.empty()) {
    const auto mine = addresses.find(site.name);
    if (mine == addresses.end()) {
      return invalid_argument("the roster gives '" + site.name + "' no address to listen on; add one (fedmesh roster add "
                              "--address) or set listen");
    }
    config.listen = mine->second;
  }
  addresses[site.name] = config.listen;
  for (const std::string& seed : config.seeds) {
    if (!addresses.contains(seed)) return invalid_argument("gossip.seeds: '" + seed + "' is not a gossip member of the roster (a peer with an address)");
  }
  topology = *gossip::parse_topology(config.topology);
  staleness = *federation::StalenessFunction::parse(config.staleness, config.max_staleness);
  rng = Rng(mix_seed(site.data_seed, 0x5eed + static_cast<uint64_t>(site.index)));

  // The data first: a tokenizer (data.tokenizer) sets the model's vocabulary
  // and the federation name this peer's shares carry (gossip_federation).
  Result<SiteData> loaded = load_site_data(site, config.test_limit);
  if (!loaded.is_ok()) return loaded.status();
  data = std::move(*loaded);

  Result<std::unique_ptr<train::Sequential>> model =
      train::make_initial_model(site.model, site.seed, data.model_input(), site.init);
  if (!model.is_ok()) return model.status();
  worker = std::move(*model);
  wire_federation = gossip_federation(site.federation, data.tokenizer_fingerprint(), worker->frozen_fingerprint());
  if (wire_federation.size() > crypto::kMaxFederationIdBytes) {
    return invalid_argument("the federation name on this peer's shares, " + wire_federation + ", is " +
                            std::to_string(wire_federation.size()) + " bytes, over the " +
                            std::to_string(crypto::kMaxFederationIdBytes) +
                            " a Hello carries: give the federation a shorter name (the tokenizer and LoRA suffixes "
                            "take up to 53 bytes)");
  }
  std::vector<std::vector<float>> reference;
  for (Parameter* p : worker->parameters()) {
    manifest.push_back({p->name, std::vector<int64_t>(p->value.shape().begin(), p->value.shape().end())});
    const float* values = p->value.data<float>();
    reference.emplace_back(values, values + p->value.numel());
  }
  Result<protocol::CompressionPlan> plan = protocol::make_compression_plan(site.compress, site.compress_overrides, site.dense_below);
  if (!plan.is_ok()) return plan.status();
  Result<kernels::CompressionKernels*> backend = kernels::compression_kernels_named(site.compress_device);
  if (!backend.is_ok()) return backend.status();
  const gossip::MergeRule rule = *gossip::parse_merge_rule(config.merge);
  const uint64_t compression_seed = mix_seed(site.data_seed, 0xc0de + static_cast<uint64_t>(site.index));
  if (rule == gossip::MergeRule::kReplicas) {
    // Every update is weighed 1 / (the roster's gossip members): the same at every peer.
    Result<gossip::ReplicaState> made = gossip::ReplicaState::create(
        *plan, manifest, std::move(reference), static_cast<int>(addresses.size()), 1.0, compression_seed, **backend,
        config.chunk_bytes);
    if (!made.is_ok()) return made.status();
    replicas.emplace(std::move(*made), site.name, clock());
    // The worker's parameters are views of the held model z: one copy of
    // the model, not two (train_round writes z back after training).
    std::vector<std::vector<float>>& held = replicas->state().model_storage();
    std::vector<Parameter*> parameters = worker->parameters();
    for (size_t t = 0; t < parameters.size(); ++t) {
      Parameter& p = *parameters[t];
      p.value = Tensor::view_of(held[t].data(), p.value.shape(), DType::kF32);
      p.set_compute_dtype(p.compute.dtype());
    }
  } else {
    Result<gossip::GossipState> made =
        gossip::GossipState::create(rule, *plan, manifest, std::move(reference), compression_seed, **backend,
                                    config.chunk_bytes);
    if (!made.is_ok()) return made.status();
    state.emplace(std::move(*made));
  }
  uint64_t dense_bytes = 0;
  for (const protocol::TensorShape& t : manifest) dense_bytes += 4 * t.element_count();
  // Push-sum and pairwise send whole model states, never resumed: a share
  // of more than 64 chunks would rarely arrive whole on a lossy link.
  // Replicas send updates (sparse by default), each asked for again when
  // it does not arrive: no cap.
  if (!replicas && dense_bytes > config.chunk_bytes * 64) {
    return invalid_argument("the model (" + std::to_string(dense_bytes) + " bytes) is too large for push-sum and "
                            "pairwise shares (at most 64 chunks of gossip.chunk_bytes, " +
                            std::to_string(config.chunk_bytes * 64) + "): use gossip.merge = \"replicas\", whose updates have no such cap");
  }

  store::StoreOptions store_options;
  store_options.vfs = env.store_vfs;
  store_options.background_maintenance = env.store_background_maintenance;
  store_options.keep_last = site.keep_last;
  Result<store::CheckpointStore> opened = store::CheckpointStore::open(site.store, store_options);
  if (!opened.is_ok()) return opened.status();
  store.emplace(std::move(*opened));
  FEDMESH_RETURN_IF_ERROR(restore());
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

  Result<protocol::FaultPlan> faults = protocol::parse_fault_plan(site.faults);
  if (!faults.is_ok()) return faults.status();
  transport.faults = *faults;
  transport.high_water_mark = 16;
  protocol::Allowlist allowlist;
  for (const crypto::RosterEntry& entry : roster.sites) {
    if (addresses.contains(entry.identity.name) && entry.identity.name != site.name) {
      allowlist[entry.identity.box_public] = entry.identity.name;
    }
  }
  protocol::TransportOptions server_options = transport;
  server_options.faults = {};  // faults act on what we send: each link once
  Result<std::unique_ptr<protocol::ServerChannel>> bound =
      env.network->bind(config.listen, protocol::CurveKeys::from(keys), std::move(allowlist), server_options);
  if (!bound.is_ok()) return bound.status();
  server = std::move(*bound);
  protocol::ReceiverPolicy policy;
  policy.federation = wire_federation;
  policy.self = site.name;
  policy.manifest = manifest;
  policy.decode_runner = parallel_each;
  policy.peer_updates = true;
  // Any sender version; staleness is ours to weigh, not a refusal.
  policy.current_round = std::numeric_limits<uint64_t>::max() / 2;
  policy.max_round_lag = std::numeric_limits<uint64_t>::max() / 2;
  policy.current_version = std::numeric_limits<uint64_t>::max() / 2;
  // A share is never resumed: one missing a chunk (a lost message) is
  // dropped soon. A replica update is: its missing chunks are asked for
  // every 0.5 s while a peer waits for the round (request_missing_updates).
  policy.transfer_idle_timeout = std::chrono::milliseconds(replicas ? 5000 : 1500);
  // Each transfer in flight stages the whole model in fp32: for a model of
  // gigabytes, one at a time (the others answered BUSY; a replica update
  // missing is asked for again every 0.5 s). Small models are not bound.
  policy.staging_budget_bytes = std::max<uint64_t>(uint64_t{256} << 20, protocol::staged_bytes(manifest));
  policy.clock = [clock = env.clock] { return clock->now(); };
  policy.unix_micros = [clock = env.clock] { return clock->unix_micros(); };
  service = std::make_unique<protocol::UpdateService>(policy, roster, *replay, protocol::RateLimits{}, server->counters());
  service->set_other_handler([this](const protocol::Incoming& in, const protocol::ParsedMessage& message,
                                    std::optional<protocol::OutgoingMessage>&, protocol::Rejection& rejection) {
    return handle_other(in, message, rejection);
  });

  swim.emplace(site.name, config.listen, config.swim, mix_seed(site.data_seed, 0x5717 + static_cast<uint64_t>(site.index)));
  if (known_membership) {
    // Only members still on the roster, at the roster's addresses.
    std::vector<gossip::MemberUpdate> known;
    for (gossip::MemberUpdate m : known_membership->members) {
      const auto it = addresses.find(m.name);
      if (it == addresses.end()) continue;
      m.address = it->second;
      known.push_back(std::move(m));
    }
    swim->resume(known_membership->incarnation, known, now());
  }
  std::vector<std::pair<std::string, std::string>> seeds;
  for (const auto& [name, address] : addresses) {
    const bool wanted = config.seeds.empty() || std::find(config.seeds.begin(), config.seeds.end(), name) != config.seeds.end();
    if (name != site.name && wanted) seeds.emplace_back(name, address);
  }
  swim->join(seeds, now());

  Result<std::unique_ptr<HttpEndpoint>> endpoint =
      serve_metrics_and_status(site.metrics, [this] { return render_metrics(); }, [this] { return render_status(); });
  if (!endpoint.is_ok()) return endpoint.status();
  http = std::move(*endpoint);
  if (http) metrics_address = http->address();
  emit({{"event", "peer"}, {"site", site.name}, {"listen", server->endpoint()}, {"members", addresses.size()},
        {"seeds", seeds.size()}, {"shard_images", data.shard->size()}, {"holdout_images", data.holdout->size()},
        {"test_images", data.test->size()}, {"store", site.store}, {"metrics", metrics_address}, {"version", version},
        {"merge", config.merge}, {"topology", config.topology}, {"compress", site.compress}});
  return Status::ok();
}

Status GossipRuntime::Impl::restore() {
  Result<std::vector<store::RoundInfo>> rounds = store->rounds();
  if (!rounds.is_ok()) return rounds.status();
  if (rounds->empty()) return Status::ok();
  // A damaged newest round is moved into quarantine: the peer goes on from
  // the round before (or from the start when none is intact) and catches up.
  Result<store::LoadedCheckpoint> latest = store->resume_latest([this](const store::QuarantineNotice& n) {
    emit({{"event", "warning"}, {"message", n.message}, {"quarantined_round", n.round.value_or(-1)}, {"reason", n.reason}});
  });
  if (latest.status().code() == StatusCode::kNotFound) return Status::ok();
  if (!latest.is_ok()) return latest.status();
  try {
    const nlohmann::json saved = nlohmann::json::parse(latest->round.state_json);
    if (saved.value("merge", config.merge) != config.merge) {
      return invalid_argument(config.site.store + " was written with merge " + saved.value("merge", std::string()) +
                              ", this config says " + config.merge);
    }
    // The model was trained on text read with one tokenizer (none: bytes);
    // resuming it with another would mix two vocabularies in one model.
    const std::string tokenizer = data.tokenizer_fingerprint();
    if (saved.value("tokenizer", std::string()) != tokenizer) {
      const auto name = [](const std::string& fingerprint) {
        return fingerprint.empty() ? std::string("bytes (no tokenizer)") : "tokenizer " + fingerprint;
      };
      return invalid_argument(config.site.store + " holds a model trained on " +
                              name(saved.value("tokenizer", std::string())) + ", this config reads " +
                              name(tokenizer) + "; use the same data.tokenizer, or a new store");
    }
    protocol::UpdateCompressor& compressor = replicas ? replicas->state().compressor() : state->compressor();
    if (replicas) {
      std::vector<std::string> warnings;
      if (Status s = replicas->restore(*latest, saved, *store, warnings); !s.is_ok()) {
        return corrupt(config.site.store + ": " + s.message());
      }
      for (const std::string& warning : warnings) emit({{"event", "warning"}, {"message", warning}});
    }
    const double weight = saved.value("weight", 1.0);
    if (!std::isfinite(weight) || !(weight > 0.0)) return corrupt(config.site.store + ": the stored push-sum weight is not positive");
    for (size_t t = 0; t < manifest.size() && state; ++t) {
      const store::StoredTensor* stored = latest->find("model", manifest[t].name);
      if (stored == nullptr || stored->value.dtype() != DType::kF32 ||
          static_cast<uint64_t>(stored->value.numel()) != manifest[t].element_count()) {
        return corrupt(config.site.store + ": no model tensor " + manifest[t].name + " of the model's shape");
      }
      std::memcpy(state->values()[t].data(), stored->value.raw(), state->values()[t].size() * sizeof(float));
    }
    if (state) state->set_weight(weight);
    set_version(saved.at("version").get<uint64_t>());
    FEDMESH_RETURN_IF_ERROR(restore_membership(saved.value("incarnation", uint64_t{0})));
    last_sequence = saved.at("last_sequence").get<uint64_t>();
    commits = latest->round.round;
    if (Status s = federation::restore_compression_tensors(compressor, "", *latest); !s.is_ok()) {
      emit({{"event", "warning"}, {"message", "starting with an empty compression residual: " + s.message()}});
    } else {
      compressor.set_rounds(saved.value("compressor_rounds", int64_t{0}));
    }
  } catch (const nlohmann::json::exception& error) {
    return corrupt(config.site.store + ": the gossip state is malformed: " + error.what());
  }
  emit({{"event", "resume"}, {"store", config.site.store}, {"version", version}, {"committed", latest->round.wall_time},
        {"members_known", known_membership ? known_membership->members.size() : 0},
        {"incarnation", known_membership ? known_membership->incarnation + 1 : 0}});
  return Status::ok();
}

// The membership the last commit saw: members with a state name the store
// does not know are skipped (and said so), not trusted.
Status GossipRuntime::Impl::restore_membership(uint64_t incarnation) {
  Result<std::vector<store::PeerRecord>> peers = store->peers();
  if (!peers.is_ok()) return peers.status();
  KnownMembership known;
  known.incarnation = incarnation;
  for (const store::PeerRecord& p : *peers) {
    std::optional<gossip::MemberState> state;
    for (const gossip::MemberState s : {gossip::MemberState::kAlive, gossip::MemberState::kSuspect,
                                        gossip::MemberState::kDead, gossip::MemberState::kLeft}) {
      if (p.status == gossip::member_state_name(s)) state = s;
    }
    if (!state || p.incarnation < 0) {
      emit({{"event", "warning"}, {"message", "the store's membership has member " + p.site + " in state '" + p.status +
                                                  "', incarnation " + std::to_string(p.incarnation) + ": left out"}});
      continue;
    }
    known.members.push_back({p.site, p.address, static_cast<uint64_t>(p.incarnation), *state, ""});
  }
  known_membership = std::move(known);
  return Status::ok();
}

Status GossipRuntime::Impl::commit(const nlohmann::json& metrics, bool new_round) {
  store::RoundToCommit round;
  round.round = ++commits;
  if (dp && new_round) {
    round.privacy = privacy::ledger_entry(*dp, "gossip-local", round.round, static_cast<int64_t>(version));
  }
  round.model_version = static_cast<int64_t>(version);
  round.metrics_json = metrics.dump();
  protocol::UpdateCompressor& compressor = replicas ? replicas->state().compressor() : state->compressor();
  nlohmann::json saved = {{"version", version}, {"weight", state ? state->weight() : 1.0}, {"merge", config.merge},
                          {"last_sequence", last_sequence},
                          {"compressor_rounds", compressor.rounds()},
                          {"incarnation", swim ? swim->incarnation() : uint64_t{0}},
                          {"tokenizer", data.tokenizer_fingerprint()}};
  std::deque<Tensor> views;
  for (size_t t = 0; t < manifest.size(); ++t) {
    auto& values = const_cast<std::vector<float>&>(model()[t]);
    views.push_back(Tensor::view_of(values.data(), Shape(manifest[t].dims), DType::kF32));
    round.tensors.push_back({"model", manifest[t].name, &views.back()});
  }
  federation::add_compression_tensors(compressor, "", views, round.tensors);
  if (replicas) replicas->save(views, round.tensors, saved, round.applied_updates);
  round.state_json = saved.dump();
  // The membership as this peer sees it (`fedmesh checkpoint show` lists it).
  if (swim) {
    std::vector<store::PeerRecord> peers;
    for (const auto& [name, member] : swim->members()) {
      peers.push_back({name, member.address, gossip::member_state_name(member.state),
                       static_cast<int64_t>(member.incarnation), round.round});
    }
    round.peers = std::move(peers);
  }
  FEDMESH_RETURN_IF_ERROR(store->commit_round(round));
  if (replicas) replicas->committed();
  return Status::ok();
}

PeerLink* GossipRuntime::Impl::link(const std::string& name) {
  if (const auto found = links.find(name); found != links.end()) return found->second.get();
  const crypto::RosterEntry* entry = roster.find(name);
  const auto address = addresses.find(name);
  if (entry == nullptr || address == addresses.end()) return nullptr;
  // The link's thread dials with copies of what it needs.
  PeerLink::Dial dial = [network = env.network, endpoint = address->second, curve = protocol::CurveKeys::from(keys),
                         server = entry->identity.box_public, options = transport] {
    return network->connect(endpoint, curve, server, options);
  };
  return (links[name] = std::make_unique<PeerLink>(name, std::move(dial), kSendTimeout, clock(), *env.threads)).get();
}

// Queued on the member's link: false when the member has no address or its
// link is full (the message is then lost, as on a congested link).
bool GossipRuntime::Impl::send_to(const std::string& name, const protocol::SharedMessage& message) {
  PeerLink* to = link(name);
  return to != nullptr && to->send(message);
}

bool GossipRuntime::Impl::send_to(const std::string& name, protocol::OutgoingMessage message) {
  return send_to(name, protocol::SharedMessage(std::move(message)));
}

void GossipRuntime::Impl::flush_swim() {
  for (const gossip::SwimMessage& message : swim->take_outbox()) {
    (void)send_to(message.to, gossip::swim_to_wire(message, version));
  }
}

void GossipRuntime::Impl::note_events() {
  for (const gossip::MembershipEvent& e : swim->take_events()) {
    emit({{"event", "member"}, {"member", e.member}, {"state", gossip::member_state_name(e.state)},
          {"incarnation", e.incarnation}, {"at", e.at}});
  }
  std::lock_guard lock(metrics_mutex);
  alive = swim->count(gossip::MemberState::kAlive);
  suspect = swim->count(gossip::MemberState::kSuspect);
  dead = swim->count(gossip::MemberState::kDead) + swim->count(gossip::MemberState::kLeft);
}

bool GossipRuntime::Impl::handle_other(const protocol::Incoming& in, const protocol::ParsedMessage& message,
                                       protocol::Rejection& rejection) {
  const auto kind = message.root().which();
  if (kind == wire::Message::PING || kind == wire::Message::PING_REQ || kind == wire::Message::PING_ACK) {
    gossip::SwimMessage swim_message;
    uint64_t their_version = 0;
    if (!gossip::swim_from_wire(message, in.peer, config.site.name, [this](std::string_view n) { return is_member(n); },
                        swim_message, their_version, rejection)) {
      return false;
    }
    uint64_t& known = peer_versions[in.peer];
    known = std::max(known, their_version);
    swim->receive(swim_message, now());
    return true;
  }
  if (kind == wire::Message::CATCH_UP_REQUEST) {
    const auto request = message.root().getCatchUpRequest();
    if (request.getSlices() == 0 || request.getSlices() > 16 || request.getSlice() >= request.getSlices()) {
      rejection = {wire::RejectCode::MALFORMED, "catch-up slice " + std::to_string(request.getSlice()) + " of " +
                                                    std::to_string(request.getSlices()) + " is not a slice"};
      return false;
    }
    if (catch_up_requests.size() >= 16) {
      rejection = {wire::RejectCode::BUSY, "too many catch-up requests waiting"};
      return false;
    }
    catch_up_requests.push_back({in.peer, {request.getSlice(), request.getSlices()}});
    return true;
  }
  if (kind == wire::Message::REPLICA_HOLDS) {
    if (!replicas) {
      rejection = {wire::RejectCode::MALFORMED, "a replica acknowledgement to a peer that does not merge by replicas"};
      return false;
    }
    uint64_t& below = held_by[in.peer];
    below = std::max(below, message.root().getReplicaHolds().getBelow());
    return true;
  }
  if (kind == wire::Message::UPDATE_REQUEST) {
    if (!replicas) {
      rejection = {wire::RejectCode::MALFORMED, "an update request to a peer that does not merge by replicas"};
      return false;
    }
    if (update_requests.size() >= 256) {
      rejection = {wire::RejectCode::BUSY, "too many update requests waiting"};
      return false;
    }
    const auto request = message.root().getUpdateRequest();
    UpdateRequest entry{in.peer, request.getRound(), request.getSequence(), {}};
    const auto have = request.getHaveChunks();
    if (have.size() > protocol::kMaxChunksPerUpdate / 8) {
      rejection = {wire::RejectCode::MALFORMED, "an update request naming " + std::to_string(have.size() * 8) +
                                                    " chunks, more than an update has"};
      return false;
    }
    entry.have.resize(have.size() * 8);
    for (size_t i = 0; i < entry.have.size(); ++i) entry.have[i] = (have[i / 8] >> (i % 8)) & 1;
    update_requests.push_back(std::move(entry));
    return true;
  }
  rejection = {wire::RejectCode::MALFORMED, "a gossip node does not take this kind of message"};
  return false;
}

void GossipRuntime::Impl::handle_frame(const protocol::Incoming& incoming) {
  std::optional<protocol::OutgoingMessage> reply = service->handle(incoming);
  if (service->last_rejection()) {
    const std::string code = protocol::reject_code_name(service->last_rejection()->code);
    // At most one line per peer key and code per interval; every one counted.
    const std::string& key = incoming.peer_key.empty() ? incoming.peer : incoming.peer_key;
    const std::optional<uint64_t> suppressed = refusal_log.admit(key + " " + code, clock().now());
    {
      std::lock_guard lock(metrics_mutex);
      ++refused;
      if (!suppressed) ++refusal_log_lines_suppressed;
    }
    if (suppressed) {
      nlohmann::json event = {{"event", "refused"}, {"from", incoming.peer}, {"code", code},
                              {"reason", service->last_rejection()->reason}};
      if (*suppressed > 0) {
        event["suppressed"] = *suppressed;
        event["message"] = "suppressed " + std::to_string(*suppressed) + " similar (" + code +
                           " from this key) since its last logged refusal";
      }
      emit(event);
    }
  }
  take_completed();
  if (reply) (void)server->send(incoming.routing_id, std::move(*reply));
}

void GossipRuntime::Impl::take_completed() {
  for (protocol::ReceivedUpdate& update : service->take_completed()) {
    Arrival a;
    a.from = update.metadata.sender;
    a.sender_version = update.metadata.round;
    a.base_version = update.metadata.base_version;
    a.values = std::move(update.tensors);
    const gossip::GossipUpdateMeta meta = update.metadata.peer.value_or(gossip::GossipUpdateMeta{});
    if (const Status checked = gossip::check_update_meta(meta); !update.metadata.peer || !checked.is_ok()) {
      {
        std::lock_guard lock(metrics_mutex);
        ++refused;
      }
      emit({{"event", "refused"}, {"from", a.from}, {"code", "malformed"},
            {"reason", update.metadata.peer ? checked.message() : std::string("an update without gossip fields")}});
      continue;
    }
    a.kind = meta.kind;
    a.weight = meta.weight;
    a.slice = meta.slice;
    a.slices = meta.slices;
    uint64_t& known = peer_versions[a.from];
    // A replica update of round r comes from a member at version r + 1 or later.
    known = std::max(known, a.sender_version + (a.kind == gossip::GossipUpdateKind::kReplicaUpdate ? 1 : 0));
    // A replica update we hold already, or one waiting in arrivals (a
    // resend that crossed the first copy while we were busy), is dropped
    // now: each waiting one holds the model's size of decoded values.
    if (replicas && a.kind == gossip::GossipUpdateKind::kReplicaUpdate) {
      const bool waiting = std::any_of(arrivals.begin(), arrivals.end(), [&](const Arrival& other) {
        return other.kind == a.kind && other.from == a.from && other.sender_version == a.sender_version;
      });
      if (waiting || replicas->state().applied({a.from, a.sender_version})) continue;
    }
    arrivals.push_back(std::move(a));
  }
}

void GossipRuntime::Impl::drain_links() {
  for (auto& [name, peer] : links) {
    PeerLink::Report report = peer->take();
    for (const std::string& warning : report.warnings) emit({{"event", "warning"}, {"message", warning}});
    for (const PeerLink::ShareOutcome& outcome : report.shares) {
      const auto in_flight = shares_in_flight.find(outcome.share);
      if (in_flight == shares_in_flight.end()) continue;
      {
        std::lock_guard lock(metrics_mutex);
        if (outcome.delivered) {
          bytes_sent += outcome.bytes;
          ++shares_sent;
        } else {
          ++shares_undelivered;
        }
      }
      // Push-sum: the part that never left comes back (merged into us).
      if (!outcome.delivered && state) state->take_back(in_flight->second.share, 1);
      if (--in_flight->second.pending == 0) shares_in_flight.erase(in_flight);
    }
    for (protocol::Incoming& incoming : report.replies) {
      std::unique_ptr<protocol::ParsedMessage> parsed;
      protocol::Rejection rejection;
      if (!protocol::parse_message(incoming.bytes, protocol::kDefaultMaxMessageBytes, incoming.frame, parsed,
                                   rejection)) {
        continue;
      }
      try {
        if (parsed->root().isReject()) {
          const auto reject = parsed->root().getReject();
          emit({{"event", "warning"}, {"message", name + " refused our message: " + std::string(reject.getText().cStr())}});
          // The member holds a later sequence of ours than we know (a crash
          // lost the last we used, and our clock went back): what we sign
          // next goes above it, or the member would refuse all of it
          // (fedmesh-vopr found that).
          if (reject.getCode() == wire::RejectCode::REPLAYED) last_sequence = std::max(last_sequence, reject.getLastAccepted());
        }
      } catch (const kj::Exception&) {
      }
    }
  }
}

void GossipRuntime::Impl::pump(double seconds) {
  const auto until =
      clock().now() + std::chrono::duration_cast<fedmesh::Clock::duration>(std::chrono::duration<double>(seconds));
  do {
    swim->tick(now());
    flush_swim();
    for (int i = 0; i < 256; ++i) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock().now());
      const auto wait = i == 0 ? std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(10))
                               : std::chrono::milliseconds(0);
      Result<std::optional<protocol::Incoming>> incoming = server->receive(wait);
      if (!incoming.is_ok() || !incoming->has_value()) break;
      handle_frame(**incoming);
    }
    flush_swim();
    drain_links();
    note_events();
    serve_catch_up_requests();
    serve_update_requests();
  } while (clock().now() < until);
}

std::vector<std::string> GossipRuntime::Impl::alive_members() const {
  std::vector<std::string> names = {config.site.name};
  for (const auto& [name, member] : swim->members()) {
    if (member.state == gossip::MemberState::kAlive && addresses.contains(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> GossipRuntime::Impl::reachable_members() const {
  std::vector<std::string> names = {config.site.name};
  for (const auto& [name, member] : swim->members()) {
    const bool reachable = member.state == gossip::MemberState::kAlive || member.state == gossip::MemberState::kSuspect;
    if (reachable && addresses.contains(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

GossipRuntime::Impl::MembersHeard GossipRuntime::Impl::members_heard() const {
  MembersHeard out;
  for (const std::string& name : alive_members()) {
    if (name == config.site.name) continue;
    ++out.others;
    const auto known = peer_versions.find(name);
    if (known == peer_versions.end()) {
      ++out.unknown;
    } else if (known->second >= version + static_cast<uint64_t>(config.catch_up_lag)) {
      out.ahead.emplace_back(known->second, name);
    }
  }
  return out;
}

Result<protocol::PreparedUpdate> GossipRuntime::Impl::prepare(const std::string& to,
                                                              std::vector<protocol::EncodedTensor> tensors,
                                                              const gossip::GossipUpdateMeta& meta,
                                                              std::optional<uint64_t> round) {
  protocol::UpdateMetadata metadata;
  metadata.federation = wire_federation;
  metadata.round = round.value_or(version);
  metadata.base_version = heard_version(to);
  metadata.sender = config.site.name;
  metadata.recipient = to;
  metadata.sequence = next_sequence();
  metadata.sample_count = static_cast<uint64_t>(data.shard->size());
  metadata.peer = meta;
  return protocol::prepare_encoded_update(metadata, std::move(tensors), keys, config.chunk_bytes);
}

// Sends each waiting requester the slice it asked for: our model's values
// (relative to x0, as every share) in that range of every tensor.
void GossipRuntime::Impl::serve_catch_up_requests() {
  while (!catch_up_requests.empty()) {
    const auto [requester, slicing] = catch_up_requests.front();
    catch_up_requests.pop_front();
    Result<std::vector<protocol::EncodedTensor>> tensors =
        gossip::encode_catch_up_slice(manifest, model(), replicas ? replicas->state().reference() : state->reference(),
                                      slicing.first, slicing.second, config.chunk_bytes);
    if (!tensors.is_ok()) continue;
    Result<protocol::PreparedUpdate> prepared =
        prepare(requester, std::move(*tensors),
                {gossip::GossipUpdateKind::kCatchUpSlice, 0.0, slicing.first, slicing.second});
    if (!prepared.is_ok()) continue;
    bool sent = send_to(requester, prepared->header);
    for (const protocol::SharedMessage& chunk : prepared->chunks) sent = sent && send_to(requester, chunk);
    std::lock_guard lock(metrics_mutex);
    if (sent) bytes_sent += protocol::wire_bytes(*prepared);
  }
}

// Replicas: our update of `round` to one member, handed to its link (the
// link reports later whether it left: drain_links counts the bytes). Asked
// to resume a transfer we sent (its sequence, the chunks the member holds),
// the same header and only the missing chunks go; otherwise the whole
// update, signed anew.
bool GossipRuntime::Impl::send_own_update(const std::string& to, uint64_t round, const UpdateRequest* resume) {
  const std::vector<protocol::EncodedTensor>* tensors = replicas->own(round);
  if (tensors == nullptr) return false;
  const auto sent = updates_sent.find({to, round});
  const bool resuming = resume != nullptr && resume->sequence != 0 && sent != updates_sent.end() &&
                        sent->second.sequence == resume->sequence;
  Result<protocol::PreparedUpdate> prepared =
      resuming ? Result<protocol::PreparedUpdate>(protocol::prepare_encoded_update(sent->second, *tensors, keys,
                                                                                   config.chunk_bytes))
               : prepare(to, *tensors, {gossip::GossipUpdateKind::kReplicaUpdate, 0.0, 0, 0}, round);
  PeerLink* link_to = prepared.is_ok() ? link(to) : nullptr;
  if (link_to == nullptr) return false;
  if (!resuming) updates_sent[{to, round}] = prepared->metadata;
  std::vector<protocol::SharedMessage> messages;
  messages.push_back(prepared->header);
  uint64_t skipped = 0;
  for (size_t c = 0; c < prepared->chunks.size(); ++c) {
    if (resuming && c < resume->have.size() && resume->have[c]) {
      ++skipped;
    } else {
      messages.push_back(prepared->chunks[c]);
    }
  }
  if (resuming) {
    std::lock_guard lock(metrics_mutex);
    ++updates_resumed;
    chunks_not_resent += skipped;
  }
  const uint64_t id = next_share++;
  if (!link_to->send_share(std::move(messages), id)) {
    std::lock_guard lock(metrics_mutex);
    ++shares_undelivered;
    return false;
  }
  shares_in_flight[id] = ShareInFlight{{}, 1};
  return true;
}

void GossipRuntime::Impl::send_own_update_to_all(uint64_t round) {
  std::erase_if(updates_sent, [&](const auto& sent) { return replicas->own(sent.first.second) == nullptr; });
  for (const std::string& member : reachable_members()) {
    if (member != config.site.name) (void)send_own_update(member, round);
  }
}

// Replicas: members asked for updates of ours they lack; those we still keep
// are sent again (signed anew), the others are gone for good.
void GossipRuntime::Impl::serve_update_requests() {
  while (!update_requests.empty()) {
    const UpdateRequest request = std::move(update_requests.front());
    update_requests.pop_front();
    ++updates_resent_or_refused;
    if (send_own_update(request.requester, request.round, &request)) {
      std::lock_guard lock(metrics_mutex);
      ++updates_resent;
    }
  }
}

// Replicas: asks each reachable member for its updates we lack (within the
// window it keeps), a few rounds per member at a time.
void GossipRuntime::Impl::request_missing_updates(uint64_t at_least) {
  for (const std::string& member : reachable_members()) {
    if (member == config.site.name) continue;
    const uint64_t heard = heard_version(member);
    const std::vector<uint64_t> rounds = replicas->missing(member, std::max(heard, at_least));
    // Part of one here already: only the transfer with the lowest sequence
    // is asked to go on (its header and the chunks missing). A later one
    // completing first would leave it a replay, dropped: one at a time, each
    // completes. With none in flight, up to four are asked for whole.
    std::optional<std::pair<uint64_t, protocol::TransferProgress>> resume;
    for (const uint64_t round : rounds) {
      std::optional<protocol::TransferProgress> partial = service->receiver().in_flight(member, round);
      if (partial && (!resume || partial->sequence < resume->second.sequence)) resume.emplace(round, std::move(*partial));
    }
    const std::vector<uint64_t> asked =
        resume ? std::vector<uint64_t>{resume->first}
               : std::vector<uint64_t>(rounds.begin(), rounds.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(rounds.size(), 4)));
    for (const uint64_t round : asked) {
      capnp::MallocMessageBuilder builder;
      auto request = builder.initRoot<wire::Message>().initUpdateRequest();
      request.setRound(round);
      if (resume) {
        const std::vector<bool>& held = resume->second.received;
        request.setSequence(resume->second.sequence);
        auto have = request.initHaveChunks(static_cast<unsigned>((held.size() + 7) / 8));
        for (size_t c = 0; c < held.size(); ++c) {
          if (held[c]) have[c / 8] |= static_cast<uint8_t>(1u << (c % 8));
        }
      }
      if (send_to(member, protocol::serialize(builder))) {
        std::lock_guard lock(metrics_mutex);
        ++updates_requested;
      }
    }
  }
}

std::vector<std::string> GossipRuntime::Impl::late_for(uint64_t round, size_t* behind) const {
  std::vector<std::string> late;
  if (behind != nullptr) *behind = 0;
  for (const std::string& member : reachable_members()) {
    if (member == config.site.name) continue;
    const uint64_t heard = heard_version(member);
    if (heard < round) {
      if (behind != nullptr) ++*behind;
      continue;
    }
    if (!replicas->state().applied({member, round})) late.push_back(member);
  }
  return late;
}

void GossipRuntime::Impl::send_holds() {
  for (const std::string& member : reachable_members()) {
    if (member == config.site.name) continue;
    const uint64_t heard = heard_version(member);
    const uint64_t upto = std::max(heard, version);
    const std::vector<uint64_t> lacking = replicas->missing(member, upto);
    capnp::MallocMessageBuilder builder;
    builder.initRoot<wire::Message>().initReplicaHolds().setBelow(lacking.empty() ? upto : lacking.front());
    (void)send_to(member, protocol::serialize(builder));
  }
}

// Replicas, after the last round: go on serving the members' requests and
// asking for what we lack until every reachable (alive or suspect) member
// has done its rounds, we hold all their updates, each of them has told us
// it holds all of ours (ReplicaHolds, which we send them every half second
// as well), and for 2 s no member has asked us for one, moved on a version
// or sent us an update (or the settle time, the longest of 20 s, two waits
// for updates and two of our longest rounds, is over), so the peers end on
// one model. (A member that has just made its last round asks for what it
// lacks only then: had we counted the quiet time from before, while it
// trained, we would leave before its first request; fedmesh-vopr found
// that. A member that never learnt of our last update asks for nothing:
// the quiet time alone let us leave without it, which is why we wait for
// each member's word that it holds ours.) What we acknowledge is committed
// first, so a crash after cannot take back what a member left on.
Status GossipRuntime::Impl::settle(const std::atomic<bool>& stop, std::vector<std::string>& unacknowledged) {
  // A member busy with a long step (a large model's commit) is waited for
  // about as long as two of our longest rounds.
  const double until = now() + std::max({20.0, 2.0 * config.wait_for_updates_seconds, 2.0 * longest_round_seconds});
  size_t committed_applied = replicas->state().applied_ids().size();
  double next_request = 0.0;
  uint64_t last_served = updates_resent_or_refused;
  const auto progress = [this] {
    uint64_t sum = replicas->state().applied_ids().size();
    for (const auto& [member, member_version] : peer_versions) sum += member_version;
    return sum;
  };
  uint64_t last_progress = progress();
  double quiet_since = now();
  while (!stop.load() && now() < until) {
    pump(0.02);
    FEDMESH_RETURN_IF_ERROR(merge_arrivals());
    // Every member does the same rounds: we expect each one's updates up to
    // ours, whatever version we last heard from it (a message saying it
    // moved on may have been lost).
    bool done = true;
    unacknowledged.clear();
    for (const std::string& member : reachable_members()) {
      if (member == config.site.name) continue;
      const uint64_t heard = heard_version(member);
      if (heard < version || !replicas->missing(member, std::max(heard, version)).empty()) done = false;
      const auto holds = held_by.find(member);
      if (holds == held_by.end() || holds->second < version) {
        unacknowledged.push_back(member);
        done = false;
      }
    }
    // Done: linger while members still ask us for updates (they ask every
    // half second while they lack one), until 2 s pass with no request.
    if (done) {
      const uint64_t served = updates_resent_or_refused, moved = progress();
      if (served != last_served || moved != last_progress) {
        last_served = served;
        last_progress = moved;
        quiet_since = now();
      }
      if (now() - quiet_since >= 2.0) return Status::ok();
    }
    if (now() >= next_request) {
      request_missing_updates(version);
      if (const size_t applied = replicas->state().applied_ids().size(); applied != committed_applied) {
        FEDMESH_RETURN_IF_ERROR(commit({{"event", "settling"}, {"round", version}, {"updates_applied", applied}}));
        committed_applied = applied;
      }
      send_holds();
      next_request = now() + 0.5;
    }
  }
  return Status::ok();
}

// Catch-up (anti-entropy): when a member is catch_up_lag versions ahead of
// us, ask the members furthest ahead for one slice each, wait for the
// slices (asking another donor for a slice whose donor stays silent), and
// adopt the model they make up.
Status GossipRuntime::Impl::catch_up_if_behind(const std::atomic<bool>& stop) {
  MembersHeard heard = members_heard();
  // Behind, but heard from fewer members ahead than donors wanted (a node
  // just restarted has heard from few): listen up to four SWIM periods more
  // for the others' versions, so the catch-up draws on several donors.
  const double wait_until = now() + 4.0 * config.swim.period_seconds;
  while (!heard.ahead.empty() && heard.ahead.size() < static_cast<size_t>(config.catch_up_donors) && heard.unknown > 0 &&
         !stop.load() && now() < wait_until) {
    pump(0.05);
    heard = members_heard();
  }
  if (heard.ahead.empty()) return Status::ok();
  gossip::CatchUp catch_up(std::move(heard.ahead), static_cast<uint32_t>(config.catch_up_donors));
  const auto ask = [&](const std::vector<std::pair<uint32_t, std::string>>& requests) {
    for (const auto& [slice, donor] : requests) {
      capnp::MallocMessageBuilder builder;
      auto request = builder.initRoot<wire::Message>().initCatchUpRequest();
      request.setSlice(slice);
      request.setSlices(catch_up.slices());
      (void)send_to(donor, protocol::serialize(builder));
    }
  };
  ask(catch_up.first_requests());
  const double began = now();
  double asked_again = began;
  while (!stop.load() && !catch_up.complete() && now() - began < config.catch_up_timeout_seconds) {
    pump(0.05);
    for (auto it = arrivals.begin(); it != arrivals.end();) {
      if (it->kind == gossip::GossipUpdateKind::kCatchUpSlice && catch_up.take(it->from, it->slice, it->slices, it->values)) {
        it = arrivals.erase(it);
      } else {
        ++it;
      }
    }
    // Silent donors: after a third of the timeout, ask the next one ahead.
    if (now() - asked_again > config.catch_up_timeout_seconds / 3) {
      asked_again = now();
      ask(catch_up.requests_again());
    }
  }
  const std::vector<std::vector<float>>& mine = state->model();
  const std::vector<std::vector<float>> model = catch_up.assemble(mine, state->reference());
  double distance = 0.0;
  for (size_t t = 0; t < model.size(); ++t) {
    for (size_t i = 0; i < model[t].size(); ++i) distance += (model[t][i] - mine[t][i]) * (model[t][i] - mine[t][i]);
  }
  if (catch_up.received() > 0) {
    FEDMESH_RETURN_IF_ERROR(state->set_model(model));
    if (catch_up.complete()) set_version(std::max(version, catch_up.target_version()));
  }
  {
    std::lock_guard lock(metrics_mutex);
    ++catch_ups;
  }
  emit({{"event", "catch-up"}, {"donors", catch_up.donors_asked()}, {"slices", catch_up.slices()},
        {"received", catch_up.received()}, {"complete", catch_up.complete()}, {"version", version},
        {"moved", std::sqrt(distance)}, {"seconds", now() - began}});
  return Status::ok();
}

Status GossipRuntime::Impl::merge_arrivals() {
  while (!arrivals.empty()) {
    Arrival a = std::move(arrivals.front());
    arrivals.pop_front();
    if (replicas) {
      if (a.kind != gossip::GossipUpdateKind::kReplicaUpdate) continue;
      // Members are at most a few windows apart; an update from far ahead
      // would sit in the ids until the window reached it.
      Result<bool> taken =
          a.sender_version > version + 4 * ReplicaSync::kKeptRounds
              ? Result<bool>(invalid_argument("an update of round " + std::to_string(a.sender_version) +
                                              ", more than " + std::to_string(4 * ReplicaSync::kKeptRounds) +
                                              " rounds past ours (" + std::to_string(version) + ")"))
              : replicas->take(a.from, a.sender_version, a.values);
      std::lock_guard lock(metrics_mutex);
      if (!taken.is_ok()) {
        ++refused;
        emit({{"event", "refused"}, {"from", a.from}, {"code", "merge"}, {"reason", taken.status().message()}});
      } else if (*taken) {
        ++merges;
      }
      continue;
    }
    if (a.kind != gossip::GossipUpdateKind::kShare) continue;  // a late catch-up slice
    const int64_t tau = a.base_version > version ? 0 : static_cast<int64_t>(version - a.base_version);
    const double distance = state->distance_to(a.values);
    if (config.max_staleness >= 0 && tau > config.max_staleness) {
      // Push-sum mass dropped here is lost to the network; the weights
      // keep every node's average consistent.
      std::lock_guard lock(metrics_mutex);
      ++stale_dropped;
      continue;
    }
    if (Status s = state->merge(a.values, a.weight, staleness.weight(tau)); !s.is_ok()) {
      std::lock_guard lock(metrics_mutex);
      ++refused;
      emit({{"event", "refused"}, {"from", a.from}, {"code", "merge"}, {"reason", s.message()}});
      continue;
    }
    std::lock_guard lock(metrics_mutex);
    ++merges;
    round_distances.push_back(distance);
  }
  return Status::ok();
}

void GossipRuntime::Impl::load_worker() {
  const std::vector<std::vector<float>>& held = model();
  std::vector<Parameter*> parameters = worker->parameters();
  for (size_t t = 0; t < parameters.size(); ++t) {
    // (Replicas: the parameters are views of the held model already.)
    if (parameters[t]->value.raw() == held[t].data()) continue;
    std::memcpy(parameters[t]->value.raw(), held[t].data(), held[t].size() * sizeof(float));
  }
  worker->refresh_compute();
}

Result<double> GossipRuntime::Impl::train_round(double& train_loss) {
  load_worker();
  // Gradients live for the round's training only (between rounds the peer
  // holds a model's size less: it matters for a model of gigabytes).
  for (Parameter* p : worker->parameters()) {
    if (!p->grad.defined()) p->grad = Tensor::zeros(p->value.shape(), DType::kF32, p->value.device());
  }
  train::TrainOptions local = config.site.local;
  local.max_steps = config.local_steps;
  local.epochs = 1 + local.max_steps * local.batch_size / std::max<int64_t>(1, data.shard->size());
  local.seed = mix_seed(mix_seed(config.site.data_seed, static_cast<uint64_t>(config.site.index)), version * 1000003ull + 17);
  train::TrainSummary summary;
  {
    // The trainer (its optimizer state) and the gradients are gone before
    // the trained copy is made.
    train::Trainer trainer(*worker, local);
    train::TrainCallbacks callbacks;
    callbacks.on_step = [&](const train::StepProgress&) {
      if (config.site.step_delay_seconds > 0.0) pump(config.site.step_delay_seconds);
      else pump(0.0);
    };
    summary = trainer.fit(*data.shard, nullptr, callbacks);
  }
  train_loss = summary.final_train_loss;
  for (Parameter* p : worker->parameters()) p->grad = Tensor();
  std::vector<std::vector<float>> trained;
  for (Parameter* p : worker->parameters()) {
    trained.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
  }
  // Replicas trained in the held model's own buffers: z back in them.
  if (replicas) replicas->state().restore_model();
  if (config.dp_clip > 0.0) privatize(trained);
  if (replicas) {
    this->trained = std::move(trained);
  } else {
    FEDMESH_RETURN_IF_ERROR(state->set_model(trained));
  }
  return static_cast<double>(summary.steps);
}

void GossipRuntime::Impl::privatize(std::vector<std::vector<float>>& trained) {
  // The round's delta, clipped to dp.clip, plus N(0, (sigma clip)^2) as a
  // discrete Gaussian on a grid of at most 2^-20 clip (crypto/dp_noise.h),
  // from the CSPRNG (the noise must not be predictable). The noised delta
  // lies on the grid; the model the peer shares is its post-processing.
  const std::vector<std::vector<float>>& before = model();
  double squares = 0.0;
  for (size_t t = 0; t < trained.size(); ++t) {
    for (size_t i = 0; i < trained[t].size(); ++i) {
      const double d = static_cast<double>(trained[t][i]) - before[t][i];
      squares += d * d;
    }
  }
  const double norm = std::sqrt(squares);
  const double scale = norm > config.dp_clip ? config.dp_clip / norm : 1.0;
  const double stddev = config.dp_noise_multiplier * config.dp_clip;
  crypto::SecureNoiseSource noise;
  const double grid = stddev > 0.0 ? crypto::noise_grid(config.dp_clip, stddev) : 0.0;
  std::vector<double> delta;
  for (size_t t = 0; t < trained.size(); ++t) {
    delta.resize(trained[t].size());
    for (size_t i = 0; i < trained[t].size(); ++i) {
      delta[i] = (static_cast<double>(trained[t][i]) - before[t][i]) * scale;
    }
    if (stddev > 0.0) crypto::add_grid_gaussian_noise(delta, stddev, grid, noise);
    for (size_t i = 0; i < trained[t].size(); ++i) trained[t][i] = static_cast<float>(before[t][i] + delta[i]);
  }
}

Status GossipRuntime::Impl::share() {
  const std::vector<std::string> members = alive_members();
  const size_t self = static_cast<size_t>(std::find(members.begin(), members.end(), config.site.name) - members.begin());
  const std::vector<size_t> chosen =
      gossip::choose_peers(topology, self, members.size(), config.fanout, static_cast<int64_t>(version), rng);
  if (chosen.empty()) return Status::ok();
  Result<gossip::GossipShare> made = state->share(static_cast<int>(chosen.size()));
  if (!made.is_ok()) return made.status();
  // Handed to the peers' links; each reports later whether its copy left
  // (drain_links takes back what did not).
  const uint64_t id = next_share++;
  int queued = 0, unprepared = 0;
  for (const size_t index : chosen) {
    const std::string& peer = members[index];
    Result<protocol::PreparedUpdate> prepared = prepare(peer, made->tensors, {gossip::GossipUpdateKind::kShare, made->weight, 0, 0});
    PeerLink* to = prepared.is_ok() ? link(peer) : nullptr;
    std::vector<protocol::SharedMessage> messages;
    if (to != nullptr) {
      messages.push_back(prepared->header);
      messages.insert(messages.end(), prepared->chunks.begin(), prepared->chunks.end());
    }
    // A link still full of earlier messages gets none of this share.
    if (to == nullptr || !to->send_share(std::move(messages), id)) {
      ++unprepared;
      continue;
    }
    ++queued;
  }
  if (unprepared > 0) {
    state->take_back(*made, unprepared);
    std::lock_guard lock(metrics_mutex);
    shares_undelivered += static_cast<uint64_t>(unprepared);
  }
  if (queued > 0) shares_in_flight[id] = ShareInFlight{std::move(*made), queued};
  return Status::ok();
}

std::string GossipRuntime::Impl::render_metrics() const {
  PrometheusText out;
  std::lock_guard lock(metrics_mutex);
  out.gauge("fedmesh_gossip_version", "Gossip rounds this node has completed", static_cast<double>(version));
  out.gauge("fedmesh_gossip_members_alive", "Members this node believes alive", alive);
  out.gauge("fedmesh_gossip_members_suspect", "Members this node suspects", suspect);
  out.gauge("fedmesh_gossip_members_dead", "Members this node believes dead or gone", dead);
  if (last_consensus >= 0.0) {
    out.gauge("fedmesh_gossip_consensus_distance", "Mean L2 distance to the models heard in the last round", last_consensus);
  }
  out.counter("fedmesh_gossip_bytes_sent_total", "Bytes of shares and catch-up slices sent, as framed on the wire",
              static_cast<double>(bytes_sent));
  out.counter("fedmesh_gossip_shares_sent_total", "Shares handed to the transport", static_cast<double>(shares_sent));
  out.counter("fedmesh_gossip_shares_undelivered_total", "Shares that could not leave (taken back)", static_cast<double>(shares_undelivered));
  out.counter("fedmesh_gossip_merges_total", "Shares merged", static_cast<double>(merges));
  out.counter("fedmesh_gossip_stale_dropped_total", "Shares dropped as staler than max_staleness", static_cast<double>(stale_dropped));
  out.counter("fedmesh_gossip_refused_total", "Messages refused", static_cast<double>(refused));
  out.counter("fedmesh_refusal_log_lines_suppressed_total",
              "Refusals counted in fedmesh_gossip_refused_total but not written to the log (at most one line per peer "
              "key and reason per interval)",
              static_cast<double>(refusal_log_lines_suppressed));
  out.counter("fedmesh_gossip_catch_ups_total", "Catch-ups from donors", static_cast<double>(catch_ups));
  if (last_test_accuracy >= 0.0) out.gauge("fedmesh_gossip_test_accuracy", "Accuracy on the test images", last_test_accuracy);
  return out.text();
}

std::string GossipRuntime::Impl::render_status() const {
  std::lock_guard lock(metrics_mutex);
  return nlohmann::json({{"role", "gossip-peer"}, {"site", config.site.name}, {"federation", config.site.federation},
                         {"version", version}, {"alive", alive}, {"suspect", suspect}, {"dead", dead},
                         {"consensus_distance", last_consensus}, {"bytes_sent", bytes_sent}, {"merges", merges},
                         {"test_accuracy", last_test_accuracy}, {"local_accuracy", last_local_accuracy}})
      .dump();
}

GossipRuntime::~GossipRuntime() = default;

Result<std::unique_ptr<GossipRuntime>> GossipRuntime::start(GossipConfig config, GossipEventSink emit,
                                                            protocol::RuntimeEnvironment env) {
  std::unique_ptr<GossipRuntime> runtime(new GossipRuntime());
  runtime->impl_ = std::make_unique<Impl>();
  FEDMESH_RETURN_IF_ERROR(runtime->impl_->open(std::move(config), std::move(emit), env));
  return runtime;
}

const std::string& GossipRuntime::metrics_address() const { return impl_->metrics_address; }

Status GossipRuntime::run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  // Hear from the members (their versions) before deciding to catch up: at
  // least about two SWIM periods, and up to four periods more until as many
  // members as catch-up donors (or every alive member) have told us theirs.
  // A restarted node is pinged by few until it is known alive again, so a
  // fixed wait could leave it knowing no version and skipping its catch-up.
  {
    const double began = s.now();
    const double at_least = std::min(3.0, 2.0 * s.config.swim.period_seconds + 0.5);
    const double at_most = at_least + 4.0 * s.config.swim.period_seconds;
    while (!stop.load() && s.now() - began < at_most) {
      s.pump(0.05);
      if (s.now() - began < at_least) continue;
      const auto heard = s.members_heard();
      if (heard.heard() >= std::min(heard.others, static_cast<size_t>(s.config.catch_up_donors))) break;
    }
  }
  // Replicas: our latest updates, committed before a crash, may not have
  // reached everyone: send the newest again (those who have it drop the
  // copy); members ask for the older ones they lack.
  if (s.replicas) {
    const std::vector<uint64_t> own = s.replicas->own_rounds();
    if (!own.empty()) s.send_own_update_to_all(own.back());
  }
  train::TrainOptions evaluation = s.config.site.local;
  evaluation.max_steps = 1;
  train::Trainer evaluator(*s.worker, evaluation);
  while (!stop.load() && (s.config.rounds == 0 || s.version < static_cast<uint64_t>(s.config.rounds))) {
    if (s.dp && s.config.dp_target_epsilon > 0.0 &&
        s.dp->after(static_cast<int64_t>(s.version) + 1).epsilon > s.config.dp_target_epsilon) {
      s.emit({{"event", "privacy_budget"}, {"rounds", s.version},
              {"epsilon", s.dp->after(static_cast<int64_t>(s.version)).epsilon},
              {"next_epsilon", s.dp->after(static_cast<int64_t>(s.version) + 1).epsilon},
              {"target_epsilon", s.config.dp_target_epsilon}, {"delta", s.config.dp_delta},
              {"message", "the next round would exceed the privacy budget: this node stops"}});
      break;
    }
    const auto began = s.clock().now();
    size_t replica_round_late = 0, replica_round_behind = 0;
    double replica_round_waited = 0.0;
    // Replicas never adopt another's model (that would break the exact
    // sum): a peer that was down asks for the updates it missed instead.
    if (!s.replicas) FEDMESH_RETURN_IF_ERROR(s.catch_up_if_behind(stop));
    double train_loss = 0.0;
    Result<double> steps = s.train_round(train_loss);
    if (!steps.is_ok()) return steps.status();
    if (stop.load()) break;
    if (s.replicas) {
      // Our update of this round: made and durable before it leaves, then
      // sent to every member; then the updates of this round of the members
      // that have reached it, asked for again when late, for up to
      // wait_for_updates_seconds (so every round starts from the same sum,
      // as in FedAvg, unless a member is slow; members a round or more
      // behind are not waited for).
      // (Updates that arrived while we trained wait in `arrivals`: the
      // pseudo-gradient is against the model training started from.)
      const uint64_t round = s.version;
      FEDMESH_RETURN_IF_ERROR(s.replicas->make(round, std::move(s.trained)));
      // Durable before it leaves: the update in the store, then the round.
      FEDMESH_RETURN_IF_ERROR(s.replicas->persist(round, *s.store));
      s.set_version(s.version + 1);
      s.replicas->advance(s.version);
      FEDMESH_RETURN_IF_ERROR(s.commit({{"event", "update"}, {"round", s.version}}));
      s.send_own_update_to_all(round);
      const double wait_began = s.now();
      const double wait_until = wait_began + s.config.wait_for_updates_seconds;
      double next_request = s.now() + std::min(0.5, s.config.wait_for_updates_seconds / 4.0);
      while (!stop.load() && s.now() < wait_until && !s.late_for(round).empty()) {
        s.pump(0.02);
        FEDMESH_RETURN_IF_ERROR(s.merge_arrivals());
        if (s.now() >= next_request) {
          // This round's too, from members we have not yet heard have
          // made it: its first copy, or the word that it was made, may be
          // what was lost (a member ignores a request for a round it has
          // not made).
          s.request_missing_updates(round + 1);
          next_request = s.now() + 0.5;
        }
      }
      FEDMESH_RETURN_IF_ERROR(s.merge_arrivals());
      s.request_missing_updates();  // what is still missing comes while we train
      replica_round_late = s.late_for(round, &replica_round_behind).size();
      replica_round_waited = s.now() - wait_began;
    } else {
      // Nothing heard since the last round: wait a little for a share, so a
      // node that ran ahead mixes rather than drifts on its own shard.
      const double wait_until = s.now() + s.config.wait_for_share_seconds;
      while (s.arrivals.empty() && !stop.load() && s.now() < wait_until) s.pump(0.02);
      FEDMESH_RETURN_IF_ERROR(s.merge_arrivals());
      s.set_version(s.version + 1);
      FEDMESH_RETURN_IF_ERROR(s.share());
    }
    // The model we now hold, evaluated.
    nlohmann::json event = {{"event", "round"}, {"round", s.version}, {"steps", *steps}, {"train_loss", train_loss}};
    const bool evaluate = s.version % static_cast<uint64_t>(s.config.eval_every) == 0 ||
                          (s.config.rounds > 0 && s.version == static_cast<uint64_t>(s.config.rounds));
    double norm = 0.0;
    for (const std::vector<float>& t : s.model()) {
      for (const float v : t) norm += static_cast<double>(v) * v;
    }
    event["model_norm"] = std::sqrt(norm);
    double consensus = -1.0;
    {
      std::lock_guard lock(s.metrics_mutex);
      if (!s.round_distances.empty()) {
        double total = 0.0;
        for (double d : s.round_distances) total += d;
        consensus = total / static_cast<double>(s.round_distances.size());
        s.last_consensus = consensus;
      }
      event["heard"] = s.round_distances.size();
      s.round_distances.clear();
    }
    if (evaluate) {
      s.load_worker();
      if (s.data.test->size() > 0) event["test_accuracy"] = evaluator.evaluate(*s.data.test).accuracy;
      if (s.data.holdout->size() > 0) event["local_accuracy"] = evaluator.evaluate(*s.data.holdout).accuracy;
    }
    {
      std::lock_guard lock(s.metrics_mutex);
      if (event.contains("test_accuracy")) s.last_test_accuracy = event["test_accuracy"].get<double>();
      if (event.contains("local_accuracy")) s.last_local_accuracy = event["local_accuracy"].get<double>();
      event["consensus"] = consensus;
      event["merged"] = s.merges;
      event["stale_dropped"] = s.stale_dropped;
      event["bytes_sent"] = s.bytes_sent;
      event["undelivered"] = s.shares_undelivered;
      event["alive"] = s.alive;
      event["suspect"] = s.suspect;
      event["dead"] = s.dead;
      if (s.state) event["weight"] = s.state->weight();
      if (s.replicas) {
        event["updates_applied"] = s.replicas->state().applied_ids().size();
        // Of this round: members' updates not in when we went on (waited
        // for, but late), and members a round or more behind (not waited for).
        event["updates_late"] = replica_round_late;
        event["members_behind"] = replica_round_behind;
        event["waited_seconds"] = replica_round_waited;
        event["updates_requested"] = s.updates_requested;
        event["updates_resent"] = s.updates_resent;
        event["updates_resumed"] = s.updates_resumed;
        event["chunks_not_resent"] = s.chunks_not_resent;
      }
    }
    uint64_t dropped = 0, transport_bytes = 0;
    for (const auto& [name, peer] : s.links) {
      if (const protocol::TransportCounters* counters = peer->counters()) {
        dropped += counters->dropped_by_faults.load();
        transport_bytes += counters->bytes_sent.load();
      }
    }
    event["dropped_by_faults"] = dropped;
    // Everything this node handed to its sockets: shares, catch-up slices,
    // membership messages (bytes_sent counts shares and slices as framed).
    event["transport_bytes_sent"] = transport_bytes;
    event["seconds"] = s.clock().seconds_since(began);
    s.longest_round_seconds = std::max(s.longest_round_seconds, s.clock().seconds_since(began));
    if (s.dp) {
      event["epsilon"] = s.dp->after(static_cast<int64_t>(s.version)).epsilon;
      event["delta"] = s.dp->delta;
    }
    FEDMESH_RETURN_IF_ERROR(s.commit(event, /*new_round=*/true));
    s.emit(event);
  }
  if (s.replicas && !stop.load()) {
    std::vector<std::string> unacknowledged;
    FEDMESH_RETURN_IF_ERROR(s.settle(stop, unacknowledged));
    // The settled model (the same at every peer that got every update), evaluated.
    nlohmann::json settled = {{"event", "settled"}, {"round", s.version},
                              {"updates_applied", s.replicas->state().applied_ids().size()},
                              {"unacknowledged", unacknowledged}};
    if (s.data.test->size() > 0) {
      s.load_worker();
      const double accuracy = evaluator.evaluate(*s.data.test).accuracy;
      settled["test_accuracy"] = accuracy;
      std::lock_guard lock(s.metrics_mutex);
      s.last_test_accuracy = accuracy;
    }
    FEDMESH_RETURN_IF_ERROR(s.commit(settled));
    s.emit(settled);
  }
  // Done or stopped: say so to the members, keep the state.
  s.swim->leave(s.now());
  s.flush_swim();
  s.pump(0.2);
  // The links drain what is queued (the leave among it) side by side.
  for (auto& [name, peer] : s.links) peer->close();
  FEDMESH_RETURN_IF_ERROR(s.commit({{"event", "left"}, {"round", s.version}}));
  nlohmann::json finished = {{"event", "finished"}, {"version", s.version}, {"test_accuracy", s.last_test_accuracy},
                             {"bytes_sent", s.bytes_sent}, {"stopped", stop.load()}};
  // Our view of the membership as we leave: each member's state.
  nlohmann::json members = nlohmann::json::object();
  for (const auto& [name, member] : s.swim->members()) {
    if (name != s.config.site.name) members[name] = gossip::member_state_name(member.state);
  }
  finished["members"] = members;
  if (s.replicas) {
    // What the peers compare: the exact sum's digest and the updates in it.
    finished["replica_digest"] = crypto::to_hex(s.replicas->state().digest());
    finished["updates_applied"] = s.replicas->state().applied_ids().size();
    finished["updates_floor"] = s.replicas->state().floor();
    // Updates of members we know of that we still lack (those the members
    // keep): empty when the run settled.
    nlohmann::json missing = nlohmann::json::object();
    for (const auto& [member, member_version] : s.peer_versions) {
      const std::vector<uint64_t> rounds = s.replicas->missing(member, member_version);
      if (!rounds.empty()) missing[member] = rounds;
    }
    finished["updates_missing"] = missing;
    std::lock_guard lock(s.metrics_mutex);
    finished["updates_resent"] = s.updates_resent;
    finished["updates_resumed"] = s.updates_resumed;
    finished["chunks_not_resent"] = s.chunks_not_resent;
  }
  s.emit(finished);
  return s.store->settle();
}

}  // namespace fedmesh::node
