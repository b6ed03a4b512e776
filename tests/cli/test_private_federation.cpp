// Private mode with real processes: `fedmesh aggregator` and six `fedmesh
// node` processes on loopback (keys and roster from
// deploy/local_federation.sh), privacy.mode = "private", threshold 4 of 6.
// The sites are killed with SIGKILL (--secure-exit-at of the command line built for tests,
// makes a site kill itself on reaching a phase, so the kill lands exactly
// there) and restarted from their stores after the round:
//   round 1 no site killed, but the aggregator, at masked-input (the
//   restarted aggregator reopens the round, and a new session finishes it);
//   rounds 2-6 one site at advertise, share-keys,
//   masked-input, consistency, unmask; rounds 7-11 two sites at each phase;
//   round 12 three sites at masked-input (more than n - t: the session
//   aborts and a new session with new keys completes the round).
// For every round: the aggregate the aggregator reports (BLAKE2b of the sum
// in Z_2^32) equals the plain sum of exactly the survivors' fixed-point
// inputs (each site writes its own with another hidden flag), bit for bit;
// a site killed before sending its masked input is not in the sum and one
// killed after is. Afterwards, no 64-byte piece of any site's input appears
// in the aggregator's store or log (every update is a canary), the global
// model learned, and the sites exit when the federation ends.
// A scripted malicious aggregator (a test double speaking the real
// protocol over CurveZMQ to four real `fedmesh node` processes; it runs the
// real SecureRound and rewrites what it sends each site) tries every
// inconsistency: in a first session a key list with an unsigned key, a
// duplicate name, an unknown name, a list without the site; in a second,
// fewer than t survivors, the site listed as dropped, a site both alive and
// dropped, a stale session id. Every site aborts, no share leaves a site
// shown a bad key list and no unmasking share leaves a site shown a bad
// request; a third, honest session then completes the round.
// Then DP-FedAvg in private mode: the privacy ledger gets one entry per
// released round with a growing epsilon, and the target budget ends the
// federation early. Local DP in gossip mode: every peer's ledger gets one
// entry per round and the budget stops the peers. And the refusals of
// incompatible settings.
#include <gtest/gtest.h>
#include <sodium.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "federation/model_chain.h"
#include "aggregator/secure_round.h"
#include "aggregator/server.h"
#include "crypto/keys.h"
#include "train/model.h"
#include "protocol/secagg_wire.h"
#include "protocol/transport.h"
#include "store/checkpoint_store.h"
#include "support/cluster.h"
#include "support/fedmesh_run.h"
#include "support/process.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::free_ports;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

std::string binary() { return fedmesh::testing::fedmesh_binary(); }
std::string script() { return fedmesh::testing::local_federation_script(); }

