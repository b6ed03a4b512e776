// The aggregator's operator dashboard, in a real browser, during a running
// federation: `fedmesh aggregator` and three `fedmesh node` processes on
// loopback (deploy/local_federation.sh), the page loaded in headless
// Chromium (Debian's chromium; deploy/setup.sh installs it) and its rendered
// DOM compared with what /status says at the same moment:
//   - the site table names every site with its live state: site-0 training
//     on, site-2 killed (dropped), site-1 taken off the roster (revoked);
//   - the chart has one accuracy and one loss point per finished round, with
//     the values /status reports;
//   - the round card shows the round and its updates in/wanted;
//   - the rejections table shows the revoked site's refusals with reasons.
// And the token: every page but /healthz answers 401 without it (counted in
// /metrics), and an aggregator whose metrics address is not loopback
// refuses to start without one, naming the option.
//
// FEDMESH_DASHBOARD_SCREENSHOT=PATH also saves a 1200x900 screenshot of the
// page there (docs/dashboard.png was made so).

#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/http_endpoint.h"
#include "support/cluster.h"
#include "support/fedmesh_run.h"
#include "support/local_federation.h"
#include "support/process.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::LocalFederation;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

constexpr const char* kChromium = "/usr/bin/chromium";
constexpr const char* kToken = "dashboard-test-token-0123456789abcdef";

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Headless Chromium with a fresh profile; its stdout (the DOM with
// --dump-dom), its log kept in `log` for failure messages.
std::string run_chromium(const std::vector<std::string>& flags, const std::string& url, const fs::path& work,
                         std::string& log) {
  static int runs = 0;
  const fs::path profile = work / ("chromium-profile-" + std::to_string(++runs));
  const fs::path log_file = work / ("chromium-" + std::to_string(runs) + ".log");
  fs::create_directories(profile);
  std::string command = std::string("exec ") + kChromium +
                        " --headless --no-sandbox --disable-gpu --disable-quic --no-first-run"
                        " --disable-background-networking --disable-component-update --disable-sync"
                        " --disable-dev-shm-usage --user-data-dir=" + shell_quote(profile.string());
  for (const std::string& flag : flags) command.append(" ").append(shell_quote(flag));
  command.append(" ").append(shell_quote(url)).append(" 2>").append(shell_quote(log_file.string()));
  ChildProcess chromium({"/bin/sh", "-c", command});
  std::string out;
  for (const std::string& line : chromium.read_all(90s)) out += line + "\n";
  chromium.wait();
  std::ifstream in(log_file);
  std::stringstream text;
  text << in.rdbuf();
  log = text.str();
  return out;
}

std::optional<json> status_of(const std::string& address) {
  fedmesh::Result<fedmesh::HttpReply> reply = fedmesh::http_fetch(address, "/status", kToken);
  if (!reply.is_ok() || reply->status != 200) return std::nullopt;
  json status = json::parse(reply->body, nullptr, false);
  if (!status.is_object()) return std::nullopt;
  return status;
}

// Polls /status until `ready` holds (returned) or the time is up.
std::optional<json> wait_for_status(const std::string& address, const std::function<bool(const json&)>& ready,
                                    std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<json> last;
  while (std::chrono::steady_clock::now() < deadline) {
    last = status_of(address);
    if (last && ready(*last)) return last;
    std::this_thread::sleep_for(200ms);
  }
  return std::nullopt;
}

std::string state_of(const json& status, const std::string& site) {
  for (const json& s : status["sites"]) {
    if (s["site"] == site) return s["state"].get<std::string>();
  }
  return "absent";
}

// What the page must show, and which does not change while nothing happens
// in the federation (unlike last-contact times and byte counts).
json shown_part(const json& status) {
  json sites = json::array(), history = json::array(), rejections = json::array();
  for (const json& s : status["sites"]) sites.push_back({s["site"], s["state"]});
  for (const json& h : status["history"]) history.push_back(h);
  for (const json& r : status["recent_rejections"]) rejections.push_back(r);
  return {{"version", status["version"]}, {"progress", status["progress"]["received"]},
          {"wanted", status["progress"]["wanted"]}, {"round", status["round"]},
          {"sites", sites}, {"history", history}, {"rejections", rejections}};
}

std::string unescape_html(std::string text) {
  const std::pair<const char*, const char*> entities[] = {
      {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&#39;", "'"}, {"&nbsp;", " "}, {"&amp;", "&"}};
  for (const auto& [from, to] : entities) {
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + std::strlen(to))) {
      text.replace(at, std::strlen(from), to);
    }
  }
  return text;
}

// Every start tag `<NAME ...>` of the DOM, as attribute maps.
std::vector<std::map<std::string, std::string>> tags(const std::string& dom, const std::string& name) {
  std::vector<std::map<std::string, std::string>> found;
  const std::regex tag("<" + name + "(\\s[^>]*)?>");
  const std::regex attribute("([a-zA-Z_:][-a-zA-Z0-9_:.]*)=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), tag); it != std::sregex_iterator(); ++it) {
    std::map<std::string, std::string> attributes;
    const std::string inside = (*it)[1].str();
    for (auto a = std::sregex_iterator(inside.begin(), inside.end(), attribute); a != std::sregex_iterator(); ++a) {
      attributes[(*a)[1].str()] = unescape_html((*a)[2].str());
    }
    found.push_back(std::move(attributes));
  }
  return found;
}

TEST(Dashboard, ShowsTheLiveFederationInABrowserAndNeedsItsToken) {
  if (!fs::exists(kChromium)) {
    GTEST_SKIP() << kChromium << " is missing: the dashboard test needs headless Chromium (Debian package chromium; "
                 << "deploy/setup.sh installs it)";
  }
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  ASSERT_FALSE(fedmesh::testing::local_federation_script().empty()) << "FEDMESH_LOCAL_FEDERATION is not set";
  // Rounds of 30 local steps on 3000 images; a site silent for 5 s is
  // dropped; a round open without one of its sites waits 60 s, longer than
  // this test looks at it.
  LocalFederation federation(
      3, {"--rounds", "50", "--local-steps", "30", "--deadline", "60", "--agg",
          std::string("metrics_token = \"") + kToken + "\"", "--agg", "site_timeout_seconds = 5", "--agg",
          "validation_limit = 1000", "--site", "data.train_limit = 3000", "--site", "give_up_seconds = 60"},
      "dashboard-");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  const std::string address = federation.metrics();

  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  std::optional<json> listening =
      wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s);
  ASSERT_TRUE(listening.has_value()) << "the aggregator did not start";
  EXPECT_EQ((*listening)["dashboard"], "http://" + address + "/dashboard");
  EXPECT_TRUE((*listening)["token_required"].get<bool>());

  // The token: refused without it or with another, counted; /healthz open.
  for (const auto& [path, token] : std::vector<std::pair<std::string, std::string>>{
           {"/dashboard", ""}, {"/", ""}, {"/status", ""}, {"/metrics", ""},
           {"/dashboard?token=not-the-token-0123456789", ""}, {"/status", "not-the-token-0123456789"}}) {
    fedmesh::Result<fedmesh::HttpReply> reply = fedmesh::http_fetch(address, path, token);
    ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
    EXPECT_EQ(reply->status, 401) << path << " with token '" << token << "'";
  }
  fedmesh::Result<fedmesh::HttpReply> health = fedmesh::http_fetch(address, "/healthz");
  ASSERT_TRUE(health.is_ok());
  EXPECT_EQ(health->status, 200);
  fedmesh::Result<fedmesh::HttpReply> page = fedmesh::http_fetch(address, std::string("/dashboard?token=") + kToken);
  ASSERT_TRUE(page.is_ok());
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->content_type.find("text/html"), std::string::npos);
  EXPECT_NE(page->body.find("<svg id=\"chart\""), std::string::npos);
  // Self-contained: nothing fetched from anywhere but the aggregator (the
  // one URL in it is SVG's namespace name, which is never fetched).
  std::string body = page->body;
  for (size_t at; (at = body.find("http://www.w3.org/2000/svg")) != std::string::npos;) body.erase(at, 26);
  for (const char* external : {"http://", "https://", "src=", "<link", "<img", "@import", "url("}) {
    EXPECT_EQ(body.find(external), std::string::npos) << "the page refers to " << external;
  }
  fedmesh::Result<fedmesh::HttpReply> metrics = fedmesh::http_fetch(address, "/metrics", kToken);
  ASSERT_TRUE(metrics.is_ok());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_NE(metrics->body.find("fedmesh_http_unauthorized_total 6\n"), std::string::npos) << metrics->body;
  // `fedmesh status` takes the token too.
  fedmesh::testing::FedmeshOutput refused = fedmesh::testing::run_fedmesh({"status", "--aggregator", address}, 30s);
  EXPECT_EQ(refused.exit_code, 1);
  fedmesh::testing::FedmeshOutput status_shown =
      fedmesh::testing::run_fedmesh({"status", "--aggregator", address, "--token", kToken, "--json"}, 30s);
  EXPECT_EQ(status_shown.exit_code, 0) << status_shown.text;
  EXPECT_EQ(status_shown.last.value("role", ""), "aggregator") << status_shown.text;

  // Two rounds with the three sites; site-2 is killed once its round-2
  // update is in, so that round 3 opens with it sampled and waits for it.
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < 3; ++k) sites.push_back(federation.site(k));
  int site2_updates = 0;
  ASSERT_TRUE(wait_for(
      *aggregator, events,
      [&](const json& e) {
        if (e.value("event", "") == "update" && e.value("site", "") == "site-2" && e.value("accepted", false)) {
          ++site2_updates;
        }
        return site2_updates == 2;
      },
      120s))
      << "site-2 never sent two updates";
  sites[2]->signal(SIGKILL);
  sites[2]->wait();
  fedmesh::testing::FedmeshOutput revoked = fedmesh::testing::run_fedmesh(
      {"roster", "revoke", "--roster", (federation.dir() / "roster.toml").string(), "--site", "site-1", "--admin-key",
       (federation.dir() / "keys" / "admin.key").string(), "--json"},
      30s);
  ASSERT_EQ(revoked.exit_code, 0) << revoked.text;

  // The aggregator sees it: site-2 dropped, site-1 revoked and refused by
  // name, site-0 done with its round's work.
  std::optional<json> settled = wait_for_status(
      address,
      [](const json& s) {
        bool named = false;
        for (const json& r : s["recent_rejections"]) named |= r["peer"] == "site-1" && r["code"] == "revoked";
        return state_of(s, "site-2") == "dropped" && state_of(s, "site-1") == "revoked" &&
               state_of(s, "site-0") == "connected" && named && s["history"].size() >= 2;
      },
      60s);
  ASSERT_TRUE(settled.has_value()) << "the federation never showed site-2 dropped, site-1 revoked, site-0 connected: "
                                   << (status_of(address) ? status_of(address)->dump() : "no status");
  // Silence the revoked site (it would go on being refused), so that the
  // rejections stand still while the page is read.
  sites[1]->signal(SIGKILL);
  sites[1]->wait();

  // Load the page; keep the DOM only if /status was the same before and after.
  const fs::path work = federation.dir() / "browser";
  fs::create_directories(work);
  const std::string url = "http://" + address + "/dashboard?token=" + kToken;
  std::string dom, log;
  json shown;
  for (int attempt = 0; attempt < 3 && shown.is_null(); ++attempt) {
    std::optional<json> before = status_of(address);
    ASSERT_TRUE(before.has_value());
    dom = run_chromium({"--virtual-time-budget=5000", "--dump-dom"}, url, work, log);
    std::optional<json> after = status_of(address);
    ASSERT_TRUE(after.has_value());
    if (shown_part(*before) == shown_part(*after)) shown = *after;
  }
  ASSERT_FALSE(shown.is_null()) << "the federation never held still while the page was read";
  ASSERT_NE(dom.find("data-loaded=\"true\""), std::string::npos)
      << "the page never rendered a status\n--- DOM ---\n" << dom << "\n--- chromium log ---\n" << log;

  // The site table: every site, its state as /status has it.
  std::map<std::string, std::string> rows;
  for (const auto& row : tags(dom, "tr")) {
    if (row.count("data-site")) rows[row.at("data-site")] = row.count("data-state") ? row.at("data-state") : "";
  }
  ASSERT_EQ(rows.size(), shown["sites"].size()) << dom;
  for (const json& site : shown["sites"]) {
    const std::string name = site["site"];
    ASSERT_TRUE(rows.count(name)) << name << " is not in the site table";
    EXPECT_EQ(rows[name], site["state"]) << name;
  }
  EXPECT_EQ(rows["site-0"], "connected");
  EXPECT_EQ(rows["site-1"], "revoked");
  EXPECT_EQ(rows["site-2"], "dropped");

  // The chart: a point per finished round and series, at /status's values.
  std::map<std::string, std::map<int64_t, double>> points;
  for (const auto& circle : tags(dom, "circle")) {
    if (!circle.count("data-series")) continue;
    points[circle.at("data-series")][std::stoll(circle.at("data-round"))] = std::stod(circle.at("data-value"));
  }
  ASSERT_GE(shown["history"].size(), 2u);
  EXPECT_EQ(points["accuracy"].size(), shown["history"].size()) << dom;
  EXPECT_EQ(points["loss"].size(), shown["history"].size()) << dom;
  for (const json& round : shown["history"]) {
    const int64_t r = round["round"];
    ASSERT_TRUE(round.contains("test_accuracy")) << round.dump();
    ASSERT_TRUE(points["accuracy"].count(r)) << "no accuracy point for round " << r;
    EXPECT_DOUBLE_EQ(points["accuracy"][r], round["test_accuracy"].get<double>()) << "round " << r;
    ASSERT_TRUE(points["loss"].count(r)) << "no loss point for round " << r;
    EXPECT_DOUBLE_EQ(points["loss"][r], round["test_loss"].get<double>()) << "round " << r;
  }

  // The round card.
  const std::vector<std::map<std::string, std::string>> cards = tags(dom, "div");
  const auto progress = std::find_if(cards.begin(), cards.end(), [](const auto& d) {
    return d.count("id") && d.at("id") == "progress";
  });
  ASSERT_NE(progress, cards.end());
  EXPECT_EQ(progress->at("data-round"), std::to_string(shown["round"].get<int64_t>()));
  EXPECT_EQ(progress->at("data-received"), std::to_string(shown["progress"]["received"].get<int64_t>()));
  EXPECT_EQ(progress->at("data-wanted"), std::to_string(shown["progress"]["wanted"].get<int64_t>()));

  // The rejections, newest first, with their reasons.
  std::vector<std::map<std::string, std::string>> refusals;
  for (const auto& row : tags(dom, "tr")) {
    if (row.count("data-peer")) refusals.push_back(row);
  }
  ASSERT_EQ(refusals.size(), shown["recent_rejections"].size());
  ASSERT_FALSE(refusals.empty());
  for (size_t i = 0; i < refusals.size(); ++i) {
    EXPECT_EQ(refusals[i]["data-peer"], shown["recent_rejections"][i]["peer"]);
    EXPECT_EQ(refusals[i]["data-code"], shown["recent_rejections"][i]["code"]);
  }
  const std::string reason = shown["recent_rejections"][0]["reason"];
  EXPECT_NE(unescape_html(dom).find(reason), std::string::npos) << "the page does not show the reason: " << reason;

  if (const std::string screenshot = fedmesh::testing::env_or_empty("FEDMESH_DASHBOARD_SCREENSHOT");
      !screenshot.empty()) {
    run_chromium({"--virtual-time-budget=5000", "--hide-scrollbars", "--window-size=1200,900",
                  "--screenshot=" + fs::absolute(screenshot).string()},
                 url, work, log);
    EXPECT_TRUE(fs::exists(screenshot)) << log;
  }
}

