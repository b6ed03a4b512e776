// One node's model in gossip, and what it sends and takes: the merge rules
// of averaging.h applied to a whole model, with compression and error
// feedback (protocol/compressor.h). The networked node (node/) and the
// gossip simulation (`fedmesh sim --mode gossip`) both run this class.
//
// Values travel relative to the reference model x0 that every node rebuilds
// from the federation's seed (version 0): a node sends its model minus x0,
// whose range is what training has moved, not the weights themselves, so a
// quantizer's grid is finer for the same bits.
//
// Push-sum is held as (z, w): the model z = x / w and the weight w, rather
// than the weighted sum x. The arithmetic is the same, but under message
// loss every weight decays geometrically (the lost shares' mass is gone),
// and x = w z would underflow fp32 within a few hundred rounds; z never
// does, and w is a double. A node sending to f peers gives each the weight
// w_s = w / (1 + f) (rounded to what the wire carries, so the sender removes
// exactly what a receiver adds) and keeps w - f w_s; its model is unchanged.
// It sends C(e + z - x0), the same bytes to every peer, keeping the residual
// e <- e + (z - x0) - D(C(.)). A receiver holding (z, w) takes a share
// (u, w_s) as z <- (w z + w_s (x0 + u)) / (w + w_s), w <- w + w_s: the
// weighted average push-sum computes. With lossless compression and no lost
// message, sum of w z and sum of w over the nodes are conserved exactly
// (tests/gossip/test_exchange.cpp).
//
// Pairwise: a node sends its model (z - x0, compressed with error feedback
// on that stream) and keeps it; a receiver moves half-way towards it,
// scaled by the staleness weight: z <- (1 - s/2) z + (s/2) (x0 + D(C)).
//
// Compression: only dense methods (identity, fp16, bf16, int8, int4) can be
// gossiped this way. A sparsifier (top-k, dct-sign) or PowerSGD sends a few
// coordinates of a *state*, not of a delta: the residual would then hold
// nearly the whole model and the receivers' models would jump where its
// mass finally lands. Sparse gossip is the merge rule kReplicas
// (gossip/replicas.h), whose messages are updates, not states.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "crypto/update_signature.h"
#include "kernels/compression_kernels.h"
#include "protocol/compression_spec.h"
#include "protocol/compressor.h"
#include "protocol/update_transfer.h"

namespace fedmesh::gossip {

// kReplicas is sparse gossip with identical replicas (gossip/replicas.h:
// every peer applies every peer's compressed update), which ReplicaState
// runs; GossipState runs the other two.
enum class MergeRule : uint8_t { kPushSum, kPairwise, kReplicas };
Result<MergeRule> parse_merge_rule(std::string_view text);  // "replicas", "push-sum", "pairwise"
const char* merge_rule_name(MergeRule rule);

// Ok for the plans gossip with `rule` can carry (the default and every
// override); kInvalidArgument naming the method and why otherwise.
Status check_gossip_compression(const protocol::CompressionPlan& plan, MergeRule rule);

// What a gossip update carries beside its model tensors, in its signed
// header (UpdateHeader.peer): whether it is a share (with its push-sum
// weight), a catch-up slice (slice `slice` of `slices`, at most
// kMaxCatchUpSlices) a member asked for, or a replica update (merge rule
// replicas: the sender's update of the header's round).
inline constexpr uint32_t kMaxCatchUpSlices = 16;
using GossipUpdateKind = crypto::PeerUpdateKind;
using GossipUpdateMeta = crypto::PeerUpdateFields;
// kInvalidArgument, saying what is wrong, unless `meta` is a share with a
// finite positive weight, a catch-up slice within kMaxCatchUpSlices, or a
// replica update.
Status check_update_meta(const GossipUpdateMeta& meta);

// What one send carries to each of its peers.
struct GossipShare {
  std::vector<protocol::EncodedTensor> tensors;  // per model tensor: the compressed values, relative to x0
  std::vector<std::vector<float>> decoded;        // D(C) per tensor: what each receiver adds (or averages with)
  double weight = 0.0;                            // push-sum: the weight each peer gets; pairwise: 1
  int peers = 0;
  uint64_t payload_bytes = 0;                     // encoded segment bytes of one copy
};

class GossipState {
 public:
  // `reference` is x0, one flattened vector per manifest tensor; the node
  // starts there with weight 1.
  static Result<GossipState> create(MergeRule rule, const protocol::CompressionPlan& plan,
                                    std::vector<protocol::TensorShape> manifest,
                                    std::vector<std::vector<float>> reference, uint64_t seed,
                                    kernels::CompressionKernels& kernels,
                                    size_t max_segment_bytes = protocol::kDefaultChunkBytes);
  GossipState(GossipState&&) noexcept = default;
  GossipState& operator=(GossipState&&) noexcept = default;

  MergeRule rule() const { return rule_; }
  const std::vector<protocol::TensorShape>& manifest() const { return manifest_; }
  // The model this node holds, one vector per tensor.
  const std::vector<std::vector<float>>& model() const { return model_; }
  // Local training (or a catch-up) moved the model to `trained`; the weight stays.
  Status set_model(std::span<const std::vector<float>> trained);
  double weight() const { return weight_; }

  // Compresses a share for `peers` (>= 1) peers and, for push-sum, gives it
  // away (see the header comment).
  Result<GossipShare> share(int peers);
  // `undelivered` of the share's peers never got it (the send failed before
  // it left): their parts come back (push-sum; nothing to do for pairwise).
  void take_back(const GossipShare& share, int undelivered);
  // Merges what a peer sent: its decoded values (relative to x0) and weight.
  // `staleness_weight` in [0, 1] scales a pairwise step (push-sum takes
  // staleness only as a cut-off, left to the caller). Refuses a length
  // mismatch, a weight that is not finite and positive (push-sum), or a
  // result that is not finite, changing nothing then.
  Status merge(std::span<const std::vector<float>> values, double weight, double staleness_weight);
  // The L2 distance between our model and the one a received share stands
  // for (x0 + values): the consensus a node reports.
  double distance_to(std::span<const std::vector<float>> values) const;

  // Checkpoint state: z (one vector per tensor), w, and the compressor's
  // residual (protocol::UpdateCompressor::state_tensors).
  std::vector<std::vector<float>>& values() { return model_; }
  void set_weight(double weight) { weight_ = weight; }
  protocol::UpdateCompressor& compressor() { return *compressor_; }
  const std::vector<std::vector<float>>& reference() const { return reference_; }

 private:
  GossipState() = default;
  MergeRule rule_ = MergeRule::kPushSum;
  std::vector<protocol::TensorShape> manifest_;
  std::vector<std::vector<float>> reference_;  // x0
  std::vector<std::vector<float>> model_;      // z
  double weight_ = 1.0;                        // w
  std::optional<protocol::UpdateCompressor> compressor_;
};

}  // namespace fedmesh::gossip