class Federation {
 public:
  Federation(int sites, const std::vector<std::string>& extra, const std::string& name) {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-private-" + name + std::to_string(::getpid()));
    fs::remove_all(dir_);
    // Ports: the aggregator's (or gossip peer k's: port + k), then the metrics ports after them.
    port_ = free_ports(2 + 2 * sites);
    std::vector<std::string> argv = {"/bin/bash", script(), "--fedmesh", binary(), "--dir", dir_.string(),
                                     "--sites", std::to_string(sites), "--port", std::to_string(port_),
                                     "--metrics-port", std::to_string(port_ + sites + 1)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ChildProcess make(argv);
    make.read_all(60s);
    made_ = port_ > 0 && make.wait() == 0;
  }
  ~Federation() { fs::remove_all(dir_); }
  bool made() const { return made_; }
  const fs::path& dir() const { return dir_; }
  std::unique_ptr<ChildProcess> aggregator() const {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{binary(), "aggregator", "--config", (dir_ / "agg.toml").string(), "--json"});
  }
  std::unique_ptr<ChildProcess> site(int k, const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> argv = {binary(), "node", "--config",
                                     (dir_ / ("site-" + std::to_string(k) + ".toml")).string(), "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv);
  }

 private:
  fs::path dir_;
  int port_ = -1;
  bool made_ = false;
};

std::vector<std::string> private_settings(const std::string& phase_seconds) {
  return {"--agg", "privacy.mode = \"private\"", "--agg", "secure_aggregation.phase_seconds = " + phase_seconds,
          "--agg", "secure_aggregation.clip = 4.0", "--agg", "linger_seconds = 8", "--agg", "validation_limit = 2000",
          "--site", "privacy.mode = \"private\"", "--site", "give_up_seconds = 120", "--site", "data.train_limit = 6000"};
}

struct Kill {
  int round;
  std::string phase;
};

std::string schedule_flag(const std::deque<Kill>& kills) {
  std::string out;
  for (const Kill& k : kills) out += (out.empty() ? "" : ",") + std::to_string(k.round) + ":" + k.phase;
  return out;
}

std::vector<uint8_t> read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<uint32_t> read_words(const fs::path& file) {
  const std::vector<uint8_t> bytes = read_bytes(file);
  std::vector<uint32_t> words(bytes.size() / 4);
  std::memcpy(words.data(), bytes.data(), words.size() * 4);
  return words;
}

bool contains_bytes(const std::vector<uint8_t>& haystack, const uint8_t* needle, size_t n) {
  return haystack.size() >= n && std::search(haystack.begin(), haystack.end(), needle, needle + n) != haystack.end();
}

std::string sum_digest(const std::vector<uint32_t>& sum) {
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), reinterpret_cast<const uint8_t*>(sum.data()), sum.size() * 4,
                     nullptr, 0);
  return fedmesh::crypto::to_hex(digest);
}

bool before_masked_input_sent(const std::string& phase) {
  return phase == "advertise" || phase == "share-keys" || phase == "masked-input";
}

