#include "protocol/update_transfer.h"

#include "protocol/sealed_update.h"

#include <kj/exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

namespace fedmesh::protocol {
namespace {

void append_u64(std::vector<uint8_t>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

void append_text(std::vector<uint8_t>& out, std::string_view text) {
  append_u64(out, text.size());
  out.insert(out.end(), text.begin(), text.end());
}

crypto::UpdateSigningFields signing_fields(const UpdateMetadata& metadata, const crypto::Hash& descriptors,
                                           std::vector<crypto::Hash> chunk_hashes, crypto::ChunkHash chunk_hash) {
  return {metadata, descriptors, std::move(chunk_hashes), chunk_hash};
}


// Runs f(0..count-1) on up to hardware_concurrency threads. Preparing an
// update (encode, serialize, hash) is the sender's whole job while it runs,
// and chunks are independent. The first exception is rethrown after all
// threads have stopped.
template <class F>
void for_each_index_in_parallel(size_t count, F&& f) {
  const size_t workers = std::min<size_t>(count, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < count;) {
      try {
        f(i);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next.store(count);
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& thread : threads) thread.join();
  if (failure) std::rethrow_exception(failure);
}

bool text_field(capnp::Text::Reader text, std::string& out, const char* what, Rejection& rejection) {
  if (text.size() > kMaxTextBytes) {
    rejection = {wire::RejectCode::MALFORMED, std::string(what) + " is over " + std::to_string(kMaxTextBytes) + " bytes"};
    return false;
  }
  out.assign(text.cStr(), text.size());
  return true;
}

std::string replayed_reason(const std::string& sender, uint64_t sequence, uint64_t last) {
  return "replayed update from '" + sender + "': sequence " + std::to_string(sequence) +
         " is not above the last accepted " + std::to_string(last) + " (from its current key)";
}

uint64_t unix_time_micros() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(since_epoch).count());
}

}  // namespace

crypto::Hash descriptor_hash(std::span<const TensorDescriptorFields> descriptors) {
  std::vector<uint8_t> bytes;
  append_text(bytes, "fedmesh-tensor-descriptors-v1");
  append_u64(bytes, descriptors.size());
  for (const auto& d : descriptors) {
    append_text(bytes, d.name);
    append_u64(bytes, d.dims.size());
    for (int64_t dim : d.dims) append_u64(bytes, static_cast<uint64_t>(dim));
    append_u64(bytes, static_cast<uint64_t>(d.encoding));
    append_u64(bytes, d.block_size);
  }
  return crypto::hash_bytes(bytes);
}

OutgoingMessage copy_message(std::span<const uint8_t> bytes) { return OutgoingMessage::from_bytes(bytes); }

void fill_descriptors(capnp::List<wire::TensorDescriptor>::Builder list,
                      std::span<const TensorDescriptorFields> descriptors) {
  for (size_t i = 0; i < descriptors.size(); ++i) {
    auto out = list[static_cast<unsigned>(i)];
    out.setName(descriptors[i].name);
    auto shape = out.initShape(static_cast<unsigned>(descriptors[i].dims.size()));
    for (size_t d = 0; d < descriptors[i].dims.size(); ++d) {
      shape.set(static_cast<unsigned>(d), static_cast<uint64_t>(descriptors[i].dims[d]));
    }
    out.setEncoding(to_wire(descriptors[i].encoding));
    out.setBlockSize(descriptors[i].block_size);
  }
}

bool read_descriptors(capnp::List<wire::TensorDescriptor>::Reader tensors,
                      std::vector<TensorDescriptorFields>& descriptors, Rejection& rejection) {
  if (tensors.size() > kMaxTensorsPerUpdate) {
    rejection = {wire::RejectCode::MALFORMED, "message declares " + std::to_string(tensors.size()) + " tensors"};
    return false;
  }
  descriptors.assign(tensors.size(), {});
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    const auto in = tensors[t];
    auto& d = descriptors[t];
    if (!text_field(in.getName(), d.name, "tensor name", rejection)) return false;
    const auto shape = in.getShape();
    if (shape.size() > kMaxTensorRank) {
      rejection = {wire::RejectCode::WRONG_SHAPE, "tensor '" + d.name + "' has rank " + std::to_string(shape.size())};
      return false;
    }
    for (uint64_t dim : shape) d.dims.push_back(static_cast<int64_t>(dim));
    if (!from_wire(in.getEncoding(), d.encoding)) {
      rejection = {wire::RejectCode::MALFORMED, "tensor '" + d.name + "' has an unknown encoding"};
      return false;
    }
    d.block_size = in.getBlockSize();
  }
  return true;
}

bool descriptors_match(std::span<const TensorDescriptorFields> descriptors, std::span<const TensorShape> manifest,
                       std::string_view what, Rejection& rejection) {
  if (descriptors.size() != manifest.size()) {
    rejection = {wire::RejectCode::WRONG_SHAPE, std::string(what) + " has " + std::to_string(descriptors.size()) +
                                                    " tensors; the model has " + std::to_string(manifest.size())};
    return false;
  }
  for (size_t t = 0; t < descriptors.size(); ++t) {
    const auto& expected = manifest[t];
    if (descriptors[t].name != expected.name || descriptors[t].dims != expected.dims) {
      const auto shape_text = [](const std::vector<int64_t>& dims) {
        std::string text;
        for (const int64_t d : dims) {
          if (!text.empty()) text += 'x';
          text += std::to_string(d);
        }
        return text;
      };
      const std::string got = shape_text(descriptors[t].dims), want = shape_text(expected.dims);
      rejection = {wire::RejectCode::WRONG_SHAPE, "tensor " + std::to_string(t) + " is '" + descriptors[t].name +
                                                      "' " + got + "; the model has '" + expected.name + "' " + want};
      return false;
    }
  }
  return true;
}

OutgoingMessage serialize_chunk(uint64_t sequence, uint32_t index, std::span<const EncodedSegment* const> segments) {
  size_t payload = 0;
  for (const auto* segment : segments) payload += segment->payload_bytes();
  // One segment for the whole message, in the buffer it is sent from: the
  // segments' bytes are copied once.
  InPlaceMessage message((payload + 8 * 64 * (segments.size() + 4)) / 8 + 64);
  auto chunk = message.builder().initRoot<wire::Message>().initUpdateChunk();
  chunk.setSequence(sequence);
  chunk.setChunkIndex(index);
  auto list = chunk.initSegments(static_cast<unsigned>(segments.size()));
  for (size_t i = 0; i < segments.size(); ++i) fill_segment(list[static_cast<unsigned>(i)], *segments[i]);
  return message.finish(index, sequence);
}

