// The round manager as a state machine: sampling, deadlines, late and
// refused updates, FedBuff buffers with staleness, and aggregates that do not
// depend on the order updates arrive in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "aggregator/round_manager.h"
#include "federation/exact_accumulator.h"

namespace fedmesh::aggregator {
namespace {

RoundManager make_manager(RoundOptions options, float start = 0.0f, int64_t elements = 4) {
  Tensor w = Tensor::empty({elements});
  std::fill(w.data<float>(), w.data<float>() + elements, start);
  auto manager = RoundManager::create(std::move(options), {"w"}, {w});
  EXPECT_TRUE(manager.is_ok()) << manager.status().to_string();
  return std::move(manager).value();
}

SiteUpdate update(const std::string& site, int64_t round, int64_t base, std::vector<float> delta, int64_t samples = 100) {
  SiteUpdate u;
  u.id = site + "/" + std::to_string(round) + "/" + std::to_string(base);
  u.site = site;
  u.round = round;
  u.base_version = base;
  u.sample_count = samples;
  u.delta = std::move(delta);
  return u;
}

const std::vector<std::string> kSites = {"a", "b", "c", "d"};

TEST(RoundManager, SyncRoundAveragesBySampleCount) {
  RoundManager manager = make_manager({});
  ASSERT_TRUE(manager.start_round(kSites, 0.0).is_ok());
  EXPECT_EQ(manager.sampled(), kSites);
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {1, 1, 1, 1}, 100), 1.0).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 1, 0, {4, 4, 4, 4}, 200), 1.0).is_ok());
  EXPECT_FALSE(manager.ready_to_close(2.0));
  ASSERT_TRUE(manager.submit(update("c", 1, 0, {0, 0, 0, 0}, 100), 1.0).is_ok());
  ASSERT_TRUE(manager.submit(update("d", 1, 0, {-1, -1, -1, -1}, 100), 1.0).is_ok());
  EXPECT_TRUE(manager.ready_to_close(2.0)) << "every sampled site reported";
  auto record = manager.close_round(2.0);
  ASSERT_TRUE(record.is_ok());
  EXPECT_EQ(record->version, 1);
  EXPECT_EQ(record->applied.size(), 4u);
  EXPECT_FALSE(record->closed_by_deadline);
  // (100*1 + 200*4 + 0 - 100*1) / 500 = 1.6, applied with FedAvg lr 1
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 1.6f);
}

TEST(RoundManager, SamplingIsSeededAndIgnoresConnectionOrder) {
  RoundOptions options;
  options.sites_per_round = 2;
  options.seed = 3;
  RoundManager one = make_manager(options), two = make_manager(options);
  std::vector<std::string> shuffled = {"d", "b", "a", "c"};
  ASSERT_TRUE(one.start_round(kSites, 0).is_ok());
  ASSERT_TRUE(two.start_round(shuffled, 0).is_ok());
  EXPECT_EQ(one.sampled(), two.sampled());
  EXPECT_EQ(one.sampled().size(), 2u);
}

TEST(RoundManager, RefusesWhatDoesNotBelongAndChangesNothing) {
  RoundOptions options;
  options.sites_per_round = 2;
  options.seed = 1;
  RoundManager manager = make_manager(options);
  ASSERT_TRUE(manager.start_round(kSites, 0).is_ok());
  const std::string in = manager.sampled()[0];
  std::string out;
  for (const auto& s : kSites) {
    if (std::find(manager.sampled().begin(), manager.sampled().end(), s) == manager.sampled().end()) out = s;
  }
  const auto refused = [&](SiteUpdate u, const std::string& why) {
    auto result = manager.submit(std::move(u), 1.0);
    ASSERT_FALSE(result.is_ok()) << why;
    EXPECT_NE(result.status().message().find(why), std::string::npos) << result.status().message();
  };
  refused(update(out, 1, 0, {1, 1, 1, 1}), "not sampled");
  refused(update(in, 2, 0, {1, 1, 1, 1}), "answers round 2");
  refused(update(in, 1, 5, {1, 1, 1, 1}), "server is at 0");
  refused(update(in, 1, 0, {1, 1, 1}), "3 values");
  refused(update(in, 1, 0, {NAN, 1, 1, 1}), "non-finite");
  refused(update(in, 1, 0, {1e7f, 1, 1, 1}), "magnitude");
  refused(update(in, 1, 0, {1, 1, 1, 1}, 0), "sample count");
  ASSERT_TRUE(manager.submit(update(in, 1, 0, {1, 1, 1, 1}), 1.0).is_ok());
  SiteUpdate again = update(in, 1, 0, {2, 2, 2, 2});
  again.id = "another id";
  refused(std::move(again), "already reported");
  EXPECT_EQ(manager.refused(), 8);
  EXPECT_EQ(manager.accepted(), 1);
}

