// Secure aggregation (Bonawitz et al., CCS 2017, with the active-adversary
// additions) as two state machines with no clock or network of their own:
// `SecAggClient` is one site's part in one session, `SecAggServer` the
// aggregator's. The transports (aggregator/secure_round.h and
// node/secure_upload.h) move their messages; tests drive them directly.
//
// One session, over the sites U0 the aggregator invites (names sorted):
//   0 AdvertiseKeys   every site makes two X25519 key pairs (c: to encrypt
//                     shares, s: to agree pairwise masks) and signs both
//                     public keys, the federation, round and session with
//                     its roster identity key.                        -> U1
//   1 ShareKeys       a site checks U1 (every signature, no unknown or
//                     duplicate names, itself in it, |U1| >= t), draws its
//                     self-mask seed b, splits b and s_sk t-of-|U1| (Shamir,
//                     crypto/masking.h) and sends each peer its two shares
//                     encrypted and authenticated to that peer's c key.  -> U2
//   2 MaskedInput     y = x + PRG(b) + Σ_{v in U2, v != u} ±PRG(s_uv), in
//                     Z_2^32, + for u < v and - for u > v; the sum over U3
//                     of the pairwise terms cancels.                      -> U3
//   3 Consistency     each site signs the list U3 (|U3| >= t, U3 ⊆ U2).   -> U4
//   4 Unmasking       given U3, the dropped U2 \ U3 and |U4| >= t valid
//                     signatures over that same U3, each site reveals, per
//                     peer, the share of b (peer alive) or of s_sk (peer
//                     dropped), never both, and never twice.              -> U5
// The server reconstructs every b of U3 and every s_sk of U2 \ U3 from t
// shares, removes PRG(b_u) and the masks the survivors hold with dropped
// sites, and is left with Σ_{u in U3} x_u exactly. Up to |U_i| - t sites may
// drop at every phase; below t the session aborts, and a new session (new
// id, new keys) is the only way on: nothing of a session is ever reused.
//
// A client aborts, wiping every secret it holds, on anything inconsistent:
// a message for another session or round, a list with an unknown or
// duplicate name or without itself, itself listed as dropped, a site both
// alive and dropped, fewer than t alive, a bad signature, a share that does
// not decrypt, a second unmasking request, or a call out of order.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "crypto/keys.h"
#include "crypto/masking.h"
#include "crypto/roster.h"

namespace fedmesh::crypto {

using X25519Public = std::array<uint8_t, 32>;

enum class SecAggPhase : uint8_t {
  kAdvertise = 0,
  kShareKeys = 1,
  kMaskedInput = 2,
  kConsistency = 3,
  kUnmask = 4,
  kDone = 5,
  kAborted = 6,
};
const char* secagg_phase_name(SecAggPhase phase);  // "advertise", "share-keys", ...
Result<SecAggPhase> parse_secagg_phase(std::string_view name);

inline constexpr size_t kMaxSecAggSites = 255;        // Shamir points 1..255
inline constexpr uint64_t kMaxSecAggWords = uint64_t{1} << 32;

struct SecAggParams {
  std::string federation;
  uint64_t round = 0;
  std::string session;       // chosen by the server, new for every session
  uint32_t threshold = 0;    // t
  uint64_t length = 0;       // words of every input
};

// The smallest threshold a site accepts for n sites: a strict majority
// (t > n/2, what the active-adversary analysis needs) and at least 2.
uint32_t secagg_min_threshold(size_t sites);

struct SecAggAdvertisement {
  std::string site;
  X25519Public cipher_public{};
  X25519Public mask_public{};
  Signature signature{};
};

struct SecAggShareCipher {
  std::string from, to;
  std::vector<uint8_t> ciphertext;  // nonce || crypto_box_easy(...)
};

struct SecAggSignature {
  std::string site;
  Signature signature{};
};

struct SecAggReveal {
  std::string owner;       // whose secret this is a share of
  bool mask_key = false;   // true: of owner's s_sk (owner dropped); false: of owner's b (owner alive)
  ShamirShare share;
};

struct SecAggUnmaskRequest {
  std::vector<std::string> alive;    // U3
  std::vector<std::string> dropped;  // U2 \ U3
  std::vector<SecAggSignature> signatures;  // U4's, over `alive`
};

// The bytes each signature covers (domain-separated, length-prefixed).
std::vector<uint8_t> secagg_advertisement_bytes(const SecAggParams& params, std::string_view site,
                                                const X25519Public& cipher_public, const X25519Public& mask_public);
std::vector<uint8_t> secagg_consistency_bytes(const SecAggParams& params, std::span<const std::string> alive);

class SecAggClient {
 public:
  // A site's part in one session. Refuses a threshold below
  // secagg_min_threshold of the sites invited or a length of 0.
  static Result<SecAggClient> start(SecAggParams params, const SiteKeys& keys, const Roster& roster, size_t invited);
  SecAggClient(SecAggClient&&) = default;
  SecAggClient& operator=(SecAggClient&&) = default;
  ~SecAggClient();

