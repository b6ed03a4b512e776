// How often one peer's refusals are written to the log: at most one line per
// key per interval. The refusals left out in between are counted, and the
// key's next line says how many ("suppressed K similar"), so a flooding key
// costs a bounded number of lines while every refusal is still counted in
// the metrics. Time comes in as an argument (the caller's clock).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace fedmesh::protocol {

inline constexpr std::chrono::milliseconds kRefusalLogInterval{10'000};
inline constexpr size_t kMaxRefusalLogKeys = 1u << 12;  // keys remembered at once

class RefusalLog {
 public:
  using Clock = std::chrono::steady_clock;
  explicit RefusalLog(std::chrono::milliseconds interval = kRefusalLogInterval) : interval_(interval) {}

  // A refusal from `key` at `now`: nullopt if it is not to be logged (it is
  // counted as suppressed), else how many of the key's refusals were
  // suppressed since its last logged line.
  std::optional<uint64_t> admit(std::string_view key, Clock::time_point now) {
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= kMaxRefusalLogKeys) forget_quiet(now);
      keys_.emplace(std::string(key), Entry{now, 0});
      return uint64_t{0};
    }
    Entry& entry = it->second;
    if (now - entry.last_logged < interval_) {
      ++entry.suppressed;
      ++suppressed_total_;
      return std::nullopt;
    }
    const uint64_t suppressed = entry.suppressed;
    entry = Entry{now, 0};
    return suppressed;
  }

  uint64_t suppressed_total() const { return suppressed_total_; }

 private:
  struct Entry {
    Clock::time_point last_logged;
    uint64_t suppressed = 0;
  };
  // Keys whose interval has passed have nothing to hold back; if every key
  // is still within its interval, the oldest goes (its next refusal logs).
  void forget_quiet(Clock::time_point now) {
    std::erase_if(keys_, [&](const auto& item) { return now - item.second.last_logged >= interval_; });
    if (keys_.size() < kMaxRefusalLogKeys) return;
    auto oldest = keys_.begin();
    for (auto it = keys_.begin(); it != keys_.end(); ++it) {
      if (it->second.last_logged < oldest->second.last_logged) oldest = it;
    }
    keys_.erase(oldest);
  }

  std::chrono::milliseconds interval_;
  std::map<std::string, Entry, std::less<>> keys_;
  uint64_t suppressed_total_ = 0;
};

}  // namespace fedmesh::protocol
