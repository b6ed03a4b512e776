#include "protocol/sealed_update.h"

#include <algorithm>
#include <deque>
#include <utility>

namespace fedmesh::protocol {

ChunkStream::ChunkStream(Producer producer, uint32_t held_limit)
    : producer_(std::move(producer)), held_limit_(held_limit) {
  start(0);
}

void ChunkStream::start(uint32_t keep_from) {
  base_ = keep_from;
  made_ = 0;
  chunks_.clear();
  done_ = false;
  stopping_ = false;
  ++runs_;
  thread_ = std::thread([this] {
    bool differs = false;
    const Emit emit = [this, &differs](SharedMessage chunk, const crypto::Hash& hash) {
      std::unique_lock lock(mutex_);
      // Room for it: chunks before the first one kept need none.
      changed_.wait(lock, [&] { return stopping_ || held_limit_ == 0 || made_ < base_ || chunks_.size() < held_limit_; });
      if (stopping_) return false;
      const uint32_t index = made_++;
      if (index < hashes_.size()) {
        // Made again: it must be the chunk the seal will name.
        if (hashes_[index] != hash) {
          differs = true;
          return false;
        }
      } else {
        hashes_.push_back(hash);
        sizes_.push_back(chunk.size());
      }
      if (index >= base_) {
        chunks_.push_back(std::move(chunk));
        most_held_ = std::max(most_held_, chunks_.size());
      }
      changed_.notify_all();
      return true;
    };
    // The producer reads hashes_ only between its own emits (this thread).
    Result<SharedMessage> seal = producer_(emit, hashes_);
    std::lock_guard lock(mutex_);
    seal_ = differs ? Status(StatusCode::kInternal, "chunk " + std::to_string(made_ - 1) +
                                                        " came out different when made again")
                    : std::move(seal);
    done_ = true;
    changed_.notify_all();
  });
}

void ChunkStream::stop_producer(std::unique_lock<std::mutex>& lock) {
  stopping_ = true;
  changed_.notify_all();
  lock.unlock();
  thread_.join();
  lock.lock();
}

ChunkStream::~ChunkStream() {
  std::unique_lock lock(mutex_);
  stop_producer(lock);
}

std::optional<SharedMessage> ChunkStream::chunk(uint32_t index) {
  std::unique_lock lock(mutex_);
  if (held_limit_ > 0 && index < base_) {
    // Let go before: make it again, keeping from it on.
    stop_producer(lock);
    start(index);
  } else if (held_limit_ > 0 && index - base_ >= held_limit_) {
    const uint32_t keep_from = index + 1 - held_limit_;
    while (!chunks_.empty() && base_ < keep_from) {
      chunks_.pop_front();
      ++base_;
    }
    base_ = std::max(base_, keep_from);
    changed_.notify_all();
  }
  changed_.wait(lock, [&] { return done_ || index < base_ + chunks_.size(); });
  if (index >= base_ && index < base_ + chunks_.size()) return chunks_[index - base_];
  return std::nullopt;
}

void ChunkStream::release_before(uint32_t index) {
  std::lock_guard lock(mutex_);
  if (held_limit_ == 0) return;
  while (!chunks_.empty() && base_ < index) {
    chunks_.pop_front();
    ++base_;
  }
  base_ = std::max(base_, index);
  changed_.notify_all();
}

Result<SharedMessage> ChunkStream::seal() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return done_; });
  return seal_;
}

std::vector<SharedMessage> ChunkStream::all_chunks() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return done_; });
  return {chunks_.begin(), chunks_.end()};
}

uint64_t ChunkStream::chunk_wire_bytes() {
  std::unique_lock lock(mutex_);
  if (held_limit_ > 0 && !done_) {
    // Nothing more will be sent from this run: let the producer finish.
    chunks_.clear();
    base_ = UINT32_MAX;
    changed_.notify_all();
  }
  changed_.wait(lock, [&] { return done_; });
  uint64_t total = 0;
  for (const uint64_t size : sizes_) total += curve_message_bytes(size);
  return total;
}

size_t ChunkStream::most_held() {
  std::lock_guard lock(mutex_);
  return most_held_;
}

int ChunkStream::runs() {
  std::lock_guard lock(mutex_);
  return runs_;
}

namespace {

// Collects segments into chunks as they are made (ChunkGrouper's packing)
// and hands each full chunk, serialized and hashed, to the stream.
class ChunkPacker {
 public:
  ChunkPacker(uint64_t sequence, size_t chunk_bytes, const ChunkStream::Emit& emit)
      : sequence_(sequence), grouper_(chunk_bytes), emit_(emit) {}

  // The segment must stay alive until its chunk is emitted (the next add()
  // that starts a chunk, or flush()).
  bool add(const EncodedSegment& segment) {
    if (!make_room(segment)) return false;
    pending_.push_back(&segment);
    return true;
  }
  // A segment the packer keeps until its chunk is emitted.
  bool add(EncodedSegment&& segment) {
    if (!make_room(segment)) return false;
    owned_.push_back(std::move(segment));
    pending_.push_back(&owned_.back());
    return true;
  }
  // Emits the chunk being packed, if any; false: the stream is stopping.
  bool flush() {
    if (pending_.empty()) return true;
    OutgoingMessage chunk = serialize_chunk(sequence_, next_index_++, pending_);
    const crypto::Hash hash = crypto::hash_chunk(kSentChunkHash, chunk.body());
    pending_.clear();
    owned_.clear();
    return emit_(SharedMessage(std::move(chunk)), hash);
  }

