// Moving one signed model update from a sender to a receiver, as data: the
// sender prepares a header and its chunks (PreparedUpdate); the receiver's
// UpdateReceiver checks each message in order (who sent it, the signature,
// the replay counter, the round, the shapes; then each chunk's hash before
// it is parsed, then every value) and decodes chunks into a per-transfer
// staging copy as they arrive: in memory, or, for a receiver given a spill
// directory (the aggregator), into an unnamed file there, so that a large
// model's uploads in flight cost disk, not memory. Only a transfer whose every chunk verified is
// made durable and handed on: nothing half-received reaches an aggregate.
// Durable means either the owner's store hook saved the update and its replay
// counter in one commit, or (no hook) the replay guard persisted the counter.
// A failure to make it durable is refused as notStored, which the sender
// retries; only a sequence at or below the durable counter is `replayed`.
//
// Resume: a sender that lost its connection resends the same header; the
// receiver recognises the transfer in flight and answers Ack{nextChunk}, the
// first chunk it does not hold, and the sender continues from there. A
// gossip replica asks for its missing chunks by name instead (UpdateRequest
// with the sequence and the chunks held, UpdateReceiver::in_flight); the
// sender resends the same header and only those.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/spill_file.h"
#include "base/status.h"
#include "crypto/keys.h"
#include "crypto/replay_guard.h"
#include "crypto/roster.h"
#include "crypto/update_signature.h"
#include "protocol/codec.h"
#include "protocol/wire.h"

namespace fedmesh::protocol {

// Transfers in flight: at most kMaxTransfersPerPeer from one sender, and in
// all max(kMaxTransfersInFlight, kMaxTransfersPerPeer x roster size), so
// that a sender holding its own maximum never keeps another one out.
inline constexpr size_t kMaxTransfersInFlight = 8;
inline constexpr size_t kMaxTransfersPerPeer = 2;
// Sites number their updates with the Unix time in microseconds (or the last
// sequence + 1, if that is larger), so an honest sequence is never far ahead
// of the receiver's clock. One further ahead than this (a day, which covers
// any clock skew and any burst of last + 1 steps) is refused as
// sequenceAhead: accepted, it would raise the sender key's replay counter so
// far that the key's honest updates would be refused as replays.
inline constexpr uint64_t kMaxSequenceAheadMicros = 24ull * 3600 * 1000 * 1000;
// The most samples an update may claim (a federation-wide default; the
// aggregator's config may lower or raise it). An update's FedAvg weight is
// its sample count, so this bounds how much one site key can outweigh the
// others; over it the update is refused as tooManySamples.
inline constexpr uint64_t kDefaultMaxSampleCount = 1'000'000;
inline constexpr size_t kMinChunkBytes = 64;
inline constexpr std::chrono::seconds kTransferIdleTimeout{120};

using UpdateMetadata = crypto::UpdateMetadata;

// How one tensor of the manifest is sent.
struct TensorPlan {
  Encoding encoding = Encoding::kDenseF32;
  uint32_t block_size = kDefaultBlockSize;  // block encodings
};

struct TensorDescriptorFields {
  std::string name;
  std::vector<int64_t> dims;
  Encoding encoding = Encoding::kDenseF32;
  uint32_t block_size = 0;
};
crypto::Hash descriptor_hash(std::span<const TensorDescriptorFields> descriptors);

class ChunkStream;  // protocol/sealed_update.h

// An update ready to send: header and chunks serialized, chunk hashes
// signed. Kept whole so that any chunk can be resent on resume.
struct PreparedUpdate {
  UpdateMetadata metadata;
  SharedMessage header;               // envelope + body
  std::vector<SharedMessage> chunks;  // envelope + body each
  uint64_t encoded_payload_bytes = 0;
  // A sealed update (protocol/sealed_update.h): the header names no chunks,
  // `chunks` stays empty, and the stream makes the chunks and then the
  // UpdateSeal while the first ones are sent.
  std::shared_ptr<ChunkStream> stream;
};

// The chunk hash fedmesh's senders use: BLAKE2bp (the schema's blake2bp).
inline constexpr crypto::ChunkHash kSentChunkHash = crypto::ChunkHash::kBlake2bp;

// Packs segments into chunks of at most chunk_bytes of payload, in order
// (a segment larger than that is a chunk of its own).
class ChunkGrouper {
 public:
  explicit ChunkGrouper(size_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}
  // Whether the next segment, of this many payload bytes, starts a chunk.
  bool starts_chunk(size_t payload_bytes) {
    const bool starts = !open_ || pending_ + payload_bytes > chunk_bytes_;
    if (starts) pending_ = 0;
    open_ = true;
    pending_ += payload_bytes;
    return starts;
  }