namespace {

// The header's fields but its chunk hashes and signature.
void fill_header(wire::UpdateHeader::Builder header, const UpdateMetadata& metadata,
                 std::span<const TensorDescriptorFields> descriptors, crypto::ChunkHash chunk_hash) {
  header.setFederation(metadata.federation);
  header.setRound(metadata.round);
  header.setBaseVersion(metadata.base_version);
  header.setSender(metadata.sender);
  header.setRecipient(metadata.recipient);
  header.setSequence(metadata.sequence);
  header.setSampleCount(metadata.sample_count);
  if (metadata.peer) {
    auto peer = header.initPeer();
    switch (metadata.peer->kind) {
      case crypto::PeerUpdateKind::kShare: peer.setKind(wire::PeerUpdateKind::SHARE); break;
      case crypto::PeerUpdateKind::kCatchUpSlice: peer.setKind(wire::PeerUpdateKind::CATCH_UP_SLICE); break;
      case crypto::PeerUpdateKind::kReplicaUpdate: peer.setKind(wire::PeerUpdateKind::REPLICA_UPDATE); break;
    }
    peer.setWeight(metadata.peer->weight);
    peer.setSlice(metadata.peer->slice);
    peer.setSlices(metadata.peer->slices);
  }
  fill_descriptors(header.initTensors(static_cast<unsigned>(descriptors.size())), descriptors);
  if (chunk_hash == crypto::ChunkHash::kBlake2bp) header.setChunkHash(wire::ChunkHashKind::BLAKE2BP);
}

crypto::Signature sign_chunks(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                              std::span<const crypto::Hash> hashes, const crypto::SiteKeys& sender_keys,
                              crypto::ChunkHash chunk_hash) {
  return crypto::sign_update(
      signing_fields(metadata, descriptor_hash(descriptors), {hashes.begin(), hashes.end()}, chunk_hash), sender_keys);
}

template <class Builder>
void fill_chunk_hashes(Builder message, std::span<const crypto::Hash> hashes, const crypto::Signature& signature) {
  message.setChunkCount(static_cast<uint32_t>(hashes.size()));
  auto hash_list = message.initChunkHashes(static_cast<unsigned>(hashes.size()));
  for (size_t i = 0; i < hashes.size(); ++i) {
    hash_list.set(static_cast<unsigned>(i), kj::arrayPtr(hashes[i].data(), hashes[i].size()));
  }
  message.setSignature(kj::arrayPtr(signature.data(), signature.size()));
}

}  // namespace

SharedMessage signed_header(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                            std::span<const crypto::Hash> hashes, const crypto::SiteKeys& sender_keys,
                            crypto::ChunkHash chunk_hash) {
  capnp::MallocMessageBuilder builder;
  auto header = builder.initRoot<wire::Message>().initUpdateHeader();
  fill_header(header, metadata, descriptors, chunk_hash);
  fill_chunk_hashes(header, hashes, sign_chunks(metadata, descriptors, hashes, sender_keys, chunk_hash));
  return SharedMessage(serialize(builder));
}

SharedMessage sealed_header(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                            crypto::ChunkHash chunk_hash) {
  capnp::MallocMessageBuilder builder;
  auto header = builder.initRoot<wire::Message>().initUpdateHeader();
  fill_header(header, metadata, descriptors, chunk_hash);
  header.setSealed(true);
  return SharedMessage(serialize(builder));
}

SharedMessage update_seal(const UpdateMetadata& metadata, std::span<const TensorDescriptorFields> descriptors,
                          std::span<const crypto::Hash> hashes, const crypto::SiteKeys& sender_keys,
                          crypto::ChunkHash chunk_hash) {
  capnp::MallocMessageBuilder builder;
  auto seal = builder.initRoot<wire::Message>().initUpdateSeal();
  seal.setSequence(metadata.sequence);
  fill_chunk_hashes(seal, hashes, sign_chunks(metadata, descriptors, hashes, sender_keys, chunk_hash));
  return SharedMessage(serialize(builder));
}

PreparedUpdate prepare_encoded_update(const UpdateMetadata& metadata, std::vector<EncodedTensor> tensors,
                                      const crypto::SiteKeys& sender_keys, size_t chunk_bytes) {
  PreparedUpdate prepared;
  prepared.metadata = metadata;
  std::vector<TensorDescriptorFields> descriptors;
  for (const auto& tensor : tensors) descriptors.push_back(tensor.descriptor);

  // Pack segments into chunks of at most chunk_bytes of payload (pointers
  // only), then serialize and hash the chunks on every core.
  std::vector<std::vector<const EncodedSegment*>> groups;
  ChunkGrouper grouper(chunk_bytes);
  for (const auto& tensor : tensors) {
    for (const auto& segment : tensor.segments) {
      if (grouper.starts_chunk(segment.payload_bytes())) groups.emplace_back();
      groups.back().push_back(&segment);
      prepared.encoded_payload_bytes += segment.payload_bytes();
    }
  }
  std::vector<crypto::Hash> hashes(groups.size());
  prepared.chunks.resize(groups.size());
  for_each_index_in_parallel(groups.size(), [&](size_t c) {
    OutgoingMessage chunk = serialize_chunk(metadata.sequence, static_cast<uint32_t>(c), groups[c]);
    hashes[c] = crypto::hash_chunk(kSentChunkHash, chunk.body());
    prepared.chunks[c] = SharedMessage(std::move(chunk));
  });

  prepared.header = signed_header(metadata, descriptors, hashes, sender_keys, kSentChunkHash);
  return prepared;
}

uint64_t wire_bytes(const PreparedUpdate& update) {
  uint64_t total = curve_message_bytes(update.header.size());
  if (update.stream) {
    total += update.stream->chunk_wire_bytes();
    if (auto seal = update.stream->seal(); seal.is_ok()) total += curve_message_bytes(seal->size());
    return total;
  }
  for (const SharedMessage& chunk : update.chunks) total += curve_message_bytes(chunk.size());
  return total;
}