TEST(PrivateFederation, SecureSumIsExactWithSitesKilledAtEveryPhase) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  ASSERT_FALSE(script().empty()) << "FEDMESH_LOCAL_FEDERATION is not set";
  constexpr int kSites = 6, kRounds = 12;
  std::vector<std::string> extra = {"--rounds", std::to_string(kRounds), "--local-steps", "30", "--deadline", "120",
                                    "--agg", "site_timeout_seconds = 2.0"};
  for (const std::string& s : private_settings("2.5")) extra.push_back(s);
  Federation federation(kSites, extra, "kills");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  const fs::path dumps = federation.dir() / "dumps";
  fs::create_directories(dumps);

  // Per site, the kills in round order (never two rounds in a row, so a
  // restarted site is back for its next one).
  std::map<int, std::deque<Kill>> schedule = {
      {0, {{7, "advertise"}, {10, "consistency"}}},
      {1, {{2, "advertise"}, {7, "advertise"}, {11, "unmask"}}},
      {2, {{3, "share-keys"}, {8, "share-keys"}, {10, "consistency"}, {12, "masked-input"}}},
      {3, {{4, "masked-input"}, {8, "share-keys"}, {11, "unmask"}}},
      {4, {{5, "consistency"}, {9, "masked-input"}, {12, "masked-input"}}},
      {5, {{6, "unmask"}, {9, "masked-input"}, {12, "masked-input"}}},
  };
  size_t scheduled = 0;
  for (const auto& [k, kills] : schedule) scheduled += kills.size();

  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  const auto start_site = [&](int k) {
    std::vector<std::string> flags = {"--secure-dump", dumps.string()};
    if (!schedule[k].empty()) {
      flags.push_back("--secure-exit-at");
      flags.push_back(schedule_flag(schedule[k]));
    }
    return federation.site(k, flags);
  };
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < kSites; ++k) sites.push_back(start_site(k));

  struct Killed {
    int site;
    Kill kill;
  };
  std::vector<Killed> killed;
  std::map<int, int> restart_after_round;  // site -> restart once this round is over
  int64_t last_round = 0;
  bool finished = false, aggregator_killed = false;
  const auto until = std::chrono::steady_clock::now() + 420s;
  while (!finished && std::chrono::steady_clock::now() < until) {
    const auto watched = [&](const json& e) {
      const std::string kind = e.value("event", "");
      return kind == "round" || kind == "finished" ||
             (!aggregator_killed && kind == "secure_phase" && e["round"] == 1 && e["phase"] == "masked-input");
    };
    if (std::optional<json> seen = wait_for(*aggregator, events, watched, 1s)) {
      const std::string kind = seen->value("event", "");
      if (kind == "finished") finished = true;
      else if (kind == "round") last_round = (*seen)["round"].get<int64_t>();
      else {
        // The aggregator dies mid-session; the same command reopens the
        // round, and only a new session (new id, new keys) can finish it.
        aggregator_killed = true;
        aggregator->signal(SIGKILL);
        aggregator->wait();
        aggregator = federation.aggregator();
        ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
      }
    }
    for (int k = 0; k < kSites; ++k) {
      ChildProcess& site = *sites[static_cast<size_t>(k)];
      while (site.read_line(0ms)) {
      }
      if (restart_after_round.count(k) != 0) {
        if (last_round >= restart_after_round[k]) {
          restart_after_round.erase(k);
          sites[static_cast<size_t>(k)] = start_site(k);
        }
        continue;
      }
      const std::optional<int> code = site.poll_exit();
      if (!code) continue;
      if (finished && *code == 0) continue;
      ASSERT_EQ(*code, 128 + SIGKILL) << "site-" << k << " exited on its own before the end";
      ASSERT_FALSE(schedule[k].empty()) << "site-" << k << " was killed with no kill scheduled";
      killed.push_back({k, schedule[k].front()});
      // Back after the round, so that it cannot rejoin it; in round 12 at
      // once: the round needs it for the session that follows the abort.
      restart_after_round[k] = schedule[k].front().round == kRounds ? 0 : schedule[k].front().round;
      schedule[k].pop_front();
    }
  }
  ASSERT_TRUE(finished) << "the federation did not finish (last round " << last_round << ")";
  EXPECT_EQ(killed.size(), scheduled) << "not every scheduled kill happened";

  std::map<int64_t, json> aggregates;
  std::map<int64_t, int> sessions, aborted;
  double last_accuracy = 0.0;
  for (const json& e : events) {
    const std::string kind = e.value("event", "");
    if (kind == "secure_aggregate") aggregates[e["round"].get<int64_t>()] = e;
    if (kind == "secure_session") ++sessions[e["round"].get<int64_t>()];
    if (kind == "secure_session_aborted") ++aborted[e["round"].get<int64_t>()];
    if (kind == "round" && e.contains("test_accuracy")) last_accuracy = e["test_accuracy"].get<double>();
  }
  ASSERT_EQ(aggregates.size(), static_cast<size_t>(kRounds));
  for (const auto& [round, e] : aggregates) {
    // The sum the aggregator released is the plain sum of the survivors' inputs.
    std::vector<uint32_t> sum;
    for (const json& site : e["contributors"]) {
      const fs::path file = dumps / (site.get<std::string>() + "-round-" + std::to_string(round) + ".u32");
      const std::vector<uint32_t> words = read_words(file);
      ASSERT_EQ(words.size(), e["words"].get<size_t>()) << file;
      if (sum.empty()) sum.assign(words.size(), 0);
      for (size_t i = 0; i < words.size(); ++i) sum[i] += words[i];
    }
    EXPECT_EQ(sum_digest(sum), e["sum_blake2b"].get<std::string>()) << "round " << round << ": " << e.dump();
    if (round >= 2 && round <= 11) {
      EXPECT_EQ(sessions[round], 1) << "round " << round << " needed another session with at most 2 kills";
      EXPECT_EQ(aborted[round], 0) << "round " << round;
    }
  }
  EXPECT_TRUE(aggregator_killed);
  std::set<std::string> round1_sessions;
  std::string first_round1_session;
  bool reopened = false;
  for (const json& e : events) {
    if (e.value("event", "") == "secure_session" && e["round"] == 1) {
      if (first_round1_session.empty()) first_round1_session = e["session"].get<std::string>();
      round1_sessions.insert(e["session"].get<std::string>());
    }
    if (e.value("event", "") == "round_open" && e["round"] == 1 && e.value("reopened", false)) reopened = true;
  }
  EXPECT_TRUE(reopened) << "the restarted aggregator did not reopen round 1";
  EXPECT_GE(round1_sessions.size(), 2u) << "round 1 was not finished by a new session after the aggregator's restart";
  EXPECT_NE(aggregates[1]["session"].get<std::string>(), first_round1_session) << "a session resumed after a crash";
  EXPECT_GE(aborted[12], 1) << "three kills in round 12 did not abort its first session";
  EXPECT_GE(sessions[12], 2);
  for (const Killed& k : killed) {
    if (k.kill.round == 12) continue;  // a later session of round 12 includes it again
    const json& contributors = aggregates[k.kill.round]["contributors"];
    const bool in_sum = std::find(contributors.begin(), contributors.end(), "site-" + std::to_string(k.site)) !=
                        contributors.end();
    EXPECT_EQ(in_sum, !before_masked_input_sent(k.kill.phase))
        << "site-" << k.site << " killed at " << k.kill.phase << " in round " << k.kill.round;
  }
  EXPECT_GE(last_accuracy, 0.55) << "the global model did not learn in private mode";

  // Every site's input is a canary: no piece of one may be in the aggregator's store or log.
  std::vector<uint8_t> stored = read_bytes(federation.dir() / "aggregator.db");
  if (fs::exists(federation.dir() / "aggregator.db-wal")) {
    const std::vector<uint8_t> wal = read_bytes(federation.dir() / "aggregator.db-wal");
    stored.insert(stored.end(), wal.begin(), wal.end());
  }
  std::string log;
  for (const json& e : events) log += e.dump() + "\n";
  int pieces = 0;
  for (const auto& entry : fs::directory_iterator(dumps)) {
    const std::vector<uint8_t> input = read_bytes(entry.path());
    for (size_t at = 0; at + 64 <= input.size(); at += input.size() / 8) {
      bool all_zero = true;
      for (size_t i = 0; i < 64; ++i) all_zero = all_zero && input[at + i] == 0;
      if (all_zero) continue;
      ++pieces;
      EXPECT_FALSE(contains_bytes(stored, input.data() + at, 64)) << entry.path() << " at byte " << at;
      EXPECT_EQ(log.find(fedmesh::crypto::to_hex(std::span<const uint8_t>(input.data() + at, 64))), std::string::npos);
    }
  }
  EXPECT_GT(pieces, 100);

  for (int k = 0; k < kSites; ++k) {
    const int code = sites[static_cast<size_t>(k)]->wait();
    EXPECT_EQ(code, 0) << "site-" << k;
  }
  EXPECT_EQ(aggregator->wait(), 0);
}


