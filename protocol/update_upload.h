// The sending side of an update transfer over a ClientSocket: Hello, then
// the header, then the chunks in a window, resuming from the receiver's
// Ack{nextChunk} when a header is resent.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "base/status.h"
#include "protocol/transport.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

struct UploadOptions {
  uint32_t window_chunks = 16;                       // chunks sent ahead of the last Ack
  std::chrono::milliseconds reply_timeout{10000};    // no reply this long: kUnavailable
  std::optional<uint32_t> stop_after_chunks;         // tests: abandon the transfer after this many chunks
};

struct UploadOutcome {
  bool accepted = false;                  // Ack{complete}
  std::optional<Rejection> rejection;     // the receiver's Reject
  uint32_t started_at_chunk = 0;          // > 0: resumed
  uint32_t chunks_sent = 0;
};

struct HelloFields {
  std::string federation;
  std::string site_name;
  wire::Role role = wire::Role::SITE;
  uint16_t min_version = kMinProtocolVersion;
  uint16_t max_version = kProtocolVersion;
};

// Sends Hello and waits for Welcome. A Reject (e.g. no common version)
// comes back as kInvalidArgument with the receiver's reason.
Result<uint16_t> say_hello(ClientSocket& socket, const HelloFields& hello, std::chrono::milliseconds timeout);

Result<UploadOutcome> upload_update(ClientSocket& socket, const PreparedUpdate& update, const UploadOptions& options);

// Waits for the handshake: ok once connected; kUnavailable if the server
// refused our key or nothing happened within timeout.
Status wait_connected(ClientSocket& socket, std::chrono::milliseconds timeout);

}  // namespace fedmesh::protocol