// An address beyond loopback without a token: the aggregator does not start,
// and says which option to set (from the config file, and from the flags).
TEST(Dashboard, AnExposedAddressWithoutATokenIsRefusedAtStart) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  ASSERT_FALSE(fedmesh::testing::local_federation_script().empty()) << "FEDMESH_LOCAL_FEDERATION is not set";
  LocalFederation federation(1, {"--rounds", "1"}, "exposed-");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  // The same config with its metrics address on every interface.
  std::ifstream in(federation.aggregator_config());
  std::string config, line;
  while (std::getline(in, line)) config += (line.rfind("metrics =", 0) == 0 ? "metrics = \"0.0.0.0:0\"" : line) + "\n";
  const fs::path exposed = federation.dir() / "exposed.toml";
  std::ofstream(exposed) << config;

  const auto start = [&](const fs::path& file, const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"aggregator", "--config", file.string(), "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    return fedmesh::testing::run_fedmesh(args, 30s);
  };
  fedmesh::testing::FedmeshOutput from_file = start(exposed, {});
  EXPECT_EQ(from_file.exit_code, 2) << from_file.text;
  EXPECT_NE(from_file.last.value("message", "").find("set metrics_token"), std::string::npos) << from_file.text;
  fedmesh::testing::FedmeshOutput from_flag = start(federation.aggregator_config(), {"--metrics", "0.0.0.0:0"});
  EXPECT_EQ(from_flag.exit_code, 2) << from_flag.text;
  EXPECT_NE(from_flag.last.value("message", "").find("set metrics_token"), std::string::npos) << from_flag.text;
  fedmesh::testing::FedmeshOutput short_token = start(exposed, {"--metrics-token", "short"});
  EXPECT_EQ(short_token.exit_code, 2) << short_token.text;
  EXPECT_NE(short_token.last.value("message", "").find("metrics_token: an access token needs 16"), std::string::npos)
      << short_token.text;
  for (const auto* out : {&from_file, &from_flag, &short_token}) {
    for (const json& e : out->events) EXPECT_NE(e.value("event", ""), "listening") << "it started: " << out->text;
  }
}

}  // namespace