TEST(RoundManager, DeadlineClosesWithEnoughUpdatesOrAbandonsTheRound) {
  RoundOptions options;
  options.round_deadline_seconds = 10.0;
  options.min_updates = 2;
  RoundManager manager = make_manager(options);
  ASSERT_TRUE(manager.start_round(kSites, 0.0).is_ok());
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {1, 1, 1, 1}), 1.0).is_ok());
  EXPECT_FALSE(manager.ready_to_close(9.9)) << "a silent site holds the round until the deadline, no longer";
  EXPECT_TRUE(manager.ready_to_close(10.0));
  auto abandoned = manager.close_round(10.0);
  ASSERT_TRUE(abandoned.is_ok());
  EXPECT_EQ(abandoned->version, 0) << "one update is below min_updates: no server step";
  EXPECT_TRUE(abandoned->applied.empty());
  ASSERT_TRUE(manager.start_round(kSites, 10.0).is_ok());
  ASSERT_TRUE(manager.submit(update("a", 2, 0, {1, 1, 1, 1}), 11.0).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 2, 0, {3, 3, 3, 3}), 11.0).is_ok());
  auto record = manager.close_round(20.0);
  ASSERT_TRUE(record.is_ok());
  EXPECT_TRUE(record->closed_by_deadline);
  EXPECT_EQ(record->version, 1);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 2.0f);
  auto late = manager.submit(update("c", 2, 0, {1, 1, 1, 1}), 21.0);
  EXPECT_FALSE(late.is_ok());
  EXPECT_NE(late.status().message().find("late"), std::string::npos) << late.status().message();
}

TEST(RoundManager, ASiteDroppedFromTheSampleNoLongerHoldsTheRound) {
  RoundOptions options;
  options.round_deadline_seconds = 60.0;
  RoundManager manager = make_manager(options);
  ASSERT_TRUE(manager.start_round({"a", "b", "c"}, 0.0).is_ok());
  // c reported, then its key was revoked: its update stays, it is no longer waited for.
  ASSERT_TRUE(manager.submit(update("c", 1, 0, {3, 3, 3, 3}), 1.0).is_ok());
  EXPECT_TRUE(manager.drop_from_sample("c"));
  EXPECT_FALSE(manager.drop_from_sample("c")) << "dropped once";
  EXPECT_FALSE(manager.drop_from_sample("z")) << "never sampled";
  EXPECT_EQ(manager.sampled(), (std::vector<std::string>{"a", "b"}));
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {1, 1, 1, 1}), 2.0).is_ok());
  EXPECT_FALSE(manager.ready_to_close(3.0)) << "b is still sampled and silent: c's update does not stand in for it";
  // b is revoked too: the round closes at once on what it has, long before its deadline.
  EXPECT_TRUE(manager.drop_from_sample("b"));
  EXPECT_TRUE(manager.ready_to_close(3.0));
  auto record = manager.close_round(3.0);
  ASSERT_TRUE(record.is_ok());
  EXPECT_FALSE(record->closed_by_deadline);
  EXPECT_EQ(record->applied.size(), 2u);
  // A later update of a dropped site is refused as not sampled.
  ASSERT_TRUE(manager.start_round({"a"}, 4.0).is_ok());
  auto refused = manager.submit(update("b", 2, 1, {1, 1, 1, 1}), 5.0);
  EXPECT_FALSE(refused.is_ok());
}

