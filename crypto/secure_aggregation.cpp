#include "crypto/secure_aggregation.h"

#include <sodium.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace fedmesh::crypto {

const char* secagg_phase_name(SecAggPhase phase) {
  switch (phase) {
    case SecAggPhase::kAdvertise: return "advertise";
    case SecAggPhase::kShareKeys: return "share-keys";
    case SecAggPhase::kMaskedInput: return "masked-input";
    case SecAggPhase::kConsistency: return "consistency";
    case SecAggPhase::kUnmask: return "unmask";
    case SecAggPhase::kDone: return "done";
    case SecAggPhase::kAborted: return "aborted";
  }
  return "unknown";
}

Result<SecAggPhase> parse_secagg_phase(std::string_view name) {
  for (int p = 0; p <= static_cast<int>(SecAggPhase::kAborted); ++p) {
    if (name == secagg_phase_name(static_cast<SecAggPhase>(p))) return static_cast<SecAggPhase>(p);
  }
  return invalid_argument("'" + std::string(name) +
                          "' is not a secure-aggregation phase (advertise, share-keys, masked-input, consistency, unmask)");
}

uint32_t secagg_min_threshold(size_t sites) { return static_cast<uint32_t>(std::max<size_t>(2, sites / 2 + 1)); }

namespace {

// Length-prefixed fields after a domain tag: no two field lists give the same bytes.
class Transcript {
 public:
  explicit Transcript(std::string_view tag) { text(tag); }
  Transcript& text(std::string_view t) {
    number(t.size());
    bytes_.insert(bytes_.end(), t.begin(), t.end());
    return *this;
  }
  Transcript& number(uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Transcript& raw(std::span<const uint8_t> b) {
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  Transcript& session(const SecAggParams& p) {
    return text(p.federation).number(p.round).text(p.session).number(p.threshold).number(p.length);
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

std::array<uint8_t, 32> session_digest(const SecAggParams& params) {
  const std::vector<uint8_t> bytes = Transcript("fedmesh-secagg-session-v1").session(params).take();
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), bytes.data(), bytes.size(), nullptr, 0);
  return digest;
}

// A share's plaintext: session digest, the two names, the point, the share
// of b, the share of s_sk.
constexpr size_t kNonce = crypto_box_NONCEBYTES;
constexpr size_t kMaxCipherBytes = 1024;

std::vector<uint8_t> share_plaintext(const SecAggParams& params, std::string_view from, std::string_view to, uint8_t x,
                                     const Seed& b_share, const Seed& s_share) {
  const std::array<uint8_t, 32> digest = session_digest(params);
  std::vector<uint8_t> out = Transcript("fedmesh-secagg-share-v1").raw(digest).text(from).text(to).take();
  out.push_back(x);
  out.insert(out.end(), b_share.begin(), b_share.end());
  out.insert(out.end(), s_share.begin(), s_share.end());
  return out;
}

bool sorted_unique(std::span<const std::string> names) {
  for (size_t i = 1; i < names.size(); ++i) {
    if (!(names[i - 1] < names[i])) return false;
  }
  return true;
}

bool contains(std::span<const std::string> sorted, const std::string& name) {
  return std::binary_search(sorted.begin(), sorted.end(), name);
}

const SignPublicKey* site_key(const Roster& roster, const std::string& name) {
  const RosterEntry* entry = roster.find(name);
  if (entry == nullptr || entry->role != Role::kSite) return nullptr;
  return &entry->identity.sign_public;
}

std::string first_problem_in_list(std::span<const std::string> names, std::span<const std::string> universe,
                                  std::string_view list, std::string_view universe_name) {
  std::set<std::string> seen;
  for (const std::string& n : names) {
    if (!seen.insert(n).second) return std::string(list) + " names " + n + " twice";
    if (!contains(universe, n)) return std::string(list) + " names " + n + ", not in " + std::string(universe_name);
  }
  return {};
}

int mask_sign(const std::string& me, const std::string& them) { return me < them ? +1 : -1; }

}  // namespace

std::vector<uint8_t> secagg_advertisement_bytes(const SecAggParams& params, std::string_view site,
                                                const X25519Public& cipher_public, const X25519Public& mask_public) {
  return Transcript("fedmesh-secagg-advertise-v1").session(params).text(site).raw(cipher_public).raw(mask_public).take();
}

std::vector<uint8_t> secagg_consistency_bytes(const SecAggParams& params, std::span<const std::string> alive) {
  Transcript t("fedmesh-secagg-consistency-v1");
  t.session(params).number(alive.size());
  for (const std::string& name : alive) t.text(name);
  return t.take();
}

// ---- client

Result<SecAggClient> SecAggClient::start(SecAggParams params, const SiteKeys& keys, const Roster& roster, size_t invited) {
  ensure_sodium();
  if (params.length == 0 || params.length >= kMaxSecAggWords) {
    return invalid_argument("secure aggregation: an input of " + std::to_string(params.length) + " words");
  }
  if (invited < 2 || invited > kMaxSecAggSites) {
    return invalid_argument("secure aggregation: " + std::to_string(invited) + " sites invited (2.." +
                            std::to_string(kMaxSecAggSites) + ")");
  }
  if (params.threshold < secagg_min_threshold(invited) || params.threshold > invited) {
    return invalid_argument("secure aggregation: threshold " + std::to_string(params.threshold) + " for " +
                            std::to_string(invited) + " sites; a site takes part only with a strict majority (" +
                            std::to_string(secagg_min_threshold(invited)) + "..)" );
  }
  if (params.session.empty()) return invalid_argument("secure aggregation: no session id");
  SecAggClient c;
  c.params_ = std::move(params);
  c.self_ = keys.identity.name;
  c.keys_ = &keys;
  c.roster_ = &roster;
  c.invited_ = invited;
  crypto_box_keypair(c.cipher_public_.data(), c.cipher_secret_.data());
  crypto_box_keypair(c.mask_public_.data(), c.mask_secret_.data());
  randombytes_buf(c.self_seed_.data(), c.self_seed_.size());
  c.has_keys_ = true;
  return c;
}

SecAggClient::~SecAggClient() { wipe(); }

bool SecAggClient::holds_secrets() const { return has_keys_ || !held_.empty(); }

void SecAggClient::wipe() {
  sodium_memzero(cipher_secret_.data(), cipher_secret_.size());
  sodium_memzero(mask_secret_.data(), mask_secret_.size());
  sodium_memzero(self_seed_.data(), self_seed_.size());
  for (auto& [name, shares] : held_) {
    sodium_memzero(shares.first.y.data(), shares.first.y.size());
    sodium_memzero(shares.second.y.data(), shares.second.y.size());
  }
  held_.clear();
  has_keys_ = false;
}

Status SecAggClient::abort(std::string reason) {
  wipe();
  if (phase_ != SecAggPhase::kAborted) {
    phase_ = SecAggPhase::kAborted;
    abort_reason_ = reason;
  }
  return invalid_argument("secure aggregation aborted (session " + params_.session + "): " + reason);
}

void SecAggClient::finish() {
  wipe();
  if (phase_ != SecAggPhase::kAborted) phase_ = SecAggPhase::kDone;
}

Status SecAggClient::expect(SecAggPhase phase) {
  if (phase_ == phase) return Status::ok();
  if (phase_ == SecAggPhase::kAborted) return invalid_argument("secure aggregation aborted earlier: " + abort_reason_);
  return abort(std::string("asked for ") + secagg_phase_name(phase) + " in phase " + secagg_phase_name(phase_));
}

Result<SecAggAdvertisement> SecAggClient::advertise() {
  FEDMESH_RETURN_IF_ERROR(expect(SecAggPhase::kAdvertise));
  SecAggAdvertisement a;
  a.site = self_;
  a.cipher_public = cipher_public_;
  a.mask_public = mask_public_;
  a.signature = sign_detached(secagg_advertisement_bytes(params_, self_, cipher_public_, mask_public_), keys_->sign_secret);
  phase_ = SecAggPhase::kShareKeys;
  return a;
}

Result<std::vector<SecAggShareCipher>> SecAggClient::share_keys(std::span<const SecAggAdvertisement> advertised) {
  FEDMESH_RETURN_IF_ERROR(expect(SecAggPhase::kShareKeys));
  std::vector<SecAggAdvertisement> u1(advertised.begin(), advertised.end());
  std::sort(u1.begin(), u1.end(), [](const auto& a, const auto& b) { return a.site < b.site; });
  std::vector<std::string> names;
  for (const SecAggAdvertisement& a : u1) {
    if (!names.empty() && names.back() == a.site) return abort("the key list names " + a.site + " twice");
    names.push_back(a.site);
    const SignPublicKey* key = site_key(*roster_, a.site);
    if (key == nullptr) return abort("the key list names " + a.site + ", not a site of the roster");
    if (!verify_detached(secagg_advertisement_bytes(params_, a.site, a.cipher_public, a.mask_public), a.signature, *key)) {
      return abort("the keys of " + a.site + " are not signed by its roster identity");
    }
  }
  if (!contains(names, self_)) return abort("the key list leaves this site out");
  auto mine = std::find_if(u1.begin(), u1.end(), [&](const auto& a) { return a.site == self_; });
  if (mine->cipher_public != cipher_public_ || mine->mask_public != mask_public_) {
    return abort("the key list holds keys for this site that it did not advertise");
  }
  if (u1.size() > invited_) {
    return abort("the key list has " + std::to_string(u1.size()) + " sites, more than the " +
                 std::to_string(invited_) + " invited");
  }
  if (u1.size() < params_.threshold) {
    return abort("only " + std::to_string(u1.size()) + " sites advertised keys, fewer than the threshold " +
                 std::to_string(params_.threshold));
  }
  u1_ = std::move(u1);
  const int n = static_cast<int>(u1_.size());
  const int t = static_cast<int>(params_.threshold);
  Seed mask_key{};
  std::memcpy(mask_key.data(), mask_secret_.data(), mask_key.size());
  Result<std::vector<ShamirShare>> b_shares = shamir_split(self_seed_, t, n);
  Result<std::vector<ShamirShare>> s_shares = shamir_split(mask_key, t, n);
  sodium_memzero(mask_key.data(), mask_key.size());
  if (!b_shares.is_ok()) return abort(b_shares.status().message());
  if (!s_shares.is_ok()) return abort(s_shares.status().message());
  std::vector<SecAggShareCipher> out;
  for (int i = 0; i < n; ++i) {
    const SecAggAdvertisement& peer = u1_[static_cast<size_t>(i)];
    std::vector<uint8_t> plain = share_plaintext(params_, self_, peer.site, static_cast<uint8_t>(i + 1),
                                                 (*b_shares)[static_cast<size_t>(i)].y, (*s_shares)[static_cast<size_t>(i)].y);
    SecAggShareCipher cipher;
    cipher.from = self_;
    cipher.to = peer.site;
    cipher.ciphertext.resize(kNonce + crypto_box_MACBYTES + plain.size());
    randombytes_buf(cipher.ciphertext.data(), kNonce);
    const int boxed = crypto_box_easy(cipher.ciphertext.data() + kNonce, plain.data(), plain.size(),
                                      cipher.ciphertext.data(), peer.cipher_public.data(), cipher_secret_.data());
    sodium_memzero(plain.data(), plain.size());
    if (boxed != 0) return abort("cannot encrypt a share to " + peer.site + " (a low-order key)");
    out.push_back(std::move(cipher));
  }
  for (auto* shares : {&*b_shares, &*s_shares}) {
    for (ShamirShare& s : *shares) sodium_memzero(s.y.data(), s.y.size());
  }
  phase_ = SecAggPhase::kMaskedInput;
  return out;
}

Result<std::vector<uint32_t>> SecAggClient::masked_input(std::span<const SecAggShareCipher> received,
                                                         std::vector<uint32_t> input) {
  FEDMESH_RETURN_IF_ERROR(expect(SecAggPhase::kMaskedInput));
  if (input.size() != params_.length) {
    return abort("an input of " + std::to_string(input.size()) + " words for a session of " +
                 std::to_string(params_.length));
  }
  std::vector<std::string> names;
  for (const SecAggAdvertisement& a : u1_) names.push_back(a.site);
  const auto my_index = static_cast<size_t>(std::find(names.begin(), names.end(), self_) - names.begin());
  const uint8_t my_point = static_cast<uint8_t>(my_index + 1);
  std::vector<std::string> u2;
  std::map<std::string, std::pair<ShamirShare, ShamirShare>> held;
  const auto refuse = [&](std::string reason) {
    for (auto& [n, s] : held) {
      sodium_memzero(s.first.y.data(), s.first.y.size());
      sodium_memzero(s.second.y.data(), s.second.y.size());
    }
    return abort(std::move(reason));
  };
  for (const SecAggShareCipher& c : received) {
    if (c.to != self_) return refuse("a share from " + c.from + " is addressed to " + c.to);
    if (!contains(names, c.from)) return refuse("a share from " + c.from + ", who advertised no keys");
    if (held.count(c.from) != 0) return refuse("two shares from " + c.from);
    if (c.ciphertext.size() < kNonce + crypto_box_MACBYTES || c.ciphertext.size() > kMaxCipherBytes) {
      return refuse("the share from " + c.from + " has " + std::to_string(c.ciphertext.size()) + " bytes");
    }
    const SecAggAdvertisement& sender = *std::find_if(u1_.begin(), u1_.end(), [&](const auto& a) { return a.site == c.from; });
    std::vector<uint8_t> plain(c.ciphertext.size() - kNonce - crypto_box_MACBYTES);
    if (crypto_box_open_easy(plain.data(), c.ciphertext.data() + kNonce, c.ciphertext.size() - kNonce,
                             c.ciphertext.data(), sender.cipher_public.data(), cipher_secret_.data()) != 0) {
      return refuse("the share from " + c.from + " does not decrypt with its advertised key");
    }
    std::pair<ShamirShare, ShamirShare> shares;
    shares.first.x = shares.second.x = my_point;
    const std::vector<uint8_t> expected_prefix = share_plaintext(params_, c.from, self_, my_point, Seed{}, Seed{});
    const size_t prefix = expected_prefix.size() - 64;
    const bool ok = plain.size() == expected_prefix.size() && std::equal(expected_prefix.begin(),
                                                                          expected_prefix.begin() + static_cast<long>(prefix), plain.begin());
    if (ok) {
      std::memcpy(shares.first.y.data(), plain.data() + prefix, 32);
      std::memcpy(shares.second.y.data(), plain.data() + prefix + 32, 32);
    }
    sodium_memzero(plain.data(), plain.size());
    if (!ok) return refuse("the share from " + c.from + " is for another session, pair or point");
    held.emplace(c.from, shares);
    sodium_memzero(shares.first.y.data(), 32);
    sodium_memzero(shares.second.y.data(), 32);
    u2.push_back(c.from);
  }
  std::sort(u2.begin(), u2.end());
  if (!contains(u2, self_)) return refuse("the shares leave out this site's own");
  if (u2.size() < params_.threshold) {
    return refuse("only " + std::to_string(u2.size()) + " sites shared keys, fewer than the threshold " +
                  std::to_string(params_.threshold));
  }
  // The self mask and every pairwise mask, added in one pass over the input.
  std::vector<Seed> seeds = {self_seed_};
  std::vector<int> signs = {+1};
  const auto wipe_seeds = [&seeds] {
    for (Seed& s : seeds) sodium_memzero(s.data(), s.size());
  };
  for (const std::string& peer : u2) {
    if (peer == self_) continue;
    const SecAggAdvertisement& a = *std::find_if(u1_.begin(), u1_.end(), [&](const auto& x) { return x.site == peer; });
    Result<Seed> seed = pairwise_seed(mask_secret_.span(), a.mask_public, params_.session, self_, peer);
    if (!seed.is_ok()) {
      wipe_seeds();
      return refuse("no pairwise mask with " + peer + ": " + seed.status().message());
    }
    seeds.push_back(*seed);
    signs.push_back(mask_sign(self_, peer));
    sodium_memzero(seed->data(), seed->size());
  }
  std::vector<uint32_t> masked = std::move(input);
  apply_masks(masked, seeds, signs);
  wipe_seeds();
  // The masked input is out: the keys that made it are needed no more; the
  // shares held for peers are, until unmasking.
  sodium_memzero(cipher_secret_.data(), cipher_secret_.size());
  sodium_memzero(mask_secret_.data(), mask_secret_.size());
  sodium_memzero(self_seed_.data(), self_seed_.size());
  has_keys_ = false;
  held_ = std::move(held);
  u2_ = std::move(u2);
  phase_ = SecAggPhase::kConsistency;
  return masked;
}

Result<Signature> SecAggClient::consistency(std::span<const std::string> alive) {
  FEDMESH_RETURN_IF_ERROR(expect(SecAggPhase::kConsistency));
  if (!sorted_unique(alive)) {
    std::vector<std::string> copy(alive.begin(), alive.end());
    std::sort(copy.begin(), copy.end());
    const auto dup = std::adjacent_find(copy.begin(), copy.end());
    if (dup != copy.end()) return abort("the list of survivors names " + *dup + " twice");
    return abort("the list of survivors is not in order");
  }
  if (std::string p = first_problem_in_list(alive, u2_, "the list of survivors", "the sites that shared keys");
      !p.empty()) {
    return abort(p);
  }
  if (!contains(alive, self_)) return abort("the list of survivors leaves this site out");
  if (alive.size() < params_.threshold) {
    return abort("only " + std::to_string(alive.size()) + " survivors, fewer than the threshold " +
                 std::to_string(params_.threshold));
  }
  u3_.assign(alive.begin(), alive.end());
  phase_ = SecAggPhase::kUnmask;
  return sign_detached(secagg_consistency_bytes(params_, u3_), keys_->sign_secret);
}

Result<std::vector<SecAggReveal>> SecAggClient::unmask(const SecAggUnmaskRequest& request) {
  FEDMESH_RETURN_IF_ERROR(expect(SecAggPhase::kUnmask));
  if (request.alive != u3_) return abort("the survivors to unmask differ from the list this site signed");
  std::set<std::string> dropped;
  for (const std::string& d : request.dropped) {
    if (d == self_) return abort("this site is listed as dropped");
    if (!dropped.insert(d).second) return abort("the dropped list names " + d + " twice");
    if (contains(u3_, d)) return abort(d + " is listed both alive and dropped");
    if (!contains(u2_, d)) return abort("the dropped list names " + d + ", not one of the sites that shared keys");
  }
  for (const std::string& peer : u2_) {
    if (!contains(u3_, peer) && dropped.count(peer) == 0) return abort(peer + " is neither alive nor dropped");
  }
  std::set<std::string> signers;
  for (const SecAggSignature& s : request.signatures) {
    if (!signers.insert(s.site).second) return abort("two consistency signatures from " + s.site);
    if (!contains(u3_, s.site)) return abort("a consistency signature from " + s.site + ", not a survivor");
    const SignPublicKey* key = site_key(*roster_, s.site);
    if (key == nullptr || !verify_detached(secagg_consistency_bytes(params_, u3_), s.signature, *key)) {
      return abort("the consistency signature of " + s.site + " does not verify: the survivors were not shown the same list");
    }
  }
  if (signers.size() < params_.threshold) {
    return abort("only " + std::to_string(signers.size()) + " sites confirmed the survivors, fewer than the threshold " +
                 std::to_string(params_.threshold));
  }
  std::vector<SecAggReveal> reveals;
  for (const std::string& peer : u2_) {
    const auto& shares = held_.at(peer);
    SecAggReveal r;
    r.owner = peer;
    r.mask_key = dropped.count(peer) != 0;
    r.share = r.mask_key ? shares.second : shares.first;
    reveals.push_back(r);
  }
  // Revealed once: a second request finds nothing to reveal.
  finish();
  return reveals;
}

// ---- server

Result<SecAggServer> SecAggServer::create(SecAggParams params, const Roster& roster, std::vector<std::string> invited) {
  std::sort(invited.begin(), invited.end());
  if (std::adjacent_find(invited.begin(), invited.end()) != invited.end()) {
    return invalid_argument("secure aggregation: a site invited twice");
  }
  if (invited.size() < 2 || invited.size() > kMaxSecAggSites) {
    return invalid_argument("secure aggregation needs 2.." + std::to_string(kMaxSecAggSites) + " sites, not " +
                            std::to_string(invited.size()));
  }
  for (const std::string& s : invited) {
    if (site_key(roster, s) == nullptr) return invalid_argument("secure aggregation: " + s + " is not a site of the roster");
  }
  if (params.threshold < secagg_min_threshold(invited.size()) || params.threshold > invited.size()) {
    return invalid_argument("secure aggregation: threshold " + std::to_string(params.threshold) + " for " +
                            std::to_string(invited.size()) + " sites (sites require at least " +
                            std::to_string(secagg_min_threshold(invited.size())) + ")");
  }
  if (params.length == 0 || params.length >= kMaxSecAggWords) return invalid_argument("secure aggregation: bad length");
  SecAggServer s;
  s.params_ = std::move(params);
  s.roster_ = &roster;
  s.u0_ = std::move(invited);
  return s;
}

void SecAggServer::abort(std::string reason) {
  phase_ = SecAggPhase::kAborted;
  abort_reason_ = std::move(reason);
  partial_.clear();
  sum_.clear();
  sum_.shrink_to_fit();
}

namespace {
Status out_of_phase(const char* what, SecAggPhase phase) {
  return invalid_argument(std::string(what) + " in phase " + secagg_phase_name(phase));
}
}  // namespace

Status SecAggServer::advertise(const std::string& site, SecAggAdvertisement a) {
  if (phase_ != SecAggPhase::kAdvertise) return out_of_phase("keys advertised", phase_);
  if (!contains(u0_, site)) return invalid_argument(site + " was not invited to session " + params_.session);
  if (a.site != site) return invalid_argument(site + " advertised keys in the name of " + a.site);
  if (advertised_.count(site) != 0) return invalid_argument(site + " advertised keys twice");
  const SignPublicKey* key = site_key(*roster_, site);
  if (key == nullptr) return invalid_argument(site + " is no longer a site of the roster");
  if (!verify_detached(secagg_advertisement_bytes(params_, site, a.cipher_public, a.mask_public), a.signature, *key)) {
    return invalid_argument("the keys of " + site + " are not signed by its roster identity");
  }
  advertised_.emplace(site, std::move(a));
  return Status::ok();
}

Status SecAggServer::share_keys(const std::string& site, std::vector<SecAggShareCipher> shares) {
  if (phase_ != SecAggPhase::kShareKeys) return out_of_phase("shares", phase_);
  if (advertised_.count(site) == 0) return invalid_argument(site + " sent shares without advertising keys");
  if (shares_.count(site) != 0) return invalid_argument(site + " sent shares twice");
  if (shares.size() != u1_.size()) {
    return invalid_argument(site + " sent " + std::to_string(shares.size()) + " shares for " +
                            std::to_string(u1_.size()) + " sites");
  }
  std::sort(shares.begin(), shares.end(), [](const auto& a, const auto& b) { return a.to < b.to; });
  for (size_t i = 0; i < shares.size(); ++i) {
    if (shares[i].from != site) return invalid_argument(site + " sent a share in the name of " + shares[i].from);
    if (shares[i].to != u1_[i].site) return invalid_argument(site + "'s shares are not one for each site with keys");
    if (shares[i].ciphertext.size() < kNonce + crypto_box_MACBYTES || shares[i].ciphertext.size() > kMaxCipherBytes) {
      return invalid_argument(site + " sent a share of " + std::to_string(shares[i].ciphertext.size()) + " bytes");
    }
  }
  shares_.emplace(site, std::move(shares));
  return Status::ok();
}

Status SecAggServer::masked_input(const std::string& site, uint64_t offset, std::span<const uint32_t> words) {
  if (phase_ != SecAggPhase::kMaskedInput) return out_of_phase("masked input", phase_);
  if (!contains(u2_, site)) return invalid_argument(site + " sent a masked input without having shared keys");
  if (std::find(masked_done_.begin(), masked_done_.end(), site) != masked_done_.end()) {
    return invalid_argument(site + " sent its masked input twice");
  }
  uint64_t& have = received_words_[site];
  if (offset != have) {
    return invalid_argument(site + "'s masked input resumes at word " + std::to_string(offset) + ", expected " +
                            std::to_string(have));
  }
  if (words.size() > params_.length - have) return invalid_argument(site + "'s masked input is longer than the model");
  if (offset == 0 && words.size() == params_.length) {
    // The whole input in one piece: straight into the sum.
    uint32_t* __restrict sum = sum_.data();
    for (size_t i = 0; i < words.size(); ++i) sum[i] += words[i];
    have = params_.length;
    masked_done_.push_back(site);
    return Status::ok();
  }
  // In pieces: held apart until complete, so that an input cut off by the
  // deadline never reaches the sum.
  std::vector<uint32_t>& buffer = partial_[site];
  if (buffer.empty()) buffer.reserve(params_.length);
  buffer.insert(buffer.end(), words.begin(), words.end());
  have += words.size();
  if (have == params_.length) {
    uint32_t* __restrict sum = sum_.data();
    const uint32_t* __restrict in = buffer.data();
    for (size_t i = 0; i < sum_.size(); ++i) sum[i] += in[i];
    partial_.erase(site);
    masked_done_.push_back(site);
  }
  return Status::ok();
}

uint64_t SecAggServer::masked_words_received(const std::string& site) const {
  const auto it = received_words_.find(site);
  return it == received_words_.end() ? 0 : it->second;
}

Status SecAggServer::consistency(const std::string& site, const Signature& signature) {
  if (phase_ != SecAggPhase::kConsistency) return out_of_phase("a consistency signature", phase_);
  if (!contains(u3_, site)) return invalid_argument(site + " is not a survivor");
  if (signatures_.count(site) != 0) return invalid_argument(site + " signed the survivors twice");
  const SignPublicKey* key = site_key(*roster_, site);
  if (key == nullptr) return invalid_argument(site + " is no longer a site of the roster");
  if (!verify_detached(secagg_consistency_bytes(params_, u3_), signature, *key)) {
    return invalid_argument("the consistency signature of " + site + " does not verify");
  }
  signatures_.emplace(site, signature);
  return Status::ok();
}

Status SecAggServer::unmask(const std::string& site, std::vector<SecAggReveal> reveals) {
  if (phase_ != SecAggPhase::kUnmask) return out_of_phase("unmasking shares", phase_);
  if (!contains(u4_, site)) return invalid_argument(site + " did not confirm the survivors");
  if (reveals_.count(site) != 0) return invalid_argument(site + " sent unmasking shares twice");
  if (reveals.size() != u2_.size()) {
    return invalid_argument(site + " revealed " + std::to_string(reveals.size()) + " shares for " +
                            std::to_string(u2_.size()) + " sites");
  }
  const auto point = static_cast<uint8_t>(
      std::find_if(u1_.begin(), u1_.end(), [&](const auto& a) { return a.site == site; }) - u1_.begin() + 1);
  std::sort(reveals.begin(), reveals.end(), [](const auto& a, const auto& b) { return a.owner < b.owner; });
  for (size_t i = 0; i < reveals.size(); ++i) {
    const SecAggReveal& r = reveals[i];
    if (r.owner != u2_[i]) return invalid_argument(site + "'s shares are not one for each site that shared keys");
    if (r.mask_key == contains(u3_, r.owner)) {
      return invalid_argument(site + " revealed the wrong kind of share for " + r.owner);
    }
    if (r.share.x != point) return invalid_argument(site + " revealed a share at another site's point");
  }
  reveals_.emplace(site, std::move(reveals));
  return Status::ok();
}

bool SecAggServer::phase_complete() const {
  switch (phase_) {
    case SecAggPhase::kAdvertise: return advertised_.size() == u0_.size();
    case SecAggPhase::kShareKeys: return shares_.size() == u1_.size();
    case SecAggPhase::kMaskedInput: return masked_done_.size() == u2_.size();
    case SecAggPhase::kConsistency: return signatures_.size() == u3_.size();
    case SecAggPhase::kUnmask: return reveals_.size() == u4_.size();
    default: return true;
  }
}

bool SecAggServer::member(const std::string& site) const {
  switch (phase_) {
    case SecAggPhase::kAdvertise: return contains(u0_, site);
    case SecAggPhase::kShareKeys: return advertised_.count(site) != 0;
    case SecAggPhase::kMaskedInput: return contains(u2_, site);
    case SecAggPhase::kConsistency: return contains(u3_, site);
    case SecAggPhase::kUnmask: return contains(u4_, site);
    case SecAggPhase::kDone: return contains(u3_, site);
    default: return false;
  }
}

bool SecAggServer::answered(const std::string& site) const {
  switch (phase_) {
    case SecAggPhase::kAdvertise: return advertised_.count(site) != 0;
    case SecAggPhase::kShareKeys: return shares_.count(site) != 0;
    case SecAggPhase::kMaskedInput:
      return std::find(masked_done_.begin(), masked_done_.end(), site) != masked_done_.end();
    case SecAggPhase::kConsistency: return signatures_.count(site) != 0;
    case SecAggPhase::kUnmask: return reveals_.count(site) != 0;
    default: return true;
  }
}

void SecAggServer::advance() {
  const auto enough = [this](size_t count, const char* what) {
    if (count >= params_.threshold) return true;
    abort("only " + std::to_string(count) + " sites " + what + ", fewer than the threshold " +
          std::to_string(params_.threshold));
    return false;
  };
  switch (phase_) {
    case SecAggPhase::kAdvertise:
      if (!enough(advertised_.size(), "advertised keys")) return;
      for (const auto& [name, a] : advertised_) u1_.push_back(a);  // map order: sorted
      phase_ = SecAggPhase::kShareKeys;
      return;
    case SecAggPhase::kShareKeys:
      if (!enough(shares_.size(), "shared keys")) return;
      for (const auto& [name, s] : shares_) u2_.push_back(name);
      sum_.assign(params_.length, 0);
      phase_ = SecAggPhase::kMaskedInput;
      return;
    case SecAggPhase::kMaskedInput:
      if (!enough(masked_done_.size(), "sent masked inputs")) return;
      u3_ = masked_done_;
      std::sort(u3_.begin(), u3_.end());
      partial_.clear();  // inputs cut off by the deadline are not part of the sum
      phase_ = SecAggPhase::kConsistency;
      return;
    case SecAggPhase::kConsistency:
      if (!enough(signatures_.size(), "confirmed the survivors")) return;
      for (const auto& [name, s] : signatures_) u4_.push_back(name);
      phase_ = SecAggPhase::kUnmask;
      return;
    case SecAggPhase::kUnmask:
      if (!enough(reveals_.size(), "revealed their shares")) return;
      if (Status s = finish_unmasking(); !s.is_ok()) {
        abort(s.message());
        return;
      }
      phase_ = SecAggPhase::kDone;
      return;
    default:
      return;
  }
}

std::vector<SecAggShareCipher> SecAggServer::shares_for(const std::string& site) const {
  std::vector<SecAggShareCipher> out;
  for (const std::string& sender : u2_) {
    for (const SecAggShareCipher& c : shares_.at(sender)) {
      if (c.to == site) out.push_back(c);
    }
  }
  return out;
}

std::vector<std::string> SecAggServer::dropped() const {
  std::vector<std::string> out;
  std::set_difference(u2_.begin(), u2_.end(), u3_.begin(), u3_.end(), std::back_inserter(out));
  return out;
}

SecAggUnmaskRequest SecAggServer::unmask_request() const {
  SecAggUnmaskRequest r;
  r.alive = u3_;
  r.dropped = dropped();
  for (const auto& [name, signature] : signatures_) r.signatures.push_back({name, signature});
  return r;
}

Status SecAggServer::finish_unmasking() {
  // t shares of each secret, from the first t sites that revealed.
  const auto reconstruct = [this](const std::string& owner) -> Result<Seed> {
    std::vector<ShamirShare> shares;
    for (const auto& [site, reveals] : reveals_) {
      for (const SecAggReveal& r : reveals) {
        if (r.owner == owner) shares.push_back(r.share);
      }
      if (shares.size() == params_.threshold) break;
    }
    Result<Seed> secret = shamir_combine(shares);
    for (ShamirShare& s : shares) sodium_memzero(s.y.data(), s.y.size());
    return secret;
  };
  // Every self mask of U3 and every mask a survivor holds with a dropped
  // site, taken out in one pass over the sum.
  std::vector<Seed> seeds;
  std::vector<int> signs;
  const auto wipe_seeds = [&seeds] {
    for (Seed& s : seeds) sodium_memzero(s.data(), s.size());
  };
  for (const std::string& u : u3_) {
    Result<Seed> b = reconstruct(u);
    if (!b.is_ok()) {
      wipe_seeds();
      return b.status();
    }
    seeds.push_back(*b);
    signs.push_back(-1);
    sodium_memzero(b->data(), b->size());
  }
  for (const std::string& v : dropped()) {
    Result<Seed> key = reconstruct(v);
    if (!key.is_ok()) {
      wipe_seeds();
      return key.status();
    }
    X25519Public derived{};
    crypto_scalarmult_base(derived.data(), key->data());
    if (derived != advertised_.at(v).mask_public) {
      sodium_memzero(key->data(), key->size());
      wipe_seeds();
      return invalid_argument("the shares revealed for " + v + " do not rebuild the key it advertised");
    }
    for (const std::string& u : u3_) {
      Result<Seed> seed = pairwise_seed(*key, advertised_.at(u).mask_public, params_.session, v, u);
      if (!seed.is_ok()) {
        sodium_memzero(key->data(), key->size());
        wipe_seeds();
        return seed.status();
      }
      // u added mask_sign(u, v) PRG(s_uv): take it back out.
      seeds.push_back(*seed);
      signs.push_back(-mask_sign(u, v));
      sodium_memzero(seed->data(), seed->size());
    }
    sodium_memzero(key->data(), key->size());
  }
  apply_masks(sum_, seeds, signs);
  wipe_seeds();
  return Status::ok();
}

}  // namespace fedmesh::crypto
