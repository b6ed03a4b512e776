// CPU parallelism for the kernels: one process-wide worker pool (like
// OpenBLAS's own), sized together with OpenBLAS's thread count so the two
// never oversubscribe the cores.
#pragma once

#include <cstdint>
#include <functional>

namespace fedmesh {

// Sets the threads used by parallel_for and by the GEMMs it splits (n <= 0:
// all cores). Rebuilds the pool: call it between pieces of work, never while
// another thread is inside parallel_for.
void set_cpu_threads(int n);
int cpu_threads();

// Runs body(begin, end) over [0, n) split into at most cpu_threads() chunks of
// at least `grain` items each. Runs inline when the work is too small or when
// called from inside another parallel_for.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);
// Runs work(i) for every i in [0, count), one item per task, over every core
// (inline inside another parallel_for): the codec's SegmentRunner.
void parallel_each(size_t count, const std::function<void(size_t)>& work);
// Whether the calling thread is running a parallel_for body (a worker's, or
// the caller's own share).
bool inside_parallel_region();

}  // namespace fedmesh
