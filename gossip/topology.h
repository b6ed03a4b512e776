// Which peers a node sends its update to in a gossip step. Members are
// indexed 0..n-1 in one order every node agrees on (the roster's names,
// sorted), so that the deterministic topologies are the same graph
// everywhere:
//   random                 `fanout` distinct peers drawn uniformly
//   ring                   the next `fanout` members: self + 1, ..., self + fanout
//   exponential            the members at distance 1, 2, 4, ..., 2^k < n
//                          (Assran et al.'s exponential graph; fanout ignored)
//   one-peer-exponential   one peer per step, at distance 2^(step mod ceil(log2 n)):
//                          the exponential graph's edges taken one at a time
//                          (Ying et al. 2021)
// Distances wrap around (mod n). A single member has no peers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/random.h"
#include "base/status.h"

namespace fedmesh::gossip {

enum class Topology : uint8_t { kRandom, kRing, kExponential, kOnePeerExponential };

Result<Topology> parse_topology(std::string_view text);  // "random", "ring", "exponential", "one-peer-exponential"
const char* topology_name(Topology topology);

// The peers of member `self` of n in gossip step `step`; never self, no
// repeats. `rng` is used by kRandom only.
std::vector<size_t> choose_peers(Topology topology, size_t self, size_t n, int fanout, int64_t step, Rng& rng);

}  // namespace fedmesh::gossip
