// libFuzzer target for the short specs a config file or a flag holds
// (data.partition, compression.default and its overrides, transport.faults,
// rounds.staleness, gossip.topology): each parser, and what runs on what it
// accepts. How to build and run it: tests/fuzz/README.md.
//
// The input is
//   byte 0  which parser, mod 7: 0 data.partition, 1 a compression spec,
//           2 a tensor override (GLOB=SPEC), 3 a whole compression plan
//           (DEFAULT;GLOB=SPEC;...), 4 transport.faults, 5 a staleness
//           function, 6 a gossip topology
//   byte 1  a small parameter: sites, peers, max_staleness + 1 or dense_below
//   rest    the spec's text
//
// For every input, besides "no crash, no sanitizer report, no hang":
//   - a rejection is kInvalidArgument with a message;
//   - an accepted spec formats (to_string) to text that parses back to the
//     same spec;
//   - partition: partition_indices over 200 labels of 10 classes puts every
//     index in exactly one of the sites, each list ascending, or refuses;
//   - faults: the injector's holds are finite and never negative;
//   - staleness: every weight is finite, in [0, 1], and never grows with tau;
//   - topology: choose_peers never picks the member itself, a repeat or one
//     out of range.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "federation/staleness.h"
#include "base/random.h"
#include "gossip/topology.h"
#include "train/data/partition.h"
#include "protocol/compression_spec.h"
#include "protocol/fault_injection.h"

namespace {

using fedmesh::Result;
using fedmesh::Status;
using fedmesh::StatusCode;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_specs: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

// Returns whether `result` holds a value; a refusal must be a named
// kInvalidArgument.
template <class T>
bool accepted(const Result<T>& result, const char* parser) {
  if (result.is_ok()) return true;
  const Status& status = result.status();
  if (status.code() != StatusCode::kInvalidArgument) {
    violated(std::string(parser) + " refused with code " + fedmesh::status_code_name(status.code()) + ": " +
             status.message());
  }
  if (status.message().empty()) violated(std::string(parser) + " refused with an empty message");
  return false;
}

void check_partition(std::string_view text, uint8_t parameter) {
  using fedmesh::train::data::PartitionSpec;
  Result<PartitionSpec> spec = PartitionSpec::parse(text);
  if (!accepted(spec, "PartitionSpec::parse")) return;
  const std::string formatted = spec->to_string();
  Result<PartitionSpec> again = PartitionSpec::parse(formatted);
  if (!again.is_ok() || again->to_string() != formatted) violated("partition '" + formatted + "' does not parse back");

  constexpr int kClasses = 10;
  std::vector<uint8_t> labels(200);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<uint8_t>((i * 7 + i / 13) % kClasses);
  const int sites = 1 + parameter % 32;
  auto parts = fedmesh::train::data::partition_indices(labels, kClasses, sites, *spec, parameter);
  if (!accepted(parts, "partition_indices")) return;
  if (parts->size() != static_cast<size_t>(sites)) violated(formatted + ": wrong number of sites");
  std::vector<int> seen(labels.size(), 0);
  for (const std::vector<int64_t>& part : *parts) {
    if (!std::is_sorted(part.begin(), part.end())) violated(formatted + ": a site's indices are not ascending");
    for (int64_t index : part) {
      if (index < 0 || index >= static_cast<int64_t>(labels.size())) violated(formatted + ": index out of range");
      ++seen[static_cast<size_t>(index)];
    }
  }
  for (int count : seen) {
    if (count != 1) violated(formatted + ": an index is in " + std::to_string(count) + " sites");
  }
}

void check_compression(std::string_view text) {
  using namespace fedmesh::protocol;
  Result<CompressionSpec> spec = parse_compression_spec(text);
  if (!accepted(spec, "parse_compression_spec")) return;
  const std::string formatted = spec->to_string();
  Result<CompressionSpec> again = parse_compression_spec(formatted);
  if (!again.is_ok() || !(*again == *spec)) violated("compression '" + formatted + "' does not parse back equal");
}

void check_override(std::string_view text) {
  using namespace fedmesh::protocol;
  Result<TensorOverride> parsed = parse_tensor_override(text);
  if (!accepted(parsed, "parse_tensor_override")) return;
  const std::string formatted = parsed->pattern + "=" + parsed->spec.to_string();
  Result<TensorOverride> again = parse_tensor_override(formatted);
  if (!again.is_ok() || again->pattern != parsed->pattern || !(again->spec == parsed->spec)) {
    violated("override '" + formatted + "' does not parse back equal");
  }
}

// The whole compression plan of a config: the text up to the first ';' is
// compression.default, each later part one of compression.overrides.
void check_plan(std::string_view text, uint8_t parameter) {
  using namespace fedmesh::protocol;
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(';', start);
    parts.emplace_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  Result<CompressionPlan> plan = make_compression_plan(parts[0], overrides, parameter);
  if (!accepted(plan, "make_compression_plan")) return;
  const int64_t dims[] = {3, int64_t{parameter} + 1};
  for (const char* name : {"layer0.weight", "layer0.bias", "x"}) (void)plan->for_tensor(name, dims);
  (void)plan->to_string();
}

void check_faults(std::string_view text) {
  using namespace fedmesh::protocol;
  Result<FaultPlan> plan = parse_fault_plan(text);
  if (!accepted(plan, "parse_fault_plan")) return;
  if (!plan->validate().is_ok()) violated("parse_fault_plan accepted a plan validate() refuses");
  const std::string formatted = plan->to_string();
  Result<FaultPlan> again = parse_fault_plan(formatted);
  if (!again.is_ok() || again->to_string() != formatted) violated("faults '" + formatted + "' do not parse back");
  FaultInjector injector(*plan);
  double now = 0.0;
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 20, uint64_t{1} << 40}) {
    const FaultInjector::Decision decision = injector.decide(bytes, now);
    if (!std::isfinite(decision.hold_seconds) || decision.hold_seconds < 0.0) {
      violated("faults '" + formatted + "' hold a message for " + std::to_string(decision.hold_seconds) + " s");
    }
    now += 0.001;
  }
}