TEST(RoundManager, LateUpdatesFoldIntoTheNextRoundWithTheirStalenessWeight) {
  RoundOptions options;
  options.fold_late_updates = true;
  options.staleness = *federation::StalenessFunction::parse("polynomial:1");  // s(1) = 1/2
  options.min_updates = 1;
  RoundManager manager = make_manager(options);
  ASSERT_TRUE(manager.start_round({"a", "b"}, 0).is_ok());
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {2, 2, 2, 2}), 1).is_ok());
  ASSERT_TRUE(manager.close_round(100).is_ok());  // b missed round 1; version 1, x = 2
  ASSERT_TRUE(manager.start_round({"a", "b"}, 100).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 1, 0, {4, 4, 4, 4}), 101).is_ok()) << "late, folded in with s(1)";
  ASSERT_TRUE(manager.submit(update("a", 2, 1, {1, 1, 1, 1}), 101).is_ok());
  auto record = manager.close_round(200);
  ASSERT_TRUE(record.is_ok());
  ASSERT_EQ(record->applied.size(), 2u);
  EXPECT_EQ(record->applied[0].staleness, 1);
  // weights 0.5 and 1: (0.5*4 + 1*1) / 1.5 = 2 on top of x = 2
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 4.0f);
}

TEST(RoundManager, FedBuffAppliesEveryKUpdatesWeightedByStaleness) {
  RoundOptions options;
  options.asynchronous = true;
  options.buffer_size = 2;
  options.staleness = *federation::StalenessFunction::parse("polynomial:0.5");
  options.max_sample_count = 100;
  RoundManager manager = make_manager(options);
  auto first = manager.submit(update("a", 0, 0, {1, 1, 1, 1}), 1);
  ASSERT_TRUE(first.is_ok());
  EXPECT_FALSE(first->has_value());
  auto second = manager.submit(update("b", 0, 0, {3, 3, 3, 3}), 2);
  ASSERT_TRUE(second.is_ok());
  ASSERT_TRUE(second->has_value()) << "the second update fills the buffer";
  EXPECT_EQ((*second)->version, 1);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 2.0f);
  // c trained from version 0: tau = 1, s = 1/sqrt(2); d from version 1: tau = 0.
  ASSERT_TRUE(manager.submit(update("c", 0, 0, {2, 2, 2, 2}), 3).is_ok());
  auto third = manager.submit(update("d", 0, 1, {0, 0, 0, 0}), 4);
  ASSERT_TRUE(third.is_ok() && third->has_value());
  EXPECT_EQ((*third)->applied[0].staleness, 1);
  EXPECT_EQ((*third)->applied[1].staleness, 0);
  // FedBuff: sum(n s(tau) d) / sum(n): the stale update's weight shrinks the step.
  const double s = 1.0 / std::sqrt(2.0);
  EXPECT_NEAR(manager.model()[0].data<float>()[0], 2.0 + (s * 2.0 + 1.0 * 0.0) / 2.0, 1e-6);
  EXPECT_FALSE(manager.start_round(kSites, 0).is_ok()) << "no rounds in asynchronous mode";

  RoundOptions cut = options;
  cut.staleness = *federation::StalenessFunction::parse("constant", 0);
  RoundManager strict = make_manager(cut);
  ASSERT_TRUE(strict.submit(update("a", 0, 0, {1, 1, 1, 1}), 1).is_ok());
  ASSERT_TRUE(strict.submit(update("b", 0, 0, {1, 1, 1, 1}), 1).is_ok());
  auto stale = strict.submit(update("c", 0, 0, {1, 1, 1, 1}), 2);
  EXPECT_FALSE(stale.is_ok());
  EXPECT_NE(stale.status().message().find("cut-off"), std::string::npos);
}