Status check_update_inputs(std::span<const TensorShape> manifest, std::span<const std::span<const float>> tensors,
                           std::span<const TensorPlan> plans, size_t chunk_bytes) {
  if (tensors.size() != manifest.size() || plans.size() != manifest.size()) {
    return invalid_argument("update has " + std::to_string(tensors.size()) + " tensors and " +
                            std::to_string(plans.size()) + " plans for a manifest of " +
                            std::to_string(manifest.size()));
  }
  if (chunk_bytes < kMinChunkBytes) return invalid_argument("chunk size under " + std::to_string(kMinChunkBytes) + " bytes");
  for (size_t t = 0; t < manifest.size(); ++t) {
    if (tensors[t].size() != manifest[t].element_count()) {
      return invalid_argument("tensor " + manifest[t].name + " has " + std::to_string(tensors[t].size()) +
                              " values; its shape holds " + std::to_string(manifest[t].element_count()));
    }
  }
  return Status::ok();
}

TensorDescriptorFields descriptor_of(const TensorShape& shape, const TensorPlan& plan) {
  return {shape.name, shape.dims, plan.encoding, encoding_is_block(plan.encoding) ? plan.block_size : 0};
}

Result<std::vector<EncodedSegment>> encode_with_plan(uint32_t tensor, std::span<const float> values,
                                                     const TensorPlan& plan, size_t chunk_bytes) {
  if (encoding_is_block(plan.encoding)) return encode_blocks(tensor, values, plan.encoding, plan.block_size, chunk_bytes);
  if (encoding_is_sparse(plan.encoding)) {
    std::vector<uint64_t> indices;
    std::vector<float> nonzero;
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i] != 0.0f) {
        indices.push_back(i);
        nonzero.push_back(values[i]);
      }
    }
    return encode_sparse(tensor, values.size(), indices, nonzero, plan.encoding, chunk_bytes);
  }
  // Checked now, written where the chunk is serialized: the values are
  // copied once (the caller's tensors outlive both).
  return encode_dense(tensor, values, plan.encoding, chunk_bytes, {}, /*defer_values=*/true);
}

Result<PreparedUpdate> prepare_update(const UpdateMetadata& metadata, std::span<const TensorShape> manifest,
                                      std::span<const std::span<const float>> tensors,
                                      std::span<const TensorPlan> plans, const crypto::SiteKeys& sender_keys,
                                      size_t chunk_bytes) {
  FEDMESH_RETURN_IF_ERROR(check_update_inputs(manifest, tensors, plans, chunk_bytes));
  // Tensors encode independently: one per core at a time.
  std::vector<EncodedTensor> encoded(manifest.size());
  std::vector<Status> statuses(manifest.size());
  for_each_index_in_parallel(manifest.size(), [&](size_t t) {
    encoded[t].descriptor = descriptor_of(manifest[t], plans[t]);
    auto segments = encode_with_plan(static_cast<uint32_t>(t), tensors[t], plans[t], chunk_bytes);
    if (segments.is_ok()) {
      encoded[t].segments = std::move(segments.value());
    } else {
      statuses[t] = segments.status();
    }
  });
  for (const Status& status : statuses) FEDMESH_RETURN_IF_ERROR(status);
  return prepare_encoded_update(metadata, std::move(encoded), sender_keys, chunk_bytes);
}

// ---- receiver -------------------------------------------------------------------

UpdateReceiver::UpdateReceiver(ReceiverPolicy policy, const crypto::Roster& roster, crypto::ReplayGuard& replay)
    : policy_(std::move(policy)), roster_(roster), replay_(replay) {
  uint64_t start = 0;
  for (const TensorShape& shape : policy_.manifest) {
    tensor_starts_.push_back(start);
    start += shape.element_count();
  }
}

OutgoingMessage make_reject(uint64_t sequence, const Rejection& rejection) {
  capnp::MallocMessageBuilder builder;
  auto reject = builder.initRoot<wire::Message>().initReject();
  reject.setSequence(sequence);
  reject.setCode(rejection.code);
  reject.setText(rejection.reason.substr(0, kMaxTextBytes));
  reject.setLastAccepted(rejection.last_accepted);
  return serialize(builder);
}

OutgoingMessage UpdateReceiver::reject(uint64_t sequence, wire::RejectCode code, std::string reason) {
  last_rejection_ = Rejection{code, std::move(reason)};
  return make_reject(sequence, *last_rejection_);
}

namespace {

OutgoingMessage make_ack(uint64_t sequence, uint32_t next_chunk, bool complete) {
  capnp::MallocMessageBuilder builder;
  auto ack = builder.initRoot<wire::Message>().initAck();
  ack.setSequence(sequence);
  ack.setNextChunk(next_chunk);
  ack.setComplete(complete);
  return serialize(builder);
}

}  // namespace

OutgoingMessage UpdateReceiver::ack(const Transfer& transfer, bool complete) {
  return make_ack(transfer.metadata.sequence, transfer.next_chunk, complete);
}

OutgoingMessage UpdateReceiver::no_transfer(const std::string& peer, uint64_t sequence, const char* what) {
  const crypto::RosterEntry* entry = policy_.insecure ? nullptr : roster_.find(peer);
  if (entry != nullptr) {
    const auto done = last_completed_.find(crypto::replay_key(entry->identity.sign_public));
    if (done != last_completed_.end() && done->second.first == sequence) return make_ack(sequence, 0, true);
  }
  return reject(sequence, wire::RejectCode::UNKNOWN_TRANSFER,
                std::string(what) + " of update " + std::to_string(sequence) + " with no accepted header from '" +
                    peer + "'");
}