void check_staleness(std::string_view text, uint8_t parameter) {
  using fedmesh::federation::StalenessFunction;
  const int64_t max_staleness = static_cast<int64_t>(parameter) - 1;  // -1: no cut-off
  Result<StalenessFunction> function = StalenessFunction::parse(text, max_staleness);
  if (!accepted(function, "StalenessFunction::parse")) return;
  const std::string formatted = function->to_string();
  Result<StalenessFunction> again = StalenessFunction::parse(formatted);
  if (!again.is_ok() || again->to_string() != formatted) violated("staleness '" + formatted + "' does not parse back");
  for (const StalenessFunction& f : {*function, *again}) {
    double previous = 1.0;
    for (int64_t tau : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{100}, int64_t{1} << 20,
                        int64_t{1} << 40, INT64_MAX}) {
      const double weight = f.weight(tau);
      if (!std::isfinite(weight) || weight < 0.0 || weight > 1.0 || weight > previous) {
        violated("staleness '" + formatted + "' weighs tau " + std::to_string(tau) + " as " + std::to_string(weight));
      }
      previous = weight;
    }
  }
}

void check_topology(std::string_view text, uint8_t parameter) {
  using namespace fedmesh::gossip;
  Result<Topology> topology = parse_topology(text);
  if (!accepted(topology, "parse_topology")) return;
  Result<Topology> again = parse_topology(topology_name(*topology));
  if (!again.is_ok() || *again != *topology) violated(std::string("topology ") + topology_name(*topology));
  const size_t n = 2 + parameter % 40;
  fedmesh::Rng rng(parameter);
  for (int64_t step = 0; step < 8; ++step) {
    const size_t self = static_cast<size_t>(step * 5 + parameter) % n;
    const int fanout = 1 + static_cast<int>((static_cast<size_t>(step) + parameter) % (n - 1));
    const std::vector<size_t> peers = choose_peers(*topology, self, n, fanout, step, rng);
    std::vector<size_t> sorted = peers;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) violated("choose_peers repeated a peer");
    for (size_t peer : peers) {
      if (peer >= n || peer == self) violated("choose_peers picked " + std::to_string(peer) + " for " + std::to_string(self));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  const uint8_t parameter = data[1];
  switch (data[0] % 7) {
    case 0: check_partition(text, parameter); break;
    case 1: check_compression(text); break;
    case 2: check_override(text); break;
    case 3: check_plan(text, parameter); break;
    case 4: check_faults(text); break;
    case 5: check_staleness(text, parameter); break;
    default: check_topology(text, parameter); break;
  }
  return 0;
}
