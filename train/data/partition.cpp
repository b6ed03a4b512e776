#include "train/data/partition.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <queue>
#include <utility>

#include "base/random.h"

namespace fedmesh::train::data {
namespace {

using Parts = std::vector<std::vector<int64_t>>;

constexpr const char* kAcceptedSpecs =
    "expected iid, dirichlet:A with A > 0 (e.g. dirichlet:0.5) or shards:K with K >= 1 (e.g. shards:2)";

// Logarithm of a Gamma(shape, 1) draw. For shape < 1 the draw is
// Gamma(shape + 1) * u^(1/shape), which underflows to 0 for small shapes
// (alpha = 0.01 gives u^100); in log space every site keeps a usable weight
// and the normalization below never divides by zero.
double log_gamma_draw(Rng& rng, double shape) {
  if (shape >= 1.0) return std::log(rng.gamma(shape));
  double u = rng.uniform();
  while (u <= 0.0) u = rng.uniform();
  return std::log(rng.gamma(shape + 1.0)) + std::log(u) / shape;
}

// Sample indices grouped by label, each group ascending.
Parts indices_by_class(std::span<const uint8_t> labels, int num_classes) {
  Parts by_class(static_cast<size_t>(num_classes));
  for (size_t i = 0; i < labels.size(); ++i) by_class[labels[i]].push_back(static_cast<int64_t>(i));
  return by_class;
}

Parts partition_iid(int64_t samples, int sites, Rng& rng) {
  std::vector<int64_t> order(static_cast<size_t>(samples));
  std::iota(order.begin(), order.end(), int64_t{0});
  rng.shuffle(std::span<int64_t>(order));
  Parts parts(static_cast<size_t>(sites));
  const int64_t base = samples / sites;
  const int64_t extra = samples % sites;
  int64_t offset = 0;
  for (int site = 0; site < sites; ++site) {
    const int64_t size = base + (site < extra ? 1 : 0);
    parts[site].assign(order.begin() + offset, order.begin() + offset + size);
    offset += size;
  }
  return parts;
}

// One draw of the NIID-Bench partitioner: each class is split by fresh
// Dirichlet proportions among the sites still below the average size.
Parts dirichlet_draw(const Parts& by_class, int64_t samples, int sites, double alpha, Rng& rng) {
  Parts parts(static_cast<size_t>(sites));
  std::vector<double> log_weights(static_cast<size_t>(sites));
  std::vector<double> weights(static_cast<size_t>(sites));
  for (const std::vector<int64_t>& class_indices : by_class) {
    if (class_indices.empty()) continue;
    std::vector<int64_t> shuffled = class_indices;
    rng.shuffle(std::span<int64_t>(shuffled));
    for (double& log_weight : log_weights) log_weight = log_gamma_draw(rng, alpha);

    // Sites already above the average share are skipped for this class, which
    // keeps site sizes from running away. At least one site is always below
    // the average: fewer than `samples` indices are placed before this class.
    double max_log_weight = -INFINITY;
    for (int site = 0; site < sites; ++site) {
      const bool below_average = static_cast<int64_t>(parts[site].size()) * sites < samples;
      if (below_average) max_log_weight = std::max(max_log_weight, log_weights[site]);
    }
    double total = 0.0;
    for (int site = 0; site < sites; ++site) {
      const bool below_average = static_cast<int64_t>(parts[site].size()) * sites < samples;
      weights[site] = below_average ? std::exp(log_weights[site] - max_log_weight) : 0.0;
      total += weights[site];
    }

    const int64_t class_size = static_cast<int64_t>(shuffled.size());
    double cumulative = 0.0;
    int64_t begin = 0;
    for (int site = 0; site < sites; ++site) {
      cumulative += weights[site];
      int64_t end = site + 1 == sites ? class_size
                                      : static_cast<int64_t>(cumulative / total * static_cast<double>(class_size));
      end = std::clamp(end, begin, class_size);
      parts[site].insert(parts[site].end(), shuffled.begin() + begin, shuffled.begin() + end);
      begin = end;
    }
  }
  return parts;
}

int64_t smallest_site(const Parts& parts) {
  int64_t smallest = INT64_MAX;
  for (const std::vector<int64_t>& part : parts) smallest = std::min(smallest, static_cast<int64_t>(part.size()));
  return smallest;
}

// Moves samples, one at a time, from the currently largest site to each site
// below `min_size`. Terminates with every site at min_size or more because
// min_size <= samples / sites: while some site is short, the largest holds
// more than the average, hence more than min_size, and stays at min_size or
// above after giving one. A donor gives its last sample, a random member of
// the last class it received.
void fill_short_sites(Parts& parts, int64_t min_size) {
  // (size, -site): the largest site first, the lowest index among equals.
  std::priority_queue<std::pair<int64_t, int>> largest;
  for (size_t site = 0; site < parts.size(); ++site) {
    largest.emplace(static_cast<int64_t>(parts[site].size()), -static_cast<int>(site));
  }
  for (size_t site = 0; site < parts.size(); ++site) {
    while (static_cast<int64_t>(parts[site].size()) < min_size) {
      // A short site's own entry is below min_size and every donor's entry is
      // exact, so the top is the true largest site, never `site` itself.
      const int donor = -largest.top().second;
      largest.pop();
      FEDMESH_CHECK(donor != static_cast<int>(site) && static_cast<int64_t>(parts[donor].size()) > min_size,
                    "dirichlet fix-up found no donor");
      parts[site].push_back(parts[donor].back());
      parts[donor].pop_back();
      largest.emplace(static_cast<int64_t>(parts[donor].size()), -donor);
    }
  }
}

Parts partition_dirichlet(std::span<const uint8_t> labels, int num_classes, int sites, double alpha, Rng& rng) {
  const int64_t samples = static_cast<int64_t>(labels.size());
  const Parts by_class = indices_by_class(labels, num_classes);
  const int64_t min_size = std::min(kDirichletMinSiteSamples, samples / sites);
  Parts parts;
  for (int draw = 0; draw < kMaxDirichletDraws; ++draw) {
    parts = dirichlet_draw(by_class, samples, sites, alpha, rng);
    if (smallest_site(parts) >= min_size) return parts;
  }
  fill_short_sites(parts, min_size);
  return parts;
}

Parts partition_shards(std::span<const uint8_t> labels, int num_classes, int sites, int shards_per_site, Rng& rng) {
  const int64_t samples = static_cast<int64_t>(labels.size());
  std::vector<int64_t> by_label;
  by_label.reserve(labels.size());
  for (const std::vector<int64_t>& class_indices : indices_by_class(labels, num_classes)) {
    by_label.insert(by_label.end(), class_indices.begin(), class_indices.end());
  }
  const int64_t shard_count = int64_t{sites} * shards_per_site;
  const int64_t base = samples / shard_count;
  const int64_t extra = samples % shard_count;
  auto shard_begin = [&](int64_t shard) { return shard * base + std::min(shard, extra); };

  std::vector<int64_t> shard_order(static_cast<size_t>(shard_count));
  std::iota(shard_order.begin(), shard_order.end(), int64_t{0});
  rng.shuffle(std::span<int64_t>(shard_order));
  Parts parts(static_cast<size_t>(sites));
  for (int site = 0; site < sites; ++site) {
    for (int k = 0; k < shards_per_site; ++k) {
      const int64_t shard = shard_order[static_cast<size_t>(int64_t{site} * shards_per_site + k)];
      parts[site].insert(parts[site].end(), by_label.begin() + shard_begin(shard),
                         by_label.begin() + shard_begin(shard + 1));
    }
  }
  return parts;
}

std::string format_double(double value) {
  char text[64];
  const std::to_chars_result written = std::to_chars(text, text + sizeof text, value);
  return std::string(text, written.ptr);
}

}  // namespace

Result<PartitionSpec> PartitionSpec::parse(std::string_view text) {
  if (text == "iid") return PartitionSpec{};
  const size_t colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  const std::string_view value = colon == std::string_view::npos ? std::string_view{} : text.substr(colon + 1);
  const std::string quoted = "partition '" + std::string(text) + "'";
  if (name == "dirichlet") {
    double alpha = 0.0;
    const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), alpha);
    if (value.empty() || error != std::errc{} || end != value.data() + value.size() || !std::isfinite(alpha) ||
        alpha <= 0.0) {
      return invalid_argument(quoted +
                              ": the dirichlet concentration must be a finite number > 0, as in dirichlet:0.5");
    }
    PartitionSpec spec;
    spec.kind = Kind::kDirichlet;
    spec.alpha = alpha;
    return spec;
  }
  if (name == "shards") {
    int shards = 0;
    const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), shards);
    if (value.empty() || error != std::errc{} || end != value.data() + value.size() || shards < 1 ||
        shards > kMaxShardsPerSite) {
      return invalid_argument(quoted + ": shards per site must be an integer in [1, " +
                              std::to_string(kMaxShardsPerSite) + "], as in shards:2");
    }
    PartitionSpec spec;
    spec.kind = Kind::kShards;
    spec.shards_per_site = shards;
    return spec;
  }
  return invalid_argument("unknown " + quoted + ": " + kAcceptedSpecs);
}

