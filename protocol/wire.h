// One protocol message as bytes: a fixed 24-byte envelope, then the Cap'n
// Proto flat-array serialization of a fedmesh::wire::Message (fedmesh.capnp).
//
//   offset size field
//   0      4    magic "FMSH"
//   4      2    protocol version of the sender (little-endian)
//   6      2    message kind: the Message union's discriminant
//   8      4    body length in bytes (a multiple of 8; the rest of the frame)
//   12     4    chunk index (updateChunk and modelChunk; 0 otherwise)
//   16     8    sequence (updateChunk: the update's sequence; 0 otherwise)
//   24     ...  body
//
// The envelope is all a receiver reads before it has authenticated the
// bytes: with it, a chunk's body is hashed and compared with the hash signed
// in its update's header before Cap'n Proto parses a single pointer.
// Parsing then runs under traversal and nesting limits proportional to the
// body, on an 8-byte-aligned copy when the frame itself is not aligned.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "protocol/codec.h"
#include "protocol/fedmesh.capnp.h"

namespace fedmesh::protocol {

inline constexpr uint32_t kEnvelopeMagic = 0x48534d46;  // "FMSH" read little-endian
inline constexpr size_t kEnvelopeBytes = 24;
inline constexpr uint16_t kProtocolVersion = wire::PROTOCOL_VERSION;
inline constexpr uint16_t kMinProtocolVersion = wire::MIN_PROTOCOL_VERSION;
// The first version that takes sealed updates (UpdateHeader.sealed, UpdateSeal).
inline constexpr uint16_t kSealedUpdatesVersion = 4;

// Every bound a peer's bytes meet, named. Chunks default to 4 MiB of
// payload; a message may carry that plus its structure.
inline constexpr size_t kDefaultChunkBytes = size_t{4} << 20;
inline constexpr size_t kMessageOverheadBytes = size_t{64} << 10;
inline constexpr size_t kDefaultMaxMessageBytes = kDefaultChunkBytes + kMessageOverheadBytes;
inline constexpr int kMaxNestingDepth = 16;
inline constexpr uint64_t kTraversalWordsPerBodyWord = 2;  // a message may not read a word twice over
inline constexpr uint32_t kMaxChunksPerUpdate = 1u << 20;   // 4 TiB at 4 MiB a chunk
inline constexpr uint32_t kMaxTensorsPerUpdate = 1u << 16;
inline constexpr uint32_t kMaxSegmentsPerChunk = 1u << 16;
inline constexpr size_t kMaxTextBytes = 1024;               // names, reasons
inline constexpr uint32_t kMaxTensorRank = 8;

// Why a message was refused: the schema's RejectCode plus a sentence naming
// what was wrong. Sent back in a Reject, logged, and counted.
struct Rejection {
  wire::RejectCode code = wire::RejectCode::MALFORMED;
  std::string reason;
  uint64_t last_accepted = 0;  // replayed: the receiver's last accepted sequence from the sender (Reject.lastAccepted)
};
const char* reject_code_name(wire::RejectCode code);  // "malformed", "too-large", ...
// A refusal that says nothing about the update itself (the receiver was busy,
// over a rate, or could not store it): the sender keeps the update and sends
// it again later. Every other refusal is final for that update.
bool reject_is_retryable(wire::RejectCode code);
inline constexpr int kRejectCodeCount = 23;

struct Envelope {
  uint16_t version = kProtocolVersion;
  wire::Message::Which kind = wire::Message::HELLO;
  uint32_t body_bytes = 0;
  uint32_t chunk_index = 0;
  uint64_t sequence = 0;
};

// Reads and checks the envelope of a received frame: size against
// max_message_bytes first, then magic, version range, kind, and that the
// body length matches the frame.
bool read_envelope(std::span<const uint8_t> frame, size_t max_message_bytes, Envelope& envelope,
                   Rejection& rejection);

// A message ready to send: envelope + body in one contiguous buffer that the
// transport hands to ZeroMQ without another copy.
class OutgoingMessage {
 public:
  OutgoingMessage() = default;
  std::span<const uint8_t> bytes() const { return {data_.get(), size_}; }
  std::span<const uint8_t> body() const { return bytes().subspan(kEnvelopeBytes); }
  size_t size() const { return size_; }
  // A copy of bytes already serialized (a chunk resent on resume).
  static OutgoingMessage from_bytes(std::span<const uint8_t> bytes);