 private:
  size_t chunk_bytes_;
  size_t pending_ = 0;
  bool open_ = false;
};

// prepare_update's pieces: its checks of the inputs, a tensor's descriptor,
// and one tensor's (or a run of its elements') encoding by its plan (dense
// segments deferred: `values` must outlive them, up to their serialization).
Status check_update_inputs(std::span<const TensorShape> manifest, std::span<const std::span<const float>> tensors,
                           std::span<const TensorPlan> plans, size_t chunk_bytes);
TensorDescriptorFields descriptor_of(const TensorShape& shape, const TensorPlan& plan);
Result<std::vector<EncodedSegment>> encode_with_plan(uint32_t tensor, std::span<const float> values,
                                                     const TensorPlan& plan, size_t chunk_bytes);

// One UpdateChunk message of these segments (one copy of their bytes).
OutgoingMessage serialize_chunk(uint64_t sequence, uint32_t index, std::span<const EncodedSegment* const> segments);

// Segments already encoded, one list per tensor (for senders that encode
// themselves, e.g. sparse top-k, or tests that need hand-made bytes).
struct EncodedTensor {
  TensorDescriptorFields descriptor;
  std::vector<EncodedSegment> segments;
};

// Encodes `tensors` (one flattened fp32 span per manifest entry) by `plans`,
// packs segments into chunks of at most chunk_bytes of payload, hashes and
// signs. Fails on non-finite input or a span that does not fit its shape.
Result<PreparedUpdate> prepare_update(const UpdateMetadata& metadata, std::span<const TensorShape> manifest,
                                      std::span<const std::span<const float>> tensors,
                                      std::span<const TensorPlan> plans, const crypto::SiteKeys& sender_keys,
                                      size_t chunk_bytes = kDefaultChunkBytes);
PreparedUpdate prepare_encoded_update(const UpdateMetadata& metadata, std::vector<EncodedTensor> tensors,
                                      const crypto::SiteKeys& sender_keys, size_t chunk_bytes = kDefaultChunkBytes);

// The bytes one message of `payload` bytes takes on a CurveZMQ connection:
// the MESSAGE command (name, 8-byte nonce, 16-byte MAC, a flags byte, the
// payload) inside a ZMTP frame (2 header bytes, 9 past 255 bytes).
constexpr uint64_t curve_message_bytes(uint64_t payload) {
  const uint64_t command = 1 + 7 + 8 + 16 + 1 + payload;
  return command + (command > 255 ? 9 : 2);
}
// What sending `update` costs on the wire: header and chunks, each framed as above.
uint64_t wire_bytes(const PreparedUpdate& update);

// The serialized, signed UpdateHeader for chunks whose hashes are given
// (`chunk_hash` says which hash they are; prepare_update's are BLAKE2bp).
SharedMessage signed_header(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                            std::span<const crypto::Hash> chunk_hashes, const crypto::SiteKeys& sender_keys,
                            crypto::ChunkHash chunk_hash = crypto::ChunkHash::kBlake2b);

// A sealed update's header (UpdateHeader.sealed: no chunk count, hashes or
// signature) and its UpdateSeal: the chunk hashes and the signature that
// signed_header would have put in the header.
SharedMessage sealed_header(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                            crypto::ChunkHash chunk_hash);
SharedMessage update_seal(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                          std::span<const crypto::Hash> chunk_hashes, const crypto::SiteKeys& sender_keys,
                          crypto::ChunkHash chunk_hash);

OutgoingMessage copy_message(std::span<const uint8_t> bytes);

// Tensor descriptors into and out of the schema (UpdateHeader, ModelChunk).
// read_descriptors checks counts, names, ranks and encodings; descriptors_match
// compares names and shapes with our own manifest (`what` names the message).
void fill_descriptors(capnp::List<wire::TensorDescriptor>::Builder list,
                      std::span<const TensorDescriptorFields> descriptors);
bool read_descriptors(capnp::List<wire::TensorDescriptor>::Reader tensors,
                      std::vector<TensorDescriptorFields>& descriptors, Rejection& rejection);
bool descriptors_match(std::span<const TensorDescriptorFields> descriptors, std::span<const TensorShape> manifest,
                       std::string_view what, Rejection& rejection);

// What the receiver accepts.
struct ReceiverPolicy {
  std::string federation;
  std::string self;                    // our roster name: the only recipient we take
  std::vector<TensorShape> manifest;
  uint64_t current_round = 0;
  uint64_t max_round_lag = 0;          // accept rounds in [current - lag, current]
  uint64_t current_version = 0;        // base versions above it are refused
  uint32_t max_chunks = kMaxChunksPerUpdate;
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  bool insecure = false;               // no transport identity: trust the signed sender name alone
  // A gossip peer: every update must carry peer fields (UpdateHeader.peer);
  // otherwise none may.
  bool peer_updates = false;
  // expire() drops transfers that made no progress (no chunk adding new
  // bytes) for this long; a resent header or a duplicate chunk is no
  // progress. (Gossip: a sender never resumes a share, so an incomplete one
  // is dropped soon.)
  std::chrono::milliseconds transfer_idle_timeout = kTransferIdleTimeout;
  // Sequences above the receiver's clock (Unix microseconds) plus this are
  // refused as sequenceAhead. UINT64_MAX: no bound (simulations, tests).
  uint64_t max_sequence_ahead_micros = kMaxSequenceAheadMicros;
  std::function<uint64_t()> unix_micros;  // the clock; empty: the system clock
  // Writes each verified chunk's decoded parts on these threads (the codec's
  // SegmentRunner); empty: on the receiving thread. fedmesh's processes pass
  // fedmesh::parallel_each.
  SegmentRunner decode_runner;
  // sampleCount above this is refused as tooManySamples.
  uint64_t max_sample_count = kDefaultMaxSampleCount;
  size_t max_transfers_per_peer = kMaxTransfersPerPeer;
  // Bytes all transfers in flight may stage (each stages the whole model in
  // fp32, in memory or in spill_dir); 0: no bound beyond the transfer caps. When it binds, fewer
  // transfers are taken at once (never fewer than one), each sender gets one
  // at a time, and the others are answered BUSY and come back: the
  // receiver's memory then stays flat however many senders there are.
  uint64_t staging_budget_bytes = 0;
  // Where transfers are staged: empty, in memory; else each transfer's
  // decoded values go, as each chunk verifies, into an unnamed file in this
  // directory (SpillFile), and the receiver itself holds one segment's
  // decode at a time. A completed update then comes with `spilled`.
  std::filesystem::path spill_dir;
  // The time idle transfers are measured by (tests drive it).
  std::function<std::chrono::steady_clock::time_point()> clock = [] { return std::chrono::steady_clock::now(); };
};

// How far a transfer in flight has come (UpdateReceiver::in_flight).
struct TransferProgress {
  uint64_t sequence = 0;
  std::vector<bool> received;  // per chunk
};

struct ReceivedUpdate {
  UpdateMetadata metadata;
  std::vector<std::vector<float>> tensors;  // decoded, one per manifest entry (staged in memory)
  // Or, staged in the policy's spill_dir: the decoded values, fp32 in this
  // machine's byte order, tensor after tensor in the manifest's order.
  std::shared_ptr<SpillFile> spilled;
  std::string replay_key;                   // the sender's signing key (crypto::replay_key)
};

class UpdateReceiver {
 public:
  UpdateReceiver(ReceiverPolicy policy, const crypto::Roster& roster, crypto::ReplayGuard& replay);

