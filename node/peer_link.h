// A gossip peer's link to one member: a thread that owns the client socket
// to that member and sends, in order, what the peer queued for it, so that a
// slow, delayed or paced link (transport.faults, or a congested network)
// holds back its own messages only, beside training, merging and the other
// links. It also takes the member's replies off the socket, and reports the
// fate of every share: delivered (every message of it handed to the
// socket), or not (a message could not be sent: the rest of that share is
// dropped, and the peer takes the share back).
//
// Everything the peer reads comes through take(), on the peer's thread;
// the socket is used on the link's thread only (ZeroMQ sockets are not
// thread-safe).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "base/threads.h"
#include "protocol/transport.h"

namespace fedmesh::node {

class PeerLink {
 public:
  using Dial = std::function<Result<std::unique_ptr<protocol::ClientChannel>>()>;
  // Dials lazily (at the first message, and again after a failed dial).
  // The link's thread comes from `threads` and reads time from `clock`
  // (the runtime's: protocol::RuntimeEnvironment).
  PeerLink(std::string member, Dial dial, std::chrono::milliseconds send_timeout, Clock& clock = real_clock(),
           Threads& threads = real_threads());
  // Sends what is queued first (for at most 2 s from close(), plus the
  // message being sent; what is left is reported undelivered), then stops.
  ~PeerLink();
  // Starts that: a peer closes all its links first, so that they drain
  // side by side, then destroys them.
  void close();
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // A link holds at most this many messages: a member that takes them
  // slower than they come gets no more until it catches up.
  static constexpr size_t kMaxQueued = 256;
  // Queues a message that is no share's (lost if the socket cannot take it).
  // False (and nothing queued) when the link holds kMaxQueued already.
  bool send(protocol::SharedMessage message);
  // Queues all of a share's messages (share 0: no share), or none (false)
  // when they do not fit.
  bool send_share(std::vector<protocol::SharedMessage> messages, uint64_t share);

  struct ShareOutcome {
    uint64_t share = 0;
    bool delivered = false;
    uint64_t bytes = 0;  // handed to the socket (all of the share's when delivered)
  };
  struct Report {
    std::vector<protocol::Incoming> replies;
    std::vector<ShareOutcome> shares;
    std::vector<std::string> warnings;
  };
  // What happened since the last call.
  Report take();
  const std::string& member() const { return member_; }
  // Messages queued and not yet sent.
  size_t queued();
  // The socket's counters once it is dialed (null before): atomics, read
  // from any thread while the link lives.
  const protocol::TransportCounters* counters() const { return counters_.load(std::memory_order_acquire); }

 private:
  struct Queued {
    protocol::SharedMessage message;
    uint64_t share = 0;
    bool last = false;
  };
  void run();
  void fail_share(uint64_t share, uint64_t bytes);

  std::string member_;
  Dial dial_;
  std::chrono::milliseconds send_timeout_;
  std::unique_ptr<protocol::ClientChannel> socket_;  // the link thread's only
  std::atomic<const protocol::TransportCounters*> counters_{nullptr};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Queued> queue_;
  Report report_;
  bool stopping_ = false;
  Clock::time_point drain_until_;  // set with stopping_
  std::set<uint64_t> failed_;    // shares whose rest is dropped (link thread)
  std::map<uint64_t, uint64_t> share_bytes_;  // bytes of shares in progress (link thread)
  Clock& clock_;
  Threads& threads_;
  std::unique_ptr<Threads::Handle> thread_;  // last: started once the rest is set
};

}  // namespace fedmesh::node
