#include "gossip/topology.h"

#include <algorithm>

namespace fedmesh::gossip {

Result<Topology> parse_topology(std::string_view text) {
  if (text == "random") return Topology::kRandom;
  if (text == "ring") return Topology::kRing;
  if (text == "exponential") return Topology::kExponential;
  if (text == "one-peer-exponential") return Topology::kOnePeerExponential;
  return invalid_argument("topology '" + std::string(text) +
                          "': expected random, ring, exponential or one-peer-exponential");
}

const char* topology_name(Topology topology) {
  switch (topology) {
    case Topology::kRandom: return "random";
    case Topology::kRing: return "ring";
    case Topology::kExponential: return "exponential";
    case Topology::kOnePeerExponential: return "one-peer-exponential";
  }
  return "unknown";
}

std::vector<size_t> choose_peers(Topology topology, size_t self, size_t n, int fanout, int64_t step, Rng& rng) {
  std::vector<size_t> peers;
  if (n < 2 || self >= n) return peers;
  const size_t f = std::min<size_t>(static_cast<size_t>(std::max(fanout, 1)), n - 1);
  switch (topology) {
    case Topology::kRandom: {
      // A partial Fisher-Yates shuffle of the others.
      std::vector<size_t> others;
      for (size_t i = 0; i < n; ++i) {
        if (i != self) others.push_back(i);
      }
      for (size_t i = 0; i < f; ++i) std::swap(others[i], others[i + rng.below(others.size() - i)]);
      peers.assign(others.begin(), others.begin() + static_cast<int64_t>(f));
      break;
    }
    case Topology::kRing:
      for (size_t d = 1; d <= f; ++d) peers.push_back((self + d) % n);
      break;
    case Topology::kExponential:
      for (size_t d = 1; d < n; d *= 2) peers.push_back((self + d) % n);
      break;
    case Topology::kOnePeerExponential: {
      size_t distances = 0;  // ceil(log2 n): the distances 1, 2, ..., 2^(distances - 1)
      while ((size_t{1} << distances) < n) ++distances;
      const auto i = static_cast<size_t>(step % static_cast<int64_t>(distances));
      peers.push_back((self + (size_t{1} << i)) % n);
      break;
    }
  }
  return peers;
}

}  // namespace fedmesh::gossip