  // Handles an UpdateHeader or UpdateChunk frame from `peer` (the ZAP
  // User-Id). Returns the reply (an Ack, or a Reject whose code and reason
  // are also stored in last_rejection()).
  // A header first expires the transfers idle for longer than the policy's
  // transfer_idle_timeout, so abandoned transfers never keep a new one out;
  // past that, a sender with max_transfers_per_peer in flight is refused as
  // BUSY, and so is anyone while the global cap is reached.
  OutgoingMessage handle_header(const std::string& peer, const ParsedMessage& message);
  // keep_alive, if given, owns `frame`: the parse then reads it in place.
  OutgoingMessage handle_chunk(const std::string& peer, const Envelope& envelope, std::span<const uint8_t> frame,
                               std::shared_ptr<const void> keep_alive = nullptr);
  // The UpdateSeal of a sealed transfer (UpdateHeader.sealed): its chunk
  // hashes and signature. Chunks that came before it were hashed and
  // decoded into staging on arrival; the seal is checked against the
  // signature and those hashes (a mismatch drops the transfer), and chunks
  // after it are checked as a header's would be. The transfer completes
  // when it has the seal and every chunk, whichever comes last.
  OutgoingMessage handle_seal(const std::string& peer, const ParsedMessage& message);

  // Makes a complete, verified update durable before it is acknowledged:
  // the hook stores the update together with its sender's replay counter in
  // one commit and returns ok only once both are on disk; then the receiver
  // raises the counter in memory (ReplayGuard::note_durable) and acks. Any
  // failure is answered notStored and nothing is recorded, so a resend of
  // the same update is taken. The hook owns the update: it is not queued
  // for take_completed(). Without a hook, the replay guard persists the
  // counter and the update is queued.
  using StoreUpdate = std::function<Status(ReceivedUpdate update)>;
  void set_store_update(StoreUpdate store) { store_update_ = std::move(store); }
  // Whether the owner would take an update with this metadata (e.g. the
  // aggregator: its site already reported for the round): asked at the
  // header, before any chunk is taken, and again when the update is
  // complete, before it is stored and acknowledged, so that an update is
  // never acknowledged and then dropped. A rejection is final (wrongRound).
  using AdmitUpdate = std::function<std::optional<std::string>(const UpdateMetadata& metadata)>;
  void set_admit_update(AdmitUpdate admit) { admit_update_ = std::move(admit); }

