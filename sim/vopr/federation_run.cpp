#include "sim/vopr/federation_run.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "aggregator/server.h"
#include "aggregator/server_config.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "node/gossip_config.h"
#include "node/gossip_runtime.h"
#include "node/site_config.h"
#include "node/site_runtime.h"
#include "protocol/environment.h"
#include "protocol/wire.h"
#include "sim/vopr/crash_vfs.h"
#include "sim/vopr/seeded_randomness.h"
#include "store/checkpoint_store.h"
#include "store/sqlite.h"

namespace fedmesh::sim::vopr {
namespace fs = std::filesystem;
namespace {

constexpr const char* kListen = "tcp://127.0.0.1:7400";  // a name on the simulated network
constexpr int kTableRows = 120;                           // per site
constexpr int kFeatures = 4;

std::string site_name(int k) { return "site-" + std::to_string(k); }
// A gossip peer's address: a name on the simulated network.
std::string peer_address(int k) { return "tcp://10.0.0." + std::to_string(k + 1) + ":7500"; }
constexpr const char* kReady = "ready-2";  // the work dir holds this version's files

// Two classes, Gaussian clusters apart on every feature: a model learns it in
// a few steps, so every round changes the model.
void write_table(const fs::path& file, int rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::ofstream out(file);
  for (int f = 0; f < kFeatures; ++f) out << "x" << f << ",";
  out << "label\n";
  for (int r = 0; r < rows; ++r) {
    const bool yes = (r % 2) == 0;
    for (int f = 0; f < kFeatures; ++f) out << (yes ? 1.0 : -1.0) + noise(rng) << ",";
    out << (yes ? "yes" : "no") << "\n";
  }
}

Status write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file);
  out << text;
  return out.good() ? Status::ok() : io_error(file.string() + ": cannot write");
}

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

fs::path run_dir(const RunOptions& o) { return fs::path(o.work_dir) / "run"; }
fs::path store_of(const RunOptions& o, const std::string& name) { return run_dir(o) / name / (name + ".db"); }

// The checker's view of one run.
struct Checker {
  std::string violation;
  std::map<uint64_t, std::string> hash_of_version;  // every RoundAnnounce sent
  std::set<std::string> acked;                      // "site/sequence" of every Ack{complete} sent
  int64_t rounds_committed = 0;

  void fail(const std::string& what) {
    if (violation.empty()) violation = what;
  }

  void on_server_message(const std::string& to, std::span<const uint8_t> bytes) {
    std::unique_ptr<protocol::ParsedMessage> parsed;
    protocol::Rejection rejection;
    if (!protocol::parse_message(bytes, protocol::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) return;
    const auto root = parsed->root();
    if (root.which() == wire::Message::ROUND_ANNOUNCE) {
      const auto a = root.getRoundAnnounce();
      const auto hash = a.getModelHash();
      const std::string text(reinterpret_cast<const char*>(hash.begin()), hash.size());
      auto [it, added] = hash_of_version.emplace(a.getModelVersion(), text);
      if (!added && it->second != text) {
        fail("two different models announced for version " + std::to_string(a.getModelVersion()));
      }
    } else if (root.which() == wire::Message::ACK) {
      const auto ack = root.getAck();
      if (ack.getComplete()) acked.insert(to + "/" + std::to_string(ack.getSequence()));
    }
  }
};

// Invariant 5 for any store, and 1 and 2 for the aggregator's.
void check_store(const fs::path& path, bool aggregator, bool sync_rounds, Checker& checker, RunResult& result) {
  if (!fs::exists(path)) return;
  ++result.stores_checked;
  store::StoreOptions options;
  options.vfs = kCrashVfsName;
  options.background_maintenance = false;
  // Opened as the process opens it when it restarts (a store created but
  // never initialized is initialized then).
  Result<store::CheckpointStore> opened = store::CheckpointStore::open(path.string(), options);
  if (!opened.is_ok()) {
    checker.fail("store " + path.filename().string() + " does not open after a crash: " + opened.status().message());
    return;
  }
  if (Status s = opened->integrity_check(); !s.is_ok()) {
    checker.fail("store " + path.filename().string() + " fails its integrity check: " + s.message());
    return;
  }
  Result<std::vector<store::RoundInfo>> rounds = opened->rounds();
  if (!rounds.is_ok()) {
    checker.fail("store " + path.filename().string() + ": rounds unreadable: " + rounds.status().message());
    return;
  }
  if (!rounds->empty()) {
    if (Status s = opened->verify_round(rounds->back().round); !s.is_ok()) {
      checker.fail("store " + path.filename().string() + ": newest round " + std::to_string(rounds->back().round) +
                   " does not verify: " + s.message());
      return;
    }
    if (aggregator) checker.rounds_committed = std::max(checker.rounds_committed, rounds->back().round);
  }
  if (!aggregator) return;
  Result<std::vector<store::PendingUpdate>> pending = opened->pending_updates();
  if (!pending.is_ok()) {
    checker.fail("aggregator store: pending updates unreadable: " + pending.status().message());
    return;
  }
  std::set<std::string> pending_ids;
  for (const store::PendingUpdate& p : *pending) pending_ids.emplace(p.update_id.begin(), p.update_id.end());
  for (const std::string& id : checker.acked) {
    ++result.acks_checked;
    if (pending_ids.count(id) != 0) continue;
    Result<std::optional<int64_t>> applied =
        opened->applied_round(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(id.data()), id.size()));
    if (!applied.is_ok() || !applied->has_value()) {
      checker.fail("update " + id + " was acknowledged as complete but the aggregator's store holds it nowhere");
      return;
    }
  }
  if (!sync_rounds) return;
  Result<store::Database> raw = store::Database::open(path.string(), store::Database::Mode::kReadOnly, kCrashVfsName);
  if (!raw.is_ok()) return;
  Result<store::Statement> twice =
      raw->prepare("SELECT round, sender, count(*) FROM applied_updates GROUP BY round, sender HAVING count(*) > 1");
  if (twice.is_ok()) {
    Result<bool> row = twice->step();
    if (row.is_ok() && *row) {
      checker.fail("site " + twice->column_text(1) + " has " + std::to_string(twice->column_int(2)) +
                   " updates applied in round " + std::to_string(twice->column_int(0)));
    }
  }
}

