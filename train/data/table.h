// Tables as a data set (`csv:FILE`): a CSV file with a header row, one row
// per sample, one column the class label and the others features. The file
// comes from outside the program, so every flaw is a Status naming the file,
// the row and the column: kCorrupt for the file's content, kInvalidArgument
// for a spec that does not fit the file, kNotFound for a missing file.
//
// Format (RFC 4180 with the usual leniencies):
//   - separator ','; a line ends with "\n", "\r\n" or "\r"; a UTF-8 BOM at the
//     start is skipped; empty lines are skipped;
//   - a field that begins with '"' is quoted: it may hold ',', line ends and
//     '""' (one '"'), and only a separator or a line end may follow its
//     closing quote; spaces and tabs around an unquoted field are trimmed;
//   - row N is the line of the file where a record begins (the header is
//     row 1), as an editor shows it;
//   - every row has as many fields as the header.
// Columns: the label (TableSpec::label), the categorical ones (named in
// TableSpec::categories), the dropped ones, and every other column numeric.
// Features, in header order: a numeric column gives one feature (its name),
// a categorical column its one-hot block ("name=value", in the order of its
// category list) where it stands in the header. Standardization applies to
// the numeric features only; a one-hot feature stays 0 or 1.
// Missing values: an empty cell or NA, N/A, NaN, NULL (any case). In a
// numeric column: refused, the mean of the training rows' present values,
// or 0 (TableSpec::missing); in a categorical column: refused, or an
// all-zero block; a label is never missing.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

inline constexpr int64_t kMaxTableBytes = int64_t{1} << 30;  // per file
inline constexpr int64_t kMaxTableColumns = 100'000;
// Numeric features plus every one-hot feature of the categorical columns.
inline constexpr int64_t kMaxTableFeatures = 100'000;
// rows x features of one split, as floats: 1 GiB.
inline constexpr int64_t kMaxTableValues = int64_t{1} << 28;
// Far above any classification table; a label column with more distinct
// values is most likely a numeric target (data.task = "regression").
inline constexpr int64_t kMaxTableClasses = 10'000;
inline constexpr int64_t kMaxTableCategories = 10'000;  // per categorical column

struct TableSpec {
  std::string path;            // the training table (CSV with a header row)
  std::string test_path;       // optional second CSV (same header); else test_fraction of path's rows
  double test_fraction = 0.2;  // in (0, 1); without test_path: a seeded shuffle picks the test rows
  uint64_t seed = 0;
  std::string label;  // the label column's name (required)
  // The label column is a real-valued target (numbers, never missing),
  // standardized as the numeric features are: its statistics are the last
  // entry of TableStats (and of the shared ones), named after the column.
  bool regression = false;
  // The label values in class-id order; empty: the sorted distinct values of
  // the whole training file's label column (numerically when all are numbers).
  std::vector<std::string> classes;
  // Categorical columns: name -> category list (one-hot in that order).
  std::map<std::string, std::vector<std::string>> categories;
  std::vector<std::string> drop;       // columns to ignore (ids)
  std::string missing = "refuse";      // "refuse" | "mean" | "zero"
  std::string normalize = "standard";  // "standard": (x - mean) / std of the training rows (std 0 -> 1) | "none"
                                       // | "shared": (x - mean) / std of `shared` (the federation's statistics)
  int64_t train_limit = 0, test_limit = 0;  // > 0: the first N rows of the split; 0: all
  // normalize "shared": one entry per numeric feature, by name and in order
  // (a mismatch is refused naming it); `shared_digest` names them in the
  // schema's canonical text, so every node must use the same ones.
  std::vector<std::string> shared_names;
  std::vector<double> shared_mean, shared_std;
  std::string shared_digest;
};

// The numeric features' statistics over the training rows (present values
// only), and for regression the target's after them: local to a site, so
// not part of the schema's canonical text.
struct TableStats {
  std::vector<std::string> names;
  std::vector<double> mean, std;  // std: population standard deviation
  std::vector<int64_t> count;     // present (non-missing) values
};

// One split of a table, encoded: (rows, features) floats and a class each,
// or (regression) a standardized target each.
class TableSet final : public Dataset {
 public:
  TableSet(int64_t features, std::vector<float> values, std::vector<int32_t> targets, TableStats stats)
      : features_(features), values_(std::move(values)), targets_(std::move(targets)), stats_(std::move(stats)) {}
  // Regression: target values (standardized) and their unit (target_scale()).
  TableSet(int64_t features, std::vector<float> values, std::vector<float> target_values, double target_scale,
           TableStats stats)
      : features_(features),
        values_(std::move(values)),
        target_values_(std::move(target_values)),
        target_scale_(target_scale),
        regression_(true),
        stats_(std::move(stats)) {}
  int64_t size() const override {
    return static_cast<int64_t>(regression_ ? target_values_.size() : targets_.size());
  }
  int64_t features() const { return features_; }
  // inputs (n, features) in `dtype`; targets the class ids (none for regression).
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;
  bool regression() const override { return regression_; }
  void batch_values(std::span<const int64_t> indices, std::vector<float>& values) const override;
  double target_scale() const override { return target_scale_; }
  const std::vector<float>& values() const { return values_; }  // (rows, features), as encoded
  const std::vector<int32_t>& targets() const { return targets_; }
  const std::vector<float>& target_values() const { return target_values_; }
  const TableStats& stats() const { return stats_; }  // of the training rows (the same in both splits)

 private:
  int64_t features_;
  std::vector<float> values_;
  std::vector<int32_t> targets_;
  std::vector<float> target_values_;
  double target_scale_ = 1.0;
  bool regression_ = false;
  TableStats stats_;
};

// Reads spec.path (and spec.test_path) and encodes them. train and test are
// TableSets; schema.sample_shape = {features}.
Result<LoadedData> load_table(const TableSpec& spec);

// The same from text in memory: `text` stands for spec.path and `test_text`
// for spec.test_path (used only when spec.test_path is set); messages name
// the paths. load_table reads the files and calls this.
Result<LoadedData> parse_table(std::string_view text, const TableSpec& spec, std::string_view test_text = {});

// The training rows' statistics of the numeric features, for display.
Result<TableStats> table_statistics(const TableSpec& spec);

}  // namespace fedmesh::train::data
