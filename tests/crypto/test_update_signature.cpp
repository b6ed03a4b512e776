#include "crypto/update_signature.h"

#include <gtest/gtest.h>

#include <cmath>
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
