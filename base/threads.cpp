#include "base/threads.h"

#include <thread>

namespace fedmesh {
namespace {

class RealThreads final : public Threads {
 public:
  class RealHandle final : public Handle {
   public:
    explicit RealHandle(std::function<void()> body) : thread_(std::move(body)) {}
    ~RealHandle() override {
      if (thread_.joinable()) thread_.join();
    }
    void join() override {
      if (thread_.joinable()) thread_.join();
    }

   private:
    std::thread thread_;
  };

  std::unique_ptr<Handle> start(std::function<void()> body) override {
    return std::make_unique<RealHandle>(std::move(body));
  }
  void wait_for(std::condition_variable& changed, std::unique_lock<std::mutex>& lock,
                Clock::duration timeout) override {
    changed.wait_for(lock, timeout);
  }
  void notify_all(std::condition_variable& changed) override { changed.notify_all(); }
};

}  // namespace

Threads& real_threads() {
  static RealThreads threads;
  return threads;
}

}  // namespace fedmesh
