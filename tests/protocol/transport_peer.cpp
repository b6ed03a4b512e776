// A small server ("sink") and client ("source") built on the real transport,
// for the loopback integration test (test_secure_transport.cpp) until the
// aggregator exists. The source can also misbehave on purpose (--attack) so
// that the test proves each hostile message is refused for the right reason
// while honest updates in the same run are accepted.
//
// Both print one JSON object per line on stdout.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>

#include "crypto/keys.h"
#include "crypto/replay_guard.h"
#include "crypto/roster.h"
#include "protocol/rate_limiter.h"
#include "protocol/transport.h"
#include "protocol/update_service.h"
#include "protocol/update_transfer.h"
#include "protocol/update_upload.h"

namespace fm = fedmesh;
namespace fp = fedmesh::protocol;
using nlohmann::json;

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

void emit(const json& line) {
  std::cout << line.dump() << std::endl;
}

[[noreturn]] void fail(const std::string& what) {
  emit({{"event", "error"}, {"message", what}});
  std::exit(2);
}

template <class T>
T must(fm::Result<T> result, const std::string& what) {
  if (!result.is_ok()) fail(what + ": " + result.status().to_string());
  return std::move(result.value());
}

// The model both sides agree on: a small linear layer.
std::vector<fp::TensorShape> manifest(int64_t rows) {
  return {{"layer.weight", {rows, 32}}, {"layer.bias", {rows}}};
}

double sum_of(const std::vector<std::vector<float>>& tensors) {
  double sum = 0;
  for (const auto& t : tensors)
    for (float v : t) sum += v;
  return sum;
}

fm::crypto::Roster load_roster(const std::string& file, const std::string& admin_public_file) {
  fm::crypto::Roster roster = must(fm::crypto::read_roster(file), "roster");
  const auto admin = must(fm::crypto::read_public_identity(admin_public_file), "admin public key");
  if (const fm::Status verified = fm::crypto::verify_roster(roster, admin.sign_public); !verified.is_ok()) {
    fail("refusing to start: " + verified.message());
  }
  return roster;
}

int run_sink(const std::string& roster_file, const std::string& admin_file, const std::string& key_file,
             const std::string& listen, const std::string& replay_file, int64_t rows, size_t max_message_bytes,
             uint64_t round, bool insecure, double rate_messages, bool no_sequence_bound) {
  const auto roster = load_roster(roster_file, admin_file);
  const auto keys = must(fm::crypto::read_site_keys(key_file), "site key");
  auto replay = must(fm::crypto::ReplayGuard::open(replay_file), "replay table");
  fp::TransportOptions options;
  options.max_message_bytes = max_message_bytes;
  options.insecure = insecure;
  auto server = must(fp::ServerSocket::bind(listen, fp::CurveKeys::from(keys), fp::allowlist_from_roster(roster), options),
                     "listening");
  fp::ReceiverPolicy policy;
  policy.federation = roster.federation;
  policy.self = keys.identity.name;
  policy.manifest = manifest(rows);
  policy.current_round = round;
  policy.current_version = round;
  policy.max_message_bytes = max_message_bytes;
  policy.insecure = insecure;
  if (no_sequence_bound) policy.max_sequence_ahead_micros = std::numeric_limits<uint64_t>::max();
  fp::UpdateService service(policy, roster, replay, {rate_messages, fp::kDefaultBytesPerSecond}, server->counters());
  emit({{"event", "listening"}, {"endpoint", server->endpoint()}, {"self_test", insecure ? "skipped" : "passed"}});

  uint64_t accepted = 0;
  json rejected = json::object();
  while (!g_stop.load()) {
    auto received = server->receive(std::chrono::milliseconds(100));
    if (!received.is_ok()) fail(received.status().to_string());
    if (!received->has_value()) continue;
    const fp::Incoming incoming = std::move(**received);
    std::optional<fp::OutgoingMessage> reply = service.handle(incoming);
    if (const auto& refused = service.last_rejection()) {
      const std::string code = fp::reject_code_name(refused->code);
      rejected[code] = rejected.value(code, 0) + 1;
      emit({{"event", "rejected"}, {"peer", incoming.peer}, {"peer_key", incoming.peer_key}, {"code", code},
            {"reason", refused->reason}});
    }
    if (reply) {
      if (const fm::Status sent = server->send(incoming.routing_id, std::move(*reply)); !sent.is_ok()) {
        emit({{"event", "reply-lost"}, {"peer", incoming.peer}, {"reason", sent.message()}});
      }
    }
    for (auto& update : service.take_completed()) {
      ++accepted;
      emit({{"event", "accepted"}, {"sender", update.metadata.sender}, {"sequence", update.metadata.sequence},
            {"replay_key", update.replay_key},
            {"sample_count", update.metadata.sample_count}, {"sum", sum_of(update.tensors)}});
    }
  }
  const auto& c = server->counters();
  // Shutdown: transfers still in flight are dropped whole (their staging
  // copies never reached anything) and said so; no replay counter moved.
  emit({{"event", "summary"}, {"accepted", accepted}, {"rejected", rejected},
        {"discarded_in_flight", service.receiver().transfers_in_flight()},
        {"zap_denied", c.zap_denied.load()}, {"zap_allowed", c.zap_allowed.load()},
        {"messages_received", c.messages_received.load()}, {"bytes_received", c.bytes_received.load()}});
  return 0;
}

