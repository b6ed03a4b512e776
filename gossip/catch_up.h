// Catch-up (anti-entropy) between gossip members: a member that fell
// behind asks the members furthest ahead for one slice each of their model
// (relative to the seeded model x0, as every share), asks another donor
// for a slice whose donor stays silent, and adopts the model the slices
// make up. The networked node (node/gossip_runtime) drives it with its
// sockets and clock; this holds what is decided and assembled.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "protocol/update_transfer.h"

namespace fedmesh::gossip {

// [begin, end) of slice `slice` of `slices` over n elements.
std::pair<size_t, size_t> slice_range(size_t n, uint32_t slice, uint32_t slices);

// A donor's answer: `model` minus `reference` in slice `slice` of `slices`
// of every tensor, encoded sparse (an index list or a bitmap, whichever is
// smaller).
Result<std::vector<protocol::EncodedTensor>> encode_catch_up_slice(
    const std::vector<protocol::TensorShape>& manifest, const std::vector<std::vector<float>>& model,
    const std::vector<std::vector<float>>& reference, uint32_t slice, uint32_t slices,
    size_t max_segment_bytes = protocol::kDefaultChunkBytes);

// The behind member's side of one catch-up.
class CatchUp {
 public:
  // `ahead`: the members ahead (version, name), any order; it asks the
  // `donors` furthest ahead (at least one) for a slice each.
  CatchUp(std::vector<std::pair<uint64_t, std::string>> ahead, uint32_t donors);

  uint32_t slices() const { return slices_; }
  uint64_t target_version() const { return ahead_.front().first; }
  // Each slice with the donor to ask for it first.
  std::vector<std::pair<uint32_t, std::string>> first_requests();
  // Each slice still missing with the next donor to ask for it (the next
  // member ahead, in turn).
  std::vector<std::pair<uint32_t, std::string>> requests_again();
  // Keeps `values` when it is a slice of this catch-up asked of `from` at
  // its latest request; false (and nothing kept) otherwise.
  bool take(const std::string& from, uint32_t slice, uint32_t slices, std::vector<std::vector<float>>& values);
  size_t received() const { return received_.size(); }
  bool complete() const { return received_.size() == slices_; }
  // Every donor asked, each once, sorted.
  std::vector<std::string> donors_asked() const;
  // `current` with every slice received in place (reference + values).
  std::vector<std::vector<float>> assemble(const std::vector<std::vector<float>>& current,
                                           const std::vector<std::vector<float>>& reference) const;

 private:
  std::vector<std::pair<uint64_t, std::string>> ahead_;  // furthest ahead first
  uint32_t slices_ = 0;
  std::map<uint32_t, std::string> donor_;               // the donor last asked for each slice
  std::map<uint32_t, std::vector<std::vector<float>>> received_;
  std::vector<std::string> asked_;
};

}  // namespace fedmesh::gossip
