#include "kernels/step_profile.h"

#include <array>
#include <atomic>
#include <chrono>
#include <thread>

#include "kernels/parallel.h"

namespace fedmesh {
namespace {

std::atomic<bool> enabled{false};
std::thread::id profiled_thread;
std::array<std::atomic<int64_t>, 5> totals_ns{};
thread_local ProfileScope* innermost = nullptr;
thread_local bool paused = false;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void enable_step_profile() {
  for (auto& total : totals_ns) total.store(0, std::memory_order_relaxed);
  profiled_thread = std::this_thread::get_id();
  enabled.store(true, std::memory_order_release);
}

void disable_step_profile() { enabled.store(false, std::memory_order_release); }

StepTimes step_profile_totals() {
  const auto seconds = [](StepTime kind) {
    return static_cast<double>(totals_ns[static_cast<size_t>(kind)].load(std::memory_order_relaxed)) * 1e-9;
  };
  return {seconds(StepTime::kGemm), seconds(StepTime::kKernels), seconds(StepTime::kCommunication),
          seconds(StepTime::kData), seconds(StepTime::kDeviceWait)};
}

ProfilePause::ProfilePause() : was_paused_(paused) { paused = true; }
ProfilePause::~ProfilePause() { paused = was_paused_; }

ProfileScope::ProfileScope(StepTime kind)
    : kind_(kind),
      active_(enabled.load(std::memory_order_relaxed) && !paused && std::this_thread::get_id() == profiled_thread &&
              !inside_parallel_region()) {
  if (!active_) return;
  parent_ = innermost;
  innermost = this;
  start_ns_ = now_ns();
}

ProfileScope::~ProfileScope() {
  if (!active_) return;
  const int64_t elapsed = now_ns() - start_ns_;
  totals_ns[static_cast<size_t>(kind_)].fetch_add(elapsed - children_ns_, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->children_ns_ += elapsed;
  innermost = parent_;
}

}  // namespace fedmesh
