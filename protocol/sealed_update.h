// Sealed updates: a sender's chunks are encoded, serialized and hashed on a
// thread of their own while the first ones are already on the wire, instead
// of all of them before the header can be signed. The header goes first
// without chunk hashes (UpdateHeader.sealed), each chunk as soon as it is
// made, and an UpdateSeal after the last one carries every chunk's hash and
// the signature over the same fields a header would have signed. The
// receiver hashes and decodes chunks as they come, checks them against the
// seal, and accepts nothing before it verifies (UpdateReceiver::handle_seal).
//
// upload_update sends a PreparedUpdate made here as it sends any other
// (protocol/update_upload.h). By default the stream keeps every chunk it
// made, so that a resumed upload finds them again. With a held limit it
// keeps at most that many past the receiver's last Ack (the producer waits
// for room), so a sender's memory for an update is a window of chunks, not
// one more copy of the model; a chunk let go and asked for again (a
// receiver that lost its staging) is made again by running the producer
// once more from the start, which makes the same bytes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "base/status.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

// The chunks of one sealed update, made in order by a producer thread.
class ChunkStream {
 public:
  // Hands each made chunk to the stream; returns false once the stream is
  // being destroyed (the producer should stop).
  using Emit = std::function<bool(SharedMessage chunk, const crypto::Hash& hash)>;
  // Makes every chunk through `emit`, then returns the UpdateSeal over the
  // hashes emitted (or why it could not make them).
  using Producer = std::function<Result<SharedMessage>(const Emit& emit, const std::vector<crypto::Hash>& hashes)>;

  // held_limit 0 keeps every chunk made; n > 0 at most n chunks at once
  // (the producer must make the same bytes each time it runs).
  explicit ChunkStream(Producer producer, uint32_t held_limit = 0);
  ~ChunkStream();  // stops the producer at its next chunk and waits for it
  ChunkStream(const ChunkStream&) = delete;
  ChunkStream& operator=(const ChunkStream&) = delete;

  // Chunk `index`, waiting until it is made; nullopt when the producer
  // ended without it (past the last chunk, or it failed: see seal()).
  // With a held limit, asking for a chunk lets go of those more than the
  // limit before it, and a chunk let go is made again.
  std::optional<SharedMessage> chunk(uint32_t index);
  // The receiver holds the chunks before `index`: with a held limit they
  // are let go (without one, kept for a resume all the same).
  void release_before(uint32_t index);
  // Waits for the producer to end: the UpdateSeal, or why there is none.
  Result<SharedMessage> seal();
  // Waits for the producer to end; every chunk made. Only for a stream
  // without a held limit (one with a limit holds a window of them).
  std::vector<SharedMessage> all_chunks();
  // Waits for the producer to end (letting go of every chunk held): the
  // bytes every chunk made takes on the wire (curve_message_bytes).
  uint64_t chunk_wire_bytes();
  // The most chunks held at once so far (tests; a held limit's bound).
  size_t most_held();
  // How many times the producer ran (1, plus one per remake).
  int runs();

 private:
  void start(uint32_t keep_from);  // mutex_ held or no thread running
  void stop_producer(std::unique_lock<std::mutex>& lock);

  Producer producer_;
  uint32_t held_limit_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<SharedMessage> chunks_;  // chunks [base_, base_ + size) of this run
  uint32_t base_ = 0;                 // the first chunk held
  uint32_t made_ = 0;                 // chunks this run has made (kept or not)
  std::vector<crypto::Hash> hashes_;  // every chunk's, from the first run
  std::vector<uint64_t> sizes_;       // every chunk's size in bytes
  size_t most_held_ = 0;
  int runs_ = 0;
  bool done_ = false;
  bool stopping_ = false;
  Result<SharedMessage> seal_ = Status(StatusCode::kInternal, "the stream has not ended");
  std::thread thread_;
};

// prepare_update's sealed counterpart: the same encodings, made a chunk's
// worth of elements at a time (sparse plans a tensor at a time). `tensors`
// and `sender_keys` must outlive the returned update's stream (and the
// values must not change while it lives: a held limit makes chunks again
// from them). Bad input (non-finite values) surfaces as the stream's
// failure, after the chunks before it were made.
Result<PreparedUpdate> prepare_sealed_update(const UpdateMetadata& metadata, std::span<const TensorShape> manifest,
                                             std::span<const std::span<const float>> tensors,
                                             std::span<const TensorPlan> plans, const crypto::SiteKeys& sender_keys,
                                             size_t chunk_bytes = kDefaultChunkBytes, uint32_t held_limit = 0);
// prepare_encoded_update's: segments already encoded, chunked, serialized
// and hashed while the first chunks are sent.
PreparedUpdate prepare_sealed_encoded_update(const UpdateMetadata& metadata, std::vector<EncodedTensor> tensors,
                                             const crypto::SiteKeys& sender_keys,
                                             size_t chunk_bytes = kDefaultChunkBytes, uint32_t held_limit = 0);

// The held limit a sender gives a sealed update uploaded with a window of
// `window_chunks`: the window, the chunks the producer makes ahead of it,
// and one.
inline uint32_t held_limit_for_window(uint32_t window_chunks) { return 2 * window_chunks + 1; }

// Chunk `index` of any prepared update (a sealed one's waits until it is
// made); nullopt past its last chunk.
std::optional<SharedMessage> chunk_to_send(const PreparedUpdate& update, uint32_t index);

}  // namespace fedmesh::protocol
