#include "protocol/wire.h"

#include <kj/exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "base/status.h"

namespace fedmesh::protocol {
namespace {

template <class T>
T load_le(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));  // the protocol is little-endian, as are our targets
  return value;
}

template <class T>
void store_le(uint8_t* p, T value) {
  std::memcpy(p, &value, sizeof(T));
}

static_assert(static_cast<int>(wire::RejectCode::REVOKED) == kRejectCodeCount - 1,
              "kRejectCodeCount counts every RejectCode");

constexpr uint16_t kLastKind = static_cast<uint16_t>(wire::Message::UPDATE_SEAL);

}  // namespace

const char* reject_code_name(wire::RejectCode code) {
  switch (code) {
    case wire::RejectCode::MALFORMED: return "malformed";
    case wire::RejectCode::TOO_LARGE: return "too-large";
    case wire::RejectCode::UNAUTHENTICATED: return "unauthenticated";
    case wire::RejectCode::BAD_SIGNATURE: return "bad-signature";
    case wire::RejectCode::REPLAYED: return "replayed";
    case wire::RejectCode::WRONG_SHAPE: return "wrong-shape";
    case wire::RejectCode::NON_FINITE: return "non-finite";
    case wire::RejectCode::VERSION_UNSUPPORTED: return "version-unsupported";
    case wire::RejectCode::RATE_LIMITED: return "rate-limited";
    case wire::RejectCode::WRONG_ROUND: return "wrong-round";
    case wire::RejectCode::TOO_MANY_CHUNKS: return "too-many-chunks";
    case wire::RejectCode::UNKNOWN_TRANSFER: return "unknown-transfer";
    case wire::RejectCode::BAD_CHUNK_HASH: return "bad-chunk-hash";
    case wire::RejectCode::WRONG_RECIPIENT: return "wrong-recipient";
    case wire::RejectCode::WRONG_FEDERATION: return "wrong-federation";
    case wire::RejectCode::BUSY: return "busy";
    case wire::RejectCode::PRIVATE_MODE: return "private-mode";
    case wire::RejectCode::NOT_STORED: return "not-stored";
    case wire::RejectCode::SEQUENCE_AHEAD: return "sequence-ahead";
    case wire::RejectCode::TOO_MANY_SAMPLES: return "too-many-samples";
    case wire::RejectCode::WRONG_ROLE: return "wrong-role";
    case wire::RejectCode::OUT_OF_RANGE: return "out-of-range";
    case wire::RejectCode::REVOKED: return "revoked";
  }
  return "unknown";
}

bool reject_is_retryable(wire::RejectCode code) {
  return code == wire::RejectCode::NOT_STORED || code == wire::RejectCode::BUSY ||
         code == wire::RejectCode::RATE_LIMITED;
}

bool read_envelope(std::span<const uint8_t> frame, size_t max_message_bytes, Envelope& envelope,
                   Rejection& rejection) {
  if (frame.size() > max_message_bytes) {
    rejection = {wire::RejectCode::TOO_LARGE, "message of " + std::to_string(frame.size()) +
                                                  " bytes is over the limit of " +
                                                  std::to_string(max_message_bytes)};
    return false;
  }
  if (frame.size() < kEnvelopeBytes) {
    rejection = {wire::RejectCode::MALFORMED,
                 "message of " + std::to_string(frame.size()) + " bytes is shorter than the envelope"};
    return false;
  }
  const uint8_t* p = frame.data();
  if (load_le<uint32_t>(p) != kEnvelopeMagic) {
    rejection = {wire::RejectCode::MALFORMED, "envelope magic is not FMSH"};
    return false;
  }
  envelope.version = load_le<uint16_t>(p + 4);
  const uint16_t kind = load_le<uint16_t>(p + 6);
  envelope.body_bytes = load_le<uint32_t>(p + 8);
  envelope.chunk_index = load_le<uint32_t>(p + 12);
  envelope.sequence = load_le<uint64_t>(p + 16);
  if (envelope.version < kMinProtocolVersion) {
    rejection = {wire::RejectCode::VERSION_UNSUPPORTED,
                 "protocol version " + std::to_string(envelope.version) + " is older than the oldest supported, " +
                     std::to_string(kMinProtocolVersion)};
    return false;
  }
  // A newer peer's envelope keeps this layout; its Hello negotiates down to
  // a version we speak, so only the kinds we know are let through.
  if (kind > kLastKind) {
    rejection = {wire::RejectCode::MALFORMED, "unknown message kind " + std::to_string(kind)};
    return false;
  }
  envelope.kind = static_cast<wire::Message::Which>(kind);
  if (envelope.body_bytes != frame.size() - kEnvelopeBytes || envelope.body_bytes % sizeof(capnp::word) != 0 ||
      envelope.body_bytes == 0) {
    rejection = {wire::RejectCode::MALFORMED, "envelope declares a body of " + std::to_string(envelope.body_bytes) +
                                                  " bytes; the frame holds " +
                                                  std::to_string(frame.size() - kEnvelopeBytes) +
                                                  " (must match and be a nonzero multiple of 8)"};
    return false;
  }
  return true;
}

