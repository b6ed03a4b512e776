// The operator's view of a site: one of five states, the first that applies
// in the order revoked, dropped, late, training, connected.

#include <gtest/gtest.h>

#include "aggregator/site_state.h"

namespace fedmesh::aggregator {
namespace {

constexpr double kTimeout = 10.0;

SiteFacts heard(double seconds_ago) {
  SiteFacts f;
  f.seconds_since_contact = seconds_ago;
  return f;
}

TEST(SiteState, EachStateFromItsFacts) {
  EXPECT_EQ(classify_site(heard(1.0), kTimeout), SiteState::kConnected);

  SiteFacts revoked = heard(1.0);
  revoked.on_roster = false;
  EXPECT_EQ(classify_site(revoked, kTimeout), SiteState::kRevoked);

  EXPECT_EQ(classify_site(heard(-1.0), kTimeout), SiteState::kDropped);  // never heard from
  EXPECT_EQ(classify_site(heard(kTimeout), kTimeout), SiteState::kDropped);

  SiteFacts training = heard(1.0);
  training.sampled_in_open_round = true;
  EXPECT_EQ(classify_site(training, kTimeout), SiteState::kTraining);
  training.delivered_this_round = true;  // its update is in: nothing owed
  EXPECT_EQ(classify_site(training, kTimeout), SiteState::kConnected);

  SiteFacts late = heard(1.0);
  late.missed_last_round = true;
  EXPECT_EQ(classify_site(late, kTimeout), SiteState::kLate);

  SiteFacts asynchronous = heard(1.0);
  asynchronous.asynchronous = true;
  EXPECT_EQ(classify_site(asynchronous, kTimeout), SiteState::kTraining);
}

TEST(SiteState, TheFirstThatAppliesWins) {
  SiteFacts f = heard(kTimeout + 1.0);
  f.sampled_in_open_round = true;
  f.missed_last_round = true;
  f.on_roster = false;
  EXPECT_EQ(classify_site(f, kTimeout), SiteState::kRevoked);
  f.on_roster = true;
  EXPECT_EQ(classify_site(f, kTimeout), SiteState::kDropped);
  f.seconds_since_contact = 0.5;
  EXPECT_EQ(classify_site(f, kTimeout), SiteState::kLate);  // sampled again after missing one: still late
  f.missed_last_round = false;                               // an update of its came in time since
  EXPECT_EQ(classify_site(f, kTimeout), SiteState::kTraining);
  f.delivered_this_round = true;
  EXPECT_EQ(classify_site(f, kTimeout), SiteState::kConnected);
}

TEST(SiteState, Names) {
  EXPECT_STREQ(site_state_name(SiteState::kConnected), "connected");
  EXPECT_STREQ(site_state_name(SiteState::kTraining), "training");
  EXPECT_STREQ(site_state_name(SiteState::kLate), "late");
  EXPECT_STREQ(site_state_name(SiteState::kDropped), "dropped");
  EXPECT_STREQ(site_state_name(SiteState::kRevoked), "revoked");
}

}  // namespace
}  // namespace fedmesh::aggregator
