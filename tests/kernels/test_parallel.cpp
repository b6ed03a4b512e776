// parallel_for and the thread count (kernels/parallel.h): every index visited
// exactly once, chunks as documented, nesting runs inline, and concurrent
// callers from separate threads both complete. No timing is asserted.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using namespace fedmesh::testing;  // NOLINT: test helpers

int hardware_threads() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

struct Coverage {
  std::vector<int> visits;                         // per index
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [begin, end) as passed to body
};

// Runs parallel_for(n, grain) recording every chunk and every index visited.
Coverage run_and_record(int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> visits(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::mutex chunks_mutex;
  Coverage coverage;
  parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    {
      std::lock_guard lock(chunks_mutex);
      coverage.chunks.emplace_back(begin, end);
    }
    for (int64_t i = begin; i < end; ++i) visits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
  });
  for (const auto& v : visits) coverage.visits.push_back(v.load());
  std::sort(coverage.chunks.begin(), coverage.chunks.end());
  return coverage;
}

void expect_exact_cover(int64_t n, int64_t grain) {
  SCOPED_TRACE("n=" + std::to_string(n) + " grain=" + std::to_string(grain) +
               " threads=" + std::to_string(cpu_threads()));
  const Coverage c = run_and_record(n, grain);
  for (size_t i = 0; i < c.visits.size(); ++i) ASSERT_EQ(c.visits[i], 1) << "index " << i;
  if (n <= 0) {
    EXPECT_TRUE(c.chunks.empty()) << "no work, no calls";
    return;
  }
  // Chunks tile [0, n) in order, none empty, at most cpu_threads() of them,
  // and when split, each holds at least `grain` items.
  ASSERT_FALSE(c.chunks.empty());
  EXPECT_LE(static_cast<int>(c.chunks.size()), cpu_threads());
  int64_t next = 0;
  for (const auto& [begin, end] : c.chunks) {
    EXPECT_EQ(begin, next);
    EXPECT_LT(begin, end) << "empty chunk";
    if (c.chunks.size() > 1) {
      EXPECT_GE(end - begin, std::max<int64_t>(grain, 1));
    }
    next = end;
  }
  EXPECT_EQ(next, n);
}

TEST(ParallelFor, VisitsEveryIndexExactlyOnce) {
  ThreadCountGuard restore;
  const int64_t sizes[] = {-5, 0, 1, 2, 3, 7, 16, 17, 100, 1000, 4097, 65537, 100003};
  const int64_t grains[] = {-1, 0, 1, 2, 3, 7, 16, 1000, 1 << 14, 1 << 20};
  for (const int threads : {1, 2, 3, 4}) {
    set_cpu_threads(threads);
    for (const int64_t n : sizes)
      for (const int64_t grain : grains) expect_exact_cover(n, grain);
  }
}

TEST(ParallelFor, SplitsLargeWorkAcrossThreads) {
  // With 3 threads and plenty of work, the range is split (the pool is used),
  // into no more chunks than threads.
  ThreadCountGuard restore;
  set_cpu_threads(3);
  const Coverage c = run_and_record(300000, 1000);
  EXPECT_GT(c.chunks.size(), 1u);
  EXPECT_LE(c.chunks.size(), 3u);
  // Small work (n < 2 * grain) runs as one inline chunk.
  const Coverage small = run_and_record(1999, 1000);
  ASSERT_EQ(small.chunks.size(), 1u);
  EXPECT_EQ(small.chunks[0], std::make_pair(int64_t{0}, int64_t{1999}));
}

TEST(ParallelFor, NestedCallsRunInlineAndCoverEverything) {
  ThreadCountGuard restore;
  for (const int threads : {1, 3}) {
    set_cpu_threads(threads);
    const int64_t outer = 64, inner = 5000;
    std::vector<std::atomic<int>> visits(static_cast<size_t>(outer * inner));
    std::atomic<int> inner_chunks{0}, inner_calls{0}, foreign_threads{0};
    parallel_for(outer, 1, [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        const std::thread::id caller = std::this_thread::get_id();
        inner_calls.fetch_add(1);
        parallel_for(inner, 1, [&](int64_t i0, int64_t i1) {
          inner_chunks.fetch_add(1);
          if (std::this_thread::get_id() != caller) foreign_threads.fetch_add(1);
          for (int64_t i = i0; i < i1; ++i) visits[static_cast<size_t>(o * inner + i)].fetch_add(1);
        });
      }
    });
    EXPECT_EQ(inner_calls.load(), outer);
    // Inline: one chunk per nested call, on the calling thread.
    EXPECT_EQ(inner_chunks.load(), outer) << "threads=" << threads;
    EXPECT_EQ(foreign_threads.load(), 0);
    for (size_t i = 0; i < visits.size(); ++i) ASSERT_EQ(visits[i].load(), 1) << "index " << i;
  }
}

