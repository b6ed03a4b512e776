// The secure-aggregation protocol (crypto/secure_aggregation.h) between six
// SecAggClients and a SecAggServer, moved by hand (an in-memory channel):
// - with 0, 1 or 2 sites dropping at each of the five phases (t = 4 of 6),
//   the server's result is the plain sum mod 2^32 of exactly the inputs of
//   the sites that delivered a masked input, bit for bit;
// - with 3 dropping, the session aborts, naming the threshold;
// - a malicious server (the test, tampering with what the honest server
//   would send) tries every inconsistency a client must refuse: a key list with an
//   unsigned key, an unknown or duplicate name, without the site, below t;
//   a stale session; survivors that differ from what the site signed, the
//   site listed as dropped, a site both alive and dropped, forged or too few
//   consistency signatures, a second unmasking request that would reveal the
//   other kind of share. Each time the site aborts, holds no secret
//   afterwards, and returns nothing to send;
// - the server refuses messages out of phase, twice, at a wrong offset, at
//   another site's Shamir point, and detects shares that do not rebuild a
//   dropped site's advertised key.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "base/random.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "crypto/secure_aggregation.h"

namespace fedmesh::crypto {
namespace {

using P = SecAggPhase;
constexpr int kSites = 6;
constexpr uint32_t kThreshold = 4;
constexpr uint64_t kLength = 1000;

class SecAgg : public ::testing::Test {
 protected:
  void SetUp() override {
    roster_.federation = "f";
    for (int i = 0; i < kSites; ++i) {
      names_.push_back("site-" + std::string(1, static_cast<char>('a' + i)));
      keys_.push_back(generate_site_keys(names_.back()).value());
      roster_.sites.push_back({keys_.back().identity, Role::kSite, ""});
    }
    Rng rng(7);
    for (int i = 0; i < kSites; ++i) {
      std::vector<uint32_t> input(kLength);
      for (uint32_t& w : input) w = static_cast<uint32_t>(rng.next_u64());
      inputs_.push_back(std::move(input));
    }
  }

  SecAggParams params(std::string session = "round-3-0123456789abcdef") const {
    return {"f", 3, std::move(session), kThreshold, kLength};
  }

  std::vector<SecAggClient> clients(const SecAggParams& p) const {
    std::vector<SecAggClient> out;
    for (int i = 0; i < kSites; ++i) out.push_back(SecAggClient::start(p, keys_[i], roster_, kSites).value());
    return out;
  }

  // One session in which sites stop answering from the phase given in `drop`
  // on; returns the server at the end.
  SecAggServer run(const std::map<std::string, P>& drop, std::vector<SecAggClient>* keep = nullptr) {
    const SecAggParams p = params();
    SecAggServer server = SecAggServer::create(p, roster_, names_).value();
    std::vector<SecAggClient> c = clients(p);
    const auto answers = [&](int i, P phase) {
      const auto it = drop.find(names_[i]);
      return (it == drop.end() || phase < it->second) && server.member(names_[i]);
    };
    for (int i = 0; i < kSites; ++i) {
      if (answers(i, P::kAdvertise)) {
        EXPECT_TRUE(server.advertise(names_[i], c[i].advertise().value()).is_ok());
      }
    }
    server.advance();
    for (int i = 0; i < kSites && server.phase() == P::kShareKeys; ++i) {
      if (answers(i, P::kShareKeys)) {
        EXPECT_TRUE(server.share_keys(names_[i], c[i].share_keys(server.advertisements()).value()).is_ok());
      }
    }
    server.advance();
    for (int i = 0; i < kSites && server.phase() == P::kMaskedInput; ++i) {
      if (!answers(i, P::kMaskedInput)) continue;
      const std::vector<uint32_t> y = c[i].masked_input(server.shares_for(names_[i]), inputs_[i]).value();
      for (uint64_t at = 0; at < kLength; at += 300) {  // in pieces, as over the wire
        const size_t n = std::min<uint64_t>(300, kLength - at);
        EXPECT_TRUE(server.masked_input(names_[i], at, std::span(y).subspan(at, n)).is_ok());
      }
    }
    server.advance();
    for (int i = 0; i < kSites && server.phase() == P::kConsistency; ++i) {
      if (answers(i, P::kConsistency)) {
        EXPECT_TRUE(server.consistency(names_[i], c[i].consistency(server.alive()).value()).is_ok());
      }
    }
    server.advance();
    for (int i = 0; i < kSites && server.phase() == P::kUnmask; ++i) {
      if (answers(i, P::kUnmask)) {
        EXPECT_TRUE(server.unmask(names_[i], c[i].unmask(server.unmask_request()).value()).is_ok());
      }
    }
    server.advance();
    if (keep != nullptr) *keep = std::move(c);
    return server;
  }