// The test double: answers heartbeats with a round in private mode, runs the
// real SecureRound, and rewrites each SecAggDown it sends by `tamper`.
class MaliciousAggregator {
 public:
  using Tamper = std::function<void(const std::string& site, int session, fedmesh::protocol::SecAggDownMessage& down)>;

  explicit MaliciousAggregator(const fs::path& agg_toml) {
    fedmesh::Result<fedmesh::aggregator::AggregatorConfig> config =
        fedmesh::aggregator::read_aggregator_config(agg_toml.string());
    if (!config.is_ok()) return;
    config_ = *config;
    fedmesh::Result<fedmesh::crypto::Membership> membership = fedmesh::crypto::load_membership(
        config_.keys, config_.name, config_.roster, config_.admin_public, config_.federation);
    if (!membership.is_ok()) return;
    keys_ = std::move(membership->keys);
    roster_ = std::move(membership->roster);
    std::unique_ptr<fedmesh::train::Sequential> model = fedmesh::train::make_model(config_.model, config_.seed).value();
    std::vector<std::string> names;
    std::vector<fedmesh::Tensor> tensors;
    for (fedmesh::Parameter* p : model->parameters()) {
      names.push_back(p->name);
      tensors.push_back(p->value.clone());
      length_ += static_cast<uint64_t>(p->value.numel());
    }
    hash0_ = fedmesh::federation::model_version_hash(0, fedmesh::crypto::Hash{}, names, tensors);
    fedmesh::Result<std::unique_ptr<fedmesh::protocol::ServerSocket>> bound = fedmesh::protocol::ServerSocket::bind(
        config_.listen, fedmesh::protocol::CurveKeys::from(keys_), fedmesh::protocol::allowlist_from_roster(roster_), {});
    if (!bound.is_ok()) return;
    socket_ = std::move(*bound);
    ready_ = true;
  }
  bool ready() const { return ready_; }

