// Catch-up between gossip members: a donor's slice decodes to its model's
// values in that range, the behind member asks the members furthest ahead,
// asks the next one for a slice whose donor stays silent, keeps only slices
// it asked of their sender, and assembles the model from what arrived.
#include "gossip/catch_up.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "protocol/codec.h"

namespace fedmesh::gossip {
namespace {

using Model = std::vector<std::vector<float>>;

const std::vector<protocol::TensorShape> kManifest = {{"w", {7, 3}}, {"b", {5}}};

Model filled(float base) {
  Model m;
  for (const protocol::TensorShape& t : kManifest) {
    std::vector<float> v(t.element_count());
    for (size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<float>(i) * 0.25f;
    m.push_back(std::move(v));
  }
  return m;
}

// What the receiver's decoder makes of a slice: every tensor whole, zeros
// outside the slice.
Model decode(const std::vector<protocol::EncodedTensor>& tensors) {
  Model out;
  for (const protocol::TensorShape& t : kManifest) out.emplace_back(t.element_count(), 0.0f);
  for (const protocol::EncodedTensor& tensor : tensors) {
    for (const protocol::EncodedSegment& segment : tensor.segments) {
      const Status s = protocol::accumulate_segment(segment.view(), kManifest, 1.0f, out[segment.tensor]);
      EXPECT_TRUE(s.is_ok()) << s.message();
    }
  }
  return out;
}

TEST(CatchUp, SlicesCoverEveryElementOnce) {
  for (const size_t n : {0u, 1u, 5u, 21u, 1000u}) {
    for (uint32_t slices = 1; slices <= 16; ++slices) {
      size_t next = 0;
      for (uint32_t s = 0; s < slices; ++s) {
        const auto [begin, end] = slice_range(n, s, slices);
        EXPECT_EQ(begin, next) << n << " " << s << "/" << slices;
        EXPECT_LE(begin, end);
        next = end;
      }
      EXPECT_EQ(next, n);
    }
  }
}

TEST(CatchUp, ADonorsSliceCarriesItsModelInThatRangeOnly) {
  const Model reference = filled(1.0f), model = filled(3.0f);
  Result<std::vector<protocol::EncodedTensor>> slice = encode_catch_up_slice(kManifest, model, reference, 1, 3);
  ASSERT_TRUE(slice.is_ok()) << slice.status().message();
  ASSERT_EQ(slice->size(), kManifest.size());
  const Model got = decode(*slice);
  for (size_t t = 0; t < kManifest.size(); ++t) {
    const auto [begin, end] = slice_range(got[t].size(), 1, 3);
    for (size_t i = 0; i < got[t].size(); ++i) {
      EXPECT_EQ(got[t][i], i >= begin && i < end ? model[t][i] - reference[t][i] : 0.0f) << t << " " << i;
    }
  }
  EXPECT_FALSE(encode_catch_up_slice(kManifest, model, reference, 3, 3).is_ok()) << "slice 3 of 3";
  EXPECT_FALSE(encode_catch_up_slice(kManifest, Model{model[0]}, reference, 0, 1).is_ok()) << "a tensor missing";
}

TEST(CatchUp, AsksTheFurthestAheadAndTheNextOneForASilentDonor) {
  CatchUp catch_up({{12, "b"}, {30, "d"}, {20, "c"}}, 2);
  EXPECT_EQ(catch_up.slices(), 2u);
  EXPECT_EQ(catch_up.target_version(), 30u);
  using Requests = std::vector<std::pair<uint32_t, std::string>>;
  EXPECT_EQ(catch_up.first_requests(), (Requests{{0, "d"}, {1, "c"}}));

  const Model reference = filled(0.0f), donor = filled(5.0f), mine = filled(-1.0f);
  Model slice0 = decode(*encode_catch_up_slice(kManifest, donor, reference, 0, 2));
  Model stranger = slice0;
  EXPECT_FALSE(catch_up.take("b", 0, 2, stranger)) << "not asked of b";
  Model wrong_count = slice0;
  EXPECT_FALSE(catch_up.take("d", 0, 3, wrong_count)) << "another slicing";
  EXPECT_TRUE(catch_up.take("d", 0, 2, slice0));
  EXPECT_EQ(catch_up.received(), 1u);
  EXPECT_FALSE(catch_up.complete());

  // c stays silent: slice 1 goes to the next one ahead of it.
  EXPECT_EQ(catch_up.requests_again(), (Requests{{1, "b"}}));
  Model late = decode(*encode_catch_up_slice(kManifest, donor, reference, 1, 2));
  Model late_copy = late;
  EXPECT_FALSE(catch_up.take("c", 1, 2, late_copy)) << "c was asked before, not now";
  EXPECT_TRUE(catch_up.take("b", 1, 2, late));
  EXPECT_TRUE(catch_up.complete());
  EXPECT_EQ(catch_up.donors_asked(), (std::vector<std::string>{"b", "c", "d"}));
  EXPECT_EQ(catch_up.assemble(mine, reference), donor);
}

TEST(CatchUp, AssemblesWhatArrivedAndKeepsTheRest) {
  CatchUp catch_up({{9, "x"}, {8, "y"}}, 4);
  EXPECT_EQ(catch_up.slices(), 2u) << "no more slices than members ahead";
  (void)catch_up.first_requests();
  const Model reference = filled(0.0f), donor = filled(2.0f), mine = filled(7.0f);
  Model slice1 = decode(*encode_catch_up_slice(kManifest, donor, reference, 1, 2));
  ASSERT_TRUE(catch_up.take("y", 1, 2, slice1));
  const Model model = catch_up.assemble(mine, reference);
  for (size_t t = 0; t < kManifest.size(); ++t) {
    const auto [begin, end] = slice_range(model[t].size(), 1, 2);
    for (size_t i = 0; i < model[t].size(); ++i) {
      EXPECT_EQ(model[t][i], i >= begin && i < end ? donor[t][i] : mine[t][i]) << t << " " << i;
    }
  }
}

}  // namespace
}  // namespace fedmesh::gossip