std::string PartitionSpec::to_string() const {
  switch (kind) {
    case Kind::kIid: return "iid";
    case Kind::kDirichlet: return "dirichlet:" + format_double(alpha);
    case Kind::kShards: return "shards:" + std::to_string(shards_per_site);
  }
  return "unknown";
}

Result<Parts> partition_indices(std::span<const uint8_t> labels, int num_classes, int sites,
                                const PartitionSpec& spec, uint64_t seed) {
  const int64_t samples = static_cast<int64_t>(labels.size());
  if (num_classes < 1 || num_classes > kMaxPartitionClasses) {
    return invalid_argument("num_classes " + std::to_string(num_classes) + " is outside [1, " +
                            std::to_string(kMaxPartitionClasses) + "]");
  }
  if (sites < 1) return invalid_argument("sites must be at least 1, got " + std::to_string(sites));
  if (spec.kind == PartitionSpec::Kind::kDirichlet && !(spec.alpha > 0.0 && std::isfinite(spec.alpha))) {
    return invalid_argument("dirichlet concentration must be a finite number > 0, got " +
                            format_double(spec.alpha));
  }
  if (spec.kind == PartitionSpec::Kind::kShards && spec.shards_per_site < 1) {
    return invalid_argument("shards per site must be at least 1, got " + std::to_string(spec.shards_per_site));
  }
  if (sites > samples) {
    return invalid_argument("cannot split " + std::to_string(samples) + " samples among " +
                            std::to_string(sites) + " sites: every site needs at least one sample");
  }
  if (spec.kind == PartitionSpec::Kind::kShards && int64_t{sites} * spec.shards_per_site > samples) {
    return invalid_argument(spec.to_string() + " with " + std::to_string(sites) + " sites needs " +
                            std::to_string(int64_t{sites} * spec.shards_per_site) + " shards but there are only " +
                            std::to_string(samples) + " samples");
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] >= num_classes) {
      return invalid_argument("label " + std::to_string(labels[i]) + " at index " + std::to_string(i) +
                              " is not below " + std::to_string(num_classes) + " classes");
    }
  }

  Rng rng(seed);
  Parts parts;
  switch (spec.kind) {
    case PartitionSpec::Kind::kIid: parts = partition_iid(samples, sites, rng); break;
    case PartitionSpec::Kind::kDirichlet:
      parts = partition_dirichlet(labels, num_classes, sites, spec.alpha, rng);
      break;
    case PartitionSpec::Kind::kShards:
      parts = partition_shards(labels, num_classes, sites, spec.shards_per_site, rng);
      break;
  }
  for (std::vector<int64_t>& part : parts) std::sort(part.begin(), part.end());
  return parts;
}

