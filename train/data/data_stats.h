// Statistics a federation's nodes combine so that every node normalizes its
// data the same way without showing a row: per numeric feature of a table,
// or per channel of images, the count of values, their sum and their sum of
// squares over the node's training part. Each node computes its own
// (`fedmesh stats compute`), the admin adds them up (`fedmesh stats merge`:
// sums only, nothing per row), and every node and the aggregator then read
// the merged file (data.normalize = "stats:FILE"): mean = sum / count and
// std = sqrt(sum of squares / count - mean^2) of all the sites' rows. The
// file's digest joins the data schema, so a node with other statistics is
// refused like one with other columns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "train/data/data_source.h"

namespace fedmesh::train::data {

struct FeatureSums {
  std::string name;  // the column's name, or "channel C" of images
  int64_t count = 0;
  double sum = 0.0, sum_squares = 0.0;
};

struct DataStats {
  std::string kind;  // "table" or "images"
  std::vector<FeatureSums> features;
  int64_t parts = 1;  // how many nodes' sums were added up

  std::vector<double> mean() const;
  std::vector<double> std() const;  // population; 0 where the values do not vary
  // "fnv1a64:..." of the sums, exactly as written.
  std::string digest() const;
  std::string to_json() const;
};

// A node's own sums over its training part (the data as `source` reads it,
// before normalization).
Result<DataStats> compute_data_stats(const DataSource& source);
// Their sum: the same kind and features, in the same order (named otherwise).
Result<DataStats> merge_data_stats(const std::vector<DataStats>& parts);
// A stats file (at most 64 MiB), every field checked: a flaw names the file.
Result<DataStats> read_data_stats(const std::string& path);
Status write_data_stats(const DataStats& stats, const std::string& path);

}  // namespace fedmesh::train::data
