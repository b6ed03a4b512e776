// The aggregator's operator view: what /status and /metrics render, bounded,
// and the history a restarted aggregator reads back from the round log.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "aggregator/operator_view.h"

namespace fedmesh::aggregator {
namespace {

using nlohmann::json;

OperatorContext context() {
  OperatorContext c;
  c.federation = "fed";
  c.name = "aggregator";
  c.mode = "sync";
  c.privacy_mode = "trusted";
  c.rounds = 10;
  c.bytes_sent = 123;
  c.bytes_received = 456;
  c.transport_rejections = {{"malformed", 2.0}};
  return c;
}

TEST(OperatorView, RejectionsAreBoundedNewestFirstAndCutAndABadByteNeverFailsThePage) {
  OperatorView view;
  for (size_t i = 0; i < kRecentRejectionsShown + 7; ++i) {
    view.rejection("site-" + std::to_string(i), "wrong-round", std::string(1000, 'x'));
  }
  view.rejection("site-z", "malformed", "bad byte \xff here");
  const json status = json::parse(view.render_status(context()));
  ASSERT_EQ(status["recent_rejections"].size(), kRecentRejectionsShown);
  EXPECT_EQ(status["recent_rejections"][0]["peer"], "site-z") << "newest first";
  EXPECT_EQ(status["recent_rejections"][1]["reason"].get<std::string>().size(), kRejectionReasonShownChars);
  EXPECT_EQ(status["rejections_total"], static_cast<int64_t>(kRecentRejectionsShown) + 8) << "counted beyond those shown";
  EXPECT_EQ(status["rejections_by_reason"]["wrong-round"], static_cast<int64_t>(kRecentRejectionsShown) + 7);
  EXPECT_EQ(status["bytes_sent"], 123);
}

TEST(OperatorView, RoundsAndAcceptedUpdatesReachStatusAndMetrics) {
  OperatorView view;
  view.update_accepted(0);
  view.update_accepted(3);
  view.round_closed({{"event", "round"}, {"round", 1}, {"version", 1}, {"updates", 2}, {"seconds", 0.5},
                     {"closed_by_deadline", false}, {"bytes_sent", 10}, {"bytes_received", 20},
                     {"staleness", {0, 3}}, {"test_accuracy", 0.625}, {"test_loss", 1.25}});
  OperatorSnapshot snapshot;
  snapshot.sites = json::array({{{"site", "a"}, {"state", "connected"}, {"connected", true}},
                                {{"site", "b"}, {"state", "dropped"}, {"connected", false}}});
  snapshot.round = 2;
  snapshot.version = 1;
  view.set_snapshot(snapshot);
  EXPECT_EQ(view.last_accuracy(), 0.625);
  const json status = json::parse(view.render_status(context()));
  EXPECT_EQ(status["round"], 2);
  EXPECT_EQ(status["updates_accepted"], 2);
  EXPECT_EQ(status["test_accuracy"], 0.625);
  ASSERT_EQ(status["history"].size(), 1u);
  EXPECT_EQ(status["history"][0]["test_loss"], 1.25);
  EXPECT_EQ(status["staleness"]["mean"], 1.5);
  const std::string metrics = view.render_metrics(context());
  EXPECT_NE(metrics.find("fedmesh_connected_sites 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("fedmesh_sites{state=\"dropped\"} 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("fedmesh_updates_rejected_total{reason=\"malformed\"} 2"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("fedmesh_global_accuracy 0.625"), std::string::npos) << metrics;
}

TEST(OperatorView, TheHistoryIsReadBackFromTheRoundLogSkippingWhatIsNotAnObject) {
  OperatorView view;
  view.round_closed({{"event", "round"}, {"round", 99}, {"version", 99}});  // replaced by the log
  const std::vector<store::RoundLogEntry> log = {
      {1, 1, "2026-11-24T00:00:00Z", R"({"updates":4,"staleness":[0,1],"seconds":2.5,"test_accuracy":0.5,"test_loss":1.5})"},
      {2, 2, "2026-11-24T00:00:01Z", "not json"},
      {3, 3, "2026-11-24T00:00:02Z", R"({"updates":"four","closed_by_deadline":"yes","staleness":7})"},
  };
  EXPECT_EQ(view.restore_history(log), 2u);
  const json status = json::parse(view.render_status(context()));
  ASSERT_EQ(status["history"].size(), 2u);
  const json& first = status["history"][0];
  EXPECT_EQ(first["round"], 1);
  EXPECT_EQ(first["updates"], 4);
  EXPECT_EQ(first["test_accuracy"], 0.5);
  EXPECT_TRUE(first["bytes_sent"].is_null()) << "counted by an earlier process: unknown";
  const json& third = status["history"][1];
  EXPECT_EQ(third["round"], 3);
  EXPECT_EQ(third["updates"], 0) << "a field of the wrong type falls back";
  EXPECT_EQ(third["closed_by_deadline"], false);
  EXPECT_TRUE(third["staleness"].is_array());
  EXPECT_FALSE(third.contains("test_accuracy"));

  std::vector<store::RoundLogEntry> long_log;
  for (int64_t r = 1; r <= static_cast<int64_t>(kRoundHistoryShown) + 5; ++r) long_log.push_back({r, r, "", "{}"});
  EXPECT_EQ(view.restore_history(long_log), kRoundHistoryShown);
}

}  // namespace
}  // namespace fedmesh::aggregator
