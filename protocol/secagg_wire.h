// Secure aggregation's messages (SecAggUp, SecAggDown in fedmesh.capnp) to
// and from the structs of crypto/secure_aggregation.h. Decoding checks every
// size a peer controls (keys 32 bytes, signatures 64, shares 32, at most
// kMaxSecAggSites entries per list, names within kMaxTextBytes, masked words
// a whole number of uint32) and refuses with a reason instead of throwing.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "crypto/secure_aggregation.h"
#include "protocol/wire.h"

namespace fedmesh::protocol {

// The largest piece of a masked input one SecAggUp carries.
inline constexpr size_t kSecAggWordsPerMessage = size_t{512} << 10;  // 2 MiB

struct SecAggUpMessage {
  enum class Kind { kJoin, kPoll, kAdvertise, kShares, kMasked, kConsistency, kReveals };
  Kind kind = Kind::kPoll;
  uint64_t round = 0;
  std::string session;
  crypto::SecAggAdvertisement advertisement;
  std::vector<crypto::SecAggShareCipher> shares;
  uint64_t offset = 0;
  std::vector<uint32_t> words;
  crypto::Signature signature{};
  std::vector<crypto::SecAggReveal> reveals;
};

struct SecAggDownMessage {
  uint64_t round = 0;
  std::string session;
  crypto::SecAggPhase phase = crypto::SecAggPhase::kAdvertise;
  bool member = false, answered = false;
  uint32_t threshold = 0;
  uint64_t length = 0;
  uint32_t invited = 0;
  uint64_t base_version = 0;
  float clip = 0.0f;
  uint8_t fraction_bits = 0;
  std::vector<crypto::SecAggAdvertisement> advertisements;
  std::vector<crypto::SecAggShareCipher> shares;
  uint64_t masked_next = 0;
  std::vector<std::string> alive, dropped;
  std::vector<crypto::SecAggSignature> signatures;
  std::string reason;
};

// `words` is used for Kind::kMasked instead of message.words (no copy of a large input).
OutgoingMessage encode_secagg_up(const SecAggUpMessage& message, std::span<const uint32_t> words = {});
bool decode_secagg_up(wire::SecAggUp::Reader in, SecAggUpMessage& out, Rejection& rejection);

OutgoingMessage encode_secagg_down(const SecAggDownMessage& message);
bool decode_secagg_down(wire::SecAggDown::Reader in, SecAggDownMessage& out, Rejection& rejection);

}  // namespace fedmesh::protocol