// --attack report: SiteReports with these values, `repeat` times.
struct SiteReportAttack {
  double accuracy = 0.5;
  uint64_t round = 0;
  int repeat = 1;
};

int run_source(const std::string& roster_file, const std::string& admin_file, const std::string& key_file,
               const std::string& server_name, const std::string& connect, const std::string& attack,
               uint64_t sequence, int64_t rows, uint64_t round, size_t chunk_bytes, std::optional<uint32_t> stop_after,
               size_t max_message_bytes, bool insecure, const SiteReportAttack& report) {
  const auto roster = load_roster(roster_file, admin_file);
  const auto keys = must(fm::crypto::read_site_keys(key_file), "site key");
  const fm::crypto::RosterEntry* server_entry = roster.find(server_name);
  if (server_entry == nullptr) fail("server '" + server_name + "' is not on the roster");
  fp::TransportOptions options;
  options.insecure = insecure;
  auto client = must(fp::ClientSocket::connect(connect, fp::CurveKeys::from(keys), server_entry->identity.box_public, options),
                     "dialling");
  if (const fm::Status up = fp::wait_connected(*client, std::chrono::seconds(10)); !up.is_ok()) {
    emit({{"event", "refused"}, {"reason", up.message()}});
    return 3;
  }
  if (attack.starts_with("hello-")) {
    // A Hello with one field wrong: the sink must refuse it by name.
    capnp::MallocMessageBuilder builder;
    auto hello = builder.initRoot<fedmesh::wire::Message>().initHello();
    hello.setFederation(attack == "hello-federation" ? "another-federation" : roster.federation);
    hello.setSiteName(attack == "hello-long-name" ? std::string(100 * 1024, 's') : keys.identity.name);
    hello.setRole(attack == "hello-role" ? fedmesh::wire::Role::AGGREGATOR : fedmesh::wire::Role::SITE);
    hello.setProtocolVersion(fp::kProtocolVersion);
    hello.setMinProtocolVersion(fp::kMinProtocolVersion);
    if (const fm::Status sent = client->send(fp::serialize(builder), std::chrono::seconds(10)); !sent.is_ok()) {
      fail(sent.message());
    }
    auto reply = must(client->receive(std::chrono::seconds(10)), "reply");
    if (!reply) fail("no reply to the Hello");
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message(reply->bytes, fp::kDefaultMaxMessageBytes, reply->frame, parsed, rejection)) fail(rejection.reason);
    if (!parsed->root().isReject()) {
      emit({{"event", "result"}, {"outcome", "accepted"}});
      return 0;
    }
    emit({{"event", "result"}, {"outcome", "rejected"},
          {"code", fp::reject_code_name(parsed->root().getReject().getCode())},
          {"reason", parsed->root().getReject().getText().cStr()}});
    return 0;
  }
  const uint16_t version = must(fp::say_hello(*client, {roster.federation, keys.identity.name}, std::chrono::seconds(10)),
                                "hello");
  if (attack == "report") {
    // Each refused report is answered by a Reject; a taken one by nothing.
    json codes = json::object();
    int answered = 0;
    std::string reason;
    for (int i = 0; i < report.repeat; ++i) {
      capnp::MallocMessageBuilder builder;
      auto r = builder.initRoot<fedmesh::wire::Message>().initSiteReport();
      r.setRound(report.round);
      r.setBaseVersion(0);
      r.setTrainLoss(0.5);
      r.setLocalLoss(0.5);
      r.setLocalAccuracy(report.accuracy);
      r.setExamples(100);
      if (const fm::Status sent = client->send(fp::serialize(builder), std::chrono::seconds(10)); !sent.is_ok()) {
        fail(sent.message());
      }
      auto reply = must(client->receive(std::chrono::seconds(3)), "reply");
      if (!reply) continue;
      std::unique_ptr<fp::ParsedMessage> parsed;
      fp::Rejection rejection;
      if (!fp::parse_message(reply->bytes, fp::kDefaultMaxMessageBytes, reply->frame, parsed, rejection)) continue;
      if (!parsed->root().isReject()) continue;
      ++answered;
      const std::string code = fp::reject_code_name(parsed->root().getReject().getCode());
      codes[code] = codes.value(code, 0) + 1;
      reason = parsed->root().getReject().getText().cStr();
    }
    emit({{"event", "result"}, {"outcome", answered > 0 ? "rejected" : "no-reply"}, {"rejected", answered},
          {"codes", codes}, {"reason", reason}});
    return 0;
  }

  fp::UpdateMetadata metadata;
  metadata.federation = roster.federation;
  metadata.round = round;
  metadata.base_version = round;
  metadata.sender = attack == "impostor" ? "site-b" : keys.identity.name;
  metadata.recipient = server_name;
  metadata.sequence = attack == "ahead" ? std::numeric_limits<uint64_t>::max() : sequence;
  metadata.sample_count = attack == "samples" ? fp::kDefaultMaxSampleCount + 1 : 100 + sequence % 1000;

  auto shapes = manifest(attack == "shape" ? rows + 1 : rows);
  std::vector<std::vector<float>> values;
  for (const auto& shape : shapes) {
    std::vector<float> tensor(shape.element_count());
    for (size_t i = 0; i < tensor.size(); ++i) {
      tensor[i] = static_cast<float>(std::sin(0.1 * static_cast<double>(i) + static_cast<double>(sequence)) * 0.01);
    }
    values.push_back(std::move(tensor));
  }

  if (attack == "oversize") {
    // A well-formed envelope around ten times the receiver's limit.
    std::vector<uint8_t> frame(10 * max_message_bytes, 0);
    const uint32_t magic = fp::kEnvelopeMagic, body = static_cast<uint32_t>(frame.size() - fp::kEnvelopeBytes);
    const uint16_t kind = static_cast<uint16_t>(fedmesh::wire::Message::UPDATE_HEADER), v = fp::kProtocolVersion;
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &v, 2);
    std::memcpy(frame.data() + 6, &kind, 2);
    std::memcpy(frame.data() + 8, &body, 4);
    if (const fm::Status sent = client->send(fp::copy_message(frame), std::chrono::seconds(10)); !sent.is_ok()) {
      fail(sent.message());
    }
    auto reply = must(client->receive(std::chrono::seconds(10)), "reply");
    if (!reply) fail("no reply to the oversized message");
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message(reply->bytes, fp::kDefaultMaxMessageBytes, reply->frame, parsed, rejection)) fail(rejection.reason);
    if (!parsed->root().isReject()) fail("oversized message was not rejected");
    emit({{"event", "result"}, {"outcome", "rejected"},
          {"code", fp::reject_code_name(parsed->root().getReject().getCode())},
          {"reason", parsed->root().getReject().getText().cStr()}});
    return 0;
  }

  std::vector<fp::EncodedTensor> encoded;
  double sum = 0;
  for (size_t t = 0; t < shapes.size(); ++t) {
    fp::EncodedTensor tensor;
    tensor.descriptor = {shapes[t].name, shapes[t].dims, fp::Encoding::kDenseF32, 0};
    tensor.segments = must(fp::encode_dense(static_cast<uint32_t>(t), values[t], fp::Encoding::kDenseF32, chunk_bytes),
                           "encoding");
    for (float v : values[t]) sum += v;
    encoded.push_back(std::move(tensor));
  }
  if (attack == "nan") {
    // Poison one value after encoding (the encoder itself refuses NaN).
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(encoded[0].segments.back().values.data(), &nan, sizeof nan);
  }
  fm::crypto::SiteKeys signer = keys;
  if (attack == "forged") signer = must(fm::crypto::generate_site_keys(keys.identity.name), "forging key");
  const fp::PreparedUpdate update = fp::prepare_encoded_update(metadata, std::move(encoded), signer, chunk_bytes);

  fp::UploadOptions upload;
  upload.stop_after_chunks = stop_after;
  const fp::UploadOutcome outcome = must(fp::upload_update(*client, update, upload), "upload");
  json result = {{"event", "result"}, {"protocol_version", version}, {"sequence", sequence},
                 {"chunks", update.chunks.size()}, {"chunks_sent", outcome.chunks_sent},
                 {"started_at_chunk", outcome.started_at_chunk}, {"sum", sum}};
  if (outcome.accepted) {
    result["outcome"] = "accepted";
  } else if (outcome.rejection) {
    result["outcome"] = "rejected";
    result["code"] = fp::reject_code_name(outcome.rejection->code);
    result["reason"] = outcome.rejection->reason;
  } else {
    result["outcome"] = "abandoned";
  }
  emit(result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fedmesh transport test peer: a sink (server) or a source (client, honest or hostile)"};
  app.require_subcommand(1);
  std::string roster, admin, key, listen = "tcp://127.0.0.1:*", replay, server = "aggregator", connect, attack = "honest";
  uint64_t sequence = 1, round = 1;
  int64_t rows = 16;
  size_t max_message_bytes = fp::kDefaultMaxMessageBytes, chunk_bytes = fp::kDefaultChunkBytes;
  std::optional<uint32_t> stop_after;
  bool insecure = false, no_sequence_bound = false;
  double rate_messages = fp::kDefaultMessagesPerSecond;
  for (CLI::App* sub : {app.add_subcommand("sink", "receive updates and print what happened to each"),
                        app.add_subcommand("source", "send one update")}) {
    sub->add_option("--roster", roster, "signed roster")->required();
    sub->add_option("--admin-public", admin, "pinned admin .pub")->required();
    sub->add_option("--key", key, "own .key file")->required();
    sub->add_option("--rows", rows, "rows of the test layer");
    sub->add_option("--round", round, "current round");
    sub->add_option("--max-message-bytes", max_message_bytes, "message size limit");
    sub->add_flag("--insecure", insecure, "no CurveZMQ, no ZAP: local experiments only");
  }
  CLI::App* sink = app.get_subcommand("sink");
  sink->add_option("--listen", listen, "endpoint to bind");
  sink->add_option("--rate-messages", rate_messages, "per-peer message rate limit (messages/s)");
  sink->add_option("--replay-file", replay, "replay counter file")->required();
  sink->add_flag("--no-sequence-bound", no_sequence_bound, "take sequences however far ahead of the clock");
  CLI::App* source = app.get_subcommand("source");
  source->add_option("--server", server, "the sink's roster name");
  source->add_option("--connect", connect, "the sink's endpoint")->required();
  source->add_option("--attack", attack,
                     "honest|forged|replay|nan|shape|oversize|impostor|ahead|samples|hello-long-name|hello-role|"
                     "hello-federation")
      ->check(CLI::IsMember({"honest", "forged", "replay", "nan", "shape", "oversize", "impostor", "ahead", "samples",
                             "hello-long-name", "hello-role", "hello-federation", "report"}));
  SiteReportAttack report;
  source->add_option("--report-accuracy", report.accuracy, "report: the localAccuracy sent");
  source->add_option("--report-round", report.round, "report: the round sent");
  source->add_option("--repeat", report.repeat, "report: how many are sent");
  source->add_option("--sequence", sequence, "update sequence number");
  source->add_option("--chunk-bytes", chunk_bytes, "chunk payload size");
  source->add_option("--stop-after-chunks", stop_after, "abandon the transfer after N chunks");
  CLI11_PARSE(app, argc, argv);
  if (insecure) {
    std::fprintf(stderr, "fedmesh: WARNING: --insecure: no encryption and no authentication of peers; "
                         "for local experiments only\n");
  }
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  if (sink->parsed()) return run_sink(roster, admin, key, listen, replay, rows, max_message_bytes, round, insecure, rate_messages,
                                      no_sequence_bound);
  return run_source(roster, admin, key, server, connect, attack, sequence, rows, round, chunk_bytes, stop_after,
                    max_message_bytes, insecure, report);
}
