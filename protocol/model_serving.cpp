#include "protocol/model_serving.h"

#include <algorithm>

namespace fedmesh::protocol {

bool QueuedModelReplies::has_room(const std::string& peer, size_t count) const {
  return queued(peer) + count <= max_per_peer_;
}

size_t QueuedModelReplies::queued(const std::string& peer) const {
  const auto found = counts_.find(peer);
  return found == counts_.end() ? 0 : found->second->load();
}

SharedMessage QueuedModelReplies::track(const std::string& peer, const SharedMessage& message) {
  // Peers are roster names; a table grown past that (insecure mode names
  // each connection) forgets the peers with nothing queued.
  if (counts_.size() >= kMaxTrackedModelReplyPeers) {
    std::erase_if(counts_, [](const auto& entry) { return entry.second->load() == 0; });
  }
  auto& count = counts_[peer];
  if (!count) count = std::make_shared<std::atomic<size_t>>(0);
  // Released on ZeroMQ's I/O thread, hence the atomic count.
  struct Counted {
    Counted(std::shared_ptr<const OutgoingMessage> m, std::shared_ptr<std::atomic<size_t>> c)
        : message(std::move(m)), count(std::move(c)) {
      count->fetch_add(1);
    }
    ~Counted() { count->fetch_sub(1); }
    Counted(const Counted&) = delete;
    Counted& operator=(const Counted&) = delete;
    std::shared_ptr<const OutgoingMessage> message;
    std::shared_ptr<std::atomic<size_t>> count;
  };
  auto counted = std::make_shared<Counted>(message.shared(), count);
  return SharedMessage(std::shared_ptr<const OutgoingMessage>(counted, counted->message.get()));
}

bool ModelServingBudget::admit(const std::string& peer, uint64_t live_bytes, uint64_t new_bytes, TimePoint now) {
  if (new_bytes == 0) return true;  // shares copies already alive
  std::erase_if(line_, [&](const Waiter& w) { return w.peer != peer && now - w.last_asked > hold_place_; });
  const bool fits = live_bytes == 0 || (live_bytes <= max_bytes_ && new_bytes <= max_bytes_ - live_bytes);
  const auto place = std::find_if(line_.begin(), line_.end(), [&](const Waiter& w) { return w.peer == peer; });
  if (fits && (line_.empty() || place == line_.begin())) {
    if (place != line_.end()) line_.erase(place);
    return true;
  }
  if (place == line_.end()) {
    // Peers are roster names; in insecure mode each connection is one, and
    // a line that long is not kept (the newcomer is refused unplaced).
    if (line_.size() < kMaxTrackedModelReplyPeers) line_.push_back({peer, now});
  } else {
    place->last_asked = now;
  }
  return false;
}

int ModelServingBudget::position(const std::string& peer) const {
  for (size_t i = 0; i < line_.size(); ++i) {
    if (line_[i].peer == peer) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace fedmesh::protocol
