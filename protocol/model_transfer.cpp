#include "protocol/model_transfer.h"

#include <kj/exception.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "kernels/parallel.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

namespace {

kj::ArrayPtr<const kj::byte> bytes_of(const crypto::Hash& hash) { return kj::arrayPtr(hash.data(), hash.size()); }

bool read_hash(capnp::Data::Reader data, crypto::Hash& out) {
  if (data.size() != crypto::kHashBytes) return false;
  std::memcpy(out.data(), data.begin(), out.size());
  return true;
}

OutgoingMessage serialize_model_chunk(uint64_t version, const crypto::Hash& hash, const crypto::Hash& parent,
                                      uint32_t index, uint32_t count,
                                      const std::vector<const EncodedSegment*>& segments) {
  size_t payload = 0;
  for (const auto* segment : segments) payload += segment->payload_bytes();
  capnp::MallocMessageBuilder builder(static_cast<unsigned>((payload + 8 * 64 * (segments.size() + 4)) / 8 + 64),
                                      capnp::AllocationStrategy::FIXED_SIZE);
  auto chunk = builder.initRoot<wire::Message>().initModelChunk();
  chunk.setVersion(version);
  chunk.setModelHash(bytes_of(hash));
  chunk.setParentHash(bytes_of(parent));
  chunk.setChunkIndex(index);
  chunk.setChunkCount(count);
  auto list = chunk.initSegments(static_cast<unsigned>(segments.size()));
  for (size_t i = 0; i < segments.size(); ++i) fill_segment(list[static_cast<unsigned>(i)], *segments[i]);
  return serialize(builder, index, version);
}

}  // namespace

Status ModelPublisher::publish(uint64_t version, std::vector<crypto::Hash> chain, std::span<const TensorShape> manifest,
                               std::span<const std::span<const float>> tensors) {
  if (chain.size() != version + 1) {
    return invalid_argument("a model version " + std::to_string(version) + " needs " + std::to_string(version + 1) +
                            " chain hashes, got " + std::to_string(chain.size()));
  }
  if (tensors.size() != manifest.size()) return invalid_argument("model tensors do not match the manifest");
  const uint64_t per_chunk = std::max<size_t>(chunk_bytes_ / sizeof(float), 1);
  std::vector<std::vector<Range>> chunks(1);
  uint64_t filled = 0;  // values in the last chunk
  for (size_t t = 0; t < manifest.size(); ++t) {
    if (tensors[t].size() != manifest[t].element_count()) {
      return invalid_argument("model tensor " + manifest[t].name + " has the wrong number of values");
    }
    FEDMESH_RETURN_IF_ERROR(check_input_values(tensors[t], Encoding::kDenseF32));
    // Segments of at most a chunk, packed into chunks in order, as many
    // whole segments to a chunk as fit.
    for (uint64_t first = 0; first < tensors[t].size(); first += per_chunk) {
      const uint64_t count = std::min<uint64_t>(per_chunk, tensors[t].size() - first);
      if (!chunks.back().empty() && filled + count > per_chunk) {
        chunks.emplace_back();
        filled = 0;
      }
      chunks.back().push_back({static_cast<uint32_t>(t), first, count});
      filled += count;
    }
  }
  if (chunks.back().empty()) chunks.pop_back();
  chunks_ = std::move(chunks);
  served_.assign(chunks_.size(), {});
  value_bytes_.assign(chunks_.size(), 0);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    for (const Range& range : chunks_[i]) value_bytes_[i] += range.count * sizeof(float);
  }
  tensors_.assign(tensors.begin(), tensors.end());
  chain_ = std::move(chain);
  manifest_.assign(manifest.begin(), manifest.end());
  version_ = version;
  published_ = true;
  return Status::ok();
}

