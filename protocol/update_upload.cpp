#include "protocol/update_upload.h"

#include "protocol/sealed_update.h"

#include <kj/exception.h>

#include <algorithm>

namespace fedmesh::protocol {
namespace {

// The next reply from the server, parsed. Anything unparseable is an error:
// the server is trusted to speak the protocol.
Result<std::unique_ptr<ParsedMessage>> next_reply(ClientChannel& socket, std::chrono::milliseconds timeout) {
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
  return Rejection{reject.getCode(), std::string(reject.getText().cStr(), reject.getText().size()),
                   reject.getLastAccepted()};
}

}  // namespace

Status wait_connected(ClientChannel& socket, std::chrono::milliseconds timeout) {
  Clock& clock = socket.clock();
  const auto deadline = clock.now() + timeout;
  while (clock.now() < deadline) {
    if (socket.connected()) return Status::ok();
    if (socket.handshake_refused()) return unavailable("the server refused our key (not on its roster)");
    clock.sleep_for(std::chrono::milliseconds(10));
  }
  return unavailable("no CURVE handshake with the server within " + std::to_string(timeout.count()) + " ms");
}

Result<uint16_t> say_hello(ClientChannel& socket, const HelloFields& fields, std::chrono::milliseconds timeout) {
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

namespace {

// What the attempts at one update have done so far, carried from one to the
// next: what went out before (an answer to it is ambiguous, so it gives the
// timer no sample) and the furthest Ack (an Ack past it is progress).
struct UploadState {
  bool header_sent = false;
  uint32_t chunks_sent_through = 0;  // chunks [0, this) went out at least once
  int64_t acknowledged = -1;         // the highest nextChunk seen; -1: no Ack yet
};

// How one attempt ended, besides its result.
struct AttemptReport {
  bool progressed = false;  // an Ack beyond every earlier one
  bool timed_out = false;   // it ended waiting for a reply
};

// The receiver holds every chunk before its furthest Ack: a sealed
// update's stream need not keep them (it does only without a held limit).
void release_acknowledged(const PreparedUpdate& update, const UploadState& state) {
  if (update.stream && state.acknowledged > 0) update.stream->release_before(static_cast<uint32_t>(state.acknowledged));
}

std::chrono::milliseconds wait_of(const UploadOptions& options) {
  if (options.timer == nullptr) return options.reply_timeout;
  return std::chrono::ceil<std::chrono::milliseconds>(options.timer->timeout());
}

Result<UploadOutcome> attempt_upload(ClientChannel& socket, const PreparedUpdate& update, const UploadOptions& options,
                                     UploadState& state, AttemptReport& report) {
  Clock& clock = socket.clock();
  UploadOutcome outcome;
  RetransmitTimer* timer = options.timer;
  // A sealed update's count is known once its stream has made the last
  // chunk; until then, as many as there are.
  uint32_t chunk_count = update.stream ? UINT32_MAX : static_cast<uint32_t>(update.chunks.size());
  bool seal_sent = false;
  // The message the timer times: -1 the header, else a chunk. Its Ack (one
  // that names a later chunk) answers it.
  int64_t timed = -1;
  FEDMESH_RETURN_IF_ERROR(socket.send(update.header, options.reply_timeout));
  auto wait_from = clock.now();
  if (timer != nullptr) timer->sent(wait_from, state.header_sent);
  state.header_sent = true;
  uint32_t next_to_send = 0;
  uint32_t acknowledged = 0;
  bool header_acked = false;
  while (true) {
    // Keep the window full.
    while (header_acked && next_to_send < chunk_count && next_to_send < acknowledged + options.window_chunks) {
      if (options.stop_after_chunks && outcome.chunks_sent >= *options.stop_after_chunks) break;
      const std::optional<SharedMessage> chunk = chunk_to_send(update, next_to_send);
      if (!chunk) {
        chunk_count = next_to_send;
        break;
      }
      FEDMESH_RETURN_IF_ERROR(socket.send(*chunk, options.reply_timeout));
      if (timer != nullptr && !timer->outstanding()) {
        timer->sent(clock.now(), next_to_send < state.chunks_sent_through);
        timed = next_to_send;
      }
      ++next_to_send;
      state.chunks_sent_through = std::max(state.chunks_sent_through, next_to_send);
      ++outcome.chunks_sent;
    }
    // A sealed update's seal follows its last chunk (its Ack{complete}
    // answers the timer).
    if (update.stream && header_acked && !seal_sent && next_to_send >= chunk_count &&
        !(options.stop_after_chunks && outcome.chunks_sent >= *options.stop_after_chunks)) {
      Result<SharedMessage> seal = update.stream->seal();
      if (!seal.is_ok()) return seal.status();
      FEDMESH_RETURN_IF_ERROR(socket.send(*seal, options.reply_timeout));
      if (timer != nullptr && !timer->outstanding()) {
        timer->sent(clock.now(), false);
        timed = next_to_send;
      }
      seal_sent = true;
    }
    // Abandoning on purpose (tests of resume): once what was sent is
    // acknowledged, walk away mid-transfer.
    if (options.stop_after_chunks && outcome.chunks_sent >= *options.stop_after_chunks && acknowledged >= next_to_send) {
      return outcome;
    }
    const auto wait = wait_of(options);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(wait_from + wait - clock.now());
    auto reply = next_reply(socket, std::max(left, std::chrono::milliseconds(0)));
    if (!reply.is_ok()) {
      if (reply.status().code() == StatusCode::kUnavailable) {
        report.timed_out = true;
        if (timer != nullptr) timer->timed_out();
        return unavailable("no reply from the server within " + std::to_string(wait.count()) + " ms");
      }
      return reply.status();
    }
    try {
      const auto root = (*reply)->root();
      if (root.isReject()) {
        // A late answer to a chunk resent for an earlier update (which the
        // receiver finished and forgot) is not about this one; a refusal
        // naming no update (sequence 0: over the rate, too large) is.
        const uint64_t refused = root.getReject().getSequence();
        if (refused != 0 && refused != update.metadata.sequence) continue;
        if (timer != nullptr) timer->answered(clock.now());
        outcome.rejection = rejection_of(root.getReject());
        return outcome;
      }
      if (!root.isAck()) continue;  // e.g. the answer to a Heartbeat: the wait goes on
      const auto ack = root.getAck();
      if (ack.getSequence() != update.metadata.sequence) continue;
      const auto now = clock.now();
      const int64_t named = ack.getNextChunk();
      // Resuming while chunks of the last attempt are still unacknowledged:
      // the receiver may still be working through them (it was busy, not
      // the link lossy), and takes the messages in order, so their Acks come
      // before the header's. Each of them advances; the header's does not
      // (it names the first chunk still missing, as the last of them did).
      // Taken for the header's answer, one of them would open the window at
      // chunks still queued at the receiver, and send them all again (a
      // window of chunks the receiver holds twice). They are progress; the
      // window opens at the header's answer.
      if (!header_acked && !ack.getComplete() && named > state.acknowledged &&
          state.acknowledged < static_cast<int64_t>(state.chunks_sent_through) &&
          named < static_cast<int64_t>(state.chunks_sent_through)) {
        if (timer != nullptr) timer->progressed();
        report.progressed = true;
        state.acknowledged = named;
        release_acknowledged(update, state);
        wait_from = now;
        continue;
      }
      if (timer != nullptr) {
        if (timer->outstanding() && (ack.getComplete() || (timed < 0 ? !header_acked : named > timed))) {
          timer->answered(now);
        } else if (named > state.acknowledged) {
          timer->progressed();
        }
      }
      if (ack.getComplete() || named > state.acknowledged) report.progressed = true;
      state.acknowledged = std::max(state.acknowledged, named);
      release_acknowledged(update, state);
      wait_from = now;
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

}  // namespace

Result<UploadOutcome> upload_update(ClientChannel& socket, const PreparedUpdate& update, const UploadOptions& options) {
  UploadState state;
  AttemptReport report;
  return attempt_upload(socket, update, options, state, report);
}

std::chrono::milliseconds backoff_delay(int attempt, const RetryPolicy& policy, Rng& rng) {
  int64_t delay = policy.first_backoff.count();
  for (int i = 1; i < attempt && delay < policy.max_backoff.count(); ++i) delay *= 2;
  delay = std::min<int64_t>(delay, policy.max_backoff.count());
  const int64_t low = delay / 2;
  return std::chrono::milliseconds(low + static_cast<int64_t>(rng.below(static_cast<uint64_t>(delay - low) + 1)));
}

Result<UploadOutcome> upload_with_retries(ClientChannel& socket, const PreparedUpdate& update,
                                          const UploadOptions& options, const RetryPolicy& retry, int* attempts) {
  Rng rng(retry.jitter_seed != 0 ? retry.jitter_seed
                                 : static_cast<uint64_t>(socket.clock().unix_micros()));
  // An attempt is lost when its header, its first window of chunks or an
  // Ack of them is.
  const size_t chunks = update.stream ? SIZE_MAX : update.chunks.size();
  const int messages = 1 + static_cast<int>(std::min<size_t>(chunks, std::max(1u, options.window_chunks)));
  UploadState state;
  Status last = unavailable("no attempt made");
  int quiet = 0;  // attempts in a row without progress
  for (int attempt = 1;; ++attempt) {
    if (attempts != nullptr) *attempts = attempt;
    AttemptReport report;
    auto outcome = attempt_upload(socket, update, options, state, report);
    if (outcome.is_ok()) return outcome;
    if (outcome.status().code() != StatusCode::kUnavailable) return outcome.status();
    last = outcome.status();
    quiet = report.progressed ? 0 : quiet + 1;
    const int allowed = options.timer != nullptr
                            ? options.timer->attempts_for(messages, kRetransmitGiveUpProbability, retry.max_attempts)
                            : std::max(1, retry.max_attempts);
    if (quiet >= allowed) {
      return unavailable("gave up after " + std::to_string(attempt) + " attempts (" + std::to_string(quiet) +
                         " in a row without an Ack): " + last.message());
    }
    if (options.timer == nullptr) {
      socket.clock().sleep_for(backoff_delay(std::max(1, quiet), retry, rng));
    } else if (!report.timed_out) {
      // It failed before waiting (no connection, a full queue): the timer's
      // wait spaces the attempts instead.
      options.timer->timed_out();
      socket.clock().sleep_for(options.timer->timeout());
    }
  }
}

}  // namespace fedmesh::protocol
