#include "train/data/data_source.h"

#include <optional>

#include "train/data/arrays.h"
#include "train/data/data_stats.h"
#include "train/data/image_folder.h"
#include "train/data/table.h"

namespace fedmesh::train::data {

namespace {

std::string prefix_of(const std::string& spec) {
  for (const char* format : {"csv", "images", "arrays", "tokens", "jsonl"}) {
    const std::string prefix = std::string(format) + ":";
    if (spec.rfind(prefix, 0) == 0) return format;
  }
  return "";
}

// What every own-data loader's spec takes alike: the held-out share, the
// split's seed, the class list and the row limits.
template <class Spec>
void set_split(Spec& spec, const DataSource& d, int64_t train_limit, int64_t test_limit) {
  spec.test_fraction = d.test_fraction;
  spec.seed = d.seed;
  spec.classes = d.classes;
  spec.train_limit = train_limit;
  spec.test_limit = test_limit;
}

}  // namespace

bool is_own_data(const std::string& spec) {
  const std::string format = prefix_of(spec);
  return format == "csv" || format == "images" || format == "arrays";
}

bool is_token_shard(const std::string& spec) { return prefix_of(spec) == "tokens"; }

bool DataSource::own() const { return is_own_data(source); }

std::string DataSource::format() const { return own() ? prefix_of(source) : std::string(); }

std::string DataSource::path() const {
  const std::string f = prefix_of(source);
  return f.empty() ? source : source.substr(f.size() + 1);
}

Status DataSource::validate() const {
  const std::string f = format();
  if (task != "classification" && task != "regression") {
    return invalid_argument("data.task (--task) must be classification or regression, not '" + task + "'");
  }
  if (regression()) {
    if (f != "csv" && f != "arrays") {
      return invalid_argument("data.task = regression takes a table (csv:FILE) whose label column is the target, or "
                              "arrays (arrays:FILE) whose y is, not " + source);
    }
    if (!classes.empty()) return invalid_argument("data.classes is for classification; a regression target has no classes");
  }
  if (is_token_shard(source)) {
    if (!test.empty() && !is_token_shard(test)) {
      return invalid_argument("data.test '" + test + "' must be tokens:FILE.bin like data.source '" + source + "'");
    }
    if (!(test_fraction > 0.0 && test_fraction < 1.0)) {
      return invalid_argument("data.test_fraction (--test-fraction) must be in (0, 1), not " + std::to_string(test_fraction));
    }
    if (path().empty()) return invalid_argument("data.source '" + source + "' names no file");
    return Status::ok();
  }
  if (f.empty()) {
    if (!test.empty()) return invalid_argument("data.test (--test-data) is for own data (csv:FILE, images:DIR, tokens:FILE), not " + source);
    if (!label.empty()) return invalid_argument("data.label (--label) is for tables (csv:FILE), not " + source);
    return Status::ok();
  }
  if (path().empty()) return invalid_argument("data.source '" + source + "' names no " + (f == "csv" ? "file" : "folder"));
  if (!test.empty() && prefix_of(test) != f) {
    return invalid_argument("data.test '" + test + "' must be " + f + ":... like data.source '" + source + "'");
  }
  if (!(test_fraction > 0.0 && test_fraction < 1.0)) {
    return invalid_argument("data.test_fraction (--test-fraction) must be in (0, 1), not " + std::to_string(test_fraction));
  }
  if (f == "arrays") {
    if (!label.empty()) return invalid_argument("data.label (--label) is for tables; arrays hold their labels as y");
    if (normalize != "standard" && normalize != "none") {
      return invalid_argument("data.normalize of arrays must be standard or none, not '" + normalize + "'");
    }
  } else if (f == "csv") {
    if (label.empty()) return invalid_argument("a table (" + source + ") needs its label column: --label COLUMN or data.label");
    if (missing != "refuse" && missing != "mean" && missing != "zero") {
      return invalid_argument("data.missing must be refuse, mean or zero, not '" + missing + "'");
    }
    if (normalize != "standard" && normalize != "none" && normalize.rfind("stats:", 0) != 0) {
      return invalid_argument("data.normalize must be standard, none or stats:FILE, not '" + normalize + "'");
    }
  } else {
    if (!label.empty()) return invalid_argument("data.label (--label) is for tables; image folders name classes by folder");
    if (image_size < 4 || image_size > 1024) {
      return invalid_argument("data.image_size (--image-size) must be in [4, 1024], not " + std::to_string(image_size));
    }
    if (normalize != "standard" && normalize.rfind("stats:", 0) != 0) {
      return invalid_argument("data.normalize of images must be standard or stats:FILE, not '" + normalize + "'");
    }
    if (channels != 1 && channels != 3) {
      return invalid_argument("data.channels (--channels) must be 1 or 3, not " + std::to_string(channels));
    }
  }
  return Status::ok();
}

void read_data_source(ConfigReader& r, DataSource& d) {
  r.read("data.source", d.source);
  r.read("data.test", d.test);
  r.read("data.test_fraction", d.test_fraction);
  r.read("data.seed", d.seed);
  r.read("data.task", d.task);
  r.read("data.label", d.label);
  r.read("data.categories", d.categories);
  r.read("data.drop", d.drop);
  r.read("data.missing", d.missing);
  r.read("data.normalize", d.normalize);
  r.read("data.image_size", d.image_size);
  r.read("data.channels", d.channels);
  r.read("data.cache", d.cache);
  r.read("data.classes", d.classes);
}

Result<LoadedData> load_own_data(const DataSource& d, int64_t train_limit, int64_t test_limit) {
  FEDMESH_RETURN_IF_ERROR(d.validate());
  std::optional<DataStats> shared;
  if (d.normalize.rfind("stats:", 0) == 0) {
    Result<DataStats> read = read_data_stats(d.normalize.substr(6));
    if (!read.is_ok()) return Status(read.status().code(), "data.normalize: " + read.status().message());
    const std::string kind = d.format() == "csv" ? "table" : "images";
    if (read->kind != kind) {
      return invalid_argument("data.normalize: " + d.normalize.substr(6) + " holds statistics of " + read->kind +
                              ", the data are " + kind);
    }
    shared = std::move(*read);
  }
  if (d.format() == "csv") {
    TableSpec spec;
    spec.path = d.path();
    spec.test_path = d.test.empty() ? "" : DataSource{d.test}.path();
    set_split(spec, d, train_limit, test_limit);
    spec.label = d.label;
    spec.regression = d.regression();
    spec.categories = d.categories;
    spec.drop = d.drop;
    spec.missing = d.missing;
    spec.normalize = d.normalize;
    if (shared) {
      spec.normalize = "shared";
      for (const FeatureSums& f : shared->features) spec.shared_names.push_back(f.name);
      spec.shared_mean = shared->mean();
      spec.shared_std = shared->std();
      spec.shared_digest = shared->digest();
    }
    return load_table(spec);
  }
  if (d.format() == "arrays") {
    ArraysSpec spec;
    spec.path = d.path();
    spec.test_path = d.test.empty() ? "" : DataSource{d.test}.path();
    set_split(spec, d, train_limit, test_limit);
    spec.regression = d.regression();
    spec.normalize = d.normalize;
    return load_arrays(spec);
  }
  if (d.format() == "images") {
    ImageFolderSpec spec;
    spec.dir = d.path();
    spec.test_dir = d.test.empty() ? "" : DataSource{d.test}.path();
    set_split(spec, d, train_limit, test_limit);
    spec.image_size = d.image_size;
    spec.channels = d.channels;
    spec.cache = d.cache;
    if (shared) {
      if (static_cast<int64_t>(shared->features.size()) != d.channels) {
        return invalid_argument("data.normalize: " + d.normalize.substr(6) + " holds statistics of " +
                                std::to_string(shared->features.size()) + " channel(s), data.channels is " +
                                std::to_string(d.channels));
      }
      for (double m : shared->mean()) spec.mean.push_back(static_cast<float>(m));
      for (double s : shared->std()) spec.std.push_back(static_cast<float>(s > 0.0 ? s : 1.0));
    }
    return load_image_folder(spec);
  }
  return invalid_argument("'" + d.source + "' is not own data (csv:FILE, images:DIR or arrays:FILE)");
}

}  // namespace fedmesh::train::data