TEST(RoundManager, ShuffledDeliveryGivesBitIdenticalAggregates) {
  std::mt19937 random(12);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  std::vector<SiteUpdate> updates;
  std::vector<std::string> sites;
  for (int s = 0; s < 12; ++s) {
    std::vector<float> delta(257);
    for (float& v : delta) v = noise(random);
    sites.push_back("site-" + std::to_string(s));
    updates.push_back(update(sites.back(), 1, 0, delta, 50 + 37 * s));
  }
  for (const char* rule : {"mean", "median", "trimmed_mean", "krum"}) {
    SCOPED_TRACE(rule);
    std::vector<float> first;
    for (int trial = 0; trial < 6; ++trial) {
      RoundOptions options;
      options.rule = rule;
      options.krum_byzantine = 2;
      options.server = *ServerOptimizerOptions::defaults_for("fedadam");
      RoundManager manager = make_manager(options, 0.1f, 257);
      ASSERT_TRUE(manager.start_round(sites, 0).is_ok());
      std::vector<SiteUpdate> order = updates;
      std::shuffle(order.begin(), order.end(), random);
      for (SiteUpdate& u : order) ASSERT_TRUE(manager.submit(std::move(u), 1).is_ok());
      ASSERT_TRUE(manager.close_round(2).is_ok());
      const float* x = manager.model()[0].data<float>();
      if (trial == 0) {
        first.assign(x, x + 257);
      } else {
        EXPECT_EQ(std::memcmp(first.data(), x, 257 * sizeof(float)), 0) << "trial " << trial;
      }
    }
  }
}

TEST(RoundManager, NormBoundScalesLongUpdates) {
  RoundOptions options;
  options.norm_bound = 1.0;
  RoundManager manager = make_manager(options, 0.0f, 2);
  ASSERT_TRUE(manager.start_round({"a"}, 0).is_ok());
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {30, 40}), 1).is_ok());
  auto record = manager.close_round(2);
  ASSERT_TRUE(record.is_ok());
  EXPECT_DOUBLE_EQ(record->applied[0].norm, 50.0);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 0.6f);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[1], 0.8f);
}

// The mean family folds each update into one exact sum as it arrives and
// keeps none of its values, so the manager's memory does not grow with the
// round's size; the result is the exact mean, bit for bit. Median, trimmed
// mean and Krum must see the round's updates together and keep them.
TEST(RoundManager, TheMeanFamilyHoldsNoUpdateValuesWhateverTheRoundSize) {
  constexpr int64_t kElements = 1000;
  std::mt19937 random(5);
  std::normal_distribution<float> noise(0.0f, 0.1f);
  std::vector<SiteUpdate> updates;
  std::vector<std::string> sites;
  for (int s = 0; s < 24; ++s) {
    std::vector<float> delta(kElements);
    for (float& v : delta) v = noise(random);
    sites.push_back("site-" + std::to_string(s));
    updates.push_back(update(sites.back(), 1, 0, delta, 10 + s));
  }
  // The expected step: the exact weighted mean, folded apart in reverse order.
  federation::ExactAccumulator expected_sum(kElements);
  for (auto u = updates.rbegin(); u != updates.rend(); ++u) {
    ASSERT_TRUE(expected_sum.add(u->delta, static_cast<double>(u->sample_count) / 1'000'000.0).is_ok());
  }
  std::vector<float> expected(kElements);
  expected_sum.mean(expected);

  RoundManager manager = make_manager({}, 0.0f, kElements);
  ASSERT_TRUE(manager.start_round(sites, 0).is_ok());
  for (const SiteUpdate& u : updates) {
    ASSERT_TRUE(manager.submit(u, 1).is_ok());
    EXPECT_EQ(manager.held_update_values(), 0) << "after " << u.site;
  }
  EXPECT_EQ(manager.buffered().size(), updates.size());
  ASSERT_TRUE(manager.ready_to_close(1));
  ASSERT_TRUE(manager.close_round(2).is_ok());
  EXPECT_EQ(std::memcmp(manager.model()[0].data<float>(), expected.data(), kElements * sizeof(float)), 0)
      << "the model after one FedAvg step (lr 1) from zero is the exact mean";

  RoundOptions buffered;
  buffered.asynchronous = true;
  buffered.buffer_size = 24;
  RoundManager fedbuff = make_manager(buffered, 0.0f, kElements);
  for (size_t i = 0; i + 1 < updates.size(); ++i) {
    ASSERT_TRUE(fedbuff.submit(updates[i], 1).is_ok());
    EXPECT_EQ(fedbuff.held_update_values(), 0);
  }
  auto step = fedbuff.submit(updates.back(), 1);
  ASSERT_TRUE(step.is_ok());
  ASSERT_TRUE(step->has_value()) << "the 24th update completes the buffer";
  EXPECT_EQ(std::memcmp(fedbuff.model()[0].data<float>(), expected.data(), kElements * sizeof(float)), 0)
      << "fresh updates: FedBuff's step is the same exact mean";

  RoundOptions median;
  median.rule = "median";
  RoundManager robust = make_manager(median, 0.0f, kElements);
  ASSERT_TRUE(robust.start_round(sites, 0).is_ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(robust.submit(updates[i], 1).is_ok());
  EXPECT_EQ(robust.held_update_values(), 5 * kElements) << "a median keeps every update of the round";
}

// An update the exact sum cannot take without risking overflow is refused on
// its own, when it arrives; the round keeps what it took and closes.
TEST(RoundManager, AnUpdateTheSumCannotTakeIsRefusedAloneAndTheRoundCloses) {
  RoundManager manager = make_manager({}, 0.0f, 2);
  ASSERT_TRUE(manager.start_round({"a", "b", "c"}, 0).is_ok());
  // Weight 1 (a million samples) times 3e6: three such terms pass 2^23.
  ASSERT_TRUE(manager.submit(update("a", 1, 0, {3e6f, 0}, 1'000'000), 1).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 1, 0, {-3e6f, 1}, 1'000'000), 1).is_ok());
  auto third = manager.submit(update("c", 1, 0, {3e6f, 0}, 1'000'000), 1);
  ASSERT_FALSE(third.is_ok());
  EXPECT_NE(third.status().message().find("exact accumulator is full"), std::string::npos)
      << third.status().to_string();
  EXPECT_EQ(manager.refused(), 1);
  EXPECT_EQ(manager.buffered().size(), 2u);
  auto record = manager.close_round(120);  // the deadline: c never reported
  ASSERT_TRUE(record.is_ok()) << record.status().to_string();
  EXPECT_EQ(record->applied.size(), 2u);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 0.0f);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[1], 0.5f);
}