  std::vector<ReceivedUpdate> take_completed();
  // The newest transfer in flight from `peer` (its transport name) for
  // `round` that can still complete (no later update of the sender's has):
  // its sequence and which chunks are held. A sender asked for the missing
  // chunks resends its very header (resumed here, see handle_header) and
  // only those.
  std::optional<TransferProgress> in_flight(const std::string& peer, uint64_t round) const;
  const std::optional<Rejection>& last_rejection() const { return last_rejection_; }
  size_t transfers_in_flight() const { return transfers_.size(); }
  // max(kMaxTransfersInFlight, max_transfers_per_peer x roster members),
  // lowered to what the staging budget holds (at least one).
  size_t transfer_capacity() const;
  // Transfers one sender may have in flight: max_transfers_per_peer, or one
  // when the staging budget binds.
  size_t per_peer_capacity() const;
  // Drops transfers that made no progress for longer than the policy's
  // transfer_idle_timeout.
  void expire(std::chrono::steady_clock::time_point now);
  // Transfers dropped unfinished since this receiver was made: by expire(),
  // or superseded (a later update of the same sender completed first).
  uint64_t transfers_expired() const { return transfers_expired_.load(std::memory_order_relaxed); }
  // Transfers dropped unfinished because a later update of the same sender
  // completed first (they could only be refused as replays).
  uint64_t transfers_superseded() const { return transfers_superseded_; }
  void set_round(uint64_t round, uint64_t version) { policy_.current_round = round; policy_.current_version = version; }

