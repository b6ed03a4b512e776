#include "store/pending_payload.h"

#include <bit>
#include <algorithm>
#include <cstring>
#include <string>

namespace fedmesh::store {

namespace {

constexpr uint8_t kMagic[4] = {'F', 'M', 'P', 'U'};
constexpr size_t kFieldsBytes = 5 * 8;                       // round .. local_accuracy
constexpr size_t kHeaderBytes = 4 + 4 + kFieldsBytes + 8;  // magic, version, fields, value count
static_assert(kHeaderBytes == kPendingHeaderBytes);

void put_u64(uint8_t* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}
uint64_t get_u64(const uint8_t* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= uint64_t{in[i]} << (8 * i);
  return value;
}
uint32_t get_u32(const uint8_t* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= uint32_t{in[i]} << (8 * i);
  return value;
}

// The five fields, little-endian, at `out` (kFieldsBytes).
void put_fields(uint8_t* out, const PendingHeader& p) {
  put_u64(out, static_cast<uint64_t>(p.round));
  put_u64(out + 8, static_cast<uint64_t>(p.base_version));
  put_u64(out + 16, static_cast<uint64_t>(p.sample_count));
  put_u64(out + 24, std::bit_cast<uint64_t>(p.local_loss));
  put_u64(out + 32, std::bit_cast<uint64_t>(p.local_accuracy));
}
void get_fields(const uint8_t* in, PendingHeader& p) {
  p.round = static_cast<int64_t>(get_u64(in));
  p.base_version = static_cast<int64_t>(get_u64(in + 8));
  p.sample_count = static_cast<int64_t>(get_u64(in + 16));
  p.local_loss = std::bit_cast<double>(get_u64(in + 24));
  p.local_accuracy = std::bit_cast<double>(get_u64(in + 32));
}

void put_floats(uint8_t* out, std::span<const float> values) {
  if constexpr (std::endian::native == std::endian::little) {
    if (!values.empty()) std::memcpy(out, values.data(), values.size() * sizeof(float));
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
      for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<uint8_t>(bits >> (8 * b));
    }
  }
}
void get_floats(const uint8_t* in, std::vector<float>& values) {
  if constexpr (std::endian::native == std::endian::little) {
    if (!values.empty()) std::memcpy(values.data(), in, values.size() * sizeof(float));
  } else {
    for (size_t i = 0; i < values.size(); ++i) values[i] = std::bit_cast<float>(get_u32(in + 4 * i));
  }
}

}  // namespace

std::vector<uint8_t> encode_pending_header(const PendingHeader& header, uint64_t values) {
  std::vector<uint8_t> bytes(kHeaderBytes);
  std::memcpy(bytes.data(), kMagic, sizeof kMagic);
  for (int i = 0; i < 4; ++i) bytes[4 + i] = static_cast<uint8_t>(kPendingPayloadVersion >> (8 * i));
  put_fields(bytes.data() + 8, header);
  put_u64(bytes.data() + 8 + kFieldsBytes, values);
  return bytes;
}

std::span<const uint8_t> pending_value_bytes(std::span<const float> values) {
  // fedmesh runs on little-endian machines only (x86-64, aarch64); a
  // big-endian build would have to stream converted copies instead.
  static_assert(std::endian::native == std::endian::little, "pending payloads stream f32 in native byte order");
  return {reinterpret_cast<const uint8_t*>(values.data()), values.size() * sizeof(float)};
}

std::vector<uint8_t> encode_pending_payload(const PendingHeader& header, std::span<const float> delta) {
  std::vector<uint8_t> bytes = encode_pending_header(header, delta.size());
  bytes.resize(kHeaderBytes + delta.size() * sizeof(float));
  put_floats(bytes.data() + kHeaderBytes, delta);
  return bytes;
}

Result<PendingLayout> read_pending_layout(std::span<const uint8_t> front, uint64_t total_bytes, size_t expected_values) {
  PendingLayout layout;
  const uint64_t delta_bytes = uint64_t{expected_values} * sizeof(float);
  if (front.size() >= sizeof kMagic && std::memcmp(front.data(), kMagic, sizeof kMagic) == 0) {
    if (front.size() < kHeaderBytes || total_bytes < kHeaderBytes) {
      return corrupt("pending update payload: " + std::to_string(total_bytes) + " bytes, shorter than its header");
    }
    const uint32_t version = get_u32(front.data() + 4);
    if (version != kPendingPayloadVersion) {
      return corrupt("pending update payload: version " + std::to_string(version) + ", this build reads version " +
                     std::to_string(kPendingPayloadVersion));
    }
    const uint64_t values = get_u64(front.data() + 8 + kFieldsBytes);
    if (values != expected_values || total_bytes != kHeaderBytes + delta_bytes) {
      return corrupt("pending update payload: a delta of " + std::to_string(values) + " values in " +
                     std::to_string(total_bytes) + " bytes, not the model's " + std::to_string(expected_values));
    }
    get_fields(front.data() + 8, layout.header);
    layout.values_offset = kHeaderBytes;
    return layout;
  }
  // Written before the format had a version: the five fields, then the delta.
  if (total_bytes != kFieldsBytes + delta_bytes || front.size() < kFieldsBytes) {
    return corrupt("pending update payload: " + std::to_string(total_bytes) +
                   " bytes, neither this format nor the earlier one for a delta of " +
                   std::to_string(expected_values) + " values");
  }
  get_fields(front.data(), layout.header);
  layout.values_offset = kFieldsBytes;
  return layout;
}

Result<PendingPayload> decode_pending_payload(std::span<const uint8_t> bytes, size_t expected_values) {
  Result<PendingLayout> layout =
      read_pending_layout(bytes.first(std::min(bytes.size(), kHeaderBytes)), bytes.size(), expected_values);
  if (!layout.is_ok()) return layout.status();
  PendingPayload payload;
  payload.header = layout->header;
  payload.delta.resize(expected_values);
  get_floats(bytes.data() + layout->values_offset, payload.delta);
  return payload;
}

}  // namespace fedmesh::store
