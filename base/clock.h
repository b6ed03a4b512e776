// Time as the runtimes see it: a steady clock to measure and wait by, the
// wall clock for what must survive a restart (a round's opening time, update
// sequences), and sleeping. Production binds real_clock(); the fault
// simulator (sim/vopr) binds a virtual clock whose sleep hands control back
// to its scheduler, so the same runtime code runs on seeded virtual time.
#pragma once

#include <chrono>
#include <cstdint>

namespace fedmesh {

class Clock {
 public:
  using duration = std::chrono::steady_clock::duration;
  using time_point = std::chrono::steady_clock::time_point;

  virtual ~Clock() = default;
  virtual time_point now() = 0;
  // Microseconds since the Unix epoch.
  virtual uint64_t unix_micros() = 0;
  virtual void sleep_for(duration d) = 0;

  uint64_t unix_ms() { return unix_micros() / 1000; }
  template <class Rep, class Period>
  void sleep_for(std::chrono::duration<Rep, Period> d) {
    sleep_for(std::chrono::duration_cast<duration>(d));
  }
  // Seconds from `since` to now.
  double seconds_since(time_point since) { return std::chrono::duration<double>(now() - since).count(); }
};

// std::chrono::steady_clock, system_clock and std::this_thread::sleep_for.
Clock& real_clock();

}  // namespace fedmesh