bool UpdateReceiver::check_header(const std::string& peer, wire::UpdateHeader::Reader header, Transfer& transfer,
                                  const Transfer* in_flight) {
  Rejection rejection;
  UpdateMetadata& m = transfer.metadata;
  m.sequence = header.getSequence();
  auto fail = [&](wire::RejectCode code, std::string reason) {
    last_rejection_ = Rejection{code, std::move(reason)};
    return false;
  };
  if (!text_field(header.getSender(), m.sender, "sender", rejection) ||
      !text_field(header.getFederation(), m.federation, "federation", rejection) ||
      !text_field(header.getRecipient(), m.recipient, "recipient", rejection)) {
    last_rejection_ = rejection;
    return false;
  }
  // Who: the name inside must be the name the handshake proved.
  if (!policy_.insecure && m.sender != peer) {
    return fail(wire::RejectCode::UNAUTHENTICATED,
                "update claims sender '" + m.sender + "' but the connection is authenticated as '" + peer + "'");
  }
  const crypto::RosterEntry* entry = roster_.find(m.sender);
  if (entry == nullptr) return fail(wire::RejectCode::UNAUTHENTICATED, "sender '" + m.sender + "' is not on the roster");
  if (m.federation != policy_.federation) {
    return fail(wire::RejectCode::WRONG_FEDERATION, "update is for federation '" + m.federation + "', this is '" +
                                                        policy_.federation + "'");
  }
  if (m.recipient != policy_.self) {
    return fail(wire::RejectCode::WRONG_RECIPIENT, "update is addressed to '" + m.recipient + "', this is '" +
                                                       policy_.self + "'");
  }
  m.round = header.getRound();
  m.base_version = header.getBaseVersion();
  m.sample_count = header.getSampleCount();
  if (header.hasPeer() != policy_.peer_updates) {
    return fail(wire::RejectCode::MALFORMED, policy_.peer_updates
                                                 ? "an update without gossip fields sent to a gossip peer"
                                                 : "a gossip update sent to an aggregator");
  }
  if (header.hasPeer()) {
    const auto peer = header.getPeer();
    crypto::PeerUpdateFields fields;
    switch (peer.getKind()) {
      case wire::PeerUpdateKind::SHARE: fields.kind = crypto::PeerUpdateKind::kShare; break;
      case wire::PeerUpdateKind::CATCH_UP_SLICE: fields.kind = crypto::PeerUpdateKind::kCatchUpSlice; break;
      case wire::PeerUpdateKind::REPLICA_UPDATE: fields.kind = crypto::PeerUpdateKind::kReplicaUpdate; break;
      default: return fail(wire::RejectCode::MALFORMED, "an unknown kind of gossip update");
    }
    fields.weight = peer.getWeight();
    fields.slice = peer.getSlice();
    fields.slices = peer.getSlices();
    m.peer = fields;
  } else {
    m.peer.reset();
  }

  const uint32_t chunk_count = header.getChunkCount();
  transfer.sealed = header.getSealed();
  if (transfer.sealed && (chunk_count != 0 || header.getChunkHashes().size() != 0 || header.getSignature().size() != 0)) {
    return fail(wire::RejectCode::MALFORMED,
                "a sealed update's header carries a chunk count, chunk hashes or a signature (they come in its UpdateSeal)");
  }
  if (transfer.sealed && policy_.insecure) {
    return fail(wire::RejectCode::UNAUTHENTICATED,
                "a sealed update needs a connection that proves its sender; this receiver has no transport identities");
  }
  if (chunk_count > policy_.max_chunks) {
    return fail(wire::RejectCode::TOO_MANY_CHUNKS, "update declares " + std::to_string(chunk_count) +
                                                       " chunks; the limit is " + std::to_string(policy_.max_chunks));
  }
  const auto hashes = header.getChunkHashes();
  if (hashes.size() != chunk_count) {
    return fail(wire::RejectCode::MALFORMED, "update declares " + std::to_string(chunk_count) + " chunks but carries " +
                                                 std::to_string(hashes.size()) + " chunk hashes");
  }
  transfer.chunk_hashes.resize(chunk_count);
  for (uint32_t i = 0; i < chunk_count; ++i) {
    const auto hash = hashes[i];
    if (hash.size() != crypto::kHashBytes) {
      return fail(wire::RejectCode::MALFORMED, "chunk hash " + std::to_string(i) + " is not 32 bytes");
    }
    std::memcpy(transfer.chunk_hashes[i].data(), hash.begin(), crypto::kHashBytes);
  }
  switch (header.getChunkHash()) {
    case wire::ChunkHashKind::BLAKE2B: transfer.chunk_hash = crypto::ChunkHash::kBlake2b; break;
    case wire::ChunkHashKind::BLAKE2BP: transfer.chunk_hash = crypto::ChunkHash::kBlake2bp; break;
    default:
      return fail(wire::RejectCode::MALFORMED, "chunk hash kind " +
                                                   std::to_string(static_cast<unsigned>(header.getChunkHash())) +
                                                   " is not one this receiver knows (blake2b, blake2bp)");
  }
  std::vector<TensorDescriptorFields> descriptors;
  if (!read_descriptors(header.getTensors(), descriptors, rejection)) {
    last_rejection_ = rejection;
    return false;
  }
  transfer.descriptors_digest = descriptor_hash(descriptors);
  const auto fields = signing_fields(m, transfer.descriptors_digest, transfer.chunk_hashes, transfer.chunk_hash);
  if (transfer.sealed) {
    // Signed in its seal. Until then the sender is who the handshake
    // proved (checked above); nothing it sends is accepted before the seal
    // verifies. The header's hash names it (a resent header resumes it)
    // and differs from any header that carries its chunk hashes.
    std::vector<uint8_t> bytes = crypto::canonical_bytes(fields);
    const std::string_view marker = "fedmesh sealed update header";
    bytes.insert(bytes.end(), marker.begin(), marker.end());
    transfer.header_hash = crypto::hash_bytes(bytes);
  } else {
    // The signature, before any state is touched.
    const auto signature_bytes = header.getSignature();
    if (signature_bytes.size() != crypto::kSignatureBytes) {
      return fail(wire::RejectCode::BAD_SIGNATURE, "signature is " + std::to_string(signature_bytes.size()) +
                                                       " bytes, not 64");
    }
    crypto::Signature signature{};
    std::memcpy(signature.data(), signature_bytes.begin(), signature.size());
    if (!crypto::verify_update(fields, signature, entry->identity.sign_public)) {
      return fail(wire::RejectCode::BAD_SIGNATURE,
                  "signature on update " + std::to_string(m.sequence) + " from '" + m.sender + "' does not verify");
    }
    transfer.header_hash = crypto::hash_bytes(crypto::canonical_bytes(fields));
  }
  transfer.replay_key = crypto::replay_key(entry->identity.sign_public);

  // Signed by the key, but too far ahead to be an honest site's: taken, it
  // would leave the key's counter where no honest sequence reaches.
  const uint64_t now_micros = policy_.unix_micros ? policy_.unix_micros() : unix_time_micros();
  const uint64_t ahead_limit = now_micros > UINT64_MAX - policy_.max_sequence_ahead_micros
                                   ? UINT64_MAX
                                   : now_micros + policy_.max_sequence_ahead_micros;
  if (m.sequence > ahead_limit) {
    return fail(wire::RejectCode::SEQUENCE_AHEAD,
                "update " + std::to_string(m.sequence) + " from '" + m.sender + "' is numbered more than " +
                    std::to_string(policy_.max_sequence_ahead_micros / 1'000'000) +
                    " s ahead of this receiver's clock (sequences are Unix microseconds; the limit is " +
                    std::to_string(ahead_limit) + ")");
  }
  if (m.sample_count > policy_.max_sample_count) {
    return fail(wire::RejectCode::TOO_MANY_SAMPLES,
                "update " + std::to_string(m.sequence) + " from '" + m.sender + "' claims " +
                    std::to_string(m.sample_count) + " samples; this receiver takes at most " +
                    std::to_string(policy_.max_sample_count) + " per update");
  }

  // The very header of a transfer in flight (signed, checked and admitted
  // when it first came) resumes it, even if a later update of the sender's
  // has completed since: the caller answers with the chunks it holds.
  if (in_flight != nullptr && in_flight->header_hash == transfer.header_hash) {
    transfer.resumes_in_flight = true;
    return true;
  }
  // Otherwise a known sequence is a replay.
  if (const Status replay = replay_.check(transfer.replay_key, m.sequence); !replay.is_ok()) {
    const auto done = last_completed_.find(transfer.replay_key);
    if (done != last_completed_.end() && done->second.first == m.sequence && done->second.second == transfer.header_hash) {
      transfer.already_complete = true;
      transfer.next_chunk = chunk_count;
      return true;
    }
    const uint64_t last = replay_.last_accepted(transfer.replay_key);
    last_rejection_ = Rejection{wire::RejectCode::REPLAYED, replayed_reason(m.sender, m.sequence, last), last};
    return false;
  }
  const uint64_t oldest_round = policy_.current_round > policy_.max_round_lag ? policy_.current_round - policy_.max_round_lag : 0;
  if (m.round > policy_.current_round || m.round < oldest_round || m.base_version > policy_.current_version) {
    return fail(wire::RejectCode::WRONG_ROUND,
                "update is for round " + std::to_string(m.round) + " from version " + std::to_string(m.base_version) +
                    "; this receiver takes rounds " + std::to_string(oldest_round) + ".." +
                    std::to_string(policy_.current_round) + " from versions up to " +
                    std::to_string(policy_.current_version));
  }
  // Shapes against our manifest, never against what the peer declares.
  if (!descriptors_match(descriptors, policy_.manifest, "update", rejection)) {
    last_rejection_ = rejection;
    return false;
  }
  for (size_t t = 0; t < descriptors.size(); ++t) {
    const auto& expected = policy_.manifest[t];
    if (encoding_is_block(descriptors[t].encoding) &&
        (descriptors[t].block_size == 0 || descriptors[t].block_size > kMaxBlockSize)) {
      return fail(wire::RejectCode::MALFORMED, "tensor '" + expected.name + "' has block size " +
                                                   std::to_string(descriptors[t].block_size));
    }
    transfer.encodings.push_back(descriptors[t].encoding);
    transfer.block_sizes.push_back(descriptors[t].block_size);
  }
  if (chunk_count == 0 && !transfer.sealed && !policy_.manifest.empty()) {
    return fail(wire::RejectCode::MALFORMED, "update has no chunks");
  }
  if (admit_update_) {
    if (std::optional<std::string> refused = admit_update_(m)) return fail(wire::RejectCode::WRONG_ROUND, *refused);
  }
  return true;
}