  std::vector<uint32_t> plain_sum(const std::vector<std::string>& sites) const {
    std::vector<uint32_t> sum(kLength, 0);
    for (const std::string& s : sites) {
      const size_t i = static_cast<size_t>(std::find(names_.begin(), names_.end(), s) - names_.begin());
      for (size_t k = 0; k < kLength; ++k) sum[k] += inputs_[i][k];
    }
    return sum;
  }

  // Brings the six clients to `phase` with the honest server; returns it.
  SecAggServer honest_until(P phase, std::vector<SecAggClient>& c, const SecAggParams& p) {
    SecAggServer server = SecAggServer::create(p, roster_, names_).value();
    c = clients(p);
    if (phase == P::kAdvertise) return server;
    for (int i = 0; i < kSites; ++i) EXPECT_TRUE(server.advertise(names_[i], c[i].advertise().value()).is_ok());
    server.advance();
    if (phase == P::kShareKeys) return server;
    for (int i = 0; i < kSites; ++i) {
      EXPECT_TRUE(server.share_keys(names_[i], c[i].share_keys(server.advertisements()).value()).is_ok());
    }
    server.advance();
    if (phase == P::kMaskedInput) return server;
    for (int i = 0; i < kSites; ++i) {
      EXPECT_TRUE(server.masked_input(names_[i], 0, c[i].masked_input(server.shares_for(names_[i]), inputs_[i]).value()).is_ok());
    }
    server.advance();
    if (phase == P::kConsistency) return server;
    for (int i = 0; i < kSites; ++i) {
      EXPECT_TRUE(server.consistency(names_[i], c[i].consistency(server.alive()).value()).is_ok());
    }
    server.advance();
    return server;
  }

  static void expect_aborted(const SecAggClient& client, const Status& status, const std::string& words) {
    EXPECT_FALSE(status.is_ok());
    EXPECT_NE(status.message().find(words), std::string::npos) << status.message();
    EXPECT_EQ(client.phase(), P::kAborted);
    EXPECT_FALSE(client.holds_secrets());
  }

