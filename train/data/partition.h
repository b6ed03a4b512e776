// Splitting one labelled data set among simulated sites, the way federated
// learning papers do, so that `fedmesh sim --partition SPEC` reproduces their
// IID and non-IID settings and a seed replays the same split.
//
//   iid           shuffle, then deal: site sizes differ by at most one.
//   dirichlet:A   per class, proportions over the sites ~ Dir(A); small A
//                 gives each site a few dominant labels, large A approaches
//                 iid. Follows the partitioner of Yurochkin et al. (2019) as
//                 used by NIID-Bench (Li et al., 2021) and FedLab: a site that
//                 already holds more than the average share gets none of the
//                 next class, and the draw is repeated until every site holds
//                 at least min(kDirichletMinSiteSamples, samples / sites)
//                 samples. The repetition is bounded by kMaxDirichletDraws;
//                 when the last draw still falls short (tiny A with many
//                 sites can make that nearly certain), a deterministic fix-up
//                 moves samples one at a time from the largest site to the
//                 smallest until that minimum holds. No site is ever empty.
//   shards:K      sort by label (stable), cut into sites*K shards whose sizes
//                 differ by at most one, give each site K of them by a seeded
//                 shuffle (McMahan et al., 2017): about K labels per site.
//
// Each site's indices are returned in ascending order; trainers shuffle them
// per epoch with their own seeded Rng.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace fedmesh::train::data {

inline constexpr int64_t kDirichletMinSiteSamples = 10;
inline constexpr int kMaxDirichletDraws = 100;
// Labels are bytes, so at most 256 classes can be told apart.
inline constexpr int kMaxPartitionClasses = 256;
// Bounds what a flag may ask for; real settings use K in 1..10.
inline constexpr int kMaxShardsPerSite = 1'000'000;

struct PartitionSpec {
  enum class Kind { kIid, kDirichlet, kShards };
  Kind kind = Kind::kIid;
  double alpha = 0.0;       // dirichlet concentration, > 0
  int shards_per_site = 0;  // shards:K

  // "iid", "dirichlet:0.5", "shards:2"; anything else is kInvalidArgument
  // saying which forms are accepted.
  static Result<PartitionSpec> parse(std::string_view text);
  // The form parse() accepts; parse(to_string()) gives back the same spec.
  std::string to_string() const;
};

// Splits sample indices 0..labels.size()-1 among `sites` sites. Every index
// lands in exactly one site; deterministic for a seed. Result is (sites)
// lists of indices, each ascending. num_classes in [1, kMaxPartitionClasses].
Result<std::vector<std::vector<int64_t>>> partition_indices(std::span<const uint8_t> labels, int num_classes,
                                                            int sites, const PartitionSpec& spec,
                                                            uint64_t seed);

// (sites, num_classes) counts of each label per site. Every index in `parts`
// must be in range and every label it reaches below num_classes (as
// partition_indices guarantees); otherwise it is a programming error.
std::vector<std::vector<int64_t>> label_histograms(std::span<const uint8_t> labels,
                                                   const std::vector<std::vector<int64_t>>& parts,
                                                   int num_classes);

// A readable table, one row per site: site, sample count, then the count of
// each class.
std::string format_label_histograms(const std::vector<std::vector<int64_t>>& histograms);

}  // namespace fedmesh::train::data