SharedMessage ModelPublisher::value_chunk(uint32_t index) const {
  if (std::shared_ptr<const OutgoingMessage> alive = served_[index - 1].lock()) return SharedMessage(std::move(alive));
  std::vector<EncodedSegment> segments;
  for (const Range& range : chunks_[index - 1]) {
    Result<std::vector<EncodedSegment>> encoded = encode_dense(
        range.tensor, tensors_[range.tensor].subspan(range.first, range.count), Encoding::kDenseF32, chunk_bytes_);
    FEDMESH_CHECK(encoded.is_ok());  // finite, as publish() checked
    for (EncodedSegment& segment : *encoded) {
      segment.offset += range.first;
      segments.push_back(std::move(segment));
    }
  }
  std::vector<const EncodedSegment*> pointers;
  for (const EncodedSegment& segment : segments) pointers.push_back(&segment);
  const crypto::Hash parent = version_ == 0 ? crypto::Hash{} : chain_[version_ - 1];
  // Counted in live_bytes_ while any reference to it lives.
  struct Counted {
    Counted(OutgoingMessage m, uint64_t b, std::shared_ptr<std::atomic<uint64_t>> l)
        : message(std::move(m)), bytes(b), live(std::move(l)) {
      live->fetch_add(bytes);
    }
    ~Counted() { live->fetch_sub(bytes); }
    Counted(const Counted&) = delete;
    Counted& operator=(const Counted&) = delete;
    OutgoingMessage message;
    uint64_t bytes;
    std::shared_ptr<std::atomic<uint64_t>> live;
  };
  auto counted = std::make_shared<Counted>(
      serialize_model_chunk(version_, chain_.back(), parent, index, chunk_count(), pointers), value_bytes_[index - 1],
      live_bytes_);
  SharedMessage chunk(std::shared_ptr<const OutgoingMessage>(counted, &counted->message));
  served_[index - 1] = chunk.shared();
  return chunk;
}

OutgoingMessage ModelPublisher::manifest_chunk(uint64_t trusted_version) const {
  capnp::MallocMessageBuilder builder;
  auto chunk = builder.initRoot<wire::Message>().initModelChunk();
  chunk.setVersion(version_);
  chunk.setModelHash(bytes_of(chain_.back()));
  chunk.setParentHash(bytes_of(version_ == 0 ? crypto::Hash{} : chain_[version_ - 1]));
  chunk.setChunkIndex(0);
  chunk.setChunkCount(chunk_count());
  std::vector<TensorDescriptorFields> descriptors;
  for (const auto& shape : manifest_) descriptors.push_back({shape.name, shape.dims, Encoding::kDenseF32, 0});
  fill_descriptors(chunk.initTensors(static_cast<unsigned>(descriptors.size())), descriptors);
  auto hashes = chunk.initChainHashes(static_cast<unsigned>(version_ - trusted_version));
  for (uint64_t v = trusted_version + 1; v <= version_; ++v) {
    hashes.set(static_cast<unsigned>(v - trusted_version - 1), bytes_of(chain_[v]));
  }
  return serialize(builder, 0, version_);
}

bool ModelPublisher::answer(wire::ModelRequest::Reader request, uint32_t window, std::vector<SharedMessage>& replies,
                            Rejection& rejection, const Admit& admit) const {
  replies.clear();
  if (!published_) {
    rejection = {wire::RejectCode::BUSY, "no model is published yet"};
    return false;
  }
  if (request.getVersion() != version_) {
    rejection = {wire::RejectCode::WRONG_ROUND, "model version " + std::to_string(request.getVersion()) +
                                                    " is not served; the current version is " +
                                                    std::to_string(version_)};
    return false;
  }
  const uint64_t trusted = request.getTrustedVersion();
  if (trusted > version_ || version_ - trusted > kMaxChainHashesPerChunk) {
    rejection = {wire::RejectCode::MALFORMED, "trusted version " + std::to_string(trusted) +
                                                  " is not within " + std::to_string(kMaxChainHashesPerChunk) +
                                                  " versions below " + std::to_string(version_)};
    return false;
  }
  const uint32_t from = request.getFromChunk();
  if (from >= chunk_count()) {
    rejection = {wire::RejectCode::MALFORMED, "chunk " + std::to_string(from) + " asked of a model of " +
                                                  std::to_string(chunk_count()) + " chunks"};
    return false;
  }
  window = std::clamp<uint32_t>(window, 1, kMaxModelWindow);
  const uint32_t end = static_cast<uint32_t>(std::min<uint64_t>(chunk_count(), uint64_t{from} + window));
  if (admit) {
    // A copy alive now may be released before it is shared below, so a
    // request can add up to its own window past what it was admitted for.
    uint64_t new_bytes = 0;
    for (uint32_t i = std::max<uint32_t>(from, 1); i < end; ++i) {
      if (served_[i - 1].expired()) new_bytes += value_bytes_[i - 1];
    }
    if (!admit(end - from, new_bytes, rejection)) return false;
  }
  for (uint32_t i = from; i < end; ++i) {
    replies.push_back(i == 0 ? SharedMessage(manifest_chunk(trusted)) : value_chunk(i));
  }
  return true;
}