 private:
  // Emits the chunk being packed first if this segment starts a new one.
  bool make_room(const EncodedSegment& segment) {
    return !grouper_.starts_chunk(segment.payload_bytes()) || flush();
  }

  uint64_t sequence_;
  ChunkGrouper grouper_;
  const ChunkStream::Emit& emit_;
  std::vector<const EncodedSegment*> pending_;
  std::deque<EncodedSegment> owned_;  // stable addresses as it grows
  uint32_t next_index_ = 0;
};

PreparedUpdate sealed_update(const UpdateMetadata& metadata, const std::vector<TensorDescriptorFields>& descriptors,
                             ChunkStream::Producer producer, uint32_t held_limit) {
  PreparedUpdate prepared;
  prepared.metadata = metadata;
  prepared.header = sealed_header(metadata, descriptors, kSentChunkHash);
  prepared.stream = std::make_shared<ChunkStream>(std::move(producer), held_limit);
  return prepared;
}

}  // namespace

Result<PreparedUpdate> prepare_sealed_update(const UpdateMetadata& metadata, std::span<const TensorShape> manifest,
                                             std::span<const std::span<const float>> tensors,
                                             std::span<const TensorPlan> plans, const crypto::SiteKeys& sender_keys,
                                             size_t chunk_bytes, uint32_t held_limit) {
  FEDMESH_RETURN_IF_ERROR(check_update_inputs(manifest, tensors, plans, chunk_bytes));
  std::vector<TensorDescriptorFields> descriptors;
  for (size_t t = 0; t < manifest.size(); ++t) descriptors.push_back(descriptor_of(manifest[t], plans[t]));
  std::vector<std::span<const float>> values(tensors.begin(), tensors.end());
  std::vector<TensorPlan> plan_copy(plans.begin(), plans.end());
  auto producer = [metadata, descriptors, values = std::move(values), plans = std::move(plan_copy), &sender_keys,
                   chunk_bytes](const ChunkStream::Emit& emit,
                                const std::vector<crypto::Hash>& hashes) -> Result<SharedMessage> {
    ChunkPacker packer(metadata.sequence, chunk_bytes, emit);
    for (size_t t = 0; t < values.size(); ++t) {
      const TensorPlan& plan = plans[t];
      // A chunk's worth of fp32 elements at a time (whole blocks); a sparse
      // tensor at once, its entries being few.
      uint64_t piece = values[t].size();
      if (!encoding_is_sparse(plan.encoding)) {
        piece = std::max<uint64_t>(1, chunk_bytes / sizeof(float));
        if (encoding_is_block(plan.encoding) && plan.block_size > 0) {
          piece = std::max<uint64_t>(plan.block_size, piece / plan.block_size * plan.block_size);
        }
      }
      for (uint64_t first = 0; first < values[t].size() || (first == 0 && values[t].empty()); first += piece) {
        const uint64_t count = std::min<uint64_t>(piece, values[t].size() - first);
        auto segments = encode_with_plan(static_cast<uint32_t>(t), values[t].subspan(first, count), plan, chunk_bytes);
        if (!segments.is_ok()) {
          return Status(segments.status().code(), "tensor '" + descriptors[t].name + "', counting from its element " +
                                                       std::to_string(first) + ": " + segments.status().message());
        }
        for (EncodedSegment& segment : *segments) {
          segment.offset += first;
          if (!packer.add(std::move(segment))) return unavailable("the update's stream was stopped");
        }
        if (values[t].empty()) break;
      }
    }
    if (!packer.flush()) return unavailable("the update's stream was stopped");
    return update_seal(metadata, descriptors, hashes, sender_keys, kSentChunkHash);
  };
  return sealed_update(metadata, descriptors, std::move(producer), held_limit);
}

PreparedUpdate prepare_sealed_encoded_update(const UpdateMetadata& metadata, std::vector<EncodedTensor> tensors,
                                             const crypto::SiteKeys& sender_keys, size_t chunk_bytes,
                                             uint32_t held_limit) {
  std::vector<TensorDescriptorFields> descriptors;
  for (const auto& tensor : tensors) descriptors.push_back(tensor.descriptor);
  auto owned = std::make_shared<std::vector<EncodedTensor>>(std::move(tensors));
  auto producer = [metadata, descriptors, owned, &sender_keys, chunk_bytes](
                      const ChunkStream::Emit& emit, const std::vector<crypto::Hash>& hashes) -> Result<SharedMessage> {
    ChunkPacker packer(metadata.sequence, chunk_bytes, emit);
    for (const EncodedTensor& tensor : *owned) {
      for (const EncodedSegment& segment : tensor.segments) {
        if (!packer.add(segment)) return unavailable("the update's stream was stopped");
      }
    }
    if (!packer.flush()) return unavailable("the update's stream was stopped");
    return update_seal(metadata, descriptors, hashes, sender_keys, kSentChunkHash);
  };
  PreparedUpdate prepared = sealed_update(metadata, descriptors, std::move(producer), held_limit);
  for (const EncodedTensor& tensor : *owned) {
    for (const EncodedSegment& segment : tensor.segments) prepared.encoded_payload_bytes += segment.payload_bytes();
  }
  return prepared;
}

std::optional<SharedMessage> chunk_to_send(const PreparedUpdate& update, uint32_t index) {
  if (update.stream) return update.stream->chunk(index);
  if (index < update.chunks.size()) return update.chunks[index];
  return std::nullopt;
}

}  // namespace fedmesh::protocol