OutgoingMessage UpdateReceiver::handle_header(const std::string& peer, const ParsedMessage& message) {
  last_rejection_.reset();
  // Transfers abandoned by their senders must not hold the in-flight slots
  // for ever: drop the idle ones before admitting another.
  expire(policy_.clock());
  uint64_t sequence = 0;
  try {
    const auto header = message.root().getUpdateHeader();
    sequence = header.getSequence();
    // A resent header of a transfer in flight resumes it.
    const TransferKey key{policy_.insecure ? std::string(header.getSender().cStr()) : peer, sequence};
    const auto in_flight = transfers_.find(key);
    Transfer candidate;
    if (!check_header(peer, header, candidate, in_flight == transfers_.end() ? nullptr : &in_flight->second)) {
      return make_reject(sequence, *last_rejection_);
    }
    if (candidate.already_complete) return ack(candidate, true);
    if (auto found = in_flight; found != transfers_.end()) {
      // A resent header resumes the transfer but is no progress: its idle
      // time keeps running.
      if (found->second.header_hash == candidate.header_hash) return ack(found->second, false);
      return reject(sequence, wire::RejectCode::REPLAYED,
                    "a different update with sequence " + std::to_string(sequence) + " is already in flight");
    }
    size_t from_peer = static_cast<size_t>(
        std::count_if(transfers_.begin(), transfers_.end(), [&](const auto& item) { return item.first.first == key.first; }));
    const size_t per_peer = per_peer_capacity();
    if (from_peer >= per_peer && per_peer < policy_.max_transfers_per_peer) {
      // The staging budget binds and allows a sender one transfer: a newer
      // update from it (a site restarted mid-upload) replaces its older,
      // abandoned one instead of waiting out the idle timeout.
      const bool newest = std::none_of(transfers_.begin(), transfers_.end(), [&](const auto& item) {
        return item.first.first == key.first && item.first.second > sequence;
      });
      if (newest) {
        const size_t dropped = std::erase_if(transfers_, [&](const auto& item) { return item.first.first == key.first; });
        transfers_superseded_ += dropped;
        from_peer = 0;
      }
    }
    if (from_peer >= per_peer) {
      return reject(sequence, wire::RejectCode::BUSY,
                    "'" + key.first + "' has " + std::to_string(from_peer) +
                        " transfers in flight, its most; finish or abandon one (idle ones are dropped after " +
                        std::to_string(policy_.transfer_idle_timeout.count()) + " ms without progress)");
    }
    if (transfers_.size() >= transfer_capacity()) {
      return reject(sequence, wire::RejectCode::BUSY, std::to_string(transfers_.size()) + " transfers in flight");
    }
    candidate.received.assign(candidate.chunk_hashes.size(), false);
    if (!policy_.spill_dir.empty()) {
      Result<std::unique_ptr<SpillFile>> spill = SpillFile::create(policy_.spill_dir, staged_bytes(policy_.manifest));
      if (!spill.is_ok()) {
        return reject(sequence, wire::RejectCode::BUSY, "cannot stage the update: " + spill.status().message());
      }
      candidate.spill = std::move(*spill);
    } else {
      // Reserved, not zero-filled: each tensor's copy grows as segments
      // arrive (zeros only for what a segment skips), and complete() zeroes
      // whatever no segment reached.
      candidate.staging.resize(policy_.manifest.size());
      for (size_t t = 0; t < policy_.manifest.size(); ++t) {
        candidate.staging[t].reserve(policy_.manifest[t].element_count());
      }
    }
    candidate.last_progress = policy_.clock();
    auto [slot, inserted] = transfers_.emplace(key, std::move(candidate));
    (void)inserted;
    return ack(slot->second, false);
  } catch (const kj::Exception& e) {
    return reject(sequence, wire::RejectCode::MALFORMED, std::string("update header does not parse: ") +
                                                             e.getDescription().cStr());
  } catch (const std::bad_alloc&) {
    return reject(sequence, wire::RejectCode::BUSY, "not enough memory to stage the update");
  }
}

