// Per-peer rate limits: a token bucket for messages and one for bytes, so
// that one site (even an authenticated one) cannot crowd out the others.
// Time comes in as an argument (the caller's clock), so tests drive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace fedmesh::protocol {

inline constexpr double kDefaultMessagesPerSecond = 2000;
inline constexpr double kDefaultBytesPerSecond = 2e9;
inline constexpr double kBurstSeconds = 2.0;  // a bucket holds this many seconds of its rate
inline constexpr size_t kMaxRateLimitedPeers = 1u << 16;

struct RateLimits {
  double messages_per_second = kDefaultMessagesPerSecond;
  double bytes_per_second = kDefaultBytesPerSecond;
};

class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit RateLimiter(RateLimits limits) : limits_(limits) {}

  // true: admit a message of `bytes` from `peer` now (and charge it).
  bool admit(std::string_view peer, uint64_t bytes, Clock::time_point now) {
    auto it = buckets_.find(peer);
    if (it == buckets_.end()) {
      if (buckets_.size() >= kMaxRateLimitedPeers) buckets_.clear();  // peers are roster-bounded; this is a backstop
      it = buckets_.emplace(std::string(peer), Bucket{limits_.messages_per_second * kBurstSeconds,
                                                      limits_.bytes_per_second * kBurstSeconds, now}).first;
    }
    Bucket& b = it->second;
    const double elapsed = std::chrono::duration<double>(now - b.last).count();
    if (elapsed > 0) {
      b.messages = std::min(limits_.messages_per_second * kBurstSeconds, b.messages + elapsed * limits_.messages_per_second);
      b.bytes = std::min(limits_.bytes_per_second * kBurstSeconds, b.bytes + elapsed * limits_.bytes_per_second);
      b.last = now;
    }
    if (b.messages < 1.0 || b.bytes < static_cast<double>(bytes)) return false;
    b.messages -= 1.0;
    b.bytes -= static_cast<double>(bytes);
    return true;
  }

 private:
  struct Bucket {
    double messages;
    double bytes;
    Clock::time_point last;
  };
  RateLimits limits_;
  std::map<std::string, Bucket, std::less<>> buckets_;
};

}  // namespace fedmesh::protocol