// Gossip (replicas), once every peer has exited: each finished its rounds,
// knowing every other peer as alive or left (membership agrees: none
// suspected, dead or unknown after a fault-free end), lacks no update a
// member still keeps, and holds the same exact sum (its digest) over as
// many updates as every other peer: an update applied twice, or lost for
// good, at one peer would show here.
void check_replicas(const RunOptions& o, const std::map<int, nlohmann::json>& finished, Checker& checker) {
  std::string digest;
  uint64_t applied = 0;
  int64_t least_version = -1;
  for (int k = 0; k < o.sites; ++k) {
    const auto it = finished.find(k);
    if (it == finished.end()) {
      checker.fail("liveness: " + site_name(k) + " never finished");
      return;
    }
    const nlohmann::json& f = it->second;
    const int64_t version = f.value("version", int64_t{0});
    least_version = least_version < 0 ? version : std::min(least_version, version);
    if (version < o.rounds) {
      checker.fail(site_name(k) + " finished at version " + std::to_string(version) + " of " + std::to_string(o.rounds));
      return;
    }
    const nlohmann::json members = f.value("members", nlohmann::json::object());
    for (int m = 0; m < o.sites; ++m) {
      if (m == k) continue;
      const std::string state = members.value(site_name(m), std::string("unknown"));
      if (state != "alive" && state != "left") {
        checker.fail("membership: " + site_name(k) + " finished holding " + site_name(m) + " " + state);
        return;
      }
    }
    const nlohmann::json missing = f.value("updates_missing", nlohmann::json::object());
    if (!missing.empty()) {
      checker.fail(site_name(k) + " finished lacking updates: " + missing.dump());
      return;
    }
    const std::string d = f.value("replica_digest", std::string());
    const uint64_t n = f.value("updates_applied", uint64_t{0});
    if (k == 0) {
      digest = d;
      applied = n;
    } else if (d != digest || n != applied) {
      checker.fail("replicas differ: " + site_name(0) + " holds " + digest.substr(0, 16) + " over " +
                   std::to_string(applied) + " updates, " + site_name(k) + " " + d.substr(0, 16) + " over " +
                   std::to_string(n));
      return;
    }
  }
  checker.rounds_committed = least_version;
}

}  // namespace