OutgoingMessage UpdateReceiver::handle_chunk(const std::string& peer, const Envelope& envelope,
                                             std::span<const uint8_t> frame, std::shared_ptr<const void> keep_alive) {
  last_rejection_.reset();
  const uint64_t sequence = envelope.sequence;
  const auto found = find_transfer(peer, sequence);
  if (found == transfers_.end()) return no_transfer(peer, sequence, "chunk");
  Transfer& transfer = found->second;
  const uint32_t index = envelope.chunk_index;
  if (transfer.hashes_known() && index >= transfer.expected_chunks()) {
    return reject(sequence, wire::RejectCode::MALFORMED, "chunk " + std::to_string(index) + " of an update with " +
                                                             std::to_string(transfer.expected_chunks()) + " chunks");
  }
  if (!transfer.hashes_known() && index >= policy_.max_chunks) {
    return reject(sequence, wire::RejectCode::TOO_MANY_CHUNKS, "chunk " + std::to_string(index) +
                                                                   " of a sealed update; the limit is " +
                                                                   std::to_string(policy_.max_chunks) + " chunks");
  }
  // A duplicate (after a resume) is answered but is no progress.
  if (index < transfer.received.size() && transfer.received[index]) return ack(transfer, false);

  // Authenticate the bytes before parsing them, or, before a sealed
  // transfer's seal, keep their hash for it to be checked against.
  const auto body = frame.subspan(kEnvelopeBytes, envelope.body_bytes);
  const crypto::Hash hash = crypto::hash_chunk(transfer.chunk_hash, body);
  if (transfer.hashes_known() && hash != transfer.chunk_hashes[index]) {
    transfers_.erase(found);
    return reject(sequence, wire::RejectCode::BAD_CHUNK_HASH,
                  "chunk " + std::to_string(index) + " does not match the hash signed in its header; transfer dropped");
  }
  std::unique_ptr<ParsedMessage> parsed;
  Rejection rejection;
  if (!parse_body(frame, envelope, std::move(keep_alive), parsed, rejection)) {
    transfers_.erase(found);
    return reject(sequence, rejection.code, rejection.reason);
  }
  try {
    const auto chunk = parsed->root().getUpdateChunk();
    if (chunk.getSequence() != sequence || chunk.getChunkIndex() != index) {
      transfers_.erase(found);
      return reject(sequence, wire::RejectCode::MALFORMED, "chunk body names another sequence or index than its envelope");
    }
    const auto segments = chunk.getSegments();
    if (segments.size() > kMaxSegmentsPerChunk) {
      transfers_.erase(found);
      return reject(sequence, wire::RejectCode::MALFORMED, std::to_string(segments.size()) + " segments in one chunk");
    }
    // Check every segment, then decode: a bad segment leaves staging as
    // it was (decode_segment validates before it writes).
    for (uint32_t s = 0; s < segments.size(); ++s) {
      SegmentView view;
      if (!read_segment(segments[s], view, rejection)) {
        transfers_.erase(found);
        return reject(sequence, rejection.code, rejection.reason);
      }
      if (view.tensor >= transfer.encodings.size() || view.encoding != transfer.encodings[view.tensor] ||
          (encoding_is_block(view.encoding) && view.block_size != transfer.block_sizes[view.tensor])) {
        transfers_.erase(found);
        return reject(sequence, wire::RejectCode::WRONG_SHAPE,
                      "segment " + std::to_string(s) + " of chunk " + std::to_string(index) +
                          " does not match its tensor's declared encoding");
      }
      const Status decoded = stage_segment(transfer, view);
      if (!decoded.is_ok()) {
        const std::string reason = "chunk " + std::to_string(index) + ": " + decoded.message();
        transfers_.erase(found);
        if (decoded.code() == StatusCode::kIoError) {
          // Our disk, not the sender's bytes: it may send the update again.
          return reject(sequence, wire::RejectCode::NOT_STORED, reason + "; transfer dropped, send it again later");
        }
        const bool non_finite = is_non_finite_error(decoded);
        return reject(sequence, non_finite ? wire::RejectCode::NON_FINITE : wire::RejectCode::MALFORMED, reason);
      }
    }
  } catch (const kj::Exception& e) {
    transfers_.erase(found);
    return reject(sequence, wire::RejectCode::MALFORMED, std::string("chunk does not parse: ") + e.getDescription().cStr());
  }
  if (!transfer.hashes_known()) {
    transfer.arrived_hashes[index] = hash;
    if (index >= transfer.received.size()) transfer.received.resize(index + 1, false);
  }
  transfer.received[index] = true;
  ++transfer.chunks_held;
  transfer.last_progress = policy_.clock();
  while (transfer.next_chunk < transfer.received.size() && transfer.received[transfer.next_chunk]) ++transfer.next_chunk;
  if (!transfer.hashes_known() || transfer.chunks_held < transfer.expected_chunks()) return ack(transfer, false);
  return complete(found);
}