namespace {

OutgoingMessage model_request(uint64_t version, uint32_t from, uint64_t trusted) {
  capnp::MallocMessageBuilder builder;
  auto request = builder.initRoot<wire::Message>().initModelRequest();
  request.setVersion(version);
  request.setFromChunk(from);
  request.setTrustedVersion(trusted);
  return serialize(builder);
}

}  // namespace

Result<FetchedModel> fetch_model(ClientChannel& socket, uint64_t version, uint64_t trusted_version,
                                 std::span<const TensorShape> manifest, const FetchOptions& options) {
  if (trusted_version > version) {
    return invalid_argument("trusted version " + std::to_string(trusted_version) + " is above the version asked for");
  }
  FetchedModel model;
  model.version = version;
  model.tensors.resize(manifest.size());
  for (size_t t = 0; t < manifest.size(); ++t) model.tensors[t].assign(manifest[t].element_count(), 0.0f);
  std::vector<bool> held;
  uint32_t count = 0;  // known after the first chunk
  uint32_t next_missing = 0;
  bool have_hashes = false;
  int quiet = 0;
  const auto advance = [&] {
    while (next_missing < held.size() && held[next_missing]) ++next_missing;
  };
  const auto bad = [&](const std::string& what) {
    return corrupt("model version " + std::to_string(version) + ": " + what);
  };
  RetransmitTimer* timer = options.timer;
  const auto wait = [&] {
    return timer == nullptr ? options.reply_timeout : std::chrono::ceil<std::chrono::milliseconds>(timer->timeout());
  };
  uint32_t busy_in_a_row = 0;  // BUSY answers since the last chunk
  while (count == 0 || next_missing < count) {
    FEDMESH_RETURN_IF_ERROR(socket.send(model_request(version, next_missing, trusted_version), options.reply_timeout));
    auto wait_from = socket.clock().now();
    if (timer != nullptr) timer->sent(wait_from);
    ++model.requests;
    const uint32_t window_end = next_missing + std::max<uint32_t>(1, std::min(options.window, kMaxModelWindow));
    bool progressed = false;
    // Told BUSY (the aggregator still has as many model chunks queued for us
    // as it allows, e.g. a window asked for again after a timeout on a slow
    // link): chunks already on their way are still read, and the request is
    // made again from the first missing chunk after this pause, which
    // doubles with each BUSY in a row.
    std::optional<std::chrono::steady_clock::time_point> busy_until;
    // Read this window's chunks (they may come in any order after a resend).
    while (true) {
      const auto until = busy_until ? *busy_until : wait_from + wait();
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - socket.clock().now());
      Result<std::optional<Incoming>> incoming = socket.receive(std::max(left, std::chrono::milliseconds(0)));
      if (!incoming.is_ok()) return incoming.status();
      if (!incoming->has_value()) {  // quiet: ask again from the first missing chunk
        if (timer != nullptr && !busy_until) timer->timed_out();
        break;
      }
      const Incoming& frame = **incoming;
      std::unique_ptr<ParsedMessage> parsed;
      Rejection rejection;
      if (!parse_message(frame.bytes, options.max_message_bytes, frame.frame, parsed, rejection)) {
        return bad("unreadable reply: " + rejection.reason);
      }
      try {
        const auto root = parsed->root();
        if (root.isReject()) {
          const auto reject = root.getReject();
          const std::string text = reject.getText().cStr();
          if (reject.getCode() == wire::RejectCode::WRONG_ROUND) return Status(StatusCode::kNotFound, text);
          if (reject.getCode() == wire::RejectCode::BUSY && busy_in_a_row < options.max_busy_answers) {
            ++busy_in_a_row;
            const auto pause = std::min<std::chrono::milliseconds>(
                options.busy_pause * (uint64_t{1} << std::min<uint32_t>(busy_in_a_row - 1, 16)),
                std::min(options.busy_max_pause, options.reply_timeout));
            busy_until = socket.clock().now() + pause;
            continue;
          }
          return unavailable("the aggregator refused the model request: " + text +
                             (busy_in_a_row > 0 ? " (busy " + std::to_string(busy_in_a_row) + " times in a row)" : ""));
        }
        if (!root.isModelChunk()) continue;  // an answer to something earlier (e.g. a heartbeat)
        const auto chunk = root.getModelChunk();
        if (chunk.getVersion() != version) continue;  // a reply to an earlier request
        const uint32_t index = chunk.getChunkIndex();
        if (count == 0) {
          count = chunk.getChunkCount();
          if (count == 0 || count > kMaxChunksPerUpdate) return bad("declares " + std::to_string(count) + " chunks");
          held.assign(count, false);
        }
        if (chunk.getChunkCount() != count || index >= count) return bad("chunk " + std::to_string(index) + " of " + std::to_string(chunk.getChunkCount()) + " does not fit " + std::to_string(count) + " chunks");
        crypto::Hash hash{}, parent{};
        if (!read_hash(chunk.getModelHash(), hash) || !read_hash(chunk.getParentHash(), parent)) {
          return bad("chunk " + std::to_string(index) + " carries a hash that is not 32 bytes");
        }
        if (have_hashes && (hash != model.hash || parent != model.parent)) {
          return bad("chunks disagree on the model's hash");
        }
        model.hash = hash;
        model.parent = parent;
        have_hashes = true;
        if (held[index]) continue;
        model.bytes_received += frame.bytes.size();
        if (index == 0) {
          std::vector<TensorDescriptorFields> descriptors;
          if (!read_descriptors(chunk.getTensors(), descriptors, rejection) ||
              !descriptors_match(descriptors, manifest, "the model", rejection)) {
            return bad(rejection.reason);
          }
          const auto hashes = chunk.getChainHashes();
          if (hashes.size() != version - trusted_version) {
            return bad("carries " + std::to_string(hashes.size()) + " chain hashes, not " +
                       std::to_string(version - trusted_version));
          }
          model.chain.resize(hashes.size());
          for (unsigned i = 0; i < hashes.size(); ++i) {
            if (!read_hash(hashes[i], model.chain[i])) return bad("a chain hash is not 32 bytes");
          }
        } else {
          for (const auto segment : chunk.getSegments()) {
            SegmentView view;
            if (!read_segment(segment, view, rejection)) return bad(rejection.reason);
            if (view.tensor >= manifest.size()) return bad("segment names tensor " + std::to_string(view.tensor));
            const Status decoded = decode_segment(view, manifest, model.tensors[view.tensor], parallel_each);
            if (!decoded.is_ok()) return bad(decoded.message());
          }
        }
        held[index] = true;
        progressed = true;
        busy_in_a_row = 0;
        wait_from = socket.clock().now();
        if (timer != nullptr) timer->answered(wait_from);  // a sample from the request's first chunk only
        advance();
        if (next_missing >= count || next_missing >= window_end) break;
      } catch (const kj::Exception& e) {
        return bad(std::string("a chunk does not parse: ") + e.getDescription().cStr());
      }
    }
    // A pause after BUSY is not a silence.
    if (progressed) {
      quiet = 0;
    } else if (!busy_until) {
      ++quiet;
    }
    const int allowed = timer == nullptr ? options.max_attempts
                                         : timer->attempts_for(1, kRetransmitGiveUpProbability, options.max_attempts);
    if (quiet >= allowed) {
      return unavailable("no model chunks from the aggregator after " + std::to_string(quiet) + " requests");
    }
  }
  if (model.chain.empty() ? version != trusted_version : model.chain.back() != model.hash) {
    return bad("the chain does not end at the model's hash");
  }
  return model;
}

}  // namespace fedmesh::protocol