Status prepare_federation(const RunOptions& o) {
  const fs::path dir(o.work_dir);
  if (fs::exists(dir / kReady)) return Status::ok();
  std::error_code error;
  fs::remove_all(dir, error);
  fs::create_directories(dir / "keys");
  Result<crypto::SiteKeys> admin = crypto::generate_site_keys("admin");
  if (!admin.is_ok()) return admin.status();
  crypto::Roster roster;
  roster.federation = "vopr";
  roster.admin_public = admin->identity.sign_public;
  std::vector<std::string> names = {"aggregator"};
  for (int k = 0; k < o.sites; ++k) names.push_back(site_name(k));
  for (const std::string& name : names) {
    Result<crypto::SiteKeys> keys = crypto::generate_site_keys(name);
    if (!keys.is_ok()) return keys.status();
    FEDMESH_RETURN_IF_ERROR(crypto::write_site_keys(*keys, dir / "keys"));
    roster.sites.push_back({keys->identity, name == "aggregator" ? crypto::Role::kAggregator : crypto::Role::kSite, ""});
  }
  FEDMESH_RETURN_IF_ERROR(crypto::sign_roster(roster, *admin));
  FEDMESH_RETURN_IF_ERROR(crypto::write_roster(roster, dir / "roster.toml"));
  // Gossip: the same sites as peers with addresses, and no aggregator.
  crypto::Roster peers = roster;
  peers.sites.clear();
  for (int k = 0; k < o.sites; ++k) {
    crypto::RosterEntry entry = roster.sites[static_cast<size_t>(k) + 1];
    entry.role = crypto::Role::kPeer;
    entry.address = peer_address(k);
    peers.sites.push_back(std::move(entry));
  }
  FEDMESH_RETURN_IF_ERROR(crypto::sign_roster(peers, *admin));
  FEDMESH_RETURN_IF_ERROR(crypto::write_roster(peers, dir / "roster-gossip.toml"));
  const std::string admin_hex = crypto::to_hex(admin->identity.sign_public);

  // A small model: the simulator tests the protocol and the stores, and a
  // model of a few hundred parameters keeps hashing and I/O from taking the
  // time (an update is one chunk at any size below 4 MiB).
  FEDMESH_RETURN_IF_ERROR(write_text(dir / "model.toml", "name = \"vopr\"\nlayers = [\n  { type = \"linear\", out = 32 },\n"
                                                          "  { type = \"relu\" },\n  { type = \"linear\" },\n]\n"));
  write_table(dir / "test.csv", 200, 1000);
  for (int k = 0; k < o.sites; ++k) write_table(dir / (site_name(k) + ".csv"), kTableRows, 2000 + k);
  const std::string shared = "federation = \"vopr\"\nadmin_public = \"" + admin_hex + "\"\nmodel = " +
                             quoted(dir / "model.toml") + "\nseed = 1\n" +
                             "data.label = \"label\"\ndata.classes = [\"no\", \"yes\"]\n";
  const std::string common = shared + "roster = " + quoted(dir / "roster.toml") + "\n";
  const std::string aggregator_common =
      common + "name = \"aggregator\"\nlisten = \"" + kListen + "\"\nkeys = " + quoted(dir / "keys/aggregator.key") +
      "\nstore = " + quoted(store_of(o, "aggregator")) + "\nrounds = " + std::to_string(o.rounds) +
      "\nlocal_steps = " + std::to_string(o.local_steps) + "\nmin_sites = " + std::to_string(o.sites) +
      "\ndeadline_seconds = 20\nsite_timeout_seconds = 10\n" +
      // It keeps answering until faults have stopped, so that a site cut
      // off when the last round closed still learns it is over.
      "linger_seconds = " + std::to_string(o.faults_until / kSecond + 15) + "\n" +
      "validation = \"csv:" + (dir / "test.csv").string() + "\"\n";
  FEDMESH_RETURN_IF_ERROR(write_text(dir / "agg-sync.toml", aggregator_common + "rounds_mode = \"sync\"\n"));
  FEDMESH_RETURN_IF_ERROR(
      write_text(dir / "agg-async.toml", aggregator_common + "rounds_mode = \"fedbuff\"\nbuffer_size = 2\n"));
  FEDMESH_RETURN_IF_ERROR(write_text(
      dir / "agg-private.toml",
      aggregator_common + "rounds_mode = \"sync\"\nprivacy.mode = \"private\"\nsecure_aggregation.phase_seconds = 5\n"));
  for (int k = 0; k < o.sites; ++k) {
    const std::string name = site_name(k);
    const std::string own = "name = \"" + name + "\"\nkeys = " + quoted(dir / ("keys/" + name + ".key")) +
                            "\nstore = " + quoted(store_of(o, name)) + "\ndata.source = \"csv:" +
                            (dir / (name + ".csv")).string() + "\"\ntraining.threads = 1\ntraining.batch_size = 16\n";
    const std::string site = common + own + "aggregator = \"" + kListen + "\"\npoll_seconds = 0.2\n";
    FEDMESH_RETURN_IF_ERROR(write_text(dir / (name + "-sync.toml"), site));
    FEDMESH_RETURN_IF_ERROR(write_text(dir / (name + "-async.toml"), site));
    FEDMESH_RETURN_IF_ERROR(write_text(dir / (name + "-private.toml"), site + "privacy.mode = \"private\"\n"));
    // A gossip peer: replicas (the default merge), the rounds and local
    // steps of the others; it evaluates only at the end.
    const std::string peer = shared + "roster = " + quoted(dir / "roster-gossip.toml") + "\n" + own +
                             "mode = \"gossip\"\ngossip.rounds = " + std::to_string(o.rounds) +
                             "\ngossip.local_steps = " + std::to_string(o.local_steps) +
                             "\ngossip.test_limit = 50\ngossip.eval_every = 1000\n";
    FEDMESH_RETURN_IF_ERROR(write_text(dir / (name + "-gossip.toml"), peer));
  }
  return write_text(dir / kReady, "");
}