 private:
  friend OutgoingMessage serialize(capnp::MessageBuilder& builder, uint32_t chunk_index, uint64_t sequence);
  friend class InPlaceMessage;
  static uint8_t* allocate(size_t size);
  struct Free { void operator()(uint8_t* p) const; };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

// Serialized bytes held by a prepared update and, without a copy, by
// ZeroMQ's send queue; a chunk resent on resume is the same buffer.
class SharedMessage {
 public:
  SharedMessage() = default;
  explicit SharedMessage(OutgoingMessage message)
      : message_(std::make_shared<const OutgoingMessage>(std::move(message))) {}
  // The same bytes under another owner (e.g. one whose release is counted).
  explicit SharedMessage(std::shared_ptr<const OutgoingMessage> message) : message_(std::move(message)) {}
  std::span<const uint8_t> bytes() const { return message_ ? message_->bytes() : std::span<const uint8_t>(); }
  operator std::span<const uint8_t>() const { return bytes(); }  // NOLINT: reads as bytes anywhere
  size_t size() const { return bytes().size(); }
  const std::shared_ptr<const OutgoingMessage>& shared() const { return message_; }

 private:
  std::shared_ptr<const OutgoingMessage> message_;
};

// Serializes the builder's Message with its envelope. The kind comes from
// the root's union; chunk_index and sequence from the caller (nonzero only
// for chunks).
OutgoingMessage serialize(capnp::MessageBuilder& builder, uint32_t chunk_index = 0, uint64_t sequence = 0);

// A message built in the buffer it is sent from: serialize() without its
// copy of the body, for large messages whose size is known beforehand
// (update chunks). The builder's first segment is that buffer's body, so
// a message that fits in it is sent as built; one that outgrows it is
// serialized as any other.
class InPlaceMessage {
 public:
  explicit InPlaceMessage(size_t body_words);
  capnp::MessageBuilder& builder() { return *builder_; }
  // The message with its envelope (chunk_index and sequence as serialize()'s).
  OutgoingMessage finish(uint32_t chunk_index = 0, uint64_t sequence = 0);

 private:
  // The first segment in our buffer (a MallocMessageBuilder would zero it
  // again when destroyed, after the buffer is handed on); any further ones,
  // zeroed, on the heap.
  class Builder final : public capnp::MessageBuilder {
   public:
    explicit Builder(kj::ArrayPtr<capnp::word> first) : first_(first) {}
    ~Builder() noexcept(false) override;
    kj::ArrayPtr<capnp::word> allocateSegment(unsigned minimum_size) override;

   private:
    kj::ArrayPtr<capnp::word> first_;
    bool first_given_ = false;
    std::vector<void*> more_;
  };
  // Envelope, then the one-segment table (8 bytes), then the segment.
  static constexpr size_t kSegmentStart = kEnvelopeBytes + 8;
  std::unique_ptr<uint8_t, OutgoingMessage::Free> data_;
  std::unique_ptr<Builder> builder_;
};

// A parsed message. Holds the aligned body (borrowed from the frame when it
// was aligned: keep_alive then owns the frame) and the reader over it.
class ParsedMessage {
 public:
  wire::Message::Reader root() const { return root_; }
  const Envelope& envelope() const { return envelope_; }

 private:
  friend bool parse_body(std::span<const uint8_t>, const Envelope&, std::shared_ptr<const void>,
                         std::unique_ptr<ParsedMessage>&, Rejection&);
  Envelope envelope_;
  std::shared_ptr<const void> keep_alive_;
  kj::Array<capnp::word> aligned_copy_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
  wire::Message::Reader root_;
};

// Envelope check, then the parse under limits, then a check that the union
// tag matches the envelope's kind. keep_alive must own `frame` if the parsed
// message may borrow it (pass nullptr to always copy).
bool parse_message(std::span<const uint8_t> frame, size_t max_message_bytes,
                   std::shared_ptr<const void> keep_alive, std::unique_ptr<ParsedMessage>& parsed,
                   Rejection& rejection);
// Same, on a body whose envelope was already read (used after the chunk
// hash check).
bool parse_body(std::span<const uint8_t> frame, const Envelope& envelope,
                std::shared_ptr<const void> keep_alive, std::unique_ptr<ParsedMessage>& parsed,
                Rejection& rejection);

// Copy codec segments into the schema and back. The view borrows the reader.
void fill_segment(wire::TensorSegment::Builder out, const EncodedSegment& segment);
bool read_segment(wire::TensorSegment::Reader in, SegmentView& view, Rejection& rejection);

wire::TensorEncoding to_wire(Encoding encoding);
bool from_wire(wire::TensorEncoding encoding, Encoding& out);

}  // namespace fedmesh::protocol
