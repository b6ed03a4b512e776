// The sending side of an update transfer over a ClientSocket: Hello, then
// the header, then the chunks in a window, resuming from the receiver's
// Ack{nextChunk} when a header is resent.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "base/random.h"
#include "base/status.h"
#include "protocol/retransmit_timer.h"
#include "protocol/transport.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

struct UploadOptions {
  uint32_t window_chunks = 16;                       // chunks sent ahead of the last Ack
  std::chrono::milliseconds reply_timeout{10000};    // no reply this long: kUnavailable
  // When given, it sizes each wait for a reply instead of reply_timeout (the
  // link's measured round trip, backed off after a timeout) and learns from
  // every Ack; the caller keeps it across updates.
  RetransmitTimer* timer = nullptr;
  std::optional<uint32_t> stop_after_chunks;         // tests: abandon the transfer after this many chunks
};

struct UploadOutcome {
  bool accepted = false;                  // Ack{complete}
  std::optional<Rejection> rejection;     // the receiver's Reject
  uint32_t started_at_chunk = 0;          // > 0: resumed
  uint32_t chunks_sent = 0;
};

// How a sender retries when the receiver goes quiet: waits a doubling,
// jittered delay (so that sites cut off together do not return together),
// then resends the header, which resumes the transfer from the receiver's
// Ack{nextChunk}. With a RetransmitTimer (UploadOptions::timer) the timer's
// own backoff spaces the attempts: the header goes again as soon as a wait
// times out, and the next wait is twice as long.
struct RetryPolicy {
  // Attempts in a row that bring no new Ack before giving up; with a timer,
  // at least this many and as many more as the measured loss needs
  // (RetransmitTimer::attempts_for).
  int max_attempts = 6;
  std::chrono::milliseconds first_backoff{200};
  std::chrono::milliseconds max_backoff{10000};
  uint64_t jitter_seed = 0;  // 0: from the clock
};

// The wait before retry number `attempt` (1, 2, ...): uniform in [d/2, d]
// with d = min(max_backoff, first_backoff * 2^(attempt-1)).
std::chrono::milliseconds backoff_delay(int attempt, const RetryPolicy& policy, Rng& rng);

struct HelloFields {
  std::string federation;
  std::string site_name;
  wire::Role role = wire::Role::SITE;
  uint16_t min_version = kMinProtocolVersion;
  uint16_t max_version = kProtocolVersion;
};

// Sends Hello and waits for Welcome. A Reject (e.g. no common version)
// comes back as kInvalidArgument with the receiver's reason.
Result<uint16_t> say_hello(ClientChannel& socket, const HelloFields& hello, std::chrono::milliseconds timeout);

Result<UploadOutcome> upload_update(ClientChannel& socket, const PreparedUpdate& update, const UploadOptions& options);

// upload_update, retried under `retry` while the failure is kUnavailable (no
// reply, no connection). A Reject or an accepted update ends it; so does any
// other error. `attempts` (if given) receives how many uploads were made.
// An attempt that got a new Ack from the receiver does not count against
// max_attempts.
Result<UploadOutcome> upload_with_retries(ClientChannel& socket, const PreparedUpdate& update,
                                          const UploadOptions& options, const RetryPolicy& retry,
                                          int* attempts = nullptr);

// Waits for the handshake: ok once connected; kUnavailable if the server
// refused our key or nothing happened within timeout.
Status wait_connected(ClientChannel& socket, std::chrono::milliseconds timeout);

}  // namespace fedmesh::protocol