void OutgoingMessage::Free::operator()(uint8_t* p) const { std::free(p); }

uint8_t* OutgoingMessage::allocate(size_t size) {
  auto* data = static_cast<uint8_t*>(std::aligned_alloc(64, (size + 63) / 64 * 64));
  if (data == nullptr) throw std::bad_alloc();
  return data;
}

OutgoingMessage OutgoingMessage::from_bytes(std::span<const uint8_t> bytes) {
  OutgoingMessage out;
  out.data_.reset(allocate(bytes.size()));
  out.size_ = bytes.size();
  std::memcpy(out.data_.get(), bytes.data(), bytes.size());
  return out;
}

namespace {

void write_envelope(uint8_t* data, wire::Message::Which kind, size_t body_bytes, uint32_t chunk_index,
                    uint64_t sequence) {
  FEDMESH_CHECK(body_bytes <= UINT32_MAX, "message body over 4 GiB");
  store_le<uint32_t>(data, kEnvelopeMagic);
  store_le<uint16_t>(data + 4, kProtocolVersion);
  store_le<uint16_t>(data + 6, static_cast<uint16_t>(kind));
  store_le<uint32_t>(data + 8, static_cast<uint32_t>(body_bytes));
  store_le<uint32_t>(data + 12, chunk_index);
  store_le<uint64_t>(data + 16, sequence);
}

}  // namespace

OutgoingMessage serialize(capnp::MessageBuilder& builder, uint32_t chunk_index, uint64_t sequence) {
  auto root = builder.getRoot<wire::Message>();
  const size_t body_bytes = capnp::computeSerializedSizeInWords(builder) * sizeof(capnp::word);
  OutgoingMessage out;
  const size_t total = kEnvelopeBytes + body_bytes;
  uint8_t* data = OutgoingMessage::allocate(total);
  out.data_.reset(data);
  out.size_ = total;
  write_envelope(data, root.which(), body_bytes, chunk_index, sequence);
  kj::ArrayOutputStream stream(kj::arrayPtr(reinterpret_cast<kj::byte*>(data + kEnvelopeBytes), body_bytes));
  capnp::writeMessage(stream, builder);
  FEDMESH_CHECK(stream.getArray().size() == body_bytes, "serialized size differs from computed size");
  return out;
}


InPlaceMessage::Builder::~Builder() noexcept(false) {
  for (void* segment : more_) std::free(segment);
}

kj::ArrayPtr<capnp::word> InPlaceMessage::Builder::allocateSegment(unsigned minimum_size) {
  if (!first_given_ && minimum_size <= first_.size()) {
    first_given_ = true;
    return first_;
  }
  const size_t words = std::max<size_t>(minimum_size, 1024);
  void* segment = std::calloc(words, sizeof(capnp::word));
  if (segment == nullptr) throw std::bad_alloc();
  more_.push_back(segment);
  return kj::arrayPtr(static_cast<capnp::word*>(segment), words);
}

InPlaceMessage::InPlaceMessage(size_t body_words) {
  const size_t words = std::max<size_t>(body_words, 1);
  // Cap'n Proto wants a zeroed first segment: calloc's pages of a large
  // buffer come zeroed from the system, without a pass over them.
  auto* data = static_cast<uint8_t*>(std::calloc(kSegmentStart + words * sizeof(capnp::word), 1));
  if (data == nullptr) throw std::bad_alloc();
  data_.reset(data);
  builder_ = std::make_unique<Builder>(kj::arrayPtr(reinterpret_cast<capnp::word*>(data + kSegmentStart), words));
}

OutgoingMessage InPlaceMessage::finish(uint32_t chunk_index, uint64_t sequence) {
  const auto segments = builder_->getSegmentsForOutput();
  uint8_t* data = data_.get();
  if (segments.size() != 1 || segments[0].begin() != reinterpret_cast<const capnp::word*>(data + kSegmentStart)) {
    return serialize(*builder_, chunk_index, sequence);
  }
  const size_t segment_bytes = segments[0].size() * sizeof(capnp::word);
  store_le<uint32_t>(data + kEnvelopeBytes, 0);  // one segment
  store_le<uint32_t>(data + kEnvelopeBytes + 4, static_cast<uint32_t>(segments[0].size()));
  write_envelope(data, builder_->getRoot<wire::Message>().which(), 8 + segment_bytes, chunk_index, sequence);
  builder_.reset();
  OutgoingMessage out;
  out.data_ = std::move(data_);
  out.size_ = kSegmentStart + segment_bytes;
  return out;
}