  // Serves until `done` says so (checked after every message and tick) or the time is up.
  bool serve(const std::vector<std::string>& sites, const Tamper& tamper, std::chrono::seconds limit) {
    fedmesh::aggregator::SecureOptions options;
    options.phase_seconds = 4.0;
    options.clip = 4.0f;
    fedmesh::aggregator::SecureRound round(options, roster_, config_.federation, length_,
                                           [this](const json& e) { events.push_back(e); });
    round.open(1, 0, sites, std::chrono::steady_clock::now());
    std::map<std::string, int> session_index;
    const auto until = std::chrono::steady_clock::now() + limit;
    std::optional<std::chrono::steady_clock::time_point> finished_at;
    while (std::chrono::steady_clock::now() < until) {
      if (round.tick(std::chrono::steady_clock::now()) && !finished_at) finished_at = std::chrono::steady_clock::now();
      if (finished_at && std::chrono::steady_clock::now() - *finished_at > 5s) return true;
      fedmesh::Result<std::optional<fedmesh::protocol::Incoming>> in = socket_->receive(50ms);
      if (!in.is_ok() || !in->has_value()) continue;
      const fedmesh::protocol::Incoming& incoming = **in;
      std::unique_ptr<fedmesh::protocol::ParsedMessage> parsed;
      fedmesh::protocol::Rejection rejection;
      if (!fedmesh::protocol::parse_message(incoming.bytes, fedmesh::protocol::kDefaultMaxMessageBytes, incoming.frame,
                                            parsed, rejection)) {
        continue;
      }
      const auto root = parsed->root();
      if (root.isHeartbeat()) {
        capnp::MallocMessageBuilder builder;
        auto a = builder.initRoot<fedmesh::wire::Message>().initRoundAnnounce();
        a.setRound(1);
        a.setModelVersion(0);
        a.setModelHash(kj::arrayPtr(hash0_.data(), hash0_.size()));
        a.setLocalSteps(5);
        a.setSecureAggregation(true);
        a.setFinished(finished_at.has_value());
        a.setRoundOpen(!finished_at.has_value());
        a.setSelected(!finished_at.has_value());
        (void)socket_->send(incoming.routing_id, fedmesh::protocol::serialize(builder));
        continue;
      }
      if (!root.isSecAggUp()) continue;
      fedmesh::protocol::SecAggUpMessage up;
      if (!fedmesh::protocol::decode_secagg_up(root.getSecAggUp(), up, rejection)) continue;
      received.push_back({incoming.peer, up.session, static_cast<int>(up.kind)});
      std::optional<fedmesh::protocol::OutgoingMessage> reply;
      if (!round.handle(incoming.peer, up, reply, rejection) || !reply) continue;
      std::unique_ptr<fedmesh::protocol::ParsedMessage> honest;
      fedmesh::protocol::SecAggDownMessage down;
      (void)fedmesh::protocol::parse_message(reply->bytes(), fedmesh::protocol::kDefaultMaxMessageBytes, nullptr,
                                             honest, rejection);
      (void)fedmesh::protocol::decode_secagg_down(honest->root().getSecAggDown(), down, rejection);
      if (!down.session.empty() && session_index.count(down.session) == 0) {
        const int next = static_cast<int>(session_index.size()) + 1;
        session_index[down.session] = next;
      }
      tamper(incoming.peer, down.session.empty() ? 0 : session_index[down.session], down);
      (void)socket_->send(incoming.routing_id, fedmesh::protocol::encode_secagg_down(down));
    }
    return false;
  }

