#include "protocol/update_upload.h"

#include <kj/exception.h>

#include <thread>

namespace fedmesh::protocol {
namespace {

// The next reply from the server, parsed. Anything unparseable is an error:
// the server is trusted to speak the protocol.
Result<std::unique_ptr<ParsedMessage>> next_reply(ClientSocket& socket, std::chrono::milliseconds timeout) {
  auto received = socket.receive(timeout);
  if (!received.is_ok()) return received.status();
  if (!received->has_value()) {
    return unavailable("no reply from the server within " + std::to_string(timeout.count()) + " ms");
  }
  Incoming incoming = std::move(**received);
  std::unique_ptr<ParsedMessage> parsed;
  Rejection rejection;
  if (!parse_message(incoming.bytes, kDefaultMaxMessageBytes, incoming.frame, parsed, rejection)) {
    return corrupt("server sent an unreadable reply: " + rejection.reason);
  }
  return parsed;
}

Rejection rejection_of(wire::Reject::Reader reject) {
  return Rejection{reject.getCode(), std::string(reject.getText().cStr(), reject.getText().size())};
}

}  // namespace

Status wait_connected(ClientSocket& socket, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (socket.connected()) return Status::ok();
    if (socket.handshake_refused()) return unavailable("the server refused our key (not on its roster)");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return unavailable("no CURVE handshake with the server within " + std::to_string(timeout.count()) + " ms");
}

Result<uint16_t> say_hello(ClientSocket& socket, const HelloFields& fields, std::chrono::milliseconds timeout) {
  capnp::MallocMessageBuilder builder;
  auto hello = builder.initRoot<wire::Message>().initHello();
  hello.setFederation(fields.federation);
  hello.setSiteName(fields.site_name);
  hello.setRole(fields.role);
  hello.setProtocolVersion(fields.max_version);
  hello.setMinProtocolVersion(fields.min_version);
  auto capabilities = hello.initCapabilities();
  auto encodings = capabilities.initEncodings(kEncodingCount);
  for (int e = 0; e < kEncodingCount; ++e) encodings.set(static_cast<unsigned>(e), static_cast<wire::TensorEncoding>(e));
  capabilities.setMaxMessageBytes(static_cast<uint32_t>(kDefaultMaxMessageBytes));
  capabilities.setChunkBytes(static_cast<uint32_t>(kDefaultChunkBytes));
  FEDMESH_RETURN_IF_ERROR(socket.send(serialize(builder), timeout));
  auto reply = next_reply(socket, timeout);
  if (!reply.is_ok()) return reply.status();
  try {
    const auto root = (*reply)->root();
    if (root.isWelcome()) return root.getWelcome().getProtocolVersion();
    if (root.isReject()) return invalid_argument("server refused Hello: " + rejection_of(root.getReject()).reason);
  } catch (const kj::Exception& e) {
    return corrupt(std::string("server reply does not parse: ") + e.getDescription().cStr());
  }
  return corrupt("server answered Hello with neither Welcome nor Reject");
}

Result<UploadOutcome> upload_update(ClientSocket& socket, const PreparedUpdate& update, const UploadOptions& options) {
  UploadOutcome outcome;
  const auto chunk_count = static_cast<uint32_t>(update.chunks.size());
  FEDMESH_RETURN_IF_ERROR(socket.send(update.header, options.reply_timeout));
  uint32_t next_to_send = 0;
  uint32_t acknowledged = 0;
  bool header_acked = false;
  while (true) {
    // Keep the window full.
    while (header_acked && next_to_send < chunk_count && next_to_send < acknowledged + options.window_chunks) {
      if (options.stop_after_chunks && outcome.chunks_sent >= *options.stop_after_chunks) break;
      FEDMESH_RETURN_IF_ERROR(socket.send(update.chunks[next_to_send], options.reply_timeout));
      ++next_to_send;
      ++outcome.chunks_sent;
    }
    // Abandoning on purpose (tests of resume): once what was sent is
    // acknowledged, walk away mid-transfer.
    if (options.stop_after_chunks && outcome.chunks_sent >= *options.stop_after_chunks && acknowledged >= next_to_send) {
      return outcome;
    }
    auto reply = next_reply(socket, options.reply_timeout);
    if (!reply.is_ok()) return reply.status();
    try {
      const auto root = (*reply)->root();
      if (root.isReject()) {
        outcome.rejection = rejection_of(root.getReject());
        return outcome;
      }
      if (!root.isAck()) continue;  // e.g. a Heartbeat
      const auto ack = root.getAck();
      if (ack.getSequence() != update.metadata.sequence) continue;
      if (ack.getComplete()) {
        outcome.accepted = true;
        return outcome;
      }
      if (!header_acked) {
        header_acked = true;
        outcome.started_at_chunk = ack.getNextChunk();
        next_to_send = std::min(ack.getNextChunk(), chunk_count);
        acknowledged = next_to_send;
      } else {
        acknowledged = std::max(acknowledged, ack.getNextChunk());
      }
    } catch (const kj::Exception& e) {
      return corrupt(std::string("server reply does not parse: ") + e.getDescription().cStr());
    }
  }
}

std::chrono::milliseconds backoff_delay(int attempt, const RetryPolicy& policy, Rng& rng) {
  int64_t delay = policy.first_backoff.count();
  for (int i = 1; i < attempt && delay < policy.max_backoff.count(); ++i) delay *= 2;
  delay = std::min<int64_t>(delay, policy.max_backoff.count());
  const int64_t low = delay / 2;
  return std::chrono::milliseconds(low + static_cast<int64_t>(rng.below(static_cast<uint64_t>(delay - low) + 1)));
}

Result<UploadOutcome> upload_with_retries(ClientSocket& socket, const PreparedUpdate& update,
                                          const UploadOptions& options, const RetryPolicy& retry, int* attempts) {
  Rng rng(retry.jitter_seed != 0 ? retry.jitter_seed
                                 : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  Status last = unavailable("no attempt made");
  for (int attempt = 1; attempt <= std::max(1, retry.max_attempts); ++attempt) {
    if (attempts != nullptr) *attempts = attempt;
    if (attempt > 1) std::this_thread::sleep_for(backoff_delay(attempt - 1, retry, rng));
    auto outcome = upload_update(socket, update, options);
    if (outcome.is_ok()) return outcome;
    if (outcome.status().code() != StatusCode::kUnavailable) return outcome.status();
    last = outcome.status();
  }
  return unavailable("gave up after " + std::to_string(retry.max_attempts) + " attempts: " + last.message());
}

}  // namespace fedmesh::protocol
