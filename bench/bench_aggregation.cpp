// How fast does the aggregator fold updates into its aggregate, next to the
// memory bandwidth of this machine, and how much memory does it hold?
//
//   baseline   a plain loop summing the same update floats into a float
//              buffer on every core (what a non-exact streaming mean costs
//              at best: the memory bandwidth)
//   exact      ExactAccumulator::add: each weighted value rounded to 64-bit
//              fixed point and summed (order-independent, bit-identical)
//   trimmed    trimmed_mean over a buffered round (a strategy that must see
//              every update at once), for a smaller round
//
// Prints GB/s of update data folded, the ratio to the baseline, and peak RSS
// against the model's size. Default: 100 updates of 10M fp32 parameters,
// made from 4 distinct random updates (memory for 100 distinct ones would
// measure the allocator, not the fold). A plain program; see --help.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "federation/exact_accumulator.h"
#include "aggregator/robust_aggregation.h"
#include "base/random.h"
#include "kernels/parallel.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t parameters = 10'000'000;
  int updates = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) {
      parameters = std::atoll(argv[++i]);
    } else if (arg == "--updates" && i + 1 < argc) {
      updates = std::atoi(argv[++i]);
    } else {
      std::printf("usage: bench_aggregation [--params 10000000] [--updates 100]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  if (parameters < 1 || updates < 1) {
    std::fprintf(stderr, "bench_aggregation: --params and --updates must be positive\n");
    return 2;
  }
  const double model_mb = static_cast<double>(parameters) * 4.0 / 1e6;
  fedmesh::Rng rng(7);
  std::vector<std::vector<float>> distinct(4, std::vector<float>(static_cast<size_t>(parameters)));
  for (auto& update : distinct) {
    for (float& v : update) v = static_cast<float>(rng.normal() * 0.01);
  }
  const double rss_inputs = peak_rss_mb();
  const double bytes = static_cast<double>(updates) * static_cast<double>(parameters) * 4.0;

  std::vector<float> plain(static_cast<size_t>(parameters), 0.0f);
  auto start = Clock::now();
  for (int u = 0; u < updates; ++u) {
    const std::vector<float>& update = distinct[static_cast<size_t>(u % 4)];
    fedmesh::parallel_for(parameters, 1 << 16, [&](int64_t begin, int64_t end) {
      const float weight = 0.01f;
      float* __restrict out = plain.data();
      const float* __restrict in = update.data();
      for (int64_t i = begin; i < end; ++i) out[i] += weight * in[i];
    });
  }
  const double baseline = seconds_since(start);
  volatile float keep = plain[static_cast<size_t>(parameters / 2)];
  (void)keep;

  fedmesh::federation::ExactAccumulator accumulator(parameters);
  const double rss_before_exact = peak_rss_mb();
  start = Clock::now();
  for (int u = 0; u < updates; ++u) {
    const fedmesh::Status s = accumulator.add(distinct[static_cast<size_t>(u % 4)], 0.01);
    if (!s.is_ok()) {
      std::fprintf(stderr, "bench_aggregation: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  std::vector<float> mean(static_cast<size_t>(parameters));
  accumulator.mean(mean);
  const double exact = seconds_since(start);
  const double rss_exact = peak_rss_mb();

  std::printf("%lld parameters (%.0f MB fp32), %d updates, %.1f GB folded\n", static_cast<long long>(parameters),
              model_mb, updates, bytes / 1e9);
  std::printf("%-32s %8s %8s %10s\n", "", "seconds", "GB/s", "vs plain");
  std::printf("%-32s %8.3f %8.2f %10s\n", "plain float sum (baseline)", baseline, bytes / baseline / 1e9, "1.00x");
  std::printf("%-32s %8.3f %8.2f %9.2fx\n", "exact fixed-point accumulator", exact, bytes / exact / 1e9,
              baseline / exact);
  const double accumulator_mb = static_cast<double>(parameters) * 8.0 / 1e6;
  std::printf("memory: the exact accumulator holds %.0f MB (int64 per parameter, %.1fx the model), %.1fx with the "
              "mean it writes (target: 1.5x the model plus chunk buffers: not met); peak RSS %.0f MB, of which the "
              "4 distinct inputs %.0f MB\n",
              accumulator_mb, accumulator_mb / model_mb, (accumulator_mb + model_mb) / model_mb, rss_exact,
              4 * model_mb);
  (void)rss_inputs;
  (void)rss_before_exact;
  // A buffered strategy over a round of 9 updates of a tenth of the size.
  const int64_t small = std::max<int64_t>(parameters / 10, 1);
  std::vector<fedmesh::aggregator::BufferedUpdate> round;
  for (int u = 0; u < 9; ++u) {
    round.push_back({std::string("update ") + std::to_string(u), std::span<const float>(distinct[static_cast<size_t>(u % 4)].data(), static_cast<size_t>(small))});
  }
  std::vector<float> out(static_cast<size_t>(small));
  start = Clock::now();
  const fedmesh::Status trimmed = fedmesh::aggregator::trimmed_mean(round, 0.2, out);
  const double trimmed_seconds = seconds_since(start);
  if (!trimmed.is_ok()) return 1;
  std::printf("%-32s %8.3f %8.2f  (9 buffered updates of %lld parameters)\n", "trimmed mean (buffered)",
              trimmed_seconds, 9.0 * static_cast<double>(small) * 4.0 / trimmed_seconds / 1e9,
              static_cast<long long>(small));
  return 0;
}