  struct Received {
    std::string site, session;
    int kind;
  };
  std::vector<Received> received;
  std::vector<json> events;

 private:
  fedmesh::aggregator::AggregatorConfig config_;
  fedmesh::crypto::SiteKeys keys_;
  fedmesh::crypto::Roster roster_;
  uint64_t length_ = 0;
  fedmesh::crypto::Hash hash0_{};
  std::unique_ptr<fedmesh::protocol::ServerSocket> socket_;
  bool ready_ = false;
};

TEST(PrivateFederation, EverySiteAbortsOnAMaliciousAggregatorAndRevealsNothing) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  using fedmesh::crypto::SecAggPhase;
  using Kind = fedmesh::protocol::SecAggUpMessage::Kind;
  Federation federation(4, {"--agg", "privacy.mode = \"private\"", "--site", "privacy.mode = \"private\"", "--site",
                            "data.train_limit = 2000", "--site", "give_up_seconds = 60"},
                        "malicious");
  ASSERT_TRUE(federation.made());
  MaliciousAggregator aggregator(federation.dir() / "agg.toml");
  ASSERT_TRUE(aggregator.ready()) << "the test double could not take the aggregator's place";
  std::vector<std::unique_ptr<ChildProcess>> sites;
  const std::vector<std::string> names = {"site-0", "site-1", "site-2", "site-3"};
  for (int k = 0; k < 4; ++k) sites.push_back(federation.site(k));
  std::map<std::string, std::set<std::string>> tampered;  // site -> sessions it was lied to in
  const auto tamper = [&](const std::string& site, int session, fedmesh::protocol::SecAggDownMessage& d) {
    if (session == 1 && d.phase == SecAggPhase::kShareKeys && d.member && !d.answered && d.advertisements.size() == 4) {
      if (site == "site-0") d.advertisements[1].signature[3] ^= 1;           // an unsigned key
      if (site == "site-1") d.advertisements.push_back(d.advertisements[0]);  // a duplicate name
      if (site == "site-2") d.advertisements[3].site = "mallory";             // an unknown name
      if (site == "site-3") d.advertisements.pop_back();                      // without the site itself
      tampered[site].insert(d.session);
    }
    if (session == 2 && d.phase == SecAggPhase::kConsistency && site == "site-0" && d.member && !d.answered) {
      d.alive.resize(2);  // fewer than t = 3 survivors
      tampered[site].insert(d.session);
    }
    if (session == 2 && d.phase == SecAggPhase::kUnmask && d.member && !d.answered) {
      if (site == "site-1") d.dropped.push_back("site-1");          // itself listed as dropped
      if (site == "site-2") d.dropped.push_back(d.alive.front());  // a site both alive and dropped
      if (site == "site-3") d.session = "r1-stale";                // a stale session id
      tampered[site].insert(d.session == "r1-stale" ? "stale" : d.session);
    }
  };
  EXPECT_TRUE(aggregator.serve(names, tamper, 200s)) << "the honest third session never completed the round";

  // What left each site: nothing after a lie, in the session lied in.
  std::map<std::string, int> sessions_seen;
  for (const auto& r : aggregator.received) {
    if (!r.session.empty()) sessions_seen.emplace(r.session, static_cast<int>(sessions_seen.size()) + 1);
    const int session = r.session.empty() ? 0 : sessions_seen[r.session];
    if (session == 1) {
      EXPECT_NE(r.kind, static_cast<int>(Kind::kShares)) << r.site << " sent shares after a bad key list";
    }
    if (session == 2) {
      EXPECT_NE(r.kind, static_cast<int>(Kind::kReveals)) << r.site << " revealed shares after a bad request";
      if (r.site == "site-0") {
        EXPECT_NE(r.kind, static_cast<int>(Kind::kConsistency)) << "site-0 signed a short list";
      }
    }
  }
  EXPECT_EQ(tampered.size(), 4u);
  int aborted_sessions = 0;
  for (const json& e : aggregator.events) aborted_sessions += e.value("event", "") == "secure_session_aborted" ? 1 : 0;
  EXPECT_GE(aborted_sessions, 2);

  // Each site said why it aborted, and ended normally when told the federation finished.
  const std::map<std::string, std::vector<std::string>> reasons = {
      {"site-0", {"not signed by its roster identity", "fewer than the threshold"}},
      {"site-1", {"twice", "listed as dropped"}},
      {"site-2", {"not a site of the roster", "both alive and dropped"}},
      {"site-3", {"leaves this site out", "moved to session r1-stale"}},
  };
  for (int k = 0; k < 4; ++k) {
    std::string out;
    for (const std::string& line : sites[static_cast<size_t>(k)]->read_all(60s)) out += line + "\n";
    EXPECT_EQ(sites[static_cast<size_t>(k)]->wait(), 0) << names[static_cast<size_t>(k)] << "\n" << out;
    for (const std::string& reason : reasons.at(names[static_cast<size_t>(k)])) {
      EXPECT_NE(out.find(reason), std::string::npos) << names[static_cast<size_t>(k)] << " never said: " << reason << "\n" << out;
    }
  }
}