// Values kept elsewhere, as the aggregator's store keeps them (a fake of
// PendingValues over a vector): passes must read the values in order from
// the first, and a pass can be made to end damaged.
class VectorValues final : public StoredValues {
 public:
  explicit VectorValues(std::vector<float> values) : values_(std::move(values)) {}
  Status read(std::span<float> out) override {
    if (at_ + out.size() > values_.size()) return corrupt("read past the end");
    std::copy_n(values_.begin() + static_cast<std::ptrdiff_t>(at_), out.size(), out.begin());
    at_ += out.size();
    largest_read = std::max(largest_read, out.size());
    return Status::ok();
  }
  Status finish() override {
    const bool whole = at_ == values_.size();
    at_ = 0;
    ++passes;
    if (damaged_from_pass > 0 && passes >= damaged_from_pass) return corrupt("checksum mismatch");
    return whole ? Status::ok() : corrupt("a pass that did not read every value");
  }
  int passes = 0;
  int damaged_from_pass = 0;  // > 0: this pass and later ones end damaged
  size_t largest_read = 0;

 private:
  std::vector<float> values_;
  size_t at_ = 0;
};

SiteUpdate stored_update(const SiteUpdate& in_memory, std::shared_ptr<VectorValues>* values = nullptr) {
  SiteUpdate u = in_memory;
  auto stored = std::make_shared<VectorValues>(u.delta);
  u.delta.clear();
  u.stored = stored;
  if (values != nullptr) *values = stored;
  return u;
}

// A model of two tensors, one of 2.5 slices (the manager reads 2^20 values
// of a stored update at a time), so the step runs over ranges that do not
// line up with the tensors.
RoundManager make_two_tensor_manager(RoundOptions options) {
  Tensor big = Tensor::empty({(int64_t{5} << 19) + 3});
  Tensor small = Tensor::empty({7, 3});
  std::fill(big.data<float>(), big.data<float>() + big.numel(), 0.25f);
  std::fill(small.data<float>(), small.data<float>() + small.numel(), -0.5f);
  auto manager = RoundManager::create(std::move(options), {"big", "small"}, {big, small});
  EXPECT_TRUE(manager.is_ok()) << manager.status().to_string();
  return std::move(manager).value();
}