std::string run_mode(const RunOptions& o) {
  if (o.mode != "mixed") return o.mode;
  static const char* const kModes[] = {"sync", "async", "private", "gossip"};
  return kModes[o.seed % 4];
}

RunResult run_federation(const RunOptions& o) {
  RunResult result;
  const std::string mode = run_mode(o);
  const bool gossip = mode == "gossip";
  if (mode != "sync" && mode != "async" && mode != "private" && !gossip) {
    result.ok = false;
    result.violation = "unknown mode '" + mode + "' (sync, async, private, gossip or mixed)";
    return result;
  }
  if (Status s = prepare_federation(o); !s.is_ok()) {
    result.ok = false;
    result.violation = "cannot prepare the federation: " + s.message();
    return result;
  }
  const fs::path dir(o.work_dir);
  std::optional<aggregator::AggregatorConfig> agg_config;
  if (!gossip) {
    Result<aggregator::AggregatorConfig> c = aggregator::read_aggregator_config((dir / ("agg-" + mode + ".toml")).string());
    if (!c.is_ok()) {
      result.ok = false;
      result.violation = "aggregator config: " + c.status().message();
      return result;
    }
    agg_config = std::move(*c);
    // The work dir's files were written for the first run's options.
    agg_config->rounds = o.rounds;
    agg_config->local_steps = o.local_steps;
    agg_config->linger_seconds = static_cast<double>(o.faults_until / kSecond + 15);
  }
  std::vector<node::SiteConfig> site_configs;
  std::vector<node::GossipConfig> peer_configs;
  for (int k = 0; k < o.sites; ++k) {
    const std::string file = (dir / (site_name(k) + "-" + mode + ".toml")).string();
    Status read = Status::ok();
    if (gossip) {
      Result<node::GossipConfig> c = node::read_gossip_config(file);
      if (c.is_ok()) {
        c->rounds = o.rounds;
        c->local_steps = o.local_steps;
        peer_configs.push_back(std::move(*c));
      }
      read = c.status();
    } else {
      Result<node::SiteConfig> c = node::read_site_config(file);
      if (c.is_ok()) site_configs.push_back(std::move(*c));
      read = c.status();
    }
    if (!read.is_ok()) {
      result.ok = false;
      result.violation = site_name(k) + " config: " + read.message();
      return result;
    }
  }

  std::error_code error;
  fs::remove_all(run_dir(o), error);
  register_crash_vfs();
  reset_crash_vfs();
  World world(o.seed);
  seed_randomness(o.seed);
  SimClock store_clock(world);  // the running process's Unix time (its clock jumps too)
  set_time_source([&store_clock] { return static_cast<int64_t>(store_clock.unix_ms()); });
  Checker checker;
  // Slow sites: each training step of a site takes up to 0.3 virtual seconds
  // (a site with a slower GPU, or a busy one); half the sites are fast.
  for (int k = 0; k < o.sites; ++k) {
    node::SiteConfig& c = gossip ? peer_configs[static_cast<size_t>(k)].site : site_configs[static_cast<size_t>(k)];
    c.step_delay_seconds = world.chance(0.5) ? world.uniform() * 0.3 : 0.0;
  }
  bool faults_on = o.faults;
  if (faults_on) {
    world.faults.drop = o.rates.message_drop;
    world.faults.duplicate = o.rates.message_duplicate;
    world.faults.long_delay = o.rates.long_delay;
  }
  world.on_server_message = [&](const std::string& to, std::span<const uint8_t> bytes) {
    checker.on_server_message(to, bytes);
  };

  // Processes: 0 is the aggregator, k + 1 site k; in gossip mode k is peer
  // k (site-k) and there is no aggregator. A process's store folder is
  // watched under its id.
  const int aggregator_id = gossip ? -1 : 0;
  bool aggregator_finished = gossip;
  std::vector<bool> exited_cleanly(static_cast<size_t>(o.sites) + (gossip ? 0 : 1), false);
  std::map<int, nlohmann::json> peer_finished;  // gossip: each peer's last `finished` event
  // Gossip: faults stop once a peer has made its second-to-last round. A
  // peer that is down or cut off when the others finish cannot be waited
  // for (they leave), so the replicas are compared after a fault-free end.
  bool last_round_near = false;
  const auto sink_for = [&](int id) {
    return [&world, &aggregator_finished, &peer_finished, &last_round_near, &o, gossip, id](const nlohmann::json& event) {
      const std::string kind = event.value("event", "");
      if (kind == "finished" && id == 0 && !gossip) aggregator_finished = true;
      if (kind == "finished" && gossip) peer_finished[id] = event;
      if (kind == "round" && gossip && event.value("round", int64_t{0}) >= o.rounds - 1) last_round_near = true;
      if (kind == "round_closed" || kind == "round" || kind == "update" || kind == "finished" || kind == "error" ||
          kind == "restored" || kind == "resumed" || kind == "trained" || kind == "sent" || kind == "refused" ||
          kind == "resume" || kind == "catch-up" || kind == "warning" || kind == "member") {
        world.trace(world.process(id).name + " " + event.dump().substr(0, 200));
      }
    };
  };
  // A process's body: its runtime started with the simulated environment
  // (`start(env)` returns the runtime or why it did not start), then run
  // until it returns; true when it returned ok.
  const auto run_runtime = [&world](const std::string& name, int id, const auto& start) {
    SimClock clock(world);
    SimNetwork network(world, clock, id, name);
    SimThreads threads(world);
    protocol::RuntimeEnvironment env{&clock, &network, &threads, kCrashVfsName, false};
    auto runtime = start(env);
    if (!runtime.is_ok()) {
      world.trace(name + " did not start: " + runtime.status().message());
      return false;
    }
    std::atomic<bool> stop{false};
    const Status s = (*runtime)->run(stop);
    world.trace(name + " exited: " + (s.is_ok() ? std::string("ok") : s.message()));
    return s.is_ok();
  };
  if (!gossip) world.add_process("aggregator", [&, id = 0] {
    const bool ok = run_runtime("aggregator", id, [&](const protocol::RuntimeEnvironment& env) {
      return aggregator::AggregatorServer::start(*agg_config, sink_for(id), env);
    });
    exited_cleanly[0] = ok && aggregator_finished;
  });
  for (int k = 0; k < o.sites; ++k) {
    const int id = gossip ? k : k + 1;
    world.add_process(site_name(k), [&, k, id] {
      const auto index = static_cast<size_t>(k);
      exited_cleanly[static_cast<size_t>(id)] =
          gossip ? run_runtime(site_name(k), id, [&](const protocol::RuntimeEnvironment& env) {
                     return node::GossipRuntime::start(peer_configs[index], sink_for(id), env);
                   })
                 : run_runtime(site_name(k), id, [&](const protocol::RuntimeEnvironment& env) {
                     return node::SiteRuntime::start(site_configs[index], sink_for(id), {}, env);
                   });
    });
  }
  for (size_t id = 0; id < world.process_count(); ++id) {
    fs::create_directories(store_of(o, world.process(static_cast<int>(id)).name).parent_path());
    watch_folder(store_of(o, world.process(static_cast<int>(id)).name).parent_path().string(), static_cast<int>(id));
  }
  set_fault_hook([&](int owner, FileOperation op, const std::string& path) {
    if (!faults_on || world.running() != owner) return FileFault::kNone;  // the checker reads freely
    if (op == FileOperation::kDelete) return FileFault::kNone;
    const double r = world.uniform();
    const std::string what = op == FileOperation::kSync ? "sync" : op == FileOperation::kWrite ? "write" : "truncate";
    if (r < o.rates.crash_at_file_operation) {
      world.trace("crash " + world.process(owner).name + " at a " + what + " of " + fs::path(path).filename().string());
      world.kill(owner);
      return FileFault::kCrash;
    }
    if (op == FileOperation::kSync && r < o.rates.crash_at_file_operation + o.rates.fsync_failure) {
      world.trace("fsync fails for " + world.process(owner).name + " (" + fs::path(path).filename().string() + ")");
      return FileFault::kFail;
    }
    if (op == FileOperation::kWrite && r < o.rates.crash_at_file_operation + o.rates.disk_full) {
      world.trace("disk full for " + world.process(owner).name);
      return FileFault::kDiskFull;
    }
    return FileFault::kNone;
  });

  std::vector<bool> was_alive(world.process_count(), false);
  std::vector<Nanos> restart_at(world.process_count(), -1);
  std::vector<Nanos> heal_at(world.process_count(), -1);
  for (size_t id = 0; id < world.process_count(); ++id) {
    world.start(static_cast<int>(id));
    was_alive[id] = true;
  }
  const auto exponential = [&](Nanos mean) {
    return static_cast<Nanos>(-std::log(1.0 - world.uniform() * 0.999999) * static_cast<double>(mean));
  };
  Nanos next_fault = faults_on ? exponential(o.rates.mean_between_faults) : -1;

  // After a process is gone: what its disk keeps, then its store is checked.
  const auto after_exit = [&](int id) {
    Process& p = world.process(id);
    const bool crashed = p.killed;
    if (crashed) {
      ++result.crashes;
      if (world.chance(o.rates.power_cut)) {
        world.trace("power cut for " + p.name);
        power_cut(id, world.rng(), 0.5, 0.2);
      } else {
        keep_unsynced(id);
      }
    }
    set_disk_dead(id, false);
    check_store(store_of(o, p.name), id == aggregator_id, mode != "async", checker, result);
    if (!exited_cleanly[static_cast<size_t>(id)]) {
      // A supervisor restarts it (systemd's Restart=on-failure).
      restart_at[static_cast<size_t>(id)] = world.now() + kSecond / 2 + exponential(2 * kSecond);
    }
  };

  while (checker.violation.empty()) {
    // The next thing the run itself does: a restart, a heal, a fault.
    Nanos control = o.deadline;
    for (size_t id = 0; id < world.process_count(); ++id) {
      if (restart_at[id] >= 0) control = std::min(control, restart_at[id]);
      if (heal_at[id] >= 0) control = std::min(control, heal_at[id]);
    }
    if (faults_on) control = std::min({control, next_fault, o.faults_until});
    if (!world.step(control)) {
      if (control >= o.deadline) break;
      world.advance_to(control);
    }
    const Nanos now = world.now();
    if (faults_on && (now >= o.faults_until || last_round_near)) {
      faults_on = false;
      world.faults = NetworkFaults{};
      for (size_t id = 0; id < world.process_count(); ++id) {
        world.set_partitioned(world.process(static_cast<int>(id)).name, false);
        heal_at[id] = -1;
        if (restart_at[id] > now) restart_at[id] = now;  // what is down comes back now
      }
      world.trace("faults stop");
    }
    for (size_t id = 0; id < world.process_count(); ++id) {
      Process& p = world.process(static_cast<int>(id));
      if (was_alive[id] && !p.alive) {
        was_alive[id] = false;
        if (p.thread.joinable()) p.thread.join();
        after_exit(static_cast<int>(id));
      }
      if (!p.alive && restart_at[id] >= 0 && now >= restart_at[id]) {
        restart_at[id] = -1;
        ++result.restarts;
        world.start(static_cast<int>(id));
        was_alive[id] = true;
      }
      if (heal_at[id] >= 0 && now >= heal_at[id]) {
        heal_at[id] = -1;
        world.set_partitioned(p.name, false);
        world.trace("heal " + p.name);
      }
    }
    if (faults_on && now >= next_fault) {
      next_fault = now + exponential(o.rates.mean_between_faults);
      const int victim = static_cast<int>(world.rng()() % world.process_count());
      Process& p = world.process(victim);
      const double kind = world.uniform();
      if (kind < 0.15) {
        // The wall clock jumps (NTP, a VM resumed): up to a minute either way.
        const int64_t jump = static_cast<int64_t>((world.uniform() * 2.0 - 1.0) * 60e6);
        p.wall_clock_offset_micros += jump;
        world.trace("wall clock of " + p.name + " jumps " + std::to_string(jump / 1000) + " ms");
      } else if (kind < 0.7) {
        if (p.alive) {
          set_disk_dead(victim, true);
          world.kill(victim);
          was_alive[static_cast<size_t>(victim)] = false;
          after_exit(victim);
        }
      } else if (victim != aggregator_id && heal_at[static_cast<size_t>(victim)] < 0) {
        ++result.partitions;
        world.set_partitioned(p.name, true);
        heal_at[static_cast<size_t>(victim)] = now + exponential(5 * kSecond);
        world.trace("partition " + p.name);
      }
    }
    // Done when every site has exited cleanly after the last round: the
    // aggregator then only lingers for sites that have all left.
    bool all_done = aggregator_finished;
    for (size_t id = 0; id < world.process_count(); ++id) {
      // (Its thread may still be joining its helpers.)
      if (static_cast<int>(id) != aggregator_id && (!exited_cleanly[id] || world.process(static_cast<int>(id)).alive)) {
        all_done = false;
      }
    }
    if (all_done && gossip) break;
    if (all_done) {
      if (world.process(aggregator_id).alive) {
        set_disk_dead(aggregator_id, true);
        world.kill(aggregator_id);
        keep_unsynced(aggregator_id);
        set_disk_dead(aggregator_id, false);
      }
      exited_cleanly[0] = true;  // it finished; a crash while it lingered changes nothing
      break;
    }
  }
  if (checker.violation.empty()) {
    for (size_t id = 0; id < world.process_count(); ++id) {
      const Process& p = world.process(static_cast<int>(id));
      if (p.alive) checker.fail("liveness: " + p.name + " still runs at " + std::to_string(o.deadline / kSecond) +
                                " s (faults stopped at " + std::to_string(o.faults_until / kSecond) + " s)");
    }
  }
  if (checker.violation.empty()) {
    if (!gossip) check_store(store_of(o, "aggregator"), true, mode != "async", checker, result);
    for (int k = 0; k < o.sites; ++k) check_store(store_of(o, site_name(k)), false, false, checker, result);
  }
  if (checker.violation.empty() && gossip) {
    for (size_t id = 0; id < world.process_count(); ++id) {
      if (!exited_cleanly[id]) checker.fail("liveness: " + world.process(static_cast<int>(id)).name + " did not finish");
    }
    check_replicas(o, peer_finished, checker);
  } else if (checker.violation.empty()) {
    if (!aggregator_finished || checker.rounds_committed < o.rounds) {
      checker.fail("liveness: " + std::to_string(checker.rounds_committed) + " of " + std::to_string(o.rounds) +
                   " rounds committed by " + std::to_string(o.deadline / kSecond) + " s (faults stopped at " +
                   std::to_string(o.faults_until / kSecond) + " s)");
    } else {
      for (size_t id = 0; id < world.process_count(); ++id) {
        if (!exited_cleanly[id]) checker.fail("liveness: " + world.process(static_cast<int>(id)).name + " did not finish");
      }
    }
  }
  result.ok = checker.violation.empty();
  result.violation = checker.violation;
  result.at = world.now();
  result.steps = world.steps();
  result.digest = world.trace_digest();
  result.rounds_committed = checker.rounds_committed;
  result.messages = world.messages_sent();
  result.messages_dropped = world.messages_dropped();
  result.recent.assign(world.recent().begin(), world.recent().end());
  // Stop what still runs before the world goes.
  for (size_t id = 0; id < world.process_count(); ++id) {
    if (world.process(static_cast<int>(id)).alive) {
      set_disk_dead(static_cast<int>(id), true);
      world.kill(static_cast<int>(id));
    }
  }
  set_fault_hook(nullptr);
  set_time_source(nullptr);
  return result;
}

}  // namespace fedmesh::sim::vopr
