// What the aggregator lets the model's downloads hold at once, as data.
//
// A model chunk asked for is encoded from the model where it lies and
// handed to ZeroMQ; it lives until ZeroMQ has encrypted it onto every
// connection it was queued for. Two bounds keep those copies flat however
// many sites download:
//   - QueuedModelReplies: per peer, at most two windows queued, so one that
//     does not read its replies holds no more (docs/security-model.md);
//   - ModelServingBudget: all peers together, at most `serving_mb` of chunk
//     copies alive (the publisher shares one copy of a chunk among every
//     peer it is queued for, so sites downloading the same chunks cost one
//     copy), granted first come first served.
// A request past either bound is answered BUSY; the site keeps what it holds
// and asks again from its first missing chunk (protocol/model_transfer.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "protocol/transport.h"

namespace fedmesh::protocol {

inline constexpr uint32_t kDefaultModelWindow = 8;  // chunks sent per ModelRequest
inline constexpr uint32_t kMaxModelWindow = 64;
// Model replies to one peer (all its connections together) handed to the
// transport and not yet taken off its queue: two windows.
inline constexpr size_t kMaxQueuedModelRepliesPerPeer = 2 * kDefaultModelWindow;
inline constexpr size_t kMaxTrackedModelReplyPeers = 4096;
// Chunk copies alive for downloads, all peers together: two peers' two
// windows of 4 MiB chunks, so that two sites download as fast as before the
// bound and twelve hold no more than two.
inline constexpr uint64_t kDefaultModelServingBytes = uint64_t{128} << 20;
// A peer refused for the budget keeps its place in line while it asks again
// within this long (a site asks again within a second, FetchOptions).
inline constexpr std::chrono::milliseconds kModelServingHoldPlace{2000};

// Counts, per peer, the model replies queued for sending: a reply counts
// from track() until the transport drops its last reference to it, which
// ZeroMQ does once the message is encrypted onto the connection or the
// connection closes. A peer that does not read its replies thus holds at
// most max_per_peer of them; further requests are refused (busy) instead of
// queued. Peers are roster names, so the table is bounded by the roster
// (kMaxTrackedModelReplyPeers where they are not).
class QueuedModelReplies {
 public:
  explicit QueuedModelReplies(size_t max_per_peer = kMaxQueuedModelRepliesPerPeer) : max_per_peer_(max_per_peer) {}
  // Room for `count` more replies to `peer`.
  bool has_room(const std::string& peer, size_t count) const;
  // `message` as a reply to `peer`, counted while any copy of the result lives.
  SharedMessage track(const std::string& peer, const SharedMessage& message);
  size_t queued(const std::string& peer) const;
  size_t max_per_peer() const { return max_per_peer_; }

 private:
  size_t max_per_peer_;
  std::map<std::string, std::shared_ptr<std::atomic<size_t>>> counts_;
};

// The bytes of model chunk copies all downloads may hold at once. A request
// that needs no new copy (every chunk it asks for is alive, queued for
// another peer) adds nothing and is always granted. One that does is granted
// when the copies fit beside those alive (or nothing is alive, so that a
// window larger than the budget still moves), and when no peer refused
// before it is still waiting: refused peers queue in the order they first
// asked, and the copies freed go to the first of them, so a site behind
// the others is not passed over for ever. A waiting peer that does not ask
// again within hold_place (gone, or served otherwise) loses its place.
// Time is passed in, so the order is the same on a simulated clock.
class ModelServingBudget {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  explicit ModelServingBudget(uint64_t max_bytes = kDefaultModelServingBytes,
                              std::chrono::milliseconds hold_place = kModelServingHoldPlace)
      : max_bytes_(max_bytes), hold_place_(hold_place) {}

  // Whether `peer` may have `new_bytes` of new chunk copies now, with
  // `live_bytes` alive. A refusal puts the peer in line (or keeps its place).
  bool admit(const std::string& peer, uint64_t live_bytes, uint64_t new_bytes, TimePoint now);

  uint64_t max_bytes() const { return max_bytes_; }
  // Peers in line, and where `peer` stands in it (0: first; -1: not in line).
  size_t waiting() const { return line_.size(); }
  int position(const std::string& peer) const;

 private:
  struct Waiter {
    std::string peer;
    TimePoint last_asked;
  };
  uint64_t max_bytes_;
  std::chrono::milliseconds hold_place_;
  std::deque<Waiter> line_;
};

}  // namespace fedmesh::protocol