bool parse_body(std::span<const uint8_t> frame, const Envelope& envelope, std::shared_ptr<const void> keep_alive,
                std::unique_ptr<ParsedMessage>& parsed, Rejection& rejection) {
  auto message = std::make_unique<ParsedMessage>();
  message->envelope_ = envelope;
  const std::span<const uint8_t> body = frame.subspan(kEnvelopeBytes, envelope.body_bytes);
  const size_t words = body.size() / sizeof(capnp::word);
  const capnp::word* aligned = nullptr;
  // Cap'n Proto reads words in place and requires 8-byte alignment.
  if (keep_alive != nullptr && reinterpret_cast<uintptr_t>(body.data()) % alignof(capnp::word) == 0) {
    aligned = reinterpret_cast<const capnp::word*>(body.data());
    message->keep_alive_ = std::move(keep_alive);
  } else {
    message->aligned_copy_ = kj::heapArray<capnp::word>(words);
    std::memcpy(message->aligned_copy_.begin(), body.data(), body.size());
    aligned = message->aligned_copy_.begin();
  }
  capnp::ReaderOptions options;
  options.traversalLimitInWords = words * kTraversalWordsPerBodyWord + 64;
  options.nestingLimit = kMaxNestingDepth;
  try {
    message->reader_ = std::make_unique<capnp::FlatArrayMessageReader>(kj::arrayPtr(aligned, words), options);
    message->root_ = message->reader_->getRoot<wire::Message>();
    const wire::Message::Which which = message->root_.which();
    if (which != envelope.kind) {
      rejection = {wire::RejectCode::MALFORMED, "envelope says message kind " +
                                                    std::to_string(static_cast<int>(envelope.kind)) +
                                                    ", body holds kind " + std::to_string(static_cast<int>(which))};
      return false;
    }
  } catch (const kj::Exception& e) {
    rejection = {wire::RejectCode::MALFORMED, std::string("message does not parse: ") + e.getDescription().cStr()};
    return false;
  }
  parsed = std::move(message);
  return true;
}

bool parse_message(std::span<const uint8_t> frame, size_t max_message_bytes, std::shared_ptr<const void> keep_alive,
                   std::unique_ptr<ParsedMessage>& parsed, Rejection& rejection) {
  Envelope envelope;
  if (!read_envelope(frame, max_message_bytes, envelope, rejection)) return false;
  return parse_body(frame, envelope, std::move(keep_alive), parsed, rejection);
}

wire::TensorEncoding to_wire(Encoding encoding) { return static_cast<wire::TensorEncoding>(encoding); }

bool from_wire(wire::TensorEncoding encoding, Encoding& out) {
  const auto value = static_cast<uint16_t>(encoding);
  if (value >= kEncodingCount) return false;
  out = static_cast<Encoding>(value);
  return true;
}

void fill_segment(wire::TensorSegment::Builder out, const EncodedSegment& segment) {
  out.setTensor(segment.tensor);
  out.setEncoding(to_wire(segment.encoding));
  out.setOffset(segment.offset);
  out.setCount(segment.count);
  out.setNnz(segment.nnz);
  out.setBlockSize(segment.block_size);
  auto copy = [](auto init, const std::vector<uint8_t>& bytes) {
    if (!bytes.empty()) std::memcpy(init.begin(), bytes.data(), bytes.size());
  };
  if (!segment.indices.empty()) copy(out.initIndices(segment.indices.size()), segment.indices);
  if (!segment.values.empty()) copy(out.initValues(segment.values.size()), segment.values);
  if (!segment.dense_source.empty()) {
    write_dense_values(segment.dense_source, segment.encoding,
                       out.initValues(static_cast<unsigned>(segment.deferred_bytes)).begin());
  }
  if (!segment.scales.empty()) copy(out.initScales(segment.scales.size()), segment.scales);
}

bool read_segment(wire::TensorSegment::Reader in, SegmentView& view, Rejection& rejection) {
  try {
    view.tensor = in.getTensor();
    if (!from_wire(in.getEncoding(), view.encoding)) {
      rejection = {wire::RejectCode::MALFORMED,
                   "unknown tensor encoding " + std::to_string(static_cast<int>(in.getEncoding()))};
      return false;
    }
    view.offset = in.getOffset();
    view.count = in.getCount();
    view.nnz = in.getNnz();
    view.block_size = in.getBlockSize();
    const auto indices = in.getIndices();
    const auto values = in.getValues();
    const auto scales = in.getScales();
    view.indices = {indices.begin(), indices.size()};
    view.values = {values.begin(), values.size()};
    view.scales = {scales.begin(), scales.size()};
  } catch (const kj::Exception& e) {
    rejection = {wire::RejectCode::MALFORMED, std::string("tensor segment does not parse: ") + e.getDescription().cStr()};
    return false;
  }
  return true;
}

}  // namespace fedmesh::protocol
