// Robust aggregation rules for the trusted mode, where the aggregator sees
// each site's update. A poisoned or broken site can push a plain mean
// anywhere; these bound its influence:
//
//   norm bounding      each update scaled to L2 norm <= bound before anything else
//   coordinate median  per coordinate, the median of the sites' values
//   trimmed mean(b)    per coordinate, drop the floor(b n) smallest and largest, average the rest
//   krum(f)            the update whose n - f - 2 nearest neighbours are closest (Blanchard et al., 2017)
//   multi-krum(f, m)   the m best by that score, averaged
//
// Median, trimmed mean and Krum need every update of the round at once: the
// caller buffers them (the round manager caps that memory and says so). All
// results are independent of the order the updates arrived in: per-coordinate
// values are sorted, Krum's scores depend only on the set, ties go to the
// update with the smaller key, and averages use the exact accumulator.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace fedmesh::aggregator {

// One buffered update: its values and a key that orders ties (e.g. its id).
struct BufferedUpdate {
  std::string key;
  std::span<const float> values;
};

// Scales `values` in place so that its L2 norm is at most `bound` (> 0);
// returns the norm it had. Non-finite values are refused before anything
// changes (a NaN would slip through any comparison with the bound).
Result<double> bound_norm(std::span<float> values, double bound);

Status coordinate_median(const std::vector<BufferedUpdate>& updates, std::span<float> out);
// beta in [0, 0.5): the share trimmed from each end.
Status trimmed_mean(const std::vector<BufferedUpdate>& updates, double beta, std::span<float> out);
// Indices into `updates` of the m updates Multi-Krum keeps, best first, for
// at most f Byzantine sites; needs n >= 2f + 3 and 1 <= m <= n - f.
Result<std::vector<size_t>> multi_krum_select(const std::vector<BufferedUpdate>& updates, int byzantine, int keep);
// The mean of the updates Multi-Krum keeps (m = 1: Krum).
Status multi_krum(const std::vector<BufferedUpdate>& updates, int byzantine, int keep, std::span<float> out);

}  // namespace fedmesh::aggregator