// The aggregator leaves each update in its store and the manager folds the
// round from there slice by slice (issue 30): the model must come out bit
// for bit as with the updates given in memory, for every streaming mode,
// with the norm bound scaling some, with stored and in-memory updates mixed,
// and for a robust rule that reads stored updates in; the manager holds no
// update's values and reads each stored one twice (the check, the step), a
// slice at a time.
TEST(RoundManager, UpdatesLeftInTheStoreGiveTheBitsOfUpdatesInMemory) {
  const int64_t elements = (int64_t{5} << 19) + 3 + 21;
  std::mt19937 random(31);
  std::normal_distribution<float> noise(0.0f, 0.02f);
  std::vector<SiteUpdate> updates;
  std::vector<std::string> sites;
  for (int s = 0; s < 5; ++s) {
    std::vector<float> delta(static_cast<size_t>(elements));
    for (float& v : delta) v = noise(random) * static_cast<float>(1 + 2 * s);
    sites.push_back("site-" + std::to_string(s));
    updates.push_back(update(sites.back(), 1, 0, delta, 40 + 13 * s));
  }
  struct Mode {
    const char* name;
    RoundOptions options;
  };
  std::vector<Mode> modes;
  {
    RoundOptions sync;
    sync.server = *ServerOptimizerOptions::defaults_for("fedadam");
    sync.norm_bound = 50.0;  // scales all but the first (norms about 32, 97, 161, ...)
    modes.push_back({"sync fedadam with a norm bound", sync});
    RoundOptions fedbuff;
    fedbuff.asynchronous = true;
    fedbuff.buffer_size = 5;
    fedbuff.staleness = *federation::StalenessFunction::parse("polynomial:0.5");
    modes.push_back({"fedbuff", fedbuff});
    RoundOptions fedasync = fedbuff;
    fedasync.fedasync_mixing = 0.6;
    modes.push_back({"fedasync", fedasync});
    RoundOptions trimmed;
    trimmed.rule = "trimmed_mean";
    modes.push_back({"trimmed mean", trimmed});
  }
  for (const Mode& mode : modes) {
    SCOPED_TRACE(mode.name);
    RoundManager in_memory = make_two_tensor_manager(mode.options);
    RoundManager from_store = make_two_tensor_manager(mode.options);
    RoundManager mixed = make_two_tensor_manager(mode.options);
    if (!mode.options.asynchronous) {
      for (RoundManager* m : {&in_memory, &from_store, &mixed}) ASSERT_TRUE(m->start_round(sites, 0).is_ok());
    }
    std::vector<std::shared_ptr<VectorValues>> readers;
    for (size_t i = 0; i < updates.size(); ++i) {
      ASSERT_TRUE(in_memory.submit(updates[i], 1).is_ok());
      std::shared_ptr<VectorValues> values;
      auto submitted = from_store.submit(stored_update(updates[i], &values), 1);
      ASSERT_TRUE(submitted.is_ok()) << submitted.status().to_string();
      readers.push_back(values);
      if (mode.options.rule == "mean") EXPECT_EQ(from_store.held_update_values(), 0);
      ASSERT_TRUE(mixed.submit(i % 2 == 0 ? stored_update(updates[i]) : updates[i], 1).is_ok());
    }
    if (!mode.options.asynchronous) {
      for (RoundManager* m : {&in_memory, &from_store, &mixed}) {
        auto record = m->close_round(2);
        ASSERT_TRUE(record.is_ok()) << record.status().to_string();
      }
    }
    ASSERT_EQ(from_store.version(), in_memory.version());
    EXPECT_EQ(from_store.link().hash, in_memory.link().hash) << "the model's bits, by its hash chain";
    EXPECT_EQ(mixed.link().hash, in_memory.link().hash);
    for (size_t t = 0; t < 2; ++t) {
      EXPECT_EQ(std::memcmp(from_store.model()[t].raw(), in_memory.model()[t].raw(),
                            static_cast<size_t>(in_memory.model()[t].numel()) * sizeof(float)), 0) << "tensor " << t;
    }
    for (const auto& values : readers) {
      if (mode.options.rule == "mean") {
        EXPECT_EQ(values->passes, 2) << "read once to check, once at the step";
        EXPECT_LE(values->largest_read, size_t{1} << 20) << "a slice at a time";
      } else {
        EXPECT_EQ(values->passes, 1) << "read in once, as the robust rules hold their updates";
      }
    }
  }
}

