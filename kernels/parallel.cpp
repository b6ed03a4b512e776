#include "kernels/parallel.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FEDMESH_CPU_RELAX() _mm_pause()
#else
#define FEDMESH_CPU_RELAX() std::this_thread::yield()
#endif

namespace fedmesh {
namespace {

thread_local bool tls_inside_parallel_region = false;

// Workers spin this many pauses (tens of microseconds) for the next region
// before sleeping: training issues many short regions back to back.
constexpr int kSpinIterations = 4000;

// generation_ packs a region's sequence number (high bits) with its task
// count (low kCountBits bits), so a worker reads both in one load: read
// separately, a worker idle in region N could pair N's generation with region
// N+1's count (published meanwhile), run N+1's task, then run it again on
// seeing N+1, decrementing pending_ twice and letting run() return while
// another worker still uses the task.
constexpr int kCountBits = 16;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
constexpr uint64_t kOneGeneration = uint64_t{1} << kCountBits;

class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    threads = std::min(threads, static_cast<int>(kCountMask));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~WorkerPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_.store(true);
      generation_.fetch_add(kOneGeneration, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls task(i) for i in [0, count) with count <= threads(); index 0 on the caller.
  void run(int count, const std::function<void(int)>& task) {
    std::lock_guard serialize(run_mutex_);  // one parallel region at a time
    task_ = &task;
    pending_.store(count - 1, std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex_);
      const uint64_t next = (generation_.load(std::memory_order_relaxed) & ~kCountMask) + kOneGeneration;
      generation_.store(next | static_cast<uint64_t>(count), std::memory_order_release);
    }
    wake_.notify_all();
    tls_inside_parallel_region = true;
    task(0);
    tls_inside_parallel_region = false;
    for (int i = 0; i < kSpinIterations && pending_.load(std::memory_order_acquire) != 0; ++i) FEDMESH_CPU_RELAX();
    if (pending_.load(std::memory_order_acquire) != 0) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
  }

 private:
  void work(int index) {
    tls_inside_parallel_region = true;
    uint64_t seen = 0;
    for (;;) {
      for (int i = 0; i < kSpinIterations && generation_.load(std::memory_order_acquire) == seen; ++i)
        FEDMESH_CPU_RELAX();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      if (stopping_.load()) return;
      seen = generation_.load(std::memory_order_acquire);
      if (index >= static_cast<int>(seen & kCountMask)) continue;  // not needed in this region
      (*task_)(index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
};

std::mutex pool_mutex;
std::unique_ptr<WorkerPool> pool;  // guarded by pool_mutex for (re)creation
int configured_threads = 0;

int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

WorkerPool& worker_pool() {
  std::lock_guard lock(pool_mutex);
  if (!pool) {
    if (configured_threads <= 0) configured_threads = hardware_threads();
    // GEMMs are split across this pool (see sgemm), so OpenBLAS runs each
    // piece on one thread: its own pool would spin beside ours and steal cores.
    openblas_set_num_threads(1);
    pool = std::make_unique<WorkerPool>(configured_threads);
  }
  return *pool;
}

}  // namespace

void set_cpu_threads(int n) {
  std::lock_guard lock(pool_mutex);
  configured_threads = n <= 0 ? hardware_threads() : n;
  pool.reset();
}

int cpu_threads() { return worker_pool().threads(); }

bool inside_parallel_region() { return tls_inside_parallel_region; }

void parallel_each(size_t count, const std::function<void(size_t)>& work) {
  parallel_for(static_cast<int64_t>(count), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) work(static_cast<size_t>(i));
  });
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (tls_inside_parallel_region || n < 2 * grain) {
    body(0, n);
    return;
  }
  WorkerPool& workers = worker_pool();
  const int64_t chunks = std::min<int64_t>(workers.threads(), n / grain);
  if (chunks <= 1) {
    body(0, n);
    return;
  }
  const std::function<void(int)> task = [&](int i) {
    const int64_t begin = n * i / chunks;
    const int64_t end = n * (i + 1) / chunks;
    body(begin, end);
  };
  workers.run(static_cast<int>(chunks), task);
}

}  // namespace fedmesh
