#include "protocol/fault_injection.h"

#include <algorithm>
#include <cmath>

#include "base/text.h"

namespace fedmesh::protocol {
namespace {

bool parse_with_unit(std::string_view text, std::initializer_list<std::pair<std::string_view, double>> units,
                     double& out) {
  for (const auto& [suffix, scale] : units) {
    if (text.size() > suffix.size() && text.ends_with(suffix) &&
        parse_number(text.substr(0, text.size() - suffix.size()), out)) {
      out *= scale;
      return true;
    }
  }
  return false;
}

}  // namespace

Status FaultPlan::validate() const {
  if (!(drop >= 0.0 && drop <= 1.0)) return invalid_argument("faults: drop must be in [0, 1]");
  if (!(delay_seconds >= 0.0 && delay_seconds <= 600.0)) return invalid_argument("faults: delay must be in [0, 600 s]");
  if (!(jitter_seconds >= 0.0 && jitter_seconds <= 600.0)) {
    return invalid_argument("faults: jitter must be in [0, 600 s]");
  }
  if (!(bandwidth_bytes_per_second >= 0.0) || !std::isfinite(bandwidth_bytes_per_second)) {
    return invalid_argument("faults: bandwidth must be >= 0 (0: unlimited)");
  }
  return Status::ok();
}

std::string FaultPlan::to_string() const {
  if (!active()) return "none";
  std::string text;
  const auto add = [&](const std::string& item) {
    if (!text.empty()) text += ',';
    text += item;
  };
  if (drop > 0.0) add("drop=" + format_number(drop, 10));
  if (delay_seconds > 0.0) add("delay=" + format_number(delay_seconds * 1000.0, 10) + "ms");
  if (jitter_seconds > 0.0) add("jitter=" + format_number(jitter_seconds * 1000.0, 10) + "ms");
  if (bandwidth_bytes_per_second > 0.0) add("bandwidth=" + format_number(bandwidth_bytes_per_second, 10) + "B/s");
  add("seed=" + std::to_string(seed));
  return text;
}

Result<FaultPlan> parse_fault_plan(std::string_view text) {
  FaultPlan plan;
  if (text.empty() || text == "none") return plan;
  const auto bad = [&](const std::string& why) {
    return invalid_argument(std::string("faults '").append(text).append("': ") + why +
                            " (expected e.g. drop=0.2,delay=50ms,jitter=10ms,bandwidth=1MB/s,seed=7)");
  };
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    start = comma + 1;
    const size_t equals = item.find('=');
    if (equals == std::string_view::npos) return bad(std::string(1, '\'').append(item).append("' is not KEY=VALUE"));
    const std::string_view key = item.substr(0, equals), value = item.substr(equals + 1);
    bool ok = false;
    if (key == "drop") {
      ok = parse_number(value, plan.drop);
    } else if (key == "delay") {
      ok = parse_with_unit(value, {{"ms", 1e-3}, {"s", 1.0}}, plan.delay_seconds);
    } else if (key == "jitter") {
      ok = parse_with_unit(value, {{"ms", 1e-3}, {"s", 1.0}}, plan.jitter_seconds);
    } else if (key == "bandwidth") {
      ok = parse_with_unit(value, {{"GB/s", 1e9}, {"MB/s", 1e6}, {"KB/s", 1e3}, {"B/s", 1.0}},
                           plan.bandwidth_bytes_per_second);
    } else if (key == "seed") {
      ok = parse_number(value, plan.seed);
    } else {
      return bad(std::string("unknown key '").append(key).append("'"));
    }
    if (!ok) return bad(std::string("cannot read '").append(value).append("' for ").append(key));
    if (comma == text.size()) break;
  }
  if (Status s = plan.validate(); !s.is_ok()) return bad(s.message());
  return plan;
}

FaultInjector::FaultInjector(FaultPlan plan) : plan_(plan), rng_(plan.seed) {}

FaultInjector::Decision FaultInjector::decide(uint64_t bytes, double now) {
  std::lock_guard lock(mutex_);
  Decision decision;
  if (plan_.drop > 0.0 && rng_.uniform() < plan_.drop) {
    decision.drop = true;
    return decision;
  }
  double leaves = now;
  if (plan_.bandwidth_bytes_per_second > 0.0) {
    leaves = std::max(now, link_free_at_) + static_cast<double>(bytes) / plan_.bandwidth_bytes_per_second;
    link_free_at_ = leaves;
  }
  double delay = plan_.delay_seconds;
  if (plan_.jitter_seconds > 0.0) delay += (2.0 * rng_.uniform() - 1.0) * plan_.jitter_seconds;
  decision.hold_seconds = std::max(0.0, leaves - now + std::max(0.0, delay));
  return decision;
}

}  // namespace fedmesh::protocol