std::vector<std::vector<int64_t>> label_histograms(std::span<const uint8_t> labels, const Parts& parts,
                                                   int num_classes) {
  FEDMESH_CHECK(num_classes >= 1, "num_classes " + std::to_string(num_classes));
  std::vector<std::vector<int64_t>> histograms(parts.size(), std::vector<int64_t>(static_cast<size_t>(num_classes)));
  for (size_t site = 0; site < parts.size(); ++site) {
    for (const int64_t index : parts[site]) {
      FEDMESH_CHECK(index >= 0 && index < static_cast<int64_t>(labels.size()),
                    "index " + std::to_string(index) + " outside the " + std::to_string(labels.size()) + " labels");
      const int label = labels[static_cast<size_t>(index)];
      FEDMESH_CHECK(label < num_classes,
                    "label " + std::to_string(label) + " is not below " + std::to_string(num_classes) + " classes");
      ++histograms[site][static_cast<size_t>(label)];
    }
  }
  return histograms;
}

std::string format_label_histograms(const std::vector<std::vector<int64_t>>& histograms) {
  size_t classes = 0;
  int64_t largest_count = 0;
  int64_t largest_total = 0;
  for (const std::vector<int64_t>& row : histograms) {
    classes = std::max(classes, row.size());
    for (const int64_t count : row) largest_count = std::max(largest_count, count);
    largest_total = std::max(largest_total, std::accumulate(row.begin(), row.end(), int64_t{0}));
  }
  const std::string site_header = "site";
  const std::string total_header = "samples";
  const size_t site_width = std::max(site_header.size(), std::to_string(histograms.size()).size());
  const size_t total_width = std::max(total_header.size(), std::to_string(largest_total).size());
  const size_t class_width =
      std::max(std::to_string(largest_count).size(), std::to_string(classes == 0 ? 0 : classes - 1).size());
  auto pad = [](const std::string& text, size_t width) {
    return std::string(width > text.size() ? width - text.size() : 0, ' ') + text;
  };

  std::string table = pad(site_header, site_width) + "  " + pad(total_header, total_width) + " |";
  // Appending piecewise: GCC 12 warns falsely (-Wrestrict) on `" " + std::string`.
  for (size_t label = 0; label < classes; ++label) {
    table += ' ';
    table += pad(std::to_string(label), class_width);
  }
  table += '\n';
  for (size_t site = 0; site < histograms.size(); ++site) {
    const std::vector<int64_t>& row = histograms[site];
    table += pad(std::to_string(site), site_width) + "  " +
             pad(std::to_string(std::accumulate(row.begin(), row.end(), int64_t{0})), total_width) + " |";
    for (size_t label = 0; label < classes; ++label) {
      table += ' ';
      table += pad(std::to_string(label < row.size() ? row[label] : 0), class_width);
    }
    table += '\n';
  }
  return table;
}

}  // namespace fedmesh::train::data