// A stored update is checked like one in memory when it is submitted: a
// non-finite value or a damaged read is refused, and nothing changes.
TEST(RoundManager, AStoredUpdateIsCheckedWhenSubmitted) {
  RoundManager manager = make_manager({}, 0.0f, 4);
  ASSERT_TRUE(manager.start_round({"a", "b"}, 0).is_ok());
  auto nan = manager.submit(stored_update(update("a", 1, 0, {1, NAN, 1, 1})), 1);
  ASSERT_FALSE(nan.is_ok());
  EXPECT_NE(nan.status().message().find("non-finite"), std::string::npos) << nan.status().to_string();
  std::shared_ptr<VectorValues> values;
  SiteUpdate damaged = stored_update(update("b", 1, 0, {1, 1, 1, 1}), &values);
  values->damaged_from_pass = 1;
  auto refused = manager.submit(damaged, 1);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kCorrupt) << refused.status().to_string();
  EXPECT_EQ(manager.refused(), 2);
  EXPECT_TRUE(manager.buffered().empty());
  EXPECT_TRUE(manager.failed_step().is_ok()) << "nothing had changed";
}

// Damage found while the step runs (a stored update read back different from
// what was checked) leaves the model between versions: the step fails, and
// the manager refuses everything after, so its owner restarts from its store.
TEST(RoundManager, AStoredUpdateDamagedAtTheStepFailsItAndTheManagerStops) {
  RoundManager manager = make_manager({}, 0.0f, 4);
  ASSERT_TRUE(manager.start_round({"a", "b"}, 0).is_ok());
  std::shared_ptr<VectorValues> values;
  ASSERT_TRUE(manager.submit(stored_update(update("a", 1, 0, {1, 1, 1, 1}), &values), 1).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 1, 0, {2, 2, 2, 2}), 1).is_ok());
  values->damaged_from_pass = 2;
  auto record = manager.close_round(2);
  ASSERT_FALSE(record.is_ok());
  EXPECT_EQ(record.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(record.status().message().find("restart from the store"), std::string::npos) << record.status().to_string();
  EXPECT_FALSE(manager.failed_step().is_ok());
  EXPECT_EQ(manager.version(), 0);
  EXPECT_FALSE(manager.start_round({"a", "b"}, 3).is_ok());
  EXPECT_FALSE(manager.submit(update("a", 2, 0, {1, 1, 1, 1}), 3).is_ok());
}

// The overflow bound counts stored updates as ExactAccumulator::add counts
// those in memory: the update that could overflow the sum is refused alone.
TEST(RoundManager, TheSumsBoundCountsStoredUpdates) {
  RoundManager manager = make_manager({}, 0.0f, 2);
  ASSERT_TRUE(manager.start_round({"a", "b", "c"}, 0).is_ok());
  ASSERT_TRUE(manager.submit(stored_update(update("a", 1, 0, {3e6f, 0}, 1'000'000)), 1).is_ok());
  ASSERT_TRUE(manager.submit(update("b", 1, 0, {-3e6f, 1}, 1'000'000), 1).is_ok());
  auto third = manager.submit(stored_update(update("c", 1, 0, {3e6f, 0}, 1'000'000)), 1);
  ASSERT_FALSE(third.is_ok());
  EXPECT_NE(third.status().message().find("exact accumulator is full"), std::string::npos)
      << third.status().to_string();
  auto record = manager.close_round(120);
  ASSERT_TRUE(record.is_ok()) << record.status().to_string();
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[0], 0.0f);
  EXPECT_FLOAT_EQ(manager.model()[0].data<float>()[1], 0.5f);
}

}  // namespace
}  // namespace fedmesh::aggregator