TEST(PrivateFederation, DpFedAvgWritesTheLedgerAndStopsAtTheBudget) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  // 4 sites, σ = 1, every site every round: epsilon after round r grows with
  // r; a target between the values of round 2 and 3 ends the federation
  // after 2 released rounds of the 6 asked.
  std::vector<std::string> extra = {"--rounds", "6", "--local-steps", "10", "--deadline", "60",
                                    "--agg", "dp.noise_multiplier = 1.0",
                                    "--agg", "dp.delta = 1e-5", "--agg", "dp.target_epsilon = 8.0"};
  for (const std::string& s : private_settings("5")) extra.push_back(s);
  Federation federation(4, extra, "dp");
  ASSERT_TRUE(federation.made());
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < 4; ++k) sites.push_back(federation.site(k));
  std::optional<json> budget =
      wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "privacy_budget"; }, 240s);
  ASSERT_TRUE(budget.has_value()) << "the privacy budget never ended the federation";
  EXPECT_LE((*budget)["epsilon"].get<double>(), 8.0);
  EXPECT_GT((*budget)["next_epsilon"].get<double>(), 8.0);
  EXPECT_EQ((*budget)["rounds"].get<int>(), 2);  // epsilon 4.73, 7.08, then 9.01 (q = 1, sigma = 1, delta 1e-5)
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "finished"; }, 30s));
  for (auto& site : sites) EXPECT_EQ(site->wait(), 0);
  EXPECT_EQ(aggregator->wait(), 0);

  std::vector<double> announced;
  bool swamp_warning = false;
  for (const json& e : events) {
    if (e.value("event", "") == "round" && e.contains("epsilon")) announced.push_back(e["epsilon"].get<double>());
    swamp_warning = swamp_warning || (e.value("event", "") == "warning" && e.value("kind", "") == "dp_noise_swamps_signal");
  }
  // sigma 1 over 4 sites and 6 rounds: sigma sqrt(parameters / rounds) / sites is far above 1.
  EXPECT_TRUE(swamp_warning) << "the aggregator did not warn that the noise swamps the signal";
  fedmesh::Result<fedmesh::store::CheckpointStore> store =
      fedmesh::store::CheckpointStore::open((federation.dir() / "aggregator.db").string());
  ASSERT_TRUE(store.is_ok()) << store.status().message();
  fedmesh::Result<std::vector<fedmesh::store::PrivacyEntry>> ledger = store->privacy_ledger();
  ASSERT_TRUE(ledger.is_ok());
  ASSERT_EQ(ledger->size(), announced.size());
  ASSERT_GE(ledger->size(), 1u);
  EXPECT_EQ(static_cast<double>(ledger->size()), (*budget)["rounds"].get<double>());
  for (size_t i = 0; i < ledger->size(); ++i) {
    EXPECT_EQ((*ledger)[i].mechanism, "dp-fedavg");
    EXPECT_EQ((*ledger)[i].steps, static_cast<int64_t>(i + 1));
    EXPECT_DOUBLE_EQ((*ledger)[i].epsilon, announced[i]);  // recorded before it was announced
    if (i > 0) {
      EXPECT_GT((*ledger)[i].epsilon, (*ledger)[i - 1].epsilon);
    }
  }
  const fedmesh::testing::FedmeshOutput report =
      fedmesh::testing::run_fedmesh({"privacy", "report", (federation.dir() / "aggregator.db").string()});
  EXPECT_EQ(report.exit_code, 0) << report.text;
  EXPECT_NE(report.text.find("dp-fedavg"), std::string::npos) << report.text;
}


