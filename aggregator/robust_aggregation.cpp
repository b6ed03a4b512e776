#include "aggregator/robust_aggregation.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "federation/exact_accumulator.h"

namespace fedmesh::aggregator {

namespace {

Status check_updates(const std::vector<BufferedUpdate>& updates, size_t elements, size_t minimum) {
  if (updates.size() < minimum) {
    return invalid_argument("needs at least " + std::to_string(minimum) + " updates, got " +
                            std::to_string(updates.size()));
  }
  for (const BufferedUpdate& update : updates) {
    if (update.values.size() != elements) {
      return invalid_argument("update " + update.key + " has " + std::to_string(update.values.size()) +
                              " values, the model " + std::to_string(elements));
    }
    for (float value : update.values) {
      if (!std::isfinite(value)) return invalid_argument("update " + update.key + " holds a non-finite value");
    }
  }
  return Status::ok();
}

// Calls fn(i, sorted values of coordinate i) for every coordinate.
template <class Fn>
void for_each_sorted_coordinate(const std::vector<BufferedUpdate>& updates, size_t elements, Fn&& fn) {
  std::vector<float> column(updates.size());
  for (size_t i = 0; i < elements; ++i) {
    for (size_t k = 0; k < updates.size(); ++k) column[k] = updates[k].values[i];
    std::sort(column.begin(), column.end());
    fn(i, column);
  }
}

}  // namespace

Result<double> bound_norm(std::span<float> values, double bound) {
  if (!(bound > 0.0) || !std::isfinite(bound)) return invalid_argument("the norm bound must be a positive number");
  double squares = 0.0;
  for (float value : values) {
    if (!std::isfinite(value)) return invalid_argument("update holds a non-finite value");
    squares += static_cast<double>(value) * static_cast<double>(value);
  }
  const double norm = std::sqrt(squares);
  if (norm > bound) {
    const double factor = bound / norm;
    for (float& value : values) value = static_cast<float>(static_cast<double>(value) * factor);
  }
  return norm;
}

Status coordinate_median(const std::vector<BufferedUpdate>& updates, std::span<float> out) {
  FEDMESH_RETURN_IF_ERROR(check_updates(updates, out.size(), 1));
  const size_t n = updates.size();
  for_each_sorted_coordinate(updates, out.size(), [&](size_t i, const std::vector<float>& sorted) {
    out[i] = n % 2 == 1 ? sorted[n / 2]
                        : static_cast<float>((static_cast<double>(sorted[n / 2 - 1]) + sorted[n / 2]) / 2.0);
  });
  return Status::ok();
}

Status trimmed_mean(const std::vector<BufferedUpdate>& updates, double beta, std::span<float> out) {
  if (!(beta >= 0.0 && beta < 0.5)) return invalid_argument("trimmed mean: beta must be in [0, 0.5)");
  FEDMESH_RETURN_IF_ERROR(check_updates(updates, out.size(), 1));
  const size_t n = updates.size();
  const size_t trim = static_cast<size_t>(std::floor(beta * static_cast<double>(n)));
  for_each_sorted_coordinate(updates, out.size(), [&](size_t i, const std::vector<float>& sorted) {
    double sum = 0.0;  // in sorted order: the same whatever order the updates came in
    for (size_t k = trim; k < n - trim; ++k) sum += sorted[k];
    out[i] = static_cast<float>(sum / static_cast<double>(n - 2 * trim));
  });
  return Status::ok();
}

Result<std::vector<size_t>> multi_krum_select(const std::vector<BufferedUpdate>& updates, int byzantine, int keep) {
  const int n = static_cast<int>(updates.size());
  if (byzantine < 0 || n < 2 * byzantine + 3) {
    return invalid_argument("krum with f = " + std::to_string(byzantine) + " needs at least 2f + 3 = " +
                            std::to_string(2 * byzantine + 3) + " updates, got " + std::to_string(n));
  }
  if (keep < 1 || keep > n - byzantine) {
    return invalid_argument("multi-krum keeps m in [1, n - f] = [1, " + std::to_string(n - byzantine) + "]");
  }
  const size_t elements = updates[0].values.size();
  FEDMESH_RETURN_IF_ERROR(check_updates(updates, elements, 1));
  std::vector<std::vector<double>> distance(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(n), 0.0));
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      double squares = 0.0;
      for (size_t i = 0; i < elements; ++i) {
        const double d = static_cast<double>(updates[static_cast<size_t>(a)].values[i]) - updates[static_cast<size_t>(b)].values[i];
        squares += d * d;
      }
      distance[static_cast<size_t>(a)][static_cast<size_t>(b)] = distance[static_cast<size_t>(b)][static_cast<size_t>(a)] = squares;
    }
  }
  const size_t neighbours = static_cast<size_t>(n - byzantine - 2);
  std::vector<double> score(static_cast<size_t>(n));
  for (size_t a = 0; a < static_cast<size_t>(n); ++a) {
    std::vector<double> others;
    for (size_t b = 0; b < static_cast<size_t>(n); ++b) {
      if (b != a) others.push_back(distance[a][b]);
    }
    std::sort(others.begin(), others.end());
    score[a] = std::accumulate(others.begin(), others.begin() + static_cast<std::ptrdiff_t>(neighbours), 0.0);
  }
  std::vector<size_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (score[a] != score[b]) return score[a] < score[b];
    return updates[a].key < updates[b].key;
  });
  order.resize(static_cast<size_t>(keep));
  return order;
}

Status multi_krum(const std::vector<BufferedUpdate>& updates, int byzantine, int keep, std::span<float> out) {
  Result<std::vector<size_t>> chosen = multi_krum_select(updates, byzantine, keep);
  if (!chosen.is_ok()) return chosen.status();
  for (const BufferedUpdate& update : updates) {
    if (update.values.size() != out.size()) return invalid_argument("update " + update.key + " has the wrong size");
  }
  federation::ExactAccumulator accumulator(static_cast<int64_t>(out.size()));
  for (size_t index : *chosen) FEDMESH_RETURN_IF_ERROR(accumulator.add(updates[index].values, 1.0));
  accumulator.mean(out);
  return Status::ok();
}

}  // namespace fedmesh::aggregator
