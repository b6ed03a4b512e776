// What a gossip peer (`fedmesh node --mode gossip`) runs with: its config
// file's keys (every one is described in docs/configuration.md), read and
// checked, and the federation name its shares carry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "gossip/swim.h"
#include "node/site_config.h"

namespace fedmesh::node {

struct GossipConfig {
  SiteConfig site;                   // identity, model, data, training, compression, transport
  std::string listen;                // default: our roster address
  std::vector<std::string> seeds;    // roster names to join through (default: every other member)
  std::string topology = "exponential";  // push-sum and pairwise
  int fanout = 1;                    // random and ring
  // replicas (sparse updates every member applies: gossip/replicas.h), or
  // push-sum or pairwise (model states)
  std::string merge = "replicas";
  int64_t local_steps = 50;          // H
  // The most payload bytes in one chunk of a share or update
  // (4096..4 MiB); a lost chunk is asked for again alone (replicas).
  size_t chunk_bytes = size_t{4} << 20;
  int64_t rounds = 0;                // 0: until stopped
  std::string staleness = "polynomial:0.5";
  int64_t max_staleness = 32;        // versions; -1: no cut-off
  int catch_up_donors = 3;
  int64_t catch_up_lag = 10;         // catch up when a member is this many versions ahead
  double catch_up_timeout_seconds = 10.0;
  int64_t test_limit = 2000;         // test images evaluated (0: all)
  int64_t eval_every = 1;            // rounds
  // push-sum and pairwise: after training, wait up to this long for a
  // share if none came.
  double wait_for_share_seconds = 1.0;
  // replicas: after making its update of a round, wait up to this long for
  // the update of that round of every reachable member that has reached
  // it (members further behind are not waited for).
  double wait_for_updates_seconds = 10.0;
  // [dp] Local differential privacy of what this node sends: each round's
  // training delta is clipped to dp.clip (L2) and gets N(0, (sigma clip)^2)
  // noise before it enters the model the node shares, so every share is a
  // post-processing of noisy deltas. Each round is one Gaussian mechanism on
  // the node's data (q = 1), composed by the RDP accountant; the ledger entry
  // of a round is committed with its model, and dp.target_epsilon stops the
  // node before a round that would exceed it.
  double dp_clip = 0.0;              // 0: off
  double dp_noise_multiplier = 0.0;
  double dp_delta = 1e-5;
  double dp_target_epsilon = 0.0;    // 0: no target
  gossip::SwimOptions swim;

  Status validate() const;
};

Result<GossipConfig> read_gossip_config(const std::string& path);

// The federation name a gossip peer's shares carry and the name it takes
// shares for: the federation's, with "/tokenizer=FINGERPRINT" appended when
// the peer reads its text with a BPE tokenizer (data.tokenizer). Peers
// merge only models of the same vocabulary and merges: a share from a peer
// with another tokenizer, or none, is refused (wrong federation) with both
// names in the reason, and counted. Likewise "/lora=FINGERPRINT" when the
// peers fine-tune by LoRA (training.lora; 12 hex digits of the
// fingerprint, so that the name fits a Hello): their shares are B factors,
// which mean the same only over the same frozen weights and A factors
// (Sequential::frozen_fingerprint).
std::string gossip_federation(const std::string& federation, const std::string& tokenizer_fingerprint,
                              const std::string& lora_fingerprint = "");

}  // namespace fedmesh::node
