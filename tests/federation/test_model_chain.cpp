// The model hash chain: every version names its parent; a broken link or a
// model whose bytes differ from its entry is found and named.
#include <gtest/gtest.h>

#include <cstring>

#include "federation/model_chain.h"
#include "aggregator/round_manager.h"

namespace fedmesh::federation {
namespace {

std::vector<Tensor> model_of(float value) {
  Tensor t = Tensor::empty({3});
  std::fill(t.data<float>(), t.data<float>() + 3, value);
  return {t};
}

TEST(ModelChain, HashesDependOnVersionParentNamesAndBytes) {
  const crypto::Hash zero{};
  const auto a = model_version_hash(1, zero, {"w"}, model_of(1.0f));
  EXPECT_EQ(a, model_version_hash(1, zero, {"w"}, model_of(1.0f)));
  EXPECT_NE(a, model_version_hash(2, zero, {"w"}, model_of(1.0f)));
  EXPECT_NE(a, model_version_hash(1, a, {"w"}, model_of(1.0f)));
  EXPECT_NE(a, model_version_hash(1, zero, {"v"}, model_of(1.0f)));
  EXPECT_NE(a, model_version_hash(1, zero, {"w"}, model_of(1.5f)));
  auto parsed = parse_hash_hex(hash_hex(a));
  ASSERT_TRUE(parsed.is_ok());
  EXPECT_EQ(*parsed, a);
  EXPECT_FALSE(parse_hash_hex("xyz").is_ok());
  EXPECT_FALSE(parse_hash_hex(std::string(64, 'g')).is_ok());
}

TEST(ModelChain, RoundsExtendTheChainAndANodeVerifiesIt) {
  aggregator::RoundOptions options;
  Tensor w = Tensor::zeros({3});
  auto manager = aggregator::RoundManager::create(options, {"w"}, {w});
  ASSERT_TRUE(manager.is_ok());
  const crypto::Hash genesis = manager->link().hash;
  std::vector<ChainLink> links;
  for (int r = 1; r <= 3; ++r) {
    ASSERT_TRUE(manager->start_round({"a"}, 0).is_ok());
    aggregator::SiteUpdate u;
    u.id = "a/" + std::to_string(r);
    u.site = "a";
    u.round = r;
    u.base_version = r - 1;
    u.sample_count = 10;
    u.delta = {0.1f * r, 0.0f, -0.1f};
    ASSERT_TRUE(manager->submit(std::move(u), 1).is_ok());
    auto record = manager->close_round(2);
    ASSERT_TRUE(record.is_ok());
    links.push_back(record->link);
  }
  EXPECT_TRUE(verify_chain(genesis, links).is_ok());
  EXPECT_TRUE(verify_model(links.back(), manager->names(), manager->model()).is_ok());

  std::vector<ChainLink> broken = links;
  broken[1].parent[0] ^= 1;
  const Status s = verify_chain(genesis, broken);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("version 2"), std::string::npos) << s.message();
  EXPECT_FALSE(verify_chain(links[0].hash, links).is_ok()) << "a node trusting version 1 cannot accept version 1 again";
  std::vector<Tensor> tampered = {manager->model()[0].clone()};
  tampered[0].data<float>()[1] += 1e-6f;
  EXPECT_FALSE(verify_model(links.back(), manager->names(), tampered).is_ok());

  // A checkpoint whose model was changed is refused on restore.
  auto state = manager->state();
  ASSERT_TRUE(state.is_ok());
  auto fresh = aggregator::RoundManager::create(options, {"w"}, {Tensor::zeros({3})});
  ASSERT_TRUE(fresh.is_ok());
  EXPECT_EQ(fresh->restore(*state).code(), StatusCode::kCorrupt) << "zeros are not version 3's model";
  std::memcpy(fresh->mutable_model()[0].raw(), manager->model()[0].raw(), 12);
  EXPECT_TRUE(fresh->restore(*state).is_ok());
  EXPECT_EQ(fresh->version(), 3);
}

}  // namespace
}  // namespace fedmesh::federation