OutgoingMessage UpdateReceiver::handle_seal(const std::string& peer, const ParsedMessage& message) {
  last_rejection_.reset();
  uint64_t sequence = 0;
  try {
    const auto seal = message.root().getUpdateSeal();
    sequence = seal.getSequence();
    const auto found = find_transfer(peer, sequence);
    if (found == transfers_.end()) return no_transfer(peer, sequence, "seal");
    Transfer& transfer = found->second;
    const auto drop = [&](wire::RejectCode code, std::string reason) {
      transfers_.erase(found);
      return reject(sequence, code, std::move(reason) + "; transfer dropped");
    };
    const std::string what = "the seal of update " + std::to_string(sequence);
    if (!transfer.sealed) return drop(wire::RejectCode::MALFORMED, what + " came for a header that carried its chunk hashes");
    const uint32_t count = seal.getChunkCount();
    const auto list = seal.getChunkHashes();
    if (count > policy_.max_chunks) {
      return drop(wire::RejectCode::TOO_MANY_CHUNKS, what + " declares " + std::to_string(count) +
                                                         " chunks; the limit is " + std::to_string(policy_.max_chunks));
    }
    if (count == 0 && !policy_.manifest.empty()) return drop(wire::RejectCode::MALFORMED, what + " declares no chunks");
    if (list.size() != count) {
      return drop(wire::RejectCode::MALFORMED, what + " declares " + std::to_string(count) + " chunks but carries " +
                                                   std::to_string(list.size()) + " chunk hashes");
    }
    if (count < transfer.received.size()) {
      return drop(wire::RejectCode::MALFORMED, what + " declares " + std::to_string(count) + " chunks, but chunk " +
                                                   std::to_string(transfer.received.size() - 1) + " came");
    }
    std::vector<crypto::Hash> hashes(count);
    for (uint32_t i = 0; i < count; ++i) {
      if (list[i].size() != crypto::kHashBytes) {
        return drop(wire::RejectCode::MALFORMED, what + ": chunk hash " + std::to_string(i) + " is not 32 bytes");
      }
      std::memcpy(hashes[i].data(), list[i].begin(), crypto::kHashBytes);
    }
    // A seal sent again (the sender resumed) is answered as the first was.
    if (transfer.seal_received) {
      if (hashes == transfer.chunk_hashes) return ack(transfer, false);
      return drop(wire::RejectCode::MALFORMED, what + " came again with other chunk hashes");
    }
    const auto signature_bytes = seal.getSignature();
    if (signature_bytes.size() != crypto::kSignatureBytes) {
      return drop(wire::RejectCode::BAD_SIGNATURE,
                  what + ": its signature is " + std::to_string(signature_bytes.size()) + " bytes, not 64");
    }
    crypto::Signature signature{};
    std::memcpy(signature.data(), signature_bytes.begin(), signature.size());
    const crypto::RosterEntry* entry = roster_.find(transfer.metadata.sender);
    if (entry == nullptr) {
      return drop(wire::RejectCode::UNAUTHENTICATED, "sender '" + transfer.metadata.sender + "' is not on the roster");
    }
    const auto fields = signing_fields(transfer.metadata, transfer.descriptors_digest, hashes, transfer.chunk_hash);
    if (!crypto::verify_update(fields, signature, entry->identity.sign_public)) {
      return drop(wire::RejectCode::BAD_SIGNATURE, "signature on " + what + " from '" + transfer.metadata.sender +
                                                       "' does not verify");
    }
    for (const auto& [index, hash] : transfer.arrived_hashes) {
      if (hash != hashes[index]) {
        return drop(wire::RejectCode::BAD_CHUNK_HASH,
                    "chunk " + std::to_string(index) + " does not match the hash signed in its seal");
      }
    }
    transfer.chunk_hashes = std::move(hashes);
    transfer.arrived_hashes.clear();
    transfer.seal_received = true;
    transfer.received.resize(count, false);
    transfer.last_progress = policy_.clock();
    if (transfer.chunks_held < transfer.expected_chunks()) return ack(transfer, false);
    return complete(found);
  } catch (const kj::Exception& e) {
    return reject(sequence, wire::RejectCode::MALFORMED, std::string("update seal does not parse: ") +
                                                             e.getDescription().cStr());
  }
}

std::map<std::pair<std::string, uint64_t>, UpdateReceiver::Transfer>::iterator UpdateReceiver::find_transfer(
    const std::string& peer, uint64_t sequence) {
  // In insecure mode the key is the sender named in the header; chunks are
  // matched by sequence among that peer's transfers. With no transport
  // identity there is none to match: take the only transfer with the sequence.
  if (!policy_.insecure) return transfers_.find({peer, sequence});
  auto found = transfers_.end();
  for (auto it = transfers_.begin(); it != transfers_.end(); ++it) {
    if (it->first.second == sequence) found = it;
  }
  return found;
}

OutgoingMessage UpdateReceiver::complete(std::map<std::pair<std::string, uint64_t>, Transfer>::iterator found) {
  Transfer& transfer = found->second;
  const uint64_t sequence = found->first.second;
  // Every chunk verified. Another transfer of the same sequence may have
  // completed meanwhile: that one is the replay.
  const std::string sender = transfer.metadata.sender;
  const std::string key = transfer.replay_key;
  const crypto::Hash header_hash = transfer.header_hash;
  if (const Status replay = replay_.check(key, sequence); !replay.is_ok()) {
    transfers_.erase(found);
    const uint64_t last = replay_.last_accepted(key);
    last_rejection_ = Rejection{wire::RejectCode::REPLAYED, replayed_reason(sender, sequence, last), last};
    return make_reject(sequence, *last_rejection_);
  }
  if (admit_update_) {
    if (std::optional<std::string> refused = admit_update_(transfer.metadata)) {
      transfers_.erase(found);
      return reject(sequence, wire::RejectCode::WRONG_ROUND, *refused);
    }
  }
  OutgoingMessage reply = ack(transfer, true);
  for (size_t t = 0; t < transfer.staging.size(); ++t) transfer.staging[t].resize(policy_.manifest[t].element_count());
  if (store_update_) {
    // The update and its counter are durable together, or neither is.
    ReceivedUpdate update{std::move(transfer.metadata), std::move(transfer.staging), std::move(transfer.spill), key};
    transfers_.erase(found);
    if (const Status stored = store_update_(std::move(update)); !stored.is_ok()) {
      return reject(sequence, wire::RejectCode::NOT_STORED,
                    "update " + std::to_string(sequence) + " from '" + sender +
                        "' was not stored (send it again later): " + stored.message());
    }
    replay_.note_durable(key, sequence);
    last_completed_[key] = {sequence, header_hash};
    drop_superseded(key, sequence);
    return reply;
  }
  if (const Status committed = replay_.commit(key, sequence); !committed.is_ok()) {
    transfers_.erase(found);
    return reject(sequence, wire::RejectCode::NOT_STORED,
                  "the replay counter of update " + std::to_string(sequence) + " from '" + sender +
                      "' was not stored (send it again later): " + committed.message());
  }
  last_completed_[key] = {sequence, header_hash};
  completed_.push_back(
      ReceivedUpdate{std::move(transfer.metadata), std::move(transfer.staging), std::move(transfer.spill), key});
  transfers_.erase(found);
  drop_superseded(key, sequence);
  return reply;
}

