// A member with a valid site key against a real `fedmesh aggregator` on
// loopback (deploy/local_federation.sh, one site whose key the test uses
// through tests/protocol/transport_peer.cpp):
//   - SiteReports with accuracy -5 or round 2^64 - 1 are refused as
//     out-of-range and never reach /status;
//   - a flood of such reports is counted, each one, in
//     fedmesh_updates_rejected_total, but written to the aggregator's log
//     as a bounded number of lines (one per key and reason per interval),
//     the rest counted in fedmesh_refusal_log_lines_suppressed_total;
//   - an honest report is then taken and shown.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/http_endpoint.h"
#include "support/cluster.h"
#include "support/local_federation.h"
#include "support/process.h"

namespace {

using fedmesh::testing::ChildProcess;
using fedmesh::testing::LocalFederation;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

std::string peer_binary() {
  const char* path = std::getenv("FEDMESH_TRANSPORT_PEER");
  return path != nullptr ? path : "tests/transport_peer";
}

// One metric sample's value from Prometheus text ("name{labels} value"), or -1.
double metric(const std::string& text, const std::string& sample) {
  const size_t at = text.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + sample.size() + 2));
}

class Insider : public ::testing::Test {
 protected:
  // Sends SiteReports as site-0 (its own key, over CurveZMQ); the source's result line.
  json report(const LocalFederation& federation, const std::string& endpoint, double accuracy, uint64_t round,
              int repeat) {
    const auto keys = federation.dir() / "keys";
    ChildProcess source({peer_binary(), "source", "--roster", (federation.dir() / "roster.toml").string(),
                         "--admin-public", (keys / "admin.pub").string(), "--key", (keys / "site-0.key").string(),
                         "--server", "aggregator", "--connect", endpoint, "--attack", "report", "--report-accuracy",
                         std::to_string(accuracy), "--report-round", std::to_string(round), "--repeat",
                         std::to_string(repeat)});
    const auto lines = source.read_all(120s);
    EXPECT_EQ(source.wait(), 0);
    if (lines.empty()) return json{{"event", "none"}};
    return json::parse(lines.back(), nullptr, false);
  }
};

TEST_F(Insider, OutOfRangeReportsAreRefusedUnshownAndTheirLogLinesBounded) {
  LocalFederation federation(1, {"--agg", "validation = \"\"", "--rounds", "1000"}, "insider");
  ASSERT_TRUE(federation.made());
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  const auto listening = wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s);
  ASSERT_TRUE(listening.has_value());
  const std::string endpoint = (*listening)["endpoint"];

  const json negative = report(federation, endpoint, -5.0, 0, 1);
  EXPECT_EQ(negative["rejected"], 1) << negative.dump();
  EXPECT_EQ(negative["codes"].value("out-of-range", 0), 1) << negative.dump();
  EXPECT_NE(negative.value("reason", "").find("localAccuracy"), std::string::npos) << negative.dump();
  const json future = report(federation, endpoint, 0.5, std::numeric_limits<uint64_t>::max(), 1);
  EXPECT_EQ(future["codes"].value("out-of-range", 0), 1) << future.dump();
  EXPECT_NE(future.value("reason", "").find("ahead of the current round"), std::string::npos) << future.dump();

  constexpr int kFlood = 300;
  const json flood = report(federation, endpoint, -5.0, 0, kFlood);
  EXPECT_EQ(flood["codes"].value("out-of-range", 0), kFlood) << flood.dump();
  constexpr int kRefused = kFlood + 2;

  // Nothing refused is shown.
  auto status = fedmesh::http_get(federation.metrics(), "/status");
  ASSERT_TRUE(status.is_ok()) << status.status().to_string();
  const json shown = json::parse(*status);
  for (const json& site : shown["sites"]) {
    if (site["site"] != "site-0") continue;
    EXPECT_GE(site["local_accuracy"].get<double>(), 0.0) << site.dump();
    EXPECT_LE(site["local_accuracy"].get<double>(), 1.0) << site.dump();
    EXPECT_LT(site["report_round"].get<int64_t>(), 1000) << site.dump();
    EXPECT_EQ(site["refused"], kRefused) << site.dump();
  }

  // Every refusal counted; the log holds a bounded number of them.
  auto metrics = fedmesh::http_get(federation.metrics(), "/metrics");
  ASSERT_TRUE(metrics.is_ok()) << metrics.status().to_string();
  EXPECT_EQ(metric(*metrics, "fedmesh_updates_rejected_total{reason=\"out-of-range\"}"), kRefused) << *metrics;
  const double suppressed = metric(*metrics, "fedmesh_refusal_log_lines_suppressed_total");

  // An honest report after all that is taken and shown.
  const json honest = report(federation, endpoint, 0.75, 0, 1);
  EXPECT_EQ(honest["outcome"], "no-reply") << honest.dump();
  wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "site_report"; }, 30s);
  status = fedmesh::http_get(federation.metrics(), "/status");
  ASSERT_TRUE(status.is_ok());
  bool seen = false;
  const json after = json::parse(*status);
  for (const json& site : after["sites"]) {
    if (site["site"] == "site-0") seen = site["local_accuracy"].get<double>() == 0.75;
  }
  EXPECT_TRUE(seen) << *status;

  aggregator->signal(SIGTERM);
  for (const std::string& line : aggregator->read_all(30s)) {
    json event = json::parse(line, nullptr, false);
    if (!event.is_discarded()) events.push_back(event);
  }
  aggregator->wait();
  int logged = 0;
  for (const json& e : events) {
    if (e.value("event", "") == "rejected" && e.value("peer", "") == "site-0") ++logged;
  }
  // The flood ran within one interval (10 s): one line, perhaps a second
  // one if the run straddled it, never one per refusal.
  EXPECT_GE(logged, 1);
  EXPECT_LE(logged, 4) << "one log line per refusal";
  EXPECT_EQ(suppressed + logged, kRefused) << "logged " << logged << ", suppressed " << suppressed;
}

}  // namespace
