// Threads as the runtimes start, wait on and join them. A runtime that runs
// a helper thread beside its own (a gossip peer's link to each member,
// node/peer_link.h) starts it and waits for work through this interface.
// Production binds real_threads(): std::thread and the condition variable
// itself. The fault simulator (sim/vopr) binds threads that run one at a
// time on its virtual time, so a helper's wait hands control back to its
// scheduler like any other wait; the helper's code is the same in both.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>

#include "base/clock.h"

namespace fedmesh {

class Threads {
 public:
  class Handle {
   public:
    virtual ~Handle() = default;
    // Waits until the thread's body has returned (or thrown).
    virtual void join() = 0;
  };

  virtual ~Threads() = default;
  // Runs `body` on a new thread beside the caller's.
  virtual std::unique_ptr<Handle> start(std::function<void()> body) = 0;
  // Waits on `changed` (with `lock` held, as std::condition_variable does)
  // for at most `timeout`: the caller checks its condition again after, as
  // after any wake-up, which may come early or without a notification.
  virtual void wait_for(std::condition_variable& changed, std::unique_lock<std::mutex>& lock,
                        Clock::duration timeout) = 0;
  // Wakes every thread waiting on `changed` (through wait_for).
  virtual void notify_all(std::condition_variable& changed) = 0;
};

// std::thread and std::condition_variable::wait_for.
Threads& real_threads();

}  // namespace fedmesh
