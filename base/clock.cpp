#include "base/clock.h"

#include <thread>

namespace fedmesh {
namespace {

class RealClock final : public Clock {
 public:
  time_point now() override { return std::chrono::steady_clock::now(); }
  uint64_t unix_micros() override {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
  }
  void sleep_for(duration d) override {
    if (d > duration::zero()) std::this_thread::sleep_for(d);
  }
};

}  // namespace

Clock& real_clock() {
  static RealClock clock;
  return clock;
}

}  // namespace fedmesh
