#include "crypto/update_signature.h"

#include "crypto/tree_hash.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <functional>
#include <string>
#include <vector>

namespace fedmesh::crypto {
namespace {

std::span<const uint8_t> bytes_of(const std::string& text) {
  return {reinterpret_cast<const uint8_t*>(text.data()), text.size()};
}

class UpdateSignatureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<SiteKeys> keys = generate_site_keys("site-a");
    ASSERT_TRUE(keys.is_ok());
    sender_ = std::move(keys).value();
    fields_.federation = "fed-demo";
    fields_.round = 7;
    fields_.base_version = 6;
    fields_.sender = "site-a";
    fields_.recipient = "agg";
    fields_.sequence = 42;
    fields_.sample_count = 6000;
    fields_.descriptor_hash = hash_bytes(bytes_of("descriptors"));
    for (const char* chunk : {"chunk 0", "chunk 1", "chunk 2"}) fields_.chunk_hashes.push_back(hash_bytes(bytes_of(chunk)));
  }

  SiteKeys sender_;
  UpdateSigningFields fields_;
};

TEST(Hash, KnownValueAndIncrementalEqualsOneShot) {
  // BLAKE2b-256 of the empty string (RFC 7693 parameters, 32-byte digest).
  EXPECT_EQ(to_hex(hash_bytes({})), "0e5751c026e543b2e8ab2eb06099daa1d1e5df47778f7787faab45cdf12fe3a8");
  std::vector<uint8_t> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  const Hash one_shot = hash_bytes(data);
  for (const size_t piece : {size_t{1}, size_t{63}, size_t{128}, size_t{4096}, data.size()}) {
    Hasher hasher;
    for (size_t at = 0; at < data.size(); at += piece) {
      hasher.update(std::span<const uint8_t>(data).subspan(at, std::min(piece, data.size() - at)));
    }
    EXPECT_EQ(hasher.finish(), one_shot) << piece;
  }
  Hasher hasher;
  hasher.update(data);
  EXPECT_EQ(hasher.finish(), one_shot);
  hasher.update(data);  // starts over after finish
  EXPECT_EQ(hasher.finish(), one_shot);
  data[500] ^= 1;
  EXPECT_NE(hash_bytes(data), one_shot);
}

// The incremental tree hash is the one-shot's, however its input is cut:
// every length up to a few stripes past the finish's window, cut at every
// kind of place (bytes, blocks, stripes, the tail), and 1 MiB rows as the
// checkpoint store reads them.
TEST(TreeHash, PiecesOfAnySizeHashAsTheWhole) {
  std::vector<uint8_t> bytes(3 * 1024 * 1024 + 777);
  uint32_t state = 99;
  for (auto& b : bytes) b = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
  const std::span<const uint8_t> all(bytes);
  for (size_t n = 0; n <= 4096; n += (n < 1100 ? 1 : 61)) {
    const auto whole = tree_hash(all.first(n));
    for (const size_t piece : {size_t{1}, size_t{127}, size_t{128}, size_t{385}, size_t{512}, size_t{513}, size_t{1000}}) {
      TreeHasher hasher;
      for (size_t at = 0; at < n; at += piece) hasher.update(all.subspan(at, std::min(piece, n - at)));
      ASSERT_EQ(hasher.finish(), whole) << n << " bytes in pieces of " << piece;
    }
    TreeHasher empty_pieces;
    empty_pieces.update({});
    empty_pieces.update(all.first(n));
    empty_pieces.update({});
    ASSERT_EQ(empty_pieces.finish(), whole) << n;
  }
  for (const size_t piece : {size_t{1} << 20, size_t{3} << 19, size_t{4099}}) {
    TreeHasher hasher;
    for (size_t at = 0; at < bytes.size(); at += piece) hasher.update(all.subspan(at, std::min(piece, bytes.size() - at)));
    EXPECT_EQ(hasher.finish(), tree_hash(all)) << "pieces of " << piece;
  }
}