TEST(PrivateFederation, GossipLocalDpWritesEachPeersLedgerAndStopsAtTheBudget) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  // sigma 1, q 1, delta 1e-5: epsilon 4.73, 7.08, then 9.01; target 8 allows 2 rounds of the 6 asked.
  Federation federation(3, {"--gossip", "--rounds", "6", "--local-steps", "5", "--site", "data.train_limit = 3000",
                            "--site", "gossip.test_limit = 500", "--site", "dp.clip = 1.0", "--site",
                            "dp.noise_multiplier = 1.0", "--site", "dp.target_epsilon = 8.0"},
                        "gossip-dp");
  ASSERT_TRUE(federation.made());
  std::vector<std::unique_ptr<ChildProcess>> peers;
  for (int k = 0; k < 3; ++k) peers.push_back(federation.site(k));
  for (int k = 0; k < 3; ++k) {
    std::vector<json> events;
    std::optional<json> budget = wait_for(*peers[static_cast<size_t>(k)], events,
                                          [](const json& e) { return e.value("event", "") == "privacy_budget"; }, 180s);
    ASSERT_TRUE(budget.has_value()) << "peer " << k << " never stopped at its budget";
    EXPECT_EQ((*budget)["rounds"].get<int>(), 2);
    std::vector<double> announced;
    for (const json& e : events) {
      if (e.value("event", "") == "round") announced.push_back(e["epsilon"].get<double>());
    }
    EXPECT_EQ(peers[static_cast<size_t>(k)]->wait(), 0);
    fedmesh::Result<fedmesh::store::CheckpointStore> store =
        fedmesh::store::CheckpointStore::open((federation.dir() / ("site-" + std::to_string(k) + ".db")).string());
    ASSERT_TRUE(store.is_ok()) << store.status().message();
    fedmesh::Result<std::vector<fedmesh::store::PrivacyEntry>> ledger = store->privacy_ledger();
    ASSERT_TRUE(ledger.is_ok());
    ASSERT_EQ(ledger->size(), 2u) << "peer " << k;
    ASSERT_EQ(announced.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ((*ledger)[i].mechanism, "gossip-local");
      EXPECT_EQ((*ledger)[i].steps, static_cast<int64_t>(i + 1));
      EXPECT_DOUBLE_EQ((*ledger)[i].epsilon, announced[i]);
    }
    EXPECT_NEAR((*ledger)[1].epsilon, 7.077, 0.01);
  }
}

TEST(PrivateFederation, IncompatibleSettingsAreRefusedAtStartup) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  Federation federation(2, {"--agg", "privacy.mode = \"private\"", "--agg", "rule = \"median\"", "--site",
                            "privacy.mode = \"private\"", "--site", "compression.default = \"topk:0.01\""},
                        "refused");
  ASSERT_TRUE(federation.made());
  const fedmesh::testing::FedmeshOutput agg =
      fedmesh::testing::run_fedmesh({"aggregator", "--config", (federation.dir() / "agg.toml").string(), "--json"});
  EXPECT_EQ(agg.exit_code, 2) << agg.text;
  EXPECT_NE(agg.text.find("needs each site's update"), std::string::npos) << agg.text;
  const fedmesh::testing::FedmeshOutput site =
      fedmesh::testing::run_fedmesh({"node", "--config", (federation.dir() / "site-0.toml").string(), "--json"});
  EXPECT_EQ(site.exit_code, 2) << site.text;
  EXPECT_NE(site.text.find("compression.default at identity"), std::string::npos) << site.text;
}

}  // namespace