Status UpdateReceiver::stage_segment(Transfer& transfer, const SegmentView& view) {
  if (!transfer.spill) {
    // The range is checked before the copy grows to hold it (it never
    // grows past its tensor, so never past what was reserved).
    FEDMESH_RETURN_IF_ERROR(check_segment(view, policy_.manifest));
    std::vector<float>& staged = transfer.staging[view.tensor];
    const uint64_t end = view.offset + view.count;
    if (staged.size() < end) staged.resize(end);
    return decode_segment_range(view, policy_.manifest, std::span<float>(staged).subspan(view.offset, view.count),
                                policy_.decode_runner);
  }
  // Segments stay in their tensor (check_lengths): the range is in the file.
  const auto write = [&](uint64_t element, std::span<const float> values) {
    const uint64_t at = (tensor_starts_[view.tensor] + element) * sizeof(float);
    return transfer.spill->write(at, {reinterpret_cast<const uint8_t*>(values.data()), values.size_bytes()});
  };
  constexpr uint64_t kWindow = uint64_t{1} << 20;  // values written at once for a wide sparse range
  Status status;
  if (encoding_is_sparse(view.encoding) && view.count > kWindow) {
    // A few values over a wide range: the range is written a window at a
    // time, zeros where nothing is stored, as decode_segment would.
    std::vector<std::pair<uint64_t, float>> entries;
    status = visit_sparse_entries(view, policy_.manifest, [&](uint64_t index, float value) {
      entries.emplace_back(index, value);
    });
    if (!status.is_ok()) return status;
    scratch_.resize(kWindow);
    size_t next = 0;
    for (uint64_t first = view.offset; first < view.offset + view.count && status.is_ok(); first += kWindow) {
      const uint64_t n = std::min(kWindow, view.offset + view.count - first);
      std::fill_n(scratch_.begin(), n, 0.0f);
      for (; next < entries.size() && entries[next].first < first + n; ++next) {
        scratch_[entries[next].first - first] = entries[next].second;
      }
      status = write(first, std::span<const float>(scratch_).first(n));
    }
  } else {
    // Dense and block segments are no wider than their bytes allow.
    scratch_.resize(view.count);
    status = decode_segment_range(view, policy_.manifest, scratch_, policy_.decode_runner);
    if (status.is_ok()) status = write(view.offset, scratch_);
  }
  if (scratch_.capacity() > 4 * kWindow) std::vector<float>().swap(scratch_);  // not kept past one large segment
  return status;
}

// The sender's counter is now at `sequence`: its transfers still in flight
// with lower sequences would be refused as replays when complete, so they
// are dropped now rather than hold a slot (and a staging copy) until idle.
void UpdateReceiver::drop_superseded(const std::string& replay_key, uint64_t sequence) {
  const size_t dropped = std::erase_if(transfers_, [&](const auto& item) {
    return item.second.replay_key == replay_key && item.first.second < sequence;
  });
  transfers_superseded_ += dropped;
}

std::vector<ReceivedUpdate> UpdateReceiver::take_completed() { return std::exchange(completed_, {}); }

std::optional<TransferProgress> UpdateReceiver::in_flight(const std::string& peer, uint64_t round) const {
  std::optional<TransferProgress> newest;
  for (const auto& [key, transfer] : transfers_) {
    if (key.first != peer || transfer.metadata.round != round) continue;
    // One that can no longer complete (a later update of the sender's did)
    // is not worth resuming.
    if (transfer.metadata.sequence <= replay_.last_accepted(transfer.replay_key)) continue;
    if (newest && newest->sequence > transfer.metadata.sequence) continue;
    newest = TransferProgress{transfer.metadata.sequence, transfer.received};
  }
  return newest;
}

size_t UpdateReceiver::roster_capacity() const {
  return std::max(kMaxTransfersInFlight, policy_.max_transfers_per_peer * roster_.sites.size());
}

size_t UpdateReceiver::transfer_capacity() const {
  const size_t by_roster = roster_capacity();
  const uint64_t model_bytes = staged_bytes(policy_.manifest);
  if (policy_.staging_budget_bytes == 0 || model_bytes == 0) return by_roster;
  return std::clamp<size_t>(static_cast<size_t>(policy_.staging_budget_bytes / model_bytes), 1, by_roster);
}

size_t UpdateReceiver::per_peer_capacity() const {
  return transfer_capacity() < roster_capacity() ? 1 : policy_.max_transfers_per_peer;
}

void UpdateReceiver::expire(std::chrono::steady_clock::time_point now) {
  const size_t dropped = std::erase_if(
      transfers_, [&](const auto& item) { return now - item.second.last_progress > policy_.transfer_idle_timeout; });
  if (dropped > 0) transfers_expired_.fetch_add(dropped, std::memory_order_relaxed);
}

bool negotiate_version(uint16_t their_min, uint16_t their_max, uint16_t& chosen, Rejection& rejection) {
  const uint16_t high = std::min(their_max, kProtocolVersion);
  const uint16_t low = std::max(their_min, kMinProtocolVersion);
  if (their_min > their_max || high < low) {
    rejection = {wire::RejectCode::VERSION_UNSUPPORTED,
                 "peer speaks protocol versions " + std::to_string(their_min) + ".." + std::to_string(their_max) +
                     "; this build speaks " + std::to_string(kMinProtocolVersion) + ".." +
                     std::to_string(kProtocolVersion)};
    return false;
  }
  chosen = high;
  return true;
}

}  // namespace fedmesh::protocol