// BLAKE2bp-256 (crypto/tree_hash.h) of bytes (7 i + 3) mod 256, as Python's
// hashlib.blake2b computes the tree from its parameters: four leaves (digest
// 64, fanout 4, depth 2, inner 64, node offset i, leaf 3 last node) over the
// 128-byte blocks in turn, a root (digest 32, node depth 1, last node) over
// their digests. Lengths around the block, the stripe of four blocks and
// the point where the vector lanes (whole stripes before each leaf's last
// block) hand over to the portable finish.
TEST(TreeHash, MatchesPythonsHashlibTree) {
  const std::pair<size_t, const char*> expected[] = {
      {0, "7fb3222c1bce0810eb69450cc6ddfc6f5822c2e5b2fe0927e27f0e292e4e45a1"},
      {1, "dfa89eab1b2ece42d1f77884cd56bf0fd479d2529b85916e87050f61fae0fdc7"},
      {127, "14ad65b60bb9e82152c39f778eb7e92964e2f3cc961a28509e0f8f30caa00292"},
      {128, "b6cb637f96bd081e0ef47b10ae97f7383300155c7206d7d8c8c86b1db38dc2ae"},
      {129, "47ce32ee1b035383ad69008fbd9ff808fca1efb13be69dddac951bd105bb312c"},
      {511, "5beb54340a3d52a83f15f01f4299cb58fee5ec26989bb0f96d54c591436213ac"},
      {512, "5e350aa77d39b02330a3b95416ac623f21714fba6b4190c8f54d43fd834105ef"},
      {513, "192d08d6d1820b593664083bf114ce91f757276f4582f537c8ce732ca498c27e"},
      {1023, "12a9cbd390b6b5a19cad813099fcbe17985a29df253577b8935beb34c8fa2d6a"},
      {1024, "94142c12c49415854850dde79b6487a5a68033b787230f474afb34731a8545c8"},
      {1025, "5ba6c1abe4867185f516a06f056d63a7568a777bed49d524d361e5831c71decc"},
      {3583, "d6801119ebdd48daf71ee972850c093fcd9c38296cdb0159c4104eac9da53e0f"},
      {3584, "68743c4521d7e27177dc2a72fa26e87c8683b4d086dc13636c9b79f962f43297"},
      {4113, "6f111a0df4c42a178d5139cd6940837fb2d5a9de92fd1878f90dc7786884a508"},
      {65536, "c95ce8b43ee7517777a124ecfe8ec77d6e4c2c15aec7d6ca54815f9ee332ae47"},
      {1000003, "6c4278e921b3e77dcddec0e89d8064b71e59bfdfcb60208f1da15a5ed9367e24"},
  };
  for (const auto& [n, hex] : expected) {
    std::vector<uint8_t> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
    EXPECT_EQ(to_hex(tree_hash(data)), hex) << n << " bytes (AVX2 lanes: " << tree_hash_uses_avx2() << ")";
  }
  std::vector<uint8_t> data(100000, 5);
  const Hash before = tree_hash(data);
  for (const size_t at : {size_t{0}, size_t{127}, size_t{640}, size_t{99999}}) {
    data[at] ^= 1;
    EXPECT_NE(tree_hash(data), before) << at;
    data[at] ^= 1;
  }
  EXPECT_EQ(hash_chunk(ChunkHash::kBlake2bp, data), before);
  EXPECT_EQ(hash_chunk(ChunkHash::kBlake2b, data), hash_bytes(data));
}

// The chunk hash kind is signed: a BLAKE2b update's bytes are as before it
// existed (nothing appended), a BLAKE2bp update's differ, and a signature
// made under one kind does not verify under the other.
TEST_F(UpdateSignatureTest, TheChunkHashKindIsSigned) {
  UpdateSigningFields tree = fields_;
  tree.chunk_hash = ChunkHash::kBlake2bp;
  const std::vector<uint8_t> plain = canonical_bytes(fields_), with_kind = canonical_bytes(tree);
  ASSERT_EQ(with_kind.size(), plain.size() + 8);
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), with_kind.begin()));
  EXPECT_EQ(with_kind[plain.size()], 1);
  EXPECT_FALSE(verify_update(tree, sign_update(fields_, sender_), sender_.identity.sign_public));
  EXPECT_FALSE(verify_update(fields_, sign_update(tree, sender_), sender_.identity.sign_public));
  EXPECT_TRUE(verify_update(tree, sign_update(tree, sender_), sender_.identity.sign_public));
}

TEST_F(UpdateSignatureTest, Verifies) {
  const Signature signature = sign_update(fields_, sender_);
  EXPECT_TRUE(verify_update(fields_, signature, sender_.identity.sign_public));
  Result<SiteKeys> other = generate_site_keys("site-b");
  ASSERT_TRUE(other.is_ok());
  EXPECT_FALSE(verify_update(fields_, signature, other->identity.sign_public));
  Signature flipped = signature;
  flipped[5] ^= 0x80;
  EXPECT_FALSE(verify_update(fields_, flipped, sender_.identity.sign_public));
}

