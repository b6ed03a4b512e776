// Issue 30's large round: the processes that stand in for sites with a
// GPT-2-Large-sized model (bench/large_round.py --senders). A site of that
// size does not fit six times on a 23 GB machine with its training state,
// so these send updates instead of training them: the deltas lie in a file
// of fp32 values that every sender maps read-only (the model's own memory,
// in the page cache, shared), and each round's update is streamed from it
// as a sealed update whose stream holds a window of chunks. What a sender
// adds to its memory for an update is that window, not a copy of the model.
//
//   make-deltas FILE --values N [--seed S]   writes N small fp32 deltas
//   site --config site-K.toml --deltas FILE --tensor NAME:D0xD1 ...
//        a site (its keys, roster and aggregator from the config made by
//        deploy/local_federation.sh) that sends the deltas as its update of
//        every round it is selected for, until the aggregator finishes
//   raw-receive --bind EP --key-out FILE --bytes TOTAL
//   raw-send --connect EP --key FILE --deltas FILE --bytes B
//        the baseline: the same bytes through raw CurveZMQ PUSH -> PULL, from
//        as many senders at once (the receiver prints the time from the
//        first byte to the last)
//
// Every mode prints one JSON line per event on stdout; errors go to stderr
// with exit status 1.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/random.h"
#include "crypto/roster.h"
#include "node/site_config.h"
#include "protocol/sealed_update.h"
#include "protocol/transport.h"
#include "protocol/update_upload.h"
#include "protocol/wire.h"

namespace fp = fedmesh::protocol;
using Seconds = std::chrono::duration<double>;
using SteadyClock = std::chrono::steady_clock;

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "large_round_sender: %s\n", message.c_str());
  std::exit(1);
}

void say(const nlohmann::json& event) {
  std::printf("%s\n", event.dump().c_str());
  std::fflush(stdout);
}

// The value after `flag` in argv, or `fallback` (nullopt: required).
std::string flag_value(int argc, char** argv, const std::string& flag, std::optional<std::string> fallback = {}) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (argv[i] == flag) return argv[i + 1];
  }
  if (!fallback) fail("missing " + flag);
  return *fallback;
}

std::vector<std::string> flag_values(int argc, char** argv, const std::string& flag) {
  std::vector<std::string> values;
  for (int i = 2; i + 1 < argc; ++i) {
    if (argv[i] == flag) values.push_back(argv[i + 1]);
  }
  return values;
}

uint64_t parse_count(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    const unsigned long long value = std::stoull(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return value;
  } catch (const std::exception&) {
    fail(what + " must be a whole number, not '" + text + "'");
  }
}

// A read-only map of a file of fp32 values (the deltas), dropped at exit.
struct MappedValues {
  const float* values = nullptr;
  uint64_t count = 0;

  explicit MappedValues(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % sizeof(float) != 0) {
      fail(path + " is not a file of fp32 values");
    }
    void* mapped = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (mapped == MAP_FAILED) fail("cannot map " + path + ": " + std::strerror(errno));
    ::madvise(mapped, static_cast<size_t>(st.st_size), MADV_SEQUENTIAL);
    values = static_cast<const float*>(mapped);
    count = static_cast<uint64_t>(st.st_size) / sizeof(float);
  }
};

// The process's anonymous resident memory (what it holds beyond the mapped
// file's pages), sampled every 50 ms: its peak is what an update costs it.
class AnonymousPeak {
 public:
  AnonymousPeak() : thread_([this] {
      while (!stop_.load()) {
        peak_.store(std::max(peak_.load(), now_kb()));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }) {}
  ~AnonymousPeak() {
    stop_.store(true);
    thread_.join();
  }
  uint64_t peak_kb() const { return std::max(peak_.load(), now_kb()); }

  static uint64_t now_kb() {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("RssAnon:", 0) == 0) return std::stoull(line.substr(8));
    }
    return 0;
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> peak_{0};
  std::thread thread_;
};

int make_deltas(int argc, char** argv) {
  if (argc < 3) fail("make-deltas FILE --values N [--seed S]");
  const std::string path = argv[2];
  const uint64_t count = parse_count(flag_value(argc, argv, "--values"), "--values");
  fedmesh::Rng rng(parse_count(flag_value(argc, argv, "--seed", "1"), "--seed"));
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) fail("cannot write " + path + ": " + std::strerror(errno));
  std::vector<float> block(1 << 20);
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min<uint64_t>(block.size(), count - done);
    // Small deltas (uniform in +-2^-10), as one local step would make.
    for (uint64_t i = 0; i < n; ++i) block[i] = static_cast<float>(rng.uniform() - 0.5) * (1.0f / 512.0f);
    if (std::fwrite(block.data(), sizeof(float), n, out) != n) fail("writing " + path + ": " + std::strerror(errno));
    done += n;
  }
  if (std::fclose(out) != 0) fail("writing " + path + ": " + std::strerror(errno));
  say({{"event", "deltas"}, {"file", path}, {"values", count}});
  return 0;
}