  const SecAggParams& params() const { return params_; }
  SecAggPhase phase() const { return phase_; }
  const std::string& abort_reason() const { return abort_reason_; }
  // Whether any secret (key, seed, share) is still held: false once done or aborted.
  bool holds_secrets() const;

  Result<SecAggAdvertisement> advertise();
  Result<std::vector<SecAggShareCipher>> share_keys(std::span<const SecAggAdvertisement> advertised);
  // The ciphertexts addressed to this site, one from each member of U2;
  // `input` is masked in place and returned.
  Result<std::vector<uint32_t>> masked_input(std::span<const SecAggShareCipher> received, std::vector<uint32_t> input);
  Result<Signature> consistency(std::span<const std::string> alive);
  Result<std::vector<SecAggReveal>> unmask(const SecAggUnmaskRequest& request);
  // Marks the session finished (the server announced the result): wipes.
  void finish();
  // Wipes every secret; the status names the reason.
  Status abort(std::string reason);

 private:
  SecAggClient() = default;
  Status expect(SecAggPhase phase);
  void wipe();

  SecAggParams params_;
  std::string self_;
  const SiteKeys* keys_ = nullptr;
  const Roster* roster_ = nullptr;
  size_t invited_ = 0;
  SecAggPhase phase_ = SecAggPhase::kAdvertise;
  std::string abort_reason_;
  SecretBytes<32> cipher_secret_, mask_secret_;
  X25519Public cipher_public_{}, mask_public_{};
  Seed self_seed_{};
  bool has_keys_ = false;
  std::vector<SecAggAdvertisement> u1_;      // sorted by name
  std::vector<std::string> u2_;             // sorted
  std::vector<std::string> u3_;             // the list this site signed
  // Shares held for each peer of U2 (decrypted in MaskedInput): of its b and of its s_sk.
  std::map<std::string, std::pair<ShamirShare, ShamirShare>> held_;
};

class SecAggServer {
 public:
  // `invited`: U0, the sites asked to take part (at most kMaxSecAggSites).
  static Result<SecAggServer> create(SecAggParams params, const Roster& roster, std::vector<std::string> invited);

  const SecAggParams& params() const { return params_; }
  SecAggPhase phase() const { return phase_; }
  const std::string& abort_reason() const { return abort_reason_; }

  // One site's contribution to the current phase. kInvalidArgument (the
  // session is unchanged) for a message out of phase, from a site outside
  // the phase's set, sent twice, or inconsistent.
  Status advertise(const std::string& site, SecAggAdvertisement advertisement);
  Status share_keys(const std::string& site, std::vector<SecAggShareCipher> shares);
  // Masked input in pieces: `offset` must be the next word expected.
  Status masked_input(const std::string& site, uint64_t offset, std::span<const uint32_t> words);
  uint64_t masked_words_received(const std::string& site) const;
  Status consistency(const std::string& site, const Signature& signature);
  Status unmask(const std::string& site, std::vector<SecAggReveal> reveals);

  // Whether every member of the current phase's set has answered.
  bool phase_complete() const;
  // Closes the current phase with whoever answered (at a deadline, or once
  // complete): the next phase starts, or the session aborts when fewer than
  // t answered. Unmasking's close computes the sum.
  void advance();

  // Whether `site` is still in the session (answered every phase so far).
  bool member(const std::string& site) const;
  // Whether `site` has answered the current phase.
  bool answered(const std::string& site) const;
  const std::vector<std::string>& invited() const { return u0_; }
  const std::vector<SecAggAdvertisement>& advertisements() const { return u1_; }
  std::vector<SecAggShareCipher> shares_for(const std::string& site) const;
  const std::vector<std::string>& alive() const { return u3_; }
  std::vector<std::string> dropped() const;  // U2 \ U3
  SecAggUnmaskRequest unmask_request() const;
  // Done: Σ_{u in alive()} x_u, mod 2^32.
  const std::vector<uint32_t>& sum() const { return sum_; }

 private:
  SecAggServer() = default;
  void abort(std::string reason);
  Status finish_unmasking();

  SecAggParams params_;
  const Roster* roster_ = nullptr;
  SecAggPhase phase_ = SecAggPhase::kAdvertise;
  std::string abort_reason_;
  std::vector<std::string> u0_;
  std::vector<SecAggAdvertisement> u1_;  // sorted by name
  std::map<std::string, SecAggAdvertisement> advertised_;
  std::map<std::string, std::vector<SecAggShareCipher>> shares_;  // by sender
  std::vector<std::string> u2_, u3_, u4_;
  std::map<std::string, std::vector<uint32_t>> partial_;  // masked inputs still arriving
  std::map<std::string, uint64_t> received_words_;
  std::vector<std::string> masked_done_;
  std::map<std::string, Signature> signatures_;
  std::map<std::string, std::vector<SecAggReveal>> reveals_;
  std::vector<uint32_t> sum_;
};

}  // namespace fedmesh::crypto