TEST_F(UpdateSignatureTest, ChangingAnyFieldBreaksTheSignature) {
  const Signature signature = sign_update(fields_, sender_);
  const std::vector<std::pair<const char*, std::function<void(UpdateSigningFields&)>>> changes = {
      {"federation", [](UpdateSigningFields& f) { f.federation = "fed-other"; }},
      {"round", [](UpdateSigningFields& f) { f.round += 1; }},
      {"base_version", [](UpdateSigningFields& f) { f.base_version -= 1; }},
      {"sender", [](UpdateSigningFields& f) { f.sender = "site-b"; }},
      {"recipient", [](UpdateSigningFields& f) { f.recipient = "site-c"; }},
      {"sequence", [](UpdateSigningFields& f) { f.sequence += 1; }},
      {"sample_count", [](UpdateSigningFields& f) { f.sample_count = 60000; }},
      {"descriptor_hash", [](UpdateSigningFields& f) { f.descriptor_hash[31] ^= 1; }},
      {"one chunk hash", [](UpdateSigningFields& f) { f.chunk_hashes[1][0] ^= 1; }},
      {"chunk order", [](UpdateSigningFields& f) { std::swap(f.chunk_hashes[0], f.chunk_hashes[2]); }},
      {"chunk dropped", [](UpdateSigningFields& f) { f.chunk_hashes.pop_back(); }},
      {"chunk added", [](UpdateSigningFields& f) { f.chunk_hashes.push_back(f.chunk_hashes[0]); }},
      {"sender/recipient boundary", [](UpdateSigningFields& f) {
         f.sender = "site-aa";
         f.recipient = "gg";
       }},
      {"peer fields added", [](UpdateSigningFields& f) { f.peer = PeerUpdateFields{PeerUpdateKind::kShare, 0.5, 0, 0}; }},
  };
  for (const auto& [what, change] : changes) {
    UpdateSigningFields changed = fields_;
    change(changed);
    EXPECT_NE(canonical_bytes(changed), canonical_bytes(fields_)) << what;
    EXPECT_FALSE(verify_update(changed, signature, sender_.identity.sign_public)) << what;
  }
}

TEST_F(UpdateSignatureTest, CanonicalBytesAreDomainSeparatedAndStable) {
  const std::vector<uint8_t> bytes = canonical_bytes(fields_);
  const std::string domain = "fedmesh-update-v1";
  ASSERT_GT(bytes.size(), 4 + domain.size());
  EXPECT_EQ(bytes[0], domain.size());
  EXPECT_EQ(std::string(bytes.begin() + 4, bytes.begin() + 4 + domain.size()), domain);
  EXPECT_EQ(canonical_bytes(fields_), bytes);
  // Size does not grow with the number of chunks (they enter by one hash).
  UpdateSigningFields many = fields_;
  many.chunk_hashes.resize(1000, fields_.chunk_hashes[0]);
  EXPECT_EQ(canonical_bytes(many).size(), bytes.size());
  // No chunks is a valid, signable update too.
  UpdateSigningFields none = fields_;
  none.chunk_hashes.clear();
  EXPECT_TRUE(verify_update(none, sign_update(none, sender_), sender_.identity.sign_public));
}

// A gossip update's peer fields are signed under their own domain: each of
// them changes the signature, and a signature made without them does not
// verify with them (nor the other way round).
TEST_F(UpdateSignatureTest, PeerFieldsAreSignedUnderTheirOwnDomain) {
  UpdateSigningFields share = fields_;
  share.peer = PeerUpdateFields{PeerUpdateKind::kShare, std::ldexp(0.75, -700), 0, 0};
  const std::vector<uint8_t> bytes = canonical_bytes(share);
  const std::string domain = "fedmesh-update-peer-v1";
  EXPECT_EQ(bytes[0], domain.size());
  EXPECT_EQ(std::string(bytes.begin() + 4, bytes.begin() + 4 + domain.size()), domain);
  const Signature signature = sign_update(share, sender_);
  EXPECT_TRUE(verify_update(share, signature, sender_.identity.sign_public));
  EXPECT_FALSE(verify_update(fields_, signature, sender_.identity.sign_public)) << "peer fields dropped";
  EXPECT_FALSE(verify_update(share, sign_update(fields_, sender_), sender_.identity.sign_public)) << "peer fields added";

  const std::vector<std::pair<const char*, std::function<void(PeerUpdateFields&)>>> changes = {
      {"kind", [](PeerUpdateFields& p) { p.kind = PeerUpdateKind::kCatchUpSlice; }},
      {"weight", [](PeerUpdateFields& p) { p.weight = std::nextafter(p.weight, 1.0); }},
      {"slice", [](PeerUpdateFields& p) { p.slice = 1; }},
      {"slices", [](PeerUpdateFields& p) { p.slices = 2; }},
  };
  for (const auto& [what, change] : changes) {
    UpdateSigningFields changed = share;
    change(*changed.peer);
    EXPECT_FALSE(verify_update(changed, signature, sender_.identity.sign_public)) << what;
  }
}

}  // namespace
}  // namespace fedmesh::crypto