  Roster roster_;
  std::vector<std::string> names_;
  std::vector<SiteKeys> keys_;
  std::vector<std::vector<uint32_t>> inputs_;
};

TEST_F(SecAgg, NoDropoutGivesThePlainSum) {
  std::vector<SecAggClient> c;
  SecAggServer server = run({}, &c);
  ASSERT_EQ(server.phase(), P::kDone) << server.abort_reason();
  EXPECT_EQ(server.alive(), names_);
  EXPECT_EQ(server.sum(), plain_sum(names_));
  for (const SecAggClient& client : c) EXPECT_FALSE(client.holds_secrets());
}

TEST_F(SecAgg, OneOrTwoDropoutsAtEveryPhaseLeaveTheSurvivorsSumExact) {
  for (P phase : {P::kAdvertise, P::kShareKeys, P::kMaskedInput, P::kConsistency, P::kUnmask}) {
    for (int dropped = 1; dropped <= 2; ++dropped) {
      std::map<std::string, P> drop;
      for (int d = 0; d < dropped; ++d) drop[names_[static_cast<size_t>(1 + 2 * d)]] = phase;
      SecAggServer server = run(drop);
      ASSERT_EQ(server.phase(), P::kDone) << secagg_phase_name(phase) << " " << dropped << ": " << server.abort_reason();
      // A site that delivered its masked input is in the sum even if it
      // vanished afterwards: its self mask is rebuilt from the others' shares.
      std::vector<std::string> contributed;
      for (const std::string& n : names_) {
        if (drop.count(n) == 0 || phase > P::kMaskedInput) contributed.push_back(n);
      }
      EXPECT_EQ(server.alive(), contributed) << secagg_phase_name(phase);
      EXPECT_EQ(server.sum(), plain_sum(contributed)) << secagg_phase_name(phase) << " with " << dropped << " dropped";
    }
  }
}

TEST_F(SecAgg, DropoutsAtSeveralPhasesInOneSession) {
  const std::map<std::string, P> drop = {{"site-b", P::kShareKeys}, {"site-e", P::kUnmask}};
  SecAggServer server = run(drop);
  ASSERT_EQ(server.phase(), P::kDone) << server.abort_reason();
  const std::vector<std::string> contributed = {"site-a", "site-c", "site-d", "site-e", "site-f"};
  EXPECT_EQ(server.sum(), plain_sum(contributed));
}

TEST_F(SecAgg, MoreDropoutsThanTheThresholdAllowsAbortCleanly) {
  for (P phase : {P::kAdvertise, P::kShareKeys, P::kMaskedInput, P::kConsistency, P::kUnmask}) {
    const std::map<std::string, P> drop = {{"site-a", phase}, {"site-c", phase}, {"site-f", phase}};
    SecAggServer server = run(drop);
    EXPECT_EQ(server.phase(), P::kAborted) << secagg_phase_name(phase);
    EXPECT_NE(server.abort_reason().find("fewer than the threshold 4"), std::string::npos) << server.abort_reason();
    EXPECT_TRUE(server.sum().empty());
  }
}

TEST_F(SecAgg, ClientRefusesAThresholdBelowAMajority) {
  SecAggParams p = params();
  p.threshold = 3;  // of 6: not a strict majority
  EXPECT_FALSE(SecAggClient::start(p, keys_[0], roster_, kSites).is_ok());
  EXPECT_FALSE(SecAggServer::create(p, roster_, names_).is_ok());
}

TEST_F(SecAgg, SiteAbortsOnABadKeyList) {
  const SecAggParams p = params();
  std::vector<SecAggClient> c;
  SecAggServer server = honest_until(P::kShareKeys, c, p);
  const std::vector<SecAggAdvertisement> honest = server.advertisements();

  std::vector<SecAggAdvertisement> unsigned_keys = honest;
  unsigned_keys[2].signature[5] ^= 1;
  expect_aborted(c[0], c[0].share_keys(unsigned_keys).status(), "not signed");

  std::vector<SecAggAdvertisement> swapped = honest;  // site-c's keys under site-d's name
  swapped[3].cipher_public = swapped[2].cipher_public;
  expect_aborted(c[1], c[1].share_keys(swapped).status(), "not signed");

  std::vector<SecAggAdvertisement> unknown = honest;
  unknown[4].site = "mallory";
  expect_aborted(c[2], c[2].share_keys(unknown).status(), "not a site of the roster");

  std::vector<SecAggAdvertisement> duplicate = honest;
  duplicate.push_back(honest[1]);
  expect_aborted(c[3], c[3].share_keys(duplicate).status(), "twice");

  std::vector<SecAggAdvertisement> without = honest;
  without.erase(without.begin() + 4);
  expect_aborted(c[4], c[4].share_keys(without).status(), "leaves this site out");

  const std::vector<SecAggAdvertisement> few(honest.begin() + 3, honest.end());
  expect_aborted(c[5], c[5].share_keys(few).status(), "fewer than the threshold");
  // An aborted site refuses everything after.
  EXPECT_FALSE(c[5].masked_input({}, inputs_[5]).is_ok());
}

TEST_F(SecAgg, SiteAbortsOnAStaleSession) {
  // Keys advertised in an earlier session of the round, replayed in a new one.
  std::vector<SecAggClient> old_clients;
  SecAggServer old_server = honest_until(P::kShareKeys, old_clients, params("round-3-stale"));
  std::vector<SecAggClient> c;
  SecAggServer server = honest_until(P::kShareKeys, c, params());
  std::vector<SecAggAdvertisement> mixed = server.advertisements();
  mixed[1] = old_server.advertisements()[1];
  expect_aborted(c[0], c[0].share_keys(mixed).status(), "not signed");
}

TEST_F(SecAgg, SiteAbortsOnInconsistentSurvivors) {
  const SecAggParams p = params();
  std::vector<SecAggClient> c;
  SecAggServer server = honest_until(P::kConsistency, c, p);
  std::vector<std::string> fewer = {"site-a", "site-b", "site-c"};
  expect_aborted(c[0], c[0].consistency(fewer).status(), "fewer than the threshold");
  std::vector<std::string> unknown = names_;
  unknown[5] = "site-z";
  expect_aborted(c[1], c[1].consistency(unknown).status(), "not in the sites that shared keys");
  std::vector<std::string> duplicate = {"site-a", "site-b", "site-c", "site-c", "site-e"};
  expect_aborted(c[2], c[2].consistency(duplicate).status(), "twice");
  std::vector<std::string> without = {"site-a", "site-b", "site-c", "site-e", "site-f"};
  expect_aborted(c[3], c[3].consistency(without).status(), "leaves this site out");
}

TEST_F(SecAgg, SiteAbortsOnAnInconsistentUnmaskingRequest) {
  const SecAggParams p = params();
  std::vector<SecAggClient> c;
  SecAggServer server = honest_until(P::kUnmask, c, p);
  const SecAggUnmaskRequest honest = server.unmask_request();
  ASSERT_EQ(honest.alive.size(), 6u);

  SecAggUnmaskRequest other_list = honest;  // not the list the site signed
  other_list.alive.erase(other_list.alive.begin() + 1);
  other_list.dropped = {"site-b"};
  expect_aborted(c[0], c[0].unmask(other_list).status(), "differ from the list this site signed");

  SecAggUnmaskRequest self_dropped = honest;
  self_dropped.dropped = {"site-b"};
  expect_aborted(c[1], c[1].unmask(self_dropped).status(), "listed as dropped");

  SecAggUnmaskRequest both = honest;
  both.dropped = {"site-d"};
  expect_aborted(c[2], c[2].unmask(both).status(), "both alive and dropped");

  SecAggUnmaskRequest forged = honest;
  forged.signatures[4].signature[0] ^= 1;
  expect_aborted(c[3], c[3].unmask(forged).status(), "does not verify");

  SecAggUnmaskRequest few = honest;
  few.signatures.resize(3);
  expect_aborted(c[4], c[4].unmask(few).status(), "fewer than the threshold");

  // The honest request, then a second one that lists a peer as dropped: the
  // site revealed the shares of b once and reveals nothing more.
  Result<std::vector<SecAggReveal>> first = c[5].unmask(honest);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  for (const SecAggReveal& r : *first) EXPECT_FALSE(r.mask_key);
  EXPECT_FALSE(c[5].holds_secrets());
  SecAggUnmaskRequest again = honest;
  again.alive.erase(again.alive.begin());
  again.dropped = {"site-a"};
  EXPECT_FALSE(c[5].unmask(again).is_ok());
}

TEST_F(SecAgg, SignaturesOverDifferentSurvivorListsDoNotVerify) {
  // The server shows site-a one list and the others another: site-a's
  // signature over its list cannot pass as a signature over theirs.
  const SecAggParams p = params();
  std::vector<SecAggClient> c;
  SecAggServer server = honest_until(P::kConsistency, c, p);
  const std::vector<std::string> full = server.alive();
  const std::vector<std::string> partial = {"site-a", "site-b", "site-c", "site-d", "site-e"};
  const Signature a_over_partial = c[0].consistency(partial).value();
  SecAggUnmaskRequest request;
  request.alive = full;
  for (int i = 1; i < kSites; ++i) request.signatures.push_back({names_[i], c[i].consistency(full).value()});
  request.signatures.push_back({"site-a", a_over_partial});
  expect_aborted(c[1], c[1].unmask(request).status(), "does not verify");
}

TEST_F(SecAgg, ServerRefusesBadMessages) {
  const SecAggParams p = params();
  std::vector<SecAggClient> c;
  SecAggServer server = SecAggServer::create(p, roster_, {"site-a", "site-b", "site-c", "site-d", "site-e"}).value();
  c = clients(p);
  EXPECT_FALSE(server.advertise("site-f", c[5].advertise().value()).is_ok());  // not invited
  const SecAggAdvertisement a = c[0].advertise().value();
  EXPECT_FALSE(server.advertise("site-b", a).is_ok());  // in another's name
  EXPECT_TRUE(server.advertise("site-a", a).is_ok());
  EXPECT_FALSE(server.advertise("site-a", a).is_ok());  // twice
  EXPECT_FALSE(server.share_keys("site-a", {}).is_ok());  // out of phase
  for (int i = 1; i < 5; ++i) ASSERT_TRUE(server.advertise(names_[i], c[i].advertise().value()).is_ok());
  EXPECT_TRUE(server.phase_complete());
  server.advance();
  std::vector<std::vector<SecAggShareCipher>> shares;
  for (int i = 0; i < 5; ++i) shares.push_back(c[i].share_keys(server.advertisements()).value());
  std::vector<SecAggShareCipher> short_list(shares[0].begin(), shares[0].end() - 1);
  EXPECT_FALSE(server.share_keys("site-a", short_list).is_ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(server.share_keys(names_[i], shares[i]).is_ok());
  server.advance();
  std::vector<std::vector<uint32_t>> masked;
  for (int i = 0; i < 5; ++i) masked.push_back(c[i].masked_input(server.shares_for(names_[i]), inputs_[i]).value());
  EXPECT_FALSE(server.masked_input("site-a", 10, std::span(masked[0]).first(10)).is_ok());  // wrong offset
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(server.masked_input(names_[i], 0, masked[i]).is_ok());
  EXPECT_FALSE(server.phase_complete());
  server.advance();  // site-e's input missed the deadline: it is dropped
  ASSERT_EQ(server.phase(), P::kConsistency);
  EXPECT_EQ(server.dropped(), std::vector<std::string>{"site-e"});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(server.consistency(names_[i], c[i].consistency(server.alive()).value()).is_ok());
  server.advance();
  std::vector<std::vector<SecAggReveal>> reveals;
  for (int i = 0; i < 4; ++i) reveals.push_back(c[i].unmask(server.unmask_request()).value());
  std::vector<SecAggReveal> wrong_point = reveals[0];
  wrong_point[0].share.x = 2;
  EXPECT_FALSE(server.unmask("site-a", wrong_point).is_ok());
  // site-a lies about site-e's key share: the rebuilt key does not match
  // the one site-e advertised, and the session aborts rather than release a
  // wrong sum.
  for (SecAggReveal& r : reveals[0]) {
    if (r.owner == "site-e") r.share.y[0] ^= 0x5a;
  }
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(server.unmask(names_[i], reveals[i]).is_ok());
  server.advance();
  EXPECT_EQ(server.phase(), P::kAborted);
  EXPECT_NE(server.abort_reason().find("do not rebuild the key"), std::string::npos) << server.abort_reason();
}

}  // namespace
}  // namespace fedmesh::crypto
