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
// (protocol/update_upload.h); a resumed upload finds the chunks it needs
// again in the stream, which keeps every chunk it made.
#pragma once

#include <condition_variable>
#include <cstdint>
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

  explicit ChunkStream(Producer producer);
  ~ChunkStream();  // stops the producer at its next chunk and waits for it
  ChunkStream(const ChunkStream&) = delete;
  ChunkStream& operator=(const ChunkStream&) = delete;

  // Chunk `index`, waiting until it is made; nullopt when the producer
  // ended without it (past the last chunk, or it failed: see seal()).
  std::optional<SharedMessage> chunk(uint32_t index);
  // Waits for the producer to end: the UpdateSeal, or why there is none.
  Result<SharedMessage> seal();
  // Waits for the producer to end; every chunk made.
  std::vector<SharedMessage> all_chunks();

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<SharedMessage> chunks_;
  std::vector<crypto::Hash> hashes_;
  bool done_ = false;
  bool stopping_ = false;
  Result<SharedMessage> seal_ = Status(StatusCode::kInternal, "the stream has not ended");
  std::thread thread_;
};

// prepare_update's sealed counterpart: the same encodings, made a chunk's
// worth of elements at a time (sparse plans a tensor at a time). `tensors`
// and `sender_keys` must outlive the returned update's stream. Bad input
// (non-finite values) surfaces as the stream's failure, after the chunks
// before it were made.
Result<PreparedUpdate> prepare_sealed_update(const UpdateMetadata& metadata, std::span<const TensorShape> manifest,
                                             std::span<const std::span<const float>> tensors,
                                             std::span<const TensorPlan> plans, const crypto::SiteKeys& sender_keys,
                                             size_t chunk_bytes = kDefaultChunkBytes);
// prepare_encoded_update's: segments already encoded, chunked, serialized
// and hashed while the first chunks are sent.
PreparedUpdate prepare_sealed_encoded_update(const UpdateMetadata& metadata, std::vector<EncodedTensor> tensors,
                                             const crypto::SiteKeys& sender_keys,
                                             size_t chunk_bytes = kDefaultChunkBytes);

// Chunk `index` of any prepared update (a sealed one's waits until it is
// made); nullopt past its last chunk.
std::optional<SharedMessage> chunk_to_send(const PreparedUpdate& update, uint32_t index);

}  // namespace fedmesh::protocol
