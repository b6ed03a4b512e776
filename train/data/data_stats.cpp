#include "train/data/data_stats.h"

#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "train/data/image_folder.h"
#include "train/data/table.h"

namespace fedmesh::train::data {

namespace {

constexpr size_t kMaxStatsBytes = size_t{64} << 20;
constexpr const char* kFormat = "fedmesh-stats v1";

std::string exact(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

}  // namespace

std::vector<double> DataStats::mean() const {
  std::vector<double> out;
  for (const FeatureSums& f : features) out.push_back(f.count > 0 ? f.sum / static_cast<double>(f.count) : 0.0);
  return out;
}

std::vector<double> DataStats::std() const {
  std::vector<double> out;
  for (const FeatureSums& f : features) {
    if (f.count <= 0) {
      out.push_back(0.0);
      continue;
    }
    const double mean = f.sum / static_cast<double>(f.count);
    out.push_back(std::sqrt(std::max(0.0, f.sum_squares / static_cast<double>(f.count) - mean * mean)));
  }
  return out;
}

std::string DataStats::digest() const {
  std::string text = kind;
  for (const FeatureSums& f : features) {
    text += "|" + f.name + ":" + std::to_string(f.count) + ":" + exact(f.sum) + ":" + exact(f.sum_squares);
  }
  return fnv1a64_text(text);
}

std::string DataStats::to_json() const {
  nlohmann::json features_json = nlohmann::json::array();
  const std::vector<double> means = mean(), stds = std();
  for (size_t i = 0; i < features.size(); ++i) {
    const FeatureSums& f = features[i];
    features_json.push_back({{"name", f.name}, {"count", f.count}, {"sum", f.sum}, {"sum_squares", f.sum_squares},
                             {"mean", means[i]}, {"std", stds[i]}});
  }
  return nlohmann::json({{"format", kFormat}, {"kind", kind}, {"parts", parts}, {"digest", digest()},
                         {"features", features_json}})
             .dump(1) +
         "\n";
}

Result<DataStats> compute_data_stats(const DataSource& source) {
  FEDMESH_RETURN_IF_ERROR(source.validate());
  DataStats stats;
  if (source.format() == "csv") {
    DataSource raw = source;
    raw.normalize = "none";  // the sums of the values as read
    Result<LoadedData> loaded = load_own_data(raw, 0, 0);
    if (!loaded.is_ok()) return loaded.status();
    const TableStats& table = static_cast<const TableSet&>(*loaded->train).stats();
    stats.kind = "table";
    for (size_t j = 0; j < table.names.size(); ++j) {
      const double n = static_cast<double>(table.count[j]);
      stats.features.push_back({table.names[j], table.count[j], table.mean[j] * n,
                                (table.std[j] * table.std[j] + table.mean[j] * table.mean[j]) * n});
    }
    return stats;
  }
  if (source.format() == "images") {
    DataSource raw = source;
    raw.normalize = "standard";
    Result<LoadedData> loaded = load_own_data(raw, 0, 0);
    if (!loaded.is_ok()) return loaded.status();
    const auto* set = dynamic_cast<const ImageSet*>(loaded->train.get());
    if (set == nullptr) return invalid_argument("images: the training part is not an image set");
    const ImageDataset& images = set->images();
    const int64_t plane = images.rows * images.cols;
    stats.kind = "images";
    for (int64_t c = 0; c < images.channels; ++c) {
      FeatureSums f{"channel " + std::to_string(c), 0, 0.0, 0.0};
      uint64_t sum = 0, squares = 0;  // exact: pixels are bytes
      for (int64_t i = 0; i < images.count; ++i) {
        const uint8_t* p = images.pixels.data() + i * images.pixels_per_image() + c * plane;
        for (int64_t k = 0; k < plane; ++k) {
          sum += p[k];
          squares += static_cast<uint64_t>(p[k]) * p[k];
        }
      }
      f.count = images.count * plane;
      f.sum = static_cast<double>(sum) / 255.0;  // pixels scaled to [0, 1], as normalization sees them
      f.sum_squares = static_cast<double>(squares) / (255.0 * 255.0);
      stats.features.push_back(f);
    }
    return stats;
  }
  return invalid_argument("statistics are computed for tables (csv:FILE) and image folders (images:DIR), not '" +
                          source.source + "'");
}

Result<DataStats> merge_data_stats(const std::vector<DataStats>& parts) {
  if (parts.empty()) return invalid_argument("no statistics to merge");
  DataStats out = parts.front();
  out.parts = 0;
  for (FeatureSums& f : out.features) f = {f.name, 0, 0.0, 0.0};
  for (size_t p = 0; p < parts.size(); ++p) {
    const DataStats& part = parts[p];
    const std::string which = "part " + std::to_string(p + 1);
    if (part.kind != out.kind) return invalid_argument(which + " is of " + part.kind + ", part 1 of " + out.kind);
    if (part.features.size() != out.features.size()) {
      return invalid_argument(which + " has " + std::to_string(part.features.size()) + " features, part 1 " +
                              std::to_string(out.features.size()));
    }
    for (size_t i = 0; i < part.features.size(); ++i) {
      if (part.features[i].name != out.features[i].name) {
        return invalid_argument(which + ": feature " + std::to_string(i + 1) + " is '" + part.features[i].name +
                                "', in part 1 '" + out.features[i].name + "'");
      }
      out.features[i].count += part.features[i].count;
      out.features[i].sum += part.features[i].sum;
      out.features[i].sum_squares += part.features[i].sum_squares;
    }
    out.parts += part.parts;
  }
  return out;
}

Result<DataStats> read_data_stats(const std::string& path) {
  Result<std::string> text = read_file_bounded(path, kMaxStatsBytes);
  if (!text.is_ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  const auto bad = [&](const std::string& what) { return corrupt(path + ": not a statistics file (" + what + ")"); };
  if (!j.is_object() || j.value("format", "") != kFormat) return bad("no \"format\": \"" + std::string(kFormat) + "\"");
  DataStats stats;
  if (!j.contains("kind") || !j["kind"].is_string()) return bad("no kind");
  stats.kind = j["kind"].get<std::string>();
  if (stats.kind != "table" && stats.kind != "images") return bad("kind '" + stats.kind + "'");
  if (!j.contains("parts") || !j["parts"].is_number_integer() || j["parts"].get<int64_t>() < 1) return bad("no parts");
  stats.parts = j["parts"].get<int64_t>();
  if (!j.contains("features") || !j["features"].is_array() || j["features"].empty()) return bad("no features");
  for (const nlohmann::json& f : j["features"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("count") ||
        !f["count"].is_number_integer() || !f.contains("sum") || !f["sum"].is_number() ||
        !f.contains("sum_squares") || !f["sum_squares"].is_number()) {
      return bad("feature " + std::to_string(stats.features.size() + 1) + " lacks name, count, sum or sum_squares");
    }
    FeatureSums sums{f["name"].get<std::string>(), f["count"].get<int64_t>(), f["sum"].get<double>(),
                     f["sum_squares"].get<double>()};
    if (sums.count < 1 || !std::isfinite(sums.sum) || !std::isfinite(sums.sum_squares) || sums.sum_squares < 0.0) {
      return bad("feature '" + sums.name + "': count below 1 or sums not finite");
    }
    stats.features.push_back(std::move(sums));
  }
  return stats;
}

Status write_data_stats(const DataStats& stats, const std::string& path) {
  return write_file_atomically(path, stats.to_json(), 0644);
}

}  // namespace fedmesh::train::data
