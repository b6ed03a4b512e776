// Moving the global model from the aggregator to a site, as data: the
// aggregator's ModelPublisher serves the current version cut into ModelChunk
// messages; a site's fetch_model() asks for them a window at a time
// (ModelRequest{version, fromChunk, trustedVersion}) and decodes each chunk
// as it arrives, so a transfer cut off midway resumes at the first chunk
// still missing.
//
// Chunk 0 carries no values: the tensor descriptors, the version's parent
// hash and its hash, and the chain of version hashes from the requester's
// trusted version up to this one. Chunks 1.. carry dense fp32 segments. The
// fetcher checks every descriptor against its own manifest before it decodes
// a value; the hash chain itself is checked by the caller (node/), which owns
// the model-hash function.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "crypto/update_signature.h"
#include "protocol/codec.h"
#include "protocol/model_serving.h"
#include "protocol/retransmit_timer.h"
#include "protocol/transport.h"
#include "protocol/wire.h"

namespace fedmesh::protocol {

inline constexpr uint64_t kMaxChainHashesPerChunk = 1u << 16;  // versions a requester may be behind

class ModelPublisher {
 public:
  explicit ModelPublisher(size_t chunk_bytes = kDefaultChunkBytes) : chunk_bytes_(chunk_bytes) {}

  // Makes `version` the one served, from `tensors` where they lie: each
  // chunk is encoded when it is asked for and shared by every request for it
  // while a copy lives, so the publisher holds no copy of the model (a large
  // model's aggregator would otherwise hold two), and the copies in flight
  // are at most one per chunk whatever the number of peers. The
  // tensors must stay alive and unchanged until the next publish: the owner
  // publishes after every change. Refuses non-finite values.
  // `chain[v]` is the hash of version v for every v <= version (chain.back()
  // is this version's hash, chain[version - 1] its parent's).
  Status publish(uint64_t version, std::vector<crypto::Hash> chain, std::span<const TensorShape> manifest,
                 std::span<const std::span<const float>> tensors);

  uint64_t version() const { return version_; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunks_.size() + 1); }
  bool published() const { return published_; }

  // Asked once a request is valid and before any chunk of it is encoded:
  // whether it may be answered now, given how many replies it takes and the
  // bytes of the chunk copies it would add (those not alive now); a refusal
  // sets the rejection.
  using Admit = std::function<bool(size_t replies, uint64_t new_bytes, Rejection& rejection)>;

  // The answer to a ModelRequest: up to `window` chunks from fromChunk on, or
  // a rejection (a version no longer served: wrongRound; a chunk past the
  // end or a trusted version above the requested one: malformed; refused by
  // `admit`: its rejection).
  bool answer(wire::ModelRequest::Reader request, uint32_t window, std::vector<SharedMessage>& replies,
              Rejection& rejection, const Admit& admit = {}) const;

  // Bytes of model values in chunk copies alive now, of any version served
  // (queued for a peer or being sent; released on ZeroMQ's I/O thread).
  uint64_t live_bytes() const { return live_bytes_->load(); }

 private:
  OutgoingMessage manifest_chunk(uint64_t trusted_version) const;
  // Chunk `index` (1..) encoded from the tensors, or the copy of it still
  // held for another peer (queued or being sent): one copy per chunk at
  // most, however many peers download at once.
  SharedMessage value_chunk(uint32_t index) const;

  // Values [first, first + count) of one tensor.
  struct Range {
    uint32_t tensor = 0;
    uint64_t first = 0, count = 0;
  };
  size_t chunk_bytes_;
  bool published_ = false;
  uint64_t version_ = 0;
  std::vector<crypto::Hash> chain_;
  std::vector<TensorShape> manifest_;
  std::vector<std::span<const float>> tensors_;
  std::vector<std::vector<Range>> chunks_;  // what chunk i + 1 carries
  mutable std::vector<std::weak_ptr<const OutgoingMessage>> served_;  // chunk i + 1 while a copy lives
  std::vector<uint64_t> value_bytes_;                                  // chunk i + 1's values, in bytes
  std::shared_ptr<std::atomic<uint64_t>> live_bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
};

struct FetchedModel {
  uint64_t version = 0;
  crypto::Hash parent{};
  crypto::Hash hash{};
  std::vector<crypto::Hash> chain;  // hashes of versions trusted + 1 .. version
  std::vector<std::vector<float>> tensors;  // one per manifest entry
  uint64_t bytes_received = 0;
  uint32_t requests = 0;  // > 1: windows, or resumed after a timeout
};

struct FetchOptions {
  uint32_t window = kDefaultModelWindow;
  std::chrono::milliseconds reply_timeout{10000};  // nothing for this long: ask again from the first missing chunk
  int max_attempts = 5;                            // requests in a row that time out
  // When given, it sizes each wait instead of reply_timeout (the link's
  // measured round trip, backed off after a timeout) and learns from every
  // answer, and the requests in a row that may time out are at least
  // max_attempts and as many more as its measured loss needs. The caller
  // keeps it across fetches.
  RetransmitTimer* timer = nullptr;
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  // Answered BUSY (the aggregator still has as many chunks queued for this
  // site as it allows, or holds as many for all downloads as it allows):
  // what is held is kept, and the request is made again from the first
  // missing chunk after busy_pause, doubled with each BUSY in a row (at most
  // busy_max_pause and reply_timeout: a site waiting its turn for the
  // aggregator's serving budget asks again soon after room is freed, and
  // well within kModelServingHoldPlace, which keeps its place in line);
  // past max_busy_answers in a row, kUnavailable.
  std::chrono::milliseconds busy_pause{20};
  std::chrono::milliseconds busy_max_pause{200};
  uint32_t max_busy_answers = 128;
};

// Fetches `version` over `socket`. kUnavailable when the server stays quiet,
// kNotFound when it no longer serves that version (the caller asks for the
// newer one), kCorrupt when a chunk does not match the manifest or
// the version asked for.
Result<FetchedModel> fetch_model(ClientChannel& socket, uint64_t version, uint64_t trusted_version,
                                 std::span<const TensorShape> manifest, const FetchOptions& options = {});

}  // namespace fedmesh::protocol
