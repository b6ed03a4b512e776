// Prometheus text exposition (version 0.0.4) for /metrics: HELP and TYPE
// headers, samples with escaped labels, and a cumulative histogram.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace fedmesh {

// Counts of observations at or below each bound, plus their sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}
  void observe(double value) {
    for (size_t i = 0; i < bounds_.size(); ++i) counts_[i] += value <= bounds_[i] ? 1 : 0;
    sum_ += value;
    ++count_;
  }
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<long long>& counts() const { return counts_; }  // cumulative
  double sum() const { return sum_; }
  long long count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<long long> counts_;
  double sum_ = 0.0;
  long long count_ = 0;
};

class PrometheusText {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  void header(const std::string& name, const std::string& type, const std::string& help) {
    text_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, const Labels& labels, double value) {
    text_ += name;
    if (!labels.empty()) {
      text_ += '{';
      for (size_t i = 0; i < labels.size(); ++i) {
        text_ += (i ? "," : "") + labels[i].first + "=\"" + escape(labels[i].second) + "\"";
      }
      text_ += '}';
    }
    text_ += ' ' + number(value) + '\n';
  }
  void gauge(const std::string& name, const std::string& help, double value) {
    header(name, "gauge", help);
    sample(name, {}, value);
  }
  void counter(const std::string& name, const std::string& help, double value) {
    header(name, "counter", help);
    sample(name, {}, value);
  }
  void histogram(const std::string& name, const std::string& help, const Histogram& h) {
    header(name, "histogram", help);
    for (size_t i = 0; i < h.bounds().size(); ++i) {
      sample(name + "_bucket", {{"le", number(h.bounds()[i])}}, static_cast<double>(h.counts()[i]));
    }
    sample(name + "_bucket", {{"le", "+Inf"}}, static_cast<double>(h.count()));
    sample(name + "_sum", {}, h.sum());
    sample(name + "_count", {}, static_cast<double>(h.count()));
  }
  const std::string& text() const { return text_; }

 private:
  static std::string number(double value) {
    if (std::isnan(value)) return "NaN";
    if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.17g", value);
    return buffer;
  }
  static std::string escape(const std::string& value) {
    std::string out;
    for (char c : value) {
      if (c == '\\' || c == '"') out += '\\';
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out += c;
    }
    return out;
  }
  std::string text_;
};

}  // namespace fedmesh