// NAME:D0xD1x... as a tensor's name and shape.
fp::TensorShape parse_tensor(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) fail("--tensor wants NAME:D0xD1..., not '" + text + "'");
  fp::TensorShape shape{text.substr(0, colon), {}};
  std::string dims = text.substr(colon + 1);
  for (size_t at = 0; at <= dims.size();) {
    const size_t x = std::min(dims.find('x', at), dims.size());
    shape.dims.push_back(static_cast<int64_t>(parse_count(dims.substr(at, x - at), "a dimension of " + text)));
    at = x + 1;
  }
  return shape;
}

struct Announcement {
  uint64_t round = 0, version = 0;
  bool open = false, selected = false, finished = false, secure = false;
  uint16_t protocol_version = 0;
};

// A Heartbeat, and the RoundAnnounce that answers it (nullopt: none within 2 s).
std::optional<Announcement> poll(fp::ClientChannel& socket) {
  capnp::MallocMessageBuilder builder;
  auto heartbeat = builder.initRoot<fedmesh::wire::Message>().initHeartbeat();
  heartbeat.setSentUnixMs(static_cast<uint64_t>(fedmesh::real_clock().unix_ms()));
  if (!socket.send(fp::serialize(builder), std::chrono::milliseconds(1000)).is_ok()) return std::nullopt;
  const auto until = SteadyClock::now() + std::chrono::seconds(2);
  while (SteadyClock::now() < until) {
    auto incoming = socket.receive(std::chrono::milliseconds(100));
    if (!incoming.is_ok() || !incoming->has_value()) continue;
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message((*incoming)->bytes, fp::kDefaultMaxMessageBytes, (*incoming)->frame, parsed, rejection)) {
      continue;
    }
    const auto root = parsed->root();
    if (!root.isRoundAnnounce()) continue;
    const auto r = root.getRoundAnnounce();
    return Announcement{r.getRound(), r.getModelVersion(), r.getRoundOpen(), r.getSelected(), r.getFinished(),
                        r.getSecureAggregation(), parsed->envelope().version};
  }
  return std::nullopt;
}