 private:
  struct Transfer {
    UpdateMetadata metadata;
    crypto::Hash header_hash{};
    std::vector<crypto::Hash> chunk_hashes;
    crypto::ChunkHash chunk_hash = crypto::ChunkHash::kBlake2b;  // what chunk_hashes are
    std::vector<Encoding> encodings;
    std::vector<uint32_t> block_sizes;
    std::vector<bool> received;
    uint32_t next_chunk = 0;
    uint32_t chunks_held = 0;
    std::vector<std::vector<float>> staging;  // in memory, or
    std::shared_ptr<SpillFile> spill;         // in the policy's spill_dir
    std::chrono::steady_clock::time_point last_progress;  // the header, or the last chunk that added bytes
    bool already_complete = false;  // the header of the sender's newest completed update, sent again
    bool resumes_in_flight = false; // the header of a transfer in flight, sent again
    std::string replay_key;         // the sender's signing key (crypto::replay_key): what counters are kept by
    // A sealed transfer (UpdateHeader.sealed): chunk_hashes come with its
    // UpdateSeal; until then each chunk's hash is kept here as it arrives.
    bool sealed = false;
    bool seal_received = false;
    crypto::Hash descriptors_digest{};
    std::map<uint32_t, crypto::Hash> arrived_hashes;
    // The chunks a header or seal declared; until a sealed transfer's seal
    // comes, the chunks seen so far.
    uint32_t expected_chunks() const { return static_cast<uint32_t>(received.size()); }
    bool hashes_known() const { return !sealed || seal_received; }
  };
  using TransferKey = std::pair<std::string, uint64_t>;

  // max(kMaxTransfersInFlight, max_transfers_per_peer x roster members).
  size_t roster_capacity() const;
  OutgoingMessage reject(uint64_t sequence, wire::RejectCode code, std::string reason);
  void drop_superseded(const std::string& replay_key, uint64_t sequence);
  OutgoingMessage ack(const Transfer& transfer, bool complete);
  // The answer to a chunk or seal (`what`) of no transfer in flight:
  // unknownTransfer, unless it is of the update `peer` completed last here,
  // come after it completed (resent in the same window as the message that
  // completed it, the sender not yet having its Ack{complete}): that Ack
  // again, as its resent header would get.
  OutgoingMessage no_transfer(const std::string& peer, uint64_t sequence, const char* what);
  // in_flight: the transfer already held under this header's key, if any.
  bool check_header(const std::string& peer, wire::UpdateHeader::Reader header, Transfer& transfer,
                    const Transfer* in_flight);

  // The transfer at `found` holds every chunk (and, sealed, its seal):
  // checks the replay counter and the owner's admission, makes it durable
  // and answers Ack{complete}, or refuses it.
  OutgoingMessage complete(std::map<std::pair<std::string, uint64_t>, Transfer>::iterator found);
  std::map<std::pair<std::string, uint64_t>, Transfer>::iterator find_transfer(const std::string& peer,
                                                                               uint64_t sequence);

  // Writes a checked segment's decoded values into the transfer's staging.
  // A failure to write them to disk is kIoError; anything else is the
  // segment's fault (decode_segment's kCorrupt).
  Status stage_segment(Transfer& transfer, const SegmentView& view);

  ReceiverPolicy policy_;
  std::vector<uint64_t> tensor_starts_;  // each manifest tensor's first value in a spill file
  std::vector<float> scratch_;           // one segment's decode, on its way to a spill file
  const crypto::Roster& roster_;
  crypto::ReplayGuard& replay_;
  std::map<TransferKey, Transfer> transfers_;
  std::vector<ReceivedUpdate> completed_;
  std::optional<Rejection> last_rejection_;
  StoreUpdate store_update_;
  AdmitUpdate admit_update_;
  // Per sender key (crypto::replay_key), the newest update completed here
  // (sequence, header hash): its header sent again (the sender missed the
  // final Ack) is answered with that Ack, not refused as a replay. One entry
  // per roster key seen.
  std::map<std::string, std::pair<uint64_t, crypto::Hash>> last_completed_;
  std::atomic<uint64_t> transfers_expired_{0};  // read by metrics from other threads
  uint64_t transfers_superseded_ = 0;
};

// Hello/Welcome: the highest version both speak, or a Reject naming both
// ranges.
bool negotiate_version(uint16_t their_min, uint16_t their_max, uint16_t& chosen, Rejection& rejection);

OutgoingMessage make_reject(uint64_t sequence, const Rejection& rejection);

}  // namespace fedmesh::protocol