TEST(ParallelFor, SetCpuThreadsReportsTheCount) {
  ThreadCountGuard restore;
  for (const int threads : {1, 2, 3}) {
    set_cpu_threads(threads);
    EXPECT_EQ(cpu_threads(), threads);
    expect_exact_cover(100003, 1);
  }
  set_cpu_threads(0);  // 0: all cores
  EXPECT_EQ(cpu_threads(), hardware_threads());
  expect_exact_cover(100003, 1);
  set_cpu_threads(-2);  // negative: also all cores
  EXPECT_EQ(cpu_threads(), hardware_threads());
  // Changing the count repeatedly (pool rebuilt each time) keeps working.
  for (int round = 0; round < 20; ++round) {
    set_cpu_threads(1 + round % 4);
    EXPECT_EQ(cpu_threads(), 1 + round % 4);
    expect_exact_cover(10007, 7);
  }
}

TEST(ParallelFor, ConcurrentCallersBothComplete) {
  ThreadCountGuard restore;
  for (const int threads : {1, 2, 3}) {
    set_cpu_threads(threads);
    // Two callers, each running many parallel_for calls of different sizes
    // and summing index values: exact integer sums check coverage.
    const auto caller = [](int64_t seed, bool* ok) {
      *ok = true;
      for (int round = 0; round < 200; ++round) {
        const int64_t n = 1 + (seed * 7919 + round * 104729) % 50000;
        std::atomic<int64_t> total{0}, count{0};
        parallel_for(n, 64, [&](int64_t begin, int64_t end) {
          int64_t local = 0;
          for (int64_t i = begin; i < end; ++i) local += i;
          total.fetch_add(local);
          count.fetch_add(end - begin);
        });
        if (count.load() != n || total.load() != n * (n - 1) / 2) *ok = false;
      }
    };
    bool first_ok = false, second_ok = false;
    std::thread first(caller, 1, &first_ok);
    std::thread second(caller, 2, &second_ok);
    first.join();
    second.join();
    EXPECT_TRUE(first_ok) << "threads=" << threads;
    EXPECT_TRUE(second_ok) << "threads=" << threads;
  }
}

TEST(ParallelFor, BackToBackRegionsWithIdleWorkers) {
  // Regions of 2..threads+1 chunks in quick succession, so that in many of
  // them some workers sit idle and the next region is published while they
  // wake. Each region must still run every chunk exactly once, and return
  // only after all of them finished. (A worker that paired one region's
  // generation with the next region's count ran a chunk twice and another
  // not at all; ThreadSanitizer reports that race on every run, this loop
  // only sometimes.)
  ThreadCountGuard restore;
  for (const int threads : {3, 4}) {
    set_cpu_threads(threads);
    std::vector<std::atomic<int>> visits(static_cast<size_t>(threads + 1));
    int bad_regions = 0;
    for (int round = 0; round < 3000; ++round) {
      const int64_t n = 2 + round % threads;  // grain 1: n chunks, capped at threads
      for (int64_t i = 0; i < n; ++i) visits[static_cast<size_t>(i)].store(0);
      parallel_for(n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) visits[static_cast<size_t>(i)].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) bad_regions += visits[static_cast<size_t>(i)].load() != 1 ? 1 : 0;
    }
    EXPECT_EQ(bad_regions, 0) << "threads=" << threads;
  }
}

TEST(ParallelFor, CallerOnAnotherThreadWhileMainThreadWorks) {
  // The main thread and a std::thread use the pool at the same time, each
  // with its own output: neither result is disturbed.
  ThreadCountGuard restore;
  set_cpu_threads(3);
  const int64_t n = 200003;
  std::vector<int> from_thread(static_cast<size_t>(n), 0), from_main(static_cast<size_t>(n), 0);
  std::thread worker([&] {
    for (int round = 0; round < 50; ++round)
      parallel_for(n, 100, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++from_thread[static_cast<size_t>(i)];
      });
  });
  for (int round = 0; round < 50; ++round)
    parallel_for(n, 100, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ++from_main[static_cast<size_t>(i)];
    });
  worker.join();
  EXPECT_TRUE(std::all_of(from_thread.begin(), from_thread.end(), [](int v) { return v == 50; }));
  EXPECT_TRUE(std::all_of(from_main.begin(), from_main.end(), [](int v) { return v == 50; }));
}

}  // namespace
}  // namespace fedmesh