int site(int argc, char** argv) {
  auto config = fedmesh::node::read_site_config(flag_value(argc, argv, "--config"));
  if (!config.is_ok()) fail(config.status().to_string());
  const MappedValues deltas(flag_value(argc, argv, "--deltas"));
  std::vector<fp::TensorShape> manifest;
  for (const std::string& text : flag_values(argc, argv, "--tensor")) manifest.push_back(parse_tensor(text));
  if (manifest.empty()) fail("give the model's tensors, in order, with --tensor NAME:D0xD1...");
  std::vector<std::span<const float>> spans;
  uint64_t used = 0;
  for (const fp::TensorShape& shape : manifest) {
    const uint64_t n = shape.element_count();
    if (used + n > deltas.count) fail("the deltas file holds fewer values than the tensors given");
    spans.emplace_back(deltas.values + used, n);
    used += n;
  }
  const std::vector<fp::TensorPlan> plans(manifest.size());  // dense fp32: a site's default (compress = identity)
  auto membership = fedmesh::crypto::load_membership(config->keys, config->name, config->roster, config->admin_public,
                                                     config->federation);
  if (!membership.is_ok()) fail(membership.status().to_string());
  const auto* aggregator = membership->roster.find(config->aggregator_name);
  if (aggregator == nullptr) fail("the roster has no '" + config->aggregator_name + "'");
  auto socket = fp::zmq_network().connect(config->aggregator, fp::CurveKeys::from(membership->keys),
                                          aggregator->identity.box_public, fp::TransportOptions{});
  if (!socket.is_ok()) fail(socket.status().to_string());
  if (auto connected = fp::wait_connected(**socket, std::chrono::seconds(60)); !connected.is_ok()) {
    fail(connected.to_string());
  }
  AnonymousPeak anonymous;
  fp::RetransmitTimer timer;
  fp::UploadOptions upload;
  upload.reply_timeout = std::chrono::milliseconds(5000);
  upload.timer = &timer;
  fp::RetryPolicy retry;
  retry.max_attempts = 8;
  uint64_t last_sequence = 0;
  std::optional<std::pair<uint64_t, uint64_t>> answered;  // (round, version) sent
  const auto quiet_since = SteadyClock::now();
  auto last_heard = quiet_since;
  while (true) {
    const std::optional<Announcement> a = poll(**socket);
    if (!a) {
      if (Seconds(SteadyClock::now() - last_heard).count() > 600) fail("no answer from the aggregator for 600 s");
      continue;
    }
    last_heard = SteadyClock::now();
    if (a->finished) {
      say({{"event", "finished"}, {"site", config->name}, {"peak_anonymous_kb", anonymous.peak_kb()}});
      return 0;
    }
    if (a->secure) fail("the aggregator runs secure aggregation: this sender sends plain updates only");
    if (!a->open || !a->selected || answered == std::make_pair(a->round, a->version)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    if (a->protocol_version < fp::kSealedUpdatesVersion) fail("the aggregator does not take sealed updates");
    const auto started = SteadyClock::now();
    const uint64_t anonymous_before = AnonymousPeak::now_kb();
    fp::UpdateMetadata metadata{config->federation, a->round, a->version, config->name, config->aggregator_name,
                                std::max(last_sequence + 1, static_cast<uint64_t>(fedmesh::real_clock().unix_micros())),
                                1};
    last_sequence = metadata.sequence;
    auto prepared = fp::prepare_sealed_update(metadata, manifest, spans, plans, membership->keys,
                                              fp::kDefaultChunkBytes, fp::held_limit_for_window(upload.window_chunks));
    if (!prepared.is_ok()) fail(prepared.status().to_string());
    int attempts = 0;
    auto outcome = fp::upload_with_retries(**socket, *prepared, upload, retry, &attempts);
    // BUSY: the aggregator stages a bounded number of uploads; offer it again shortly, as a site does.
    fedmesh::Rng jitter(metadata.sequence);
    fp::RetryPolicy busy_wait;
    busy_wait.first_backoff = std::chrono::milliseconds(250);
    busy_wait.max_backoff = std::chrono::milliseconds(2000);
    int busy = 0;
    for (; busy < 1000 && outcome.is_ok() && outcome->rejection &&
           outcome->rejection->code == fedmesh::wire::RejectCode::BUSY;
         ++busy) {
      std::this_thread::sleep_for(fp::backoff_delay(std::min(busy + 1, 4), busy_wait, jitter));
      int more = 0;
      outcome = fp::upload_with_retries(**socket, *prepared, upload, retry, &more);
      attempts += more;
    }
    if (!outcome.is_ok()) fail("round " + std::to_string(a->round) + ": " + outcome.status().to_string());
    nlohmann::json event = {{"event", "update"}, {"site", config->name}, {"round", a->round},
                            {"accepted", outcome->accepted}, {"attempts", attempts}, {"busy", busy},
                            {"seconds", Seconds(SteadyClock::now() - started).count()},
                            {"wire_bytes", fp::wire_bytes(*prepared)},
                            {"held_chunks_peak", prepared->stream->most_held()},
                            {"stream_runs", prepared->stream->runs()},
                            {"anonymous_kb_before", anonymous_before}, {"peak_anonymous_kb", anonymous.peak_kb()}};
    if (outcome->rejection) {
      event["code"] = fp::reject_code_name(outcome->rejection->code);
      event["reason"] = outcome->rejection->reason;
    }
    say(event);
    if (outcome->accepted) answered = std::make_pair(a->round, a->version);
  }
}

// ---- the raw CurveZMQ baseline ----

void zmq_ok(int rc, const char* what) {
  if (rc != 0) fail(std::string(what) + ": " + zmq_strerror(zmq_errno()));
}

int raw_receive(int argc, char** argv) {
  const std::string bind = flag_value(argc, argv, "--bind");
  const std::string key_out = flag_value(argc, argv, "--key-out");
  const uint64_t total = parse_count(flag_value(argc, argv, "--bytes"), "--bytes");
  void* context = zmq_ctx_new();
  void* pull = zmq_socket(context, ZMQ_PULL);
  char server_public[41], server_secret[41];
  zmq_ok(zmq_curve_keypair(server_public, server_secret), "zmq_curve_keypair");
  const int one = 1;
  zmq_ok(zmq_setsockopt(pull, ZMQ_CURVE_SERVER, &one, sizeof one), "ZMQ_CURVE_SERVER");
  zmq_ok(zmq_setsockopt(pull, ZMQ_CURVE_SECRETKEY, server_secret, 40), "ZMQ_CURVE_SECRETKEY");
  const int timeout_ms = 600'000;
  zmq_ok(zmq_setsockopt(pull, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms), "ZMQ_RCVTIMEO");
  zmq_ok(zmq_bind(pull, bind.c_str()), "zmq_bind");
  {
    std::ofstream key(key_out + ".part");
    key << server_public;
  }
  if (std::rename((key_out + ".part").c_str(), key_out.c_str()) != 0) fail("cannot write " + key_out);
  uint64_t received = 0;
  SteadyClock::time_point first{};
  while (received < total) {
    zmq_msg_t message;
    zmq_msg_init(&message);
    if (zmq_msg_recv(&message, pull, 0) == -1) fail(std::string("zmq_msg_recv: ") + zmq_strerror(zmq_errno()));
    if (received == 0) first = SteadyClock::now();
    received += zmq_msg_size(&message);
    zmq_msg_close(&message);
  }
  const double seconds = Seconds(SteadyClock::now() - first).count();
  say({{"event", "raw"}, {"bytes", received}, {"seconds", seconds}, {"gb_per_s", received / seconds / 1e9}});
  zmq_close(pull);
  zmq_ctx_term(context);
  return 0;
}

int raw_send(int argc, char** argv) {
  const std::string connect = flag_value(argc, argv, "--connect");
  const std::string key_file = flag_value(argc, argv, "--key");
  const MappedValues deltas(flag_value(argc, argv, "--deltas"));
  const uint64_t bytes = parse_count(flag_value(argc, argv, "--bytes"), "--bytes");
  if (bytes > deltas.count * sizeof(float)) fail("--bytes is more than the deltas file holds");
  std::string server_public;
  for (int i = 0; i < 600 && server_public.size() != 40; ++i) {
    std::ifstream key(key_file);
    std::getline(key, server_public);
    if (server_public.size() != 40) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (server_public.size() != 40) fail("no server key in " + key_file);
  void* context = zmq_ctx_new();
  void* push = zmq_socket(context, ZMQ_PUSH);
  char client_public[41], client_secret[41];
  zmq_ok(zmq_curve_keypair(client_public, client_secret), "zmq_curve_keypair");
  zmq_ok(zmq_setsockopt(push, ZMQ_CURVE_SERVERKEY, server_public.data(), 40), "ZMQ_CURVE_SERVERKEY");
  zmq_ok(zmq_setsockopt(push, ZMQ_CURVE_PUBLICKEY, client_public, 40), "ZMQ_CURVE_PUBLICKEY");
  zmq_ok(zmq_setsockopt(push, ZMQ_CURVE_SECRETKEY, client_secret, 40), "ZMQ_CURVE_SECRETKEY");
  zmq_ok(zmq_connect(push, connect.c_str()), "zmq_connect");
  const auto* base = reinterpret_cast<const uint8_t*>(deltas.values);
  for (uint64_t at = 0; at < bytes; at += fp::kDefaultChunkBytes) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(fp::kDefaultChunkBytes, bytes - at));
    zmq_msg_t message;
    // Sent from the mapped file (no copy), as the sealed sender serializes from it.
    zmq_ok(zmq_msg_init_data(&message, const_cast<uint8_t*>(base + at), n, nullptr, nullptr), "zmq_msg_init_data");
    if (zmq_msg_send(&message, push, 0) == -1) fail(std::string("zmq_msg_send: ") + zmq_strerror(zmq_errno()));
  }
  zmq_close(push);  // lingers until every message is out
  zmq_ctx_term(context);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "make-deltas") return make_deltas(argc, argv);
  if (mode == "site") return site(argc, argv);
  if (mode == "raw-receive") return raw_receive(argc, argv);
  if (mode == "raw-send") return raw_send(argc, argv);
  std::fprintf(stderr,
               "usage: large_round_sender make-deltas FILE --values N [--seed S]\n"
               "       large_round_sender site --config site-K.toml --deltas FILE --tensor NAME:D0xD1... ...\n"
               "       large_round_sender raw-receive --bind EP --key-out FILE --bytes TOTAL\n"
               "       large_round_sender raw-send --connect EP --key FILE --deltas FILE --bytes B\n"
               "(bench/large_round.py --senders runs them; see the comment at the top of large_round_sender.cpp)\n");
  return mode == "--help" || mode == "-h" ? 0 : 2;
}
