#include "node/peer_link.h"

#include <utility>

namespace fedmesh::node {

namespace {

// How long a closing link goes on sending what was queued (a peer that
// leaves says so to a few members; a dead link is not waited for longer).
constexpr auto kDrainOnClose = std::chrono::seconds(2);
constexpr int kRepliesPerPass = 64;
// An idle link looks at its socket for replies this often (a message to
// send wakes it at once).
constexpr auto kIdleWait = std::chrono::milliseconds(50);

}  // namespace

PeerLink::PeerLink(std::string member, Dial dial, std::chrono::milliseconds send_timeout, Clock& clock,
                   Threads& threads)
    : member_(std::move(member)),
      dial_(std::move(dial)),
      send_timeout_(send_timeout),
      clock_(clock),
      threads_(threads),
      thread_(threads_.start([this] { run(); })) {}

PeerLink::~PeerLink() {
  close();
  thread_->join();
}

void PeerLink::close() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    drain_until_ = clock_.now() + kDrainOnClose;
  }
  threads_.notify_all(changed_);
}

bool PeerLink::send(protocol::SharedMessage message) {
  return send_share({std::move(message)}, 0);
}

bool PeerLink::send_share(std::vector<protocol::SharedMessage> messages, uint64_t share) {
  if (messages.empty()) return false;
  {
    std::lock_guard lock(mutex_);
    if (queue_.size() + messages.size() > kMaxQueued) return false;
    for (size_t i = 0; i < messages.size(); ++i) queue_.push_back({std::move(messages[i]), share, i + 1 == messages.size()});
  }
  threads_.notify_all(changed_);
  return true;
}

PeerLink::Report PeerLink::take() {
  std::lock_guard lock(mutex_);
  return std::exchange(report_, Report{});
}

size_t PeerLink::queued() {
  std::lock_guard lock(mutex_);
  return queue_.size();
}

void PeerLink::fail_share(uint64_t share, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  report_.shares.push_back({share, false, bytes});
}

void PeerLink::run() {
  for (;;) {
    Queued next;
    bool have = false;
    {
      std::unique_lock lock(mutex_);
      if (!stopping_ && queue_.empty()) threads_.wait_for(changed_, lock, kIdleWait);
      const bool out_of_time = stopping_ && clock_.now() > drain_until_;
      if (!queue_.empty() && !out_of_time) {
        next = std::move(queue_.front());
        queue_.pop_front();
        have = true;
      } else if (stopping_) {
        // What is left is not sent: its shares are reported undelivered.
        std::set<uint64_t> dropped;
        for (const Queued& q : queue_) {
          if (q.share != 0 && !failed_.contains(q.share)) dropped.insert(q.share);
        }
        for (const uint64_t share : dropped) report_.shares.push_back({share, false, share_bytes_[share]});
        queue_.clear();
        return;
      }
    }
    if (have) {
      const uint64_t share = next.share;
      if (share != 0 && failed_.contains(share)) {
        if (next.last) failed_.erase(share);  // nothing more of it will come
      } else {
        Status sent = unavailable("not connected");
        if (!socket_) {
          Result<std::unique_ptr<protocol::ClientChannel>> dialed = dial_();
          if (dialed.is_ok()) {
            socket_ = std::move(*dialed);
            counters_.store(&socket_->counters(), std::memory_order_release);
          } else {
            std::lock_guard lock(mutex_);
            report_.warnings.push_back("cannot dial " + member_ + ": " + dialed.status().message());
          }
        }
        // With transport faults the socket holds a message back here, on
        // this link's thread only.
        if (socket_) sent = socket_->send(next.message, send_timeout_);
        if (share != 0) {
          if (!sent.is_ok()) {
            if (!next.last) failed_.insert(share);
            fail_share(share, share_bytes_[share]);
            share_bytes_.erase(share);
          } else {
            share_bytes_[share] += next.message.size();
            if (next.last) {
              std::lock_guard lock(mutex_);
              report_.shares.push_back({share, true, share_bytes_[share]});
              share_bytes_.erase(share);
            }
          }
        }
      }
    }
    if (!socket_) continue;
    for (int i = 0; i < kRepliesPerPass; ++i) {
      Result<std::optional<protocol::Incoming>> incoming = socket_->receive(std::chrono::milliseconds(0));
      if (!incoming.is_ok() || !incoming->has_value()) break;
      std::lock_guard lock(mutex_);
      report_.replies.push_back(std::move(**incoming));
    }
  }
}

}  // namespace fedmesh::node
