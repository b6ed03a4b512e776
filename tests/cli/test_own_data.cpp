// Own data end to end, with real processes and the small real data sets
// Debian's python3-sklearn ships:
// - A table: the Wisconsin breast-cancer data, split by
//   tests/data/split_breast_cancer.py into 3 site tables with different
//   class balances and a held-out test table. `fedmesh train` on all the
//   sites' rows, and a federation of an aggregator (evaluating on the test
//   table) and 3 `fedmesh node`s on their own tables, standardized with the
//   statistics they computed together (`fedmesh stats`), each reach >= 0.94.
// - A regression table: the diabetes data, split by age by
//   tests/data/split_diabetes.py; R² >= 0.40 centrally and >= 0.42 in a
//   3-site federation with the target standardized by the federation's
//   statistics (scikit-learn's linear regression: 0.48).
// - Image folders: the 8x8 digits written as PNG class folders by
//   tests/data/make_digits_images.py; cnn reaches >= 0.93 centrally and in
//   a federation of 4 sites on their own folders, and the same folders read
//   as RGB 16x16 train.
// - `fedmesh sim` splits own data among its virtual sites (a table by a
//   Dirichlet over its classes >= 0.93; the digits as .npz in gossip mode,
//   every peer >= 0.93); token shards as two sites' own data train gpt-nano.
// - A site whose data has another schema is refused naming both; bad data
//   exits 2 naming the file and the place, never a failed check.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/cluster.h"
#include "train/data/data_stats.h"
#include "train/model_spec.h"
#include "support/fedmesh_run.h"
#include "support/process.h"
#include "support/text_files.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::FedmeshOutput;
using fedmesh::testing::run_fedmesh;
using fedmesh::testing::set_toml_option;
using fedmesh::testing::slurp;
using fedmesh::testing::spit;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

constexpr const char* kSklearnData = "/usr/lib/python3/dist-packages/sklearn/datasets/data";

std::string python() { return fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3"; }

std::string source_dir() { return fedmesh::testing::env_or_empty("FEDMESH_SOURCE_DIR"); }

std::string script_command(const std::string& script, const std::vector<std::string>& args) {
  std::string command = python() + " " + (fs::path(source_dir()) / script).string();
  for (const std::string& a : args) command += " '" + a + "'";
  return command;
}

int run_script(const std::string& script, const std::vector<std::string>& args) {
  return std::system((script_command(script, args) + " >/dev/null").c_str());
}

// The last line of a script's output (its baseline: "central ... test R2: 0.4806 ..."); "" if it failed.
std::string script_last_line(const std::string& script, const std::vector<std::string>& args) {
  std::FILE* pipe = ::popen(script_command(script, args).c_str(), "r");
  if (pipe == nullptr) return "";
  std::string last;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr) last = line;
  return ::pclose(pipe) == 0 ? last : "";
}

class OwnData : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(fs::path(kSklearnData) / "breast_cancer.csv")) {
      GTEST_SKIP() << "python3-sklearn's data files are not installed (deploy/setup.sh installs them)";
    }
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-own-data-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Kits for a federation of `sites` sites (site-0, ...) on free ports, each
  // site's demo split undone (own data is used whole); "" on failure.
  fs::path provision_kits(const std::string& model, int sites, int rounds, int local_steps,
                          const std::string& mode = "trusted") {
    const int port = fedmesh::testing::free_ports(2 + sites);
    if (port <= 0) return {};
    std::string names;
    for (int i = 0; i < sites; ++i) names += (i ? ", \"site-" : "\"site-") + std::to_string(i) + "\"";
    spit(dir_ / "federation.toml", "name = \"own-data\"\naggregator = \"tcp://127.0.0.1:" + std::to_string(port) +
                                       "\"\nmodel = \"" + model + "\"\nrounds = " + std::to_string(rounds) +
                                       "\nlocal_steps = " + std::to_string(local_steps) + "\nsites = [" + names +
                                       "]\nmode = \"" + mode + "\"\n");
    const fs::path kits = dir_ / "kits";
    if (run_fedmesh({"provision", "--federation", (dir_ / "federation.toml").string(), "--out", kits.string()})
            .exit_code != 0) {
      return {};
    }
    const fs::path agg = kits / "aggregator" / "agg.toml";
    set_toml_option(agg, "metrics", "\"127.0.0.1:" + std::to_string(port + 1) + "\"");
    set_toml_option(agg, "linger_seconds", "3");
    for (int i = 0; i < sites; ++i) {
      const fs::path config = site_config(kits, i);
      set_toml_option(config, "metrics", "\"127.0.0.1:" + std::to_string(port + 2 + i) + "\"");
      set_toml_option(config, "data.sites", "1");
      set_toml_option(config, "data.index", "0");
    }
    return kits;
  }
  static fs::path site_config(const fs::path& kits, int i) {
    return kits / ("site-" + std::to_string(i)) / "site.toml";
  }
  // Points site i of the kits at TABLES/site-i.csv and sets `data.*` keys
  // (key, value) in those and the aggregator's configs; returns all of them,
  // the aggregator's first.
  static std::vector<fs::path> use_tables(const fs::path& kits, int sites, const fs::path& tables,
                                          const std::vector<std::pair<std::string, std::string>>& keys) {
    std::vector<fs::path> configs = {kits / "aggregator" / "agg.toml"};
    for (int i = 0; i < sites; ++i) {
      configs.push_back(site_config(kits, i));
      set_toml_option(configs.back(), "data.source",
                      "\"csv:" + (tables / ("site-" + std::to_string(i) + ".csv")).string() + "\"");
    }
    for (const fs::path& config : configs) {
      for (const auto& [key, value] : keys) set_toml_option(config, key, value);
    }
    return configs;
  }
  // A copy of site i's config, `name` in its kit, with `key` set to `value`.
  static std::string variant_config(const fs::path& kits, int i, const std::string& name, const std::string& key,
                                    const std::string& value) {
    const fs::path variant = kits / ("site-" + std::to_string(i)) / name;
    spit(variant, slurp(site_config(kits, i)));
    set_toml_option(variant, key, value);
    return name;
  }
  // `fedmesh ARGS --json`, run from the kit directory `kit`.
  static std::vector<std::string> in_kit(const fs::path& kits, const std::string& kit, const std::string& args) {
    ::setenv("FEDMESH", fedmesh::testing::fedmesh_binary().c_str(), 1);
    return {"/bin/sh", "-c", "cd '" + (kits / kit).string() + "' && exec \"$FEDMESH\" " + args + " --json"};
  }
  // The statistics through the aggregator: `stats serve` into `out`, then
  // `before_sends` (sites expected to be refused), then `stats send` at
  // each site, each exiting 0 with federation.stats.json in its kit. The
  // aggregator's events.
  std::vector<json> exchange_stats(const fs::path& kits, int sites, const fs::path& out,
                                   const std::function<void()>& before_sends) {
    ChildProcess serve(in_kit(kits, "aggregator", "stats serve --config agg.toml --linger 2 --timeout 120 --out '" +
                                                      out.string() + "'"));
    std::vector<json> events;
    if (!wait_for(serve, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s)) {
      ADD_FAILURE() << "stats serve did not start";
      return events;
    }
    before_sends();
    std::vector<std::unique_ptr<ChildProcess>> senders;
    for (int i = 0; i < sites; ++i) {
      senders.push_back(std::make_unique<ChildProcess>(in_kit(
          kits, "site-" + std::to_string(i), "stats send --config site.toml --timeout 120 --out federation.stats.json")));
    }
    for (auto& sender : senders) EXPECT_EQ(sender->wait(), 0);
    EXPECT_TRUE(wait_for(serve, events, [](const json& e) { return e.value("event", "") == "summary"; }, 60s));
    EXPECT_EQ(serve.wait(), 0);
    return events;
  }
  // Runs the kits' aggregator, then `before_sites`, then the sites, to the
  // end; the last round's `metric` (-1 if the federation did not finish).
  // The aggregator's events go to `aggregator_events` when given.
  double run_kits(const fs::path& kits, int sites, const std::function<void()>& before_sites = {},
                  const std::string& metric = "test_accuracy", std::vector<json>* aggregator_events = nullptr) {
    ::setenv("FEDMESH", fedmesh::testing::fedmesh_binary().c_str(), 1);
    ChildProcess aggregator({"/bin/sh", (kits / "aggregator" / "start.sh").string(), "--json"});
    std::vector<json> events;
    if (!wait_for(aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s)) {
      ADD_FAILURE() << "the aggregator did not start";
      return -1.0;
    }
    if (before_sites) before_sites();
    std::vector<std::unique_ptr<ChildProcess>> running;
    for (int i = 0; i < sites; ++i) {
      running.push_back(std::make_unique<ChildProcess>(std::vector<std::string>{
          "/bin/sh", (kits / ("site-" + std::to_string(i)) / "start.sh").string(), "--json"}));
    }
    std::optional<json> finished =
        wait_for(aggregator, events, [](const json& e) { return e.value("event", "") == "finished"; }, 300s);
    if (!finished) {
      ADD_FAILURE() << "the federation on own data did not finish";
      return -1.0;
    }
    double accuracy = -1.0;
    for (const json& e : events) {
      if (e.value("event", "") == "round" && e.contains(metric)) accuracy = e[metric];
    }
    for (auto& site : running) EXPECT_EQ(site->wait(), 0);
    EXPECT_EQ(aggregator.wait(), 0);
    if (aggregator_events != nullptr) *aggregator_events = std::move(events);
    return accuracy;
  }

  fs::path dir_;
};

double final_accuracy(const FedmeshOutput& out) { return out.last.value("test_accuracy", -1.0); }

// --profile: how long the data took to load, and the batches' share of the steps.
void print_data_time(const std::string& what, const FedmeshOutput& out) {
  const json times = out.last.value("step_time", json::object());
  const double train = times.value("train_seconds", 0.0);
  std::printf("%s: data loaded in %.3f s; batches %.1f%% of %.2f s of steps\n", what.c_str(),
              times.value("load_seconds", 0.0), train > 0 ? 100.0 * times.value("data_seconds", 0.0) / train : 0.0,
              train);
  EXPECT_TRUE(times.contains("data_seconds")) << out.last.dump();
}

TEST_F(OwnData, ATableTrainsCentrallyAndInAThreeSiteFederation) {
  const fs::path tables = dir_ / "tables";
  ASSERT_EQ(run_script("tests/data/split_breast_cancer.py", {tables.string()}), 0);
  const std::string label = "diagnosis";

  // Centrally, on every site's rows.
  const FedmeshOutput central =
      run_fedmesh({"train", "--model", "mlp", "--data", "csv:" + (tables / "all-train.csv").string(), "--label", label,
                   "--test-data", "csv:" + (tables / "test.csv").string(), "--epochs", "20", "--batch-size", "32",
                   "--lr", "0.001", "--profile", "--json"});
  ASSERT_EQ(central.exit_code, 0) << central.text;
  print_data_time("breast cancer, mlp", central);
  std::printf("breast cancer, fedmesh train (central, mlp): test accuracy %.4f\n", final_accuracy(central));
  std::printf("breast cancer, %s", script_last_line("tests/data/split_breast_cancer.py",
                                                     {(dir_ / "baseline").string(), "--baseline"}).c_str());
  EXPECT_GE(final_accuracy(central), 0.94) << central.text;

  // Federated: an aggregator evaluating on the test table, three sites on their own.
  const fs::path kits = provision_kits("mlp", 3, 12, 30);
  ASSERT_FALSE(kits.empty());
  const std::vector<fs::path> configs =
      use_tables(kits, 3, tables, {{"data.label", "\"" + label + "\""}, {"data.classes", "[\"benign\", \"malignant\"]"}});
  const fs::path agg = configs.front();
  set_toml_option(agg, "validation", "\"csv:" + (tables / "test.csv").string() + "\"");
  // Federated statistics: each site's sums over its own rows, added up;
  // every site and the aggregator standardize with the merged ones.
  std::vector<std::string> merge = {"stats", "merge"};
  for (int i = 0; i < 3; ++i) {
    const fs::path sums = dir_ / ("site-" + std::to_string(i) + ".stats.json");
    const FedmeshOutput computed =
        run_fedmesh({"stats", "compute", "--config", site_config(kits, i).string(), "--out", sums.string(), "--json"});
    ASSERT_EQ(computed.exit_code, 0) << computed.text;
    EXPECT_EQ(computed.last["features"].size(), 30u) << computed.text;
    merge.push_back(sums.string());
  }
  const fs::path shared = dir_ / "federation.stats.json";
  merge.insert(merge.end(), {"--out", shared.string(), "--json"});
  const FedmeshOutput merged = run_fedmesh(merge);
  ASSERT_EQ(merged.exit_code, 0) << merged.text;
  EXPECT_EQ(merged.last["parts"], 3) << merged.text;
  // Every site's training part: 205, 128 and 123 rows less a fifth held out each.
  EXPECT_EQ(merged.last["features"][0]["count"], 164 + 102 + 98) << merged.text;
  for (const fs::path& config : configs) set_toml_option(config, "data.normalize", "\"stats:" + shared.string() + "\"");
  // Before the sites start, site-2 with another schema (the classes in
  // another order): it hears the aggregator's schema and refuses to take
  // part, naming both.
  const auto odd_site = [&] {
    const fs::path odd = kits / "site-2" / "odd.toml";
    spit(odd, slurp(site_config(kits, 2)));
    set_toml_option(odd, "data.classes", "[\"malignant\", \"benign\"]");
    set_toml_option(odd, "store", "\"odd.db\"");
    set_toml_option(odd, "metrics", "\"\"");
    ChildProcess refused(
        {"/bin/sh", "-c", "cd '" + (kits / "site-2").string() + "' && exec \"$FEDMESH\" node --config odd.toml --json"});
    std::vector<json> odd_events;
    std::optional<json> error =
        wait_for(refused, odd_events, [](const json& e) { return e.value("event", "") == "error"; }, 60s);
    ASSERT_TRUE(error.has_value()) << "a site with another schema was not refused";
    EXPECT_NE((*error)["message"].get<std::string>().find("schema"), std::string::npos) << error->dump();
    EXPECT_EQ(refused.wait(), 2);
    for (const json& e : odd_events) EXPECT_NE(e.value("event", ""), "update") << e.dump();
  };
  const double accuracy = run_kits(kits, 3, odd_site);
  std::printf("breast cancer, 3-site federation (mlp, 12 rounds, federated statistics): test accuracy %.4f\n", accuracy);
  EXPECT_GE(accuracy, 0.94);
}

// Regression: the diabetes table (442 patients, the disease's progression a
// year later), split by age into 3 sites whose targets differ in mean. The
// target is standardized like the features (by the federation's statistics,
// where it is the last entry) and the metrics come back in its own units.
TEST_F(OwnData, ARegressionTableTrainsCentrallyAndInAThreeSiteFederation) {
  const fs::path tables = dir_ / "diabetes";
  ASSERT_EQ(run_script("tests/data/split_diabetes.py", {tables.string(), "--npz"}), 0);
  const std::string label = "progression";
  const FedmeshOutput central =
      run_fedmesh({"train", "--model", "mlp", "--task", "regression", "--data",
                   "csv:" + (tables / "all-train.csv").string(), "--label", label, "--test-data",
                   "csv:" + (tables / "test.csv").string(), "--epochs", "10", "--batch-size", "32", "--json"});
  ASSERT_EQ(central.exit_code, 0) << central.text;
  const double r2 = central.last.value("test_r2", -1.0), mae = central.last.value("test_mae", -1.0);
  std::printf("diabetes, fedmesh train (central, mlp): test R2 %.4f, MAE %.2f\n", r2, mae);
  // scikit-learn's linear regression on the same split: R² 0.48, MAE 45.7.
  std::printf("diabetes, %s", script_last_line("tests/data/split_diabetes.py",
                                                {(dir_ / "baseline").string(), "--baseline"}).c_str());
  EXPECT_GE(r2, 0.40) << central.text;
  EXPECT_GT(mae, 20.0) << "MAE in the target's units (progression 25..346)";
  EXPECT_LT(mae, 55.0) << central.text;
  // The same rows as .npz arrays (y float64) train to the same model.
  const FedmeshOutput arrays =
      run_fedmesh({"train", "--model", "mlp", "--task", "regression", "--data",
                   "arrays:" + (tables / "all-train.npz").string(), "--test-data",
                   "arrays:" + (tables / "test.npz").string(), "--epochs", "10", "--batch-size", "32", "--json"});
  ASSERT_EQ(arrays.exit_code, 0) << arrays.text;
  std::printf("diabetes as .npz arrays: test R2 %.4f, MAE %.2f\n", arrays.last.value("test_r2", -1.0),
              arrays.last.value("test_mae", -1.0));
  EXPECT_NEAR(arrays.last.value("test_r2", -1.0), r2, 1e-6) << arrays.text;

  const fs::path kits = provision_kits("mlp", 3, 10, 4);
  ASSERT_FALSE(kits.empty());
  const std::vector<fs::path> configs =
      use_tables(kits, 3, tables, {{"data.label", "\"" + label + "\""}, {"data.task", "\"regression\""}});
  set_toml_option(configs.front(), "validation", "\"csv:" + (tables / "test.csv").string() + "\"");
  // The statistics through the aggregator: `stats serve` on its endpoint,
  // `stats send` at each site, every site getting the same file back. A
  // site whose table drops a column is refused first, naming the mismatch.
  const fs::path shared = dir_ / "diabetes.stats.json";
  const std::vector<json> serve_events = exchange_stats(kits, 3, shared, [&] {
    const std::string odd = variant_config(kits, 2, "odd.toml", "data.drop", "[\"bmi\"]");
    ChildProcess odd_send(in_kit(kits, "site-2", "stats send --config " + odd + " --timeout 60 --out odd.stats.json"));
    EXPECT_EQ(odd_send.wait(), 2) << "a site with other features is refused";
    // A site in private mode would send its sums masked: a trusted aggregator refuses them.
    const std::string masked = variant_config(kits, 1, "masked.toml", "privacy.mode", "\"private\"");
    ChildProcess masked_send(
        in_kit(kits, "site-1", "stats send --config " + masked + " --timeout 60 --out masked.stats.json"));
    EXPECT_EQ(masked_send.wait(), 2) << "masked sums at a trusted aggregator are refused";
  });
  fedmesh::Result<fedmesh::train::data::DataStats> merged = fedmesh::train::data::read_data_stats(shared.string());
  ASSERT_TRUE(merged.is_ok()) << merged.status().to_string();
  EXPECT_EQ(merged->parts, 3);
  ASSERT_EQ(merged->features.size(), 11u);  // 10 features, then the target
  EXPECT_EQ(merged->features[10].name, label);
  EXPECT_EQ(merged->features[10].count, 3 * 118 - (24 + 24 + 24)) << "every site's training part: 118 rows less a fifth";
  for (int i = 0; i < 3; ++i) {
    fedmesh::Result<fedmesh::train::data::DataStats> copy = fedmesh::train::data::read_data_stats(
        (kits / ("site-" + std::to_string(i)) / "federation.stats.json").string());
    ASSERT_TRUE(copy.is_ok()) << copy.status().to_string();
    EXPECT_EQ(copy->digest(), merged->digest()) << "site-" << i;
  }
  EXPECT_FALSE(fs::exists(kits / "site-2" / "odd.stats.json"));
  bool refused_odd = false, refused_masked = false;
  for (const json& e : serve_events) {
    if (e.value("event", "") != "refused") continue;
    const std::string reason = e.value("reason", "");
    refused_odd = refused_odd || reason.find("do not match") != std::string::npos;
    refused_masked = refused_masked || reason.find("sends them masked") != std::string::npos;
    EXPECT_TRUE(reason.find("do not match") != std::string::npos || reason.find("masked") != std::string::npos) << e.dump();
  }
  EXPECT_TRUE(refused_odd);
  EXPECT_TRUE(refused_masked);
  for (const fs::path& config : configs) set_toml_option(config, "data.normalize", "\"stats:" + shared.string() + "\"");
  std::vector<json> events;
  const double federated = run_kits(kits, 3, {}, "test_r2", &events);
  // Each site reports R² and MAE on its own held-out rows.
  std::set<std::string> reported;
  for (const json& e : events) {
    if (e.value("event", "") != "site_report" || !e.contains("local_r2")) continue;
    reported.insert(e.value("site", ""));
    EXPECT_LE(e["local_r2"].get<double>(), 1.0) << e.dump();
    EXPECT_GT(e.value("local_mae", -1.0), 0.0) << e.dump();
  }
  EXPECT_EQ(reported.size(), 3u) << "every site's report carries local_r2 and local_mae";
  std::printf("diabetes, 3-site federation split by age (mlp, 10 rounds of 4 steps, federated statistics): test R2 %.4f\n",
              federated);
  EXPECT_GE(federated, 0.42);
}

// Private mode: the statistics through secure aggregation. Each site names
// its features, then masks its sums in a session over the roster's sites;
// the aggregator sees only their total, which equals the plain merge of the
// sites' own `stats compute` files (counts exactly, sums to 1e-12), and
// every site gets the same file back. A site whose config says trusted
// (it would send its sums in the clear) is refused first, naming the mode.
TEST_F(OwnData, PrivateModeAddsTheStatisticsUpMasked) {
  const fs::path tables = dir_ / "tables";
  ASSERT_EQ(run_script("tests/data/split_breast_cancer.py", {tables.string()}), 0);
  const fs::path kits = provision_kits("mlp", 3, 1, 1, "private");
  ASSERT_FALSE(kits.empty());
  use_tables(kits, 3, tables, {{"data.label", "\"diagnosis\""}, {"data.classes", "[\"benign\", \"malignant\"]"}});
  // What `stats merge` makes of the sites' own sums: the reference.
  std::vector<fedmesh::train::data::DataStats> own;
  for (int i = 0; i < 3; ++i) {
    const fs::path sums = dir_ / ("own-" + std::to_string(i) + ".stats.json");
    const FedmeshOutput computed =
        run_fedmesh({"stats", "compute", "--config", site_config(kits, i).string(), "--out", sums.string(), "--json"});
    ASSERT_EQ(computed.exit_code, 0) << computed.text;
    own.push_back(fedmesh::train::data::read_data_stats(sums.string()).value());
  }
  const fedmesh::train::data::DataStats plain = fedmesh::train::data::merge_data_stats(own).value();

  const fs::path shared = dir_ / "private.stats.json";
  const std::vector<json> serve_events = exchange_stats(kits, 3, shared, [&] {
    const std::string clear = variant_config(kits, 2, "clear.toml", "privacy.mode", "\"trusted\"");
    ChildProcess clear_send(in_kit(kits, "site-2", "stats send --config " + clear + " --timeout 60 --out clear.stats.json"));
    EXPECT_EQ(clear_send.wait(), 2) << "a site that would send its sums in the clear is refused";
  });
  bool refused_clear = false, summed = false;
  for (const json& e : serve_events) {
    const std::string kind = e.value("event", "");
    if (kind == "refused") {
      refused_clear = true;
      EXPECT_NE(e.value("reason", "").find("private"), std::string::npos) << e.dump();
    } else if (kind == "stats_report") {
      EXPECT_TRUE(e.value("masked", false)) << e.dump();
    } else if (kind == "masked_sum") {
      summed = true;
      EXPECT_EQ(e["contributors"].size(), 3u) << e.dump();
    }
  }
  EXPECT_TRUE(refused_clear);
  EXPECT_TRUE(summed) << "the sums went through a secure-aggregation session";
  EXPECT_FALSE(fs::exists(kits / "site-2" / "clear.stats.json"));

  const fedmesh::train::data::DataStats merged = fedmesh::train::data::read_data_stats(shared.string()).value();
  EXPECT_EQ(merged.parts, 3);
  ASSERT_EQ(merged.features.size(), plain.features.size());
  double worst = 0.0;
  for (size_t i = 0; i < plain.features.size(); ++i) {
    EXPECT_EQ(merged.features[i].name, plain.features[i].name);
    EXPECT_EQ(merged.features[i].count, plain.features[i].count) << plain.features[i].name;
    EXPECT_NEAR(merged.features[i].sum, plain.features[i].sum, 1e-12 * std::fabs(plain.features[i].sum));
    EXPECT_NEAR(merged.features[i].sum_squares, plain.features[i].sum_squares,
                1e-12 * std::fabs(plain.features[i].sum_squares));
    worst = std::max(worst, std::fabs(merged.features[i].sum - plain.features[i].sum) /
                                std::max(std::fabs(plain.features[i].sum), 1e-300));
  }
  std::printf("breast cancer, 3 sites, statistics by secure aggregation: %zu features, largest relative difference "
              "of a sum from the plain merge %.3g\n", merged.features.size(), worst);
  for (int i = 0; i < 3; ++i) {
    const fedmesh::train::data::DataStats copy = fedmesh::train::data::read_data_stats(
        (kits / ("site-" + std::to_string(i)) / "federation.stats.json").string()).value();
    EXPECT_EQ(copy.digest(), merged.digest()) << "site-" << i;
  }
}

// A model described in a file (train/model_spec.h) on the breast-cancer
// table: `model show` sizes it by the data, `train` reaches the built-in
// mlp's accuracy, a spec that does not fit the table exits 2 naming the
// layer, and a 3-site federation trains it, a site with another model being
// refused by the spec's fingerprint.
TEST_F(OwnData, AModelSpecFileTrainsOnATableAndInAFederation) {
  const fs::path tables = dir_ / "tables";
  ASSERT_EQ(run_script("tests/data/split_breast_cancer.py", {tables.string()}), 0);
  const fs::path spec = dir_ / "tabular.toml";
  spit(spec, "name = \"tabular\"\nlayers = [\n  { type = \"linear\", out = 32 },\n  { type = \"silu\" },\n"
             "  { type = \"dropout\", p = 0.1 },\n  { type = \"linear\" },\n]\n");
  const std::vector<std::string> data = {"--data", "csv:" + (tables / "all-train.csv").string(), "--label", "diagnosis"};
  std::vector<std::string> show = {"model", "show", spec.string(), "--json"};
  show.insert(show.end(), data.begin(), data.end());
  const FedmeshOutput shown = run_fedmesh(show);
  ASSERT_EQ(shown.exit_code, 0) << shown.text;
  EXPECT_EQ(shown.last["parameters"], 30 * 32 + 32 + 32 * 2 + 2) << shown.text;
  EXPECT_EQ(shown.last["layers"].size(), 4u);
  EXPECT_EQ(shown.last["layers"][3]["output"], json::array({2})) << "the last linear gets the data's 2 classes";
  const std::string fingerprint = shown.last.value("fingerprint", "");
  EXPECT_EQ(fingerprint.rfind("fnv1a64:", 0), 0u) << shown.text;

  const fs::path db = dir_ / "tabular.db";
  std::vector<std::string> train = {"train", "--model", spec.string(), "--test-data", "csv:" + (tables / "test.csv").string(),
                                    "--epochs", "20", "--batch-size", "32", "--lr", "0.001", "--db", db.string(), "--json"};
  train.insert(train.end(), data.begin(), data.end());
  const FedmeshOutput central = run_fedmesh(train);
  ASSERT_EQ(central.exit_code, 0) << central.text;
  std::printf("breast cancer, fedmesh train (central, spec tabular.toml: linear 32, silu, dropout 0.1, linear): test "
              "accuracy %.4f\n", final_accuracy(central));
  EXPECT_GE(final_accuracy(central), 0.94) << central.text;
  // The export says what it holds: the spec (as a file that builds the same
  // layers) and the data's schema, in the safetensors metadata.
  const fs::path exported = dir_ / "tabular.safetensors";
  const FedmeshOutput export_run = run_fedmesh({"checkpoint", "export", db.string(), "--out", exported.string(), "--json"});
  ASSERT_EQ(export_run.exit_code, 0) << export_run.text;
  const std::string file = slurp(exported);
  ASSERT_GT(file.size(), 8u);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), 8);
  const json metadata = json::parse(file.substr(8, header_bytes))["__metadata__"];
  ASSERT_TRUE(metadata.contains("model_spec")) << metadata.dump();
  fedmesh::Result<fedmesh::train::ModelSpec> carried =
      fedmesh::train::parse_model_spec(metadata["model_spec"].get<std::string>(), "metadata", "m");
  ASSERT_TRUE(carried.is_ok()) << carried.status().to_string();
  EXPECT_EQ(carried->fingerprint(), fingerprint) << "the export's spec builds the same layers";
  EXPECT_NE(metadata.value("data_schema", "").find("diagnosis"), std::string::npos) << metadata.dump();
  // Resuming the run with another spec under the same file name is refused.
  spit(spec, "name = \"tabular\"\nlayers = [{ type = \"linear\", out = 16 }, { type = \"linear\" }]\n");
  const FedmeshOutput changed = run_fedmesh(train);
  EXPECT_EQ(changed.exit_code, 2) << changed.text;
  EXPECT_NE(changed.text.find("model-spec"), std::string::npos) << changed.text;
  spit(spec, "name = \"tabular\"\nlayers = [\n  { type = \"linear\", out = 32 },\n  { type = \"silu\" },\n"
             "  { type = \"dropout\", p = 0.1 },\n  { type = \"linear\" },\n]\n");
  const fs::path images_only = dir_ / "images-only.toml";
  spit(images_only, "layers = [{ type = \"conv2d\", out = 8 }, { type = \"flatten\" }, { type = \"linear\" }]\n");
  train[2] = images_only.string();
  const FedmeshOutput refused = run_fedmesh(train);
  EXPECT_EQ(refused.exit_code, 2) << refused.text;
  EXPECT_NE(refused.text.find("layer 1 (conv2d) takes images"), std::string::npos) << refused.text;

  const fs::path kits = provision_kits("mlp", 3, 8, 30);
  ASSERT_FALSE(kits.empty());
  const std::vector<fs::path> configs = use_tables(
      kits, 3, tables, {{"data.label", "\"diagnosis\""}, {"data.classes", "[\"benign\", \"malignant\"]"}});
  for (const fs::path& config : configs) set_toml_option(config, "model", "\"" + spec.string() + "\"");
  set_toml_option(configs.front(), "validation", "\"csv:" + (tables / "test.csv").string() + "\"");
  const auto built_in_site = [&] {
    // site-2 with the built-in mlp: the aggregator's announcement names another spec.
    const std::string other = variant_config(kits, 2, "mlp.toml", "model", "\"mlp\"");
    set_toml_option(kits / "site-2" / other, "store", "\"mlp.db\"");
    set_toml_option(kits / "site-2" / other, "metrics", "\"\"");
    ChildProcess site(in_kit(kits, "site-2", "node --config " + other));
    std::vector<json> events;
    const std::optional<json> error =
        wait_for(site, events, [](const json& e) { return e.value("event", "") == "error"; }, 60s);
    ASSERT_TRUE(error.has_value()) << "a site with another model was not refused";
    EXPECT_NE((*error)["message"].get<std::string>().find(fingerprint), std::string::npos) << error->dump();
    EXPECT_EQ(site.wait(), 2);
  };
  const double accuracy = run_kits(kits, 3, built_in_site);
  std::printf("breast cancer, 3-site federation of the spec model (8 rounds): test accuracy %.4f\n", accuracy);
  EXPECT_GE(accuracy, 0.90);
}

TEST_F(OwnData, ImageFoldersTrainAtTheirOwnSizeAndChannels) {
  const fs::path gray = dir_ / "digits";
  ASSERT_EQ(run_script("tests/data/make_digits_images.py", {gray.string(), "--sites", "4", "--npz"}), 0);
  const FedmeshOutput cnn =
      run_fedmesh({"train", "--model", "cnn", "--data", "images:" + (gray / "train").string(), "--test-data",
                   "images:" + (gray / "test").string(), "--image-size", "8", "--epochs", "8", "--batch-size", "32",
                   "--profile", "--json"});
  ASSERT_EQ(cnn.exit_code, 0) << cnn.text;
  print_data_time("digits 8x8, cnn", cnn);
  std::printf("digits 8x8, fedmesh train cnn: test accuracy %.4f\n", final_accuracy(cnn));
  EXPECT_GE(final_accuracy(cnn), 0.93) << cnn.text;
  ASSERT_FALSE(cnn.events.empty());
  EXPECT_EQ(cnn.events.front()["classes"], 10) << cnn.events.front().dump();

  // The same digits as arrays NumPy wrote (np.savez_compressed: x (N, 1, 8, 8) uint8, y int64).
  const FedmeshOutput arrays =
      run_fedmesh({"train", "--model", "cnn", "--data", "arrays:" + (gray / "train.npz").string(), "--test-data",
                   "arrays:" + (gray / "test.npz").string(), "--epochs", "8", "--batch-size", "32", "--json"});
  ASSERT_EQ(arrays.exit_code, 0) << arrays.text;
  std::printf("digits 8x8 as .npz arrays, fedmesh train cnn: test accuracy %.4f\n", final_accuracy(arrays));
  EXPECT_GE(final_accuracy(arrays), 0.93) << arrays.text;
  EXPECT_EQ(arrays.events.front()["sample_shape"], json::array({1, 8, 8})) << arrays.events.front().dump();

  // A federation of 4 sites, each on its own folder, the aggregator on the test folder.
  const fs::path kits = provision_kits("cnn", 4, 10, 30);
  ASSERT_FALSE(kits.empty());
  const std::string classes = "[\"0\", \"1\", \"2\", \"3\", \"4\", \"5\", \"6\", \"7\", \"8\", \"9\"]";
  set_toml_option(kits / "aggregator" / "agg.toml", "validation", "\"images:" + (gray / "test").string() + "\"");
  for (const fs::path& config : {kits / "aggregator" / "agg.toml", site_config(kits, 0), site_config(kits, 1),
                                site_config(kits, 2), site_config(kits, 3)}) {
    set_toml_option(config, "data.image_size", "8");
    set_toml_option(config, "data.classes", classes);
  }
  for (int i = 0; i < 4; ++i) {
    set_toml_option(site_config(kits, i), "data.source",
                    "\"images:" + (gray / ("site-" + std::to_string(i))).string() + "\"");
  }
  const double federated = run_kits(kits, 4);
  std::printf("digits 8x8, 4-site federation (cnn, 10 rounds): test accuracy %.4f\n", federated);
  EXPECT_GE(federated, 0.93);

  const fs::path rgb = dir_ / "digits-rgb";
  ASSERT_EQ(run_script("tests/data/make_digits_images.py", {rgb.string(), "--rgb"}), 0);
  const FedmeshOutput colour =
      run_fedmesh({"train", "--model", "cnn", "--data", "images:" + (rgb / "train").string(), "--test-data",
                   "images:" + (rgb / "test").string(), "--image-size", "16", "--channels", "3", "--epochs", "2",
                   "--json"});
  ASSERT_EQ(colour.exit_code, 0) << colour.text;
  EXPECT_EQ(colour.events.front()["sample_shape"], json::array({3, 16, 16})) << colour.events.front().dump();
  EXPECT_GE(final_accuracy(colour), 0.8) << colour.text;
}

TEST_F(OwnData, BadDataIsRefusedNamingTheFileAndPlaceWithExit2) {
  const fs::path table = dir_ / "bad.csv";
  spit(table, "age,weight,outcome\n31,70,yes\n45,,no\n52,80,yes\n");
  FedmeshOutput out = run_fedmesh({"train", "--model", "mlp", "--data", "csv:" + table.string(), "--label", "outcome",
                                   "--epochs", "1", "--json"});
  EXPECT_EQ(out.exit_code, 2) << out.text;
  EXPECT_NE(out.last.value("message", "").find("bad.csv"), std::string::npos) << out.text;
  EXPECT_NE(out.last.value("message", "").find("weight"), std::string::npos) << out.text;

  out = run_fedmesh({"train", "--model", "mlp", "--data", "csv:" + table.string(), "--label", "nosuch", "--json"});
  EXPECT_EQ(out.exit_code, 2) << out.text;
  EXPECT_NE(out.last.value("message", "").find("nosuch"), std::string::npos) << out.text;

  out = run_fedmesh({"train", "--model", "mlp", "--data", "csv:" + table.string(), "--json"});
  EXPECT_EQ(out.exit_code, 2) << out.text;
  EXPECT_NE(out.last.value("message", "").find("--label"), std::string::npos) << out.text;

  const fs::path images = dir_ / "images";
  fs::create_directories(images / "cat");
  fs::create_directories(images / "dog");
  spit(images / "cat" / "broken.png", std::string("\x89PNG\r\n\x1a\n\0\0\0\rIHDR", 16));
  spit(images / "dog" / "broken.jpg", std::string("\xff\xd8\xff\xe0\0\x10JFIF", 10));
  out = run_fedmesh({"train", "--model", "cnn", "--data", "images:" + images.string(), "--json"});
  EXPECT_EQ(out.exit_code, 2) << out.text;
  EXPECT_NE(out.last.value("message", "").find("broken."), std::string::npos) << out.text;

  // A table given to the cnn: refused before training, naming the model and the shape.
  const fs::path good = dir_ / "good.csv";
  spit(good, "a,b,y\n1,2,p\n2,1,q\n3,4,p\n4,3,q\n5,6,p\n6,5,q\n");
  out = run_fedmesh({"train", "--model", "cnn", "--data", "csv:" + good.string(), "--label", "y", "--json"});
  EXPECT_EQ(out.exit_code, 2) << out.text;
  EXPECT_NE(out.last.value("message", "").find("cnn"), std::string::npos) << out.text;
  EXPECT_EQ(out.text.find("check failed"), std::string::npos) << out.text;

  // A folder of the user's that holds no IDX files: the message says how to name own data.
  const FedmeshOutput missing = run_fedmesh({"train", "--model", "mlp", "--data", dir_.string(), "--json"});
  EXPECT_EQ(missing.exit_code, 2) << missing.text;
  EXPECT_NE(missing.last.value("message", "").find("csv:FILE"), std::string::npos) << missing.text;
}

// An IDX set of 32x32 images (not Fashion-MNIST's 28x28): the models follow its shape.
TEST_F(OwnData, IdxImagesOfAnotherSizeTrain) {
  const fs::path idx = dir_ / "idx32";
  fs::create_directories(idx);
  const auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  for (const char* split : {"train", "t10k"}) {
    const uint32_t count = 64;
    std::string images = be32(0x803) + be32(count) + be32(32) + be32(32), labels = be32(0x801) + be32(count);
    for (uint32_t i = 0; i < count; ++i) {
      const uint8_t label = static_cast<uint8_t>(i % 2);
      for (int p = 0; p < 32 * 32; ++p) images += static_cast<char>(label ? (p % 32 < 16 ? 255 : 0) : (p % 32 < 16 ? 0 : 255));
      labels += static_cast<char>(label);
    }
    spit(idx / (std::string(split) + "-images-idx3-ubyte"), images);
    spit(idx / (std::string(split) + "-labels-idx1-ubyte"), labels);
  }
  for (const char* model : {"mlp", "cnn"}) {
    const FedmeshOutput out = run_fedmesh({"train", "--model", model, "--data", idx.string(), "--epochs", "1", "--json"});
    ASSERT_EQ(out.exit_code, 0) << model << ": " << out.text;
    EXPECT_EQ(out.events.front()["sample_shape"], json::array({1, 32, 32})) << out.events.front().dump();
  }
}

// Text for the language models: a 1 GiB token shard trains gpt-nano for 100
// steps in bounded memory (the peak RSS printed and held under 400 MB), and
// JSON lines train like a folder of text.
// `fedmesh sim` takes own data like every other command and splits it
// among its virtual sites by --partition: the breast-cancer table by a
// Dirichlet over its classes, the digits as .npz arrays in gossip mode.
TEST_F(OwnData, SimSplitsOwnDataAmongItsVirtualSites) {
  const fs::path tables = dir_ / "tables";
  ASSERT_EQ(run_script("tests/data/split_breast_cancer.py", {tables.string()}), 0);
  const FedmeshOutput table =
      run_fedmesh({"sim", "--model", "mlp", "--data", "csv:" + (tables / "all-train.csv").string(), "--label",
                   "diagnosis", "--test-data", "csv:" + (tables / "test.csv").string(), "--sites", "3", "--rounds", "10",
                   "--partition", "dirichlet:0.5", "--json"});
  ASSERT_EQ(table.exit_code, 0) << table.text;
  const double table_accuracy = table.last.value("final_accuracy", table.last.value("test_accuracy", -1.0));
  std::printf("breast cancer, fedmesh sim (3 virtual sites, dirichlet:0.5, 10 rounds): test accuracy %.4f\n",
              table_accuracy);
  EXPECT_GE(table_accuracy, 0.93) << table.last.dump();

  const fs::path digits = dir_ / "digits";
  ASSERT_EQ(run_script("tests/data/make_digits_images.py", {digits.string(), "--npz"}), 0);
  const FedmeshOutput gossip =
      run_fedmesh({"sim", "--mode", "gossip", "--model", "mlp", "--data", "arrays:" + (digits / "train.npz").string(),
                   "--test-data", "arrays:" + (digits / "test.npz").string(), "--sites", "4", "--rounds", "8", "--json"});
  ASSERT_EQ(gossip.exit_code, 0) << gossip.text;
  std::printf("digits .npz, fedmesh sim --mode gossip (4 peers, 8 rounds): mean test accuracy %.4f (min %.4f)\n",
              gossip.last.value("test_accuracy", -1.0), gossip.last.value("min_test_accuracy", -1.0));
  EXPECT_GE(gossip.last.value("min_test_accuracy", -1.0), 0.93) << gossip.last.dump();

  const fs::path diabetes = dir_ / "diabetes";
  ASSERT_EQ(run_script("tests/data/split_diabetes.py", {diabetes.string()}), 0);
  const FedmeshOutput regression =
      run_fedmesh({"sim", "--model", "mlp", "--task", "regression", "--label", "progression", "--data",
                   "csv:" + (diabetes / "all-train.csv").string(), "--json"});
  EXPECT_EQ(regression.exit_code, 2) << regression.text;
  EXPECT_NE(regression.text.find("regression"), std::string::npos) << regression.text;
}

// An llm.c shard (version 1: uint16 ids) of `count` ids, the alphabet's
// letters as bytes cycling from `first`, written in pieces of at most
// 4 Mi ids; on disk (fsync) when `sync`.
void write_cycle_shard(const fs::path& path, int64_t count, int64_t first, bool sync = false) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  ASSERT_NE(out, nullptr);
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(count);
  ASSERT_EQ(std::fwrite(header.data(), 4, header.size(), out), header.size());
  std::vector<uint16_t> ids(static_cast<size_t>(std::min<int64_t>(count, int64_t{1} << 22)));
  for (int64_t at = 0; at < count; at += static_cast<int64_t>(ids.size())) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(count - at, static_cast<int64_t>(ids.size())));
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<uint16_t>(97 + (first + at + static_cast<int64_t>(i)) % 26);
    ASSERT_EQ(std::fwrite(ids.data(), 2, n, out), n);
  }
  if (sync) {
    ASSERT_EQ(std::fflush(out), 0);
    ASSERT_EQ(::fsync(::fileno(out)), 0);
  }
  ASSERT_EQ(std::fclose(out), 0);
}

// Token shards as a site's own data: two sites train gpt-nano on their own
// shards, the aggregator evaluates on a third; the held-out loss falls
// below the uniform model's ln 256, with no bits per byte (no bytes behind
// the ids). A shard given to an image model is refused by name.
TEST_F(OwnData, TokenShardsAreASitesOwnData) {
  ASSERT_NO_FATAL_FAILURE(write_cycle_shard(dir_ / "site-0.bin", 40000, 0));
  ASSERT_NO_FATAL_FAILURE(write_cycle_shard(dir_ / "site-1.bin", 40000, 13));
  ASSERT_NO_FATAL_FAILURE(write_cycle_shard(dir_ / "held.bin", 8000, 5));
  const fs::path kits = provision_kits("gpt-nano", 2, 3, 20);
  ASSERT_FALSE(kits.empty());
  const fs::path agg = kits / "aggregator" / "agg.toml";
  set_toml_option(agg, "validation", "\"tokens:" + (dir_ / "held.bin").string() + "\"");
  set_toml_option(agg, "validation_limit", "20");
  for (int i = 0; i < 2; ++i) {
    set_toml_option(site_config(kits, i), "data.source",
                    "\"tokens:" + (dir_ / ("site-" + std::to_string(i) + ".bin")).string() + "\"");
  }
  const fs::path image_site = kits / "site-1" / "image.toml";
  spit(image_site, slurp(site_config(kits, 1)));
  set_toml_option(image_site, "model", "\"mlp\"");
  const FedmeshOutput refused = run_fedmesh({"node", "--config", image_site.string(), "--json"});
  EXPECT_EQ(refused.exit_code, 2) << refused.text;
  EXPECT_NE(refused.text.find("token shards are for the language models"), std::string::npos) << refused.text;

  const double loss = run_kits(kits, 2, {}, "val_loss");
  std::printf("gpt-nano, 2 sites on their own token shards, 3 rounds of 20 steps: held-out loss %.3f\n", loss);
  EXPECT_GT(loss, 0.0);
  EXPECT_LT(loss, std::log(256.0) - 1.0) << "learned something of the cycle";
}

TEST_F(OwnData, ATokenShardLargerThanMemoryNeedsTrainsInBoundedMemory) {
  const fs::path shard = dir_ / "big.bin";
  // 512 Mi uint16 ids (1 GiB), a text-like cycle below gpt-nano's 256 so the
  // loss can fall; on disk, as a shard made earlier is: pages still being
  // written back would stay in the page cache whatever the reader advises.
  ASSERT_NO_FATAL_FAILURE(write_cycle_shard(shard, int64_t{512} << 20, 0, /*sync=*/true));
  const FedmeshOutput out = run_fedmesh({"train", "--model", "gpt-nano", "--data", "tokens:" + shard.string(),
                                         "--steps", "100", "--batch-size", "16", "--test-limit", "20", "--json"});
  fs::remove(shard);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const double peak = out.last.value("peak_rss_mb", -1.0);
  std::printf("gpt-nano on a 1 GiB token shard, 100 steps: peak RSS %.0f MB, held-out loss %.3f\n", peak,
              out.last.value("val_loss", -1.0));
  EXPECT_GT(peak, 0.0);
  EXPECT_LT(peak, 400.0) << out.last.dump();
  EXPECT_FALSE(out.last.contains("val_bits_per_byte")) << "ids with no bytes behind them: " << out.last.dump();
  EXPECT_LT(out.last.value("val_loss", 99.0), std::log(256.0)) << "learned something of the cycle";

  // A shard with an id past the model's vocabulary: refused naming the place, exit 2 or 1, never a crash.
  {
    std::FILE* bad = std::fopen((dir_ / "bad.bin").c_str(), "wb");
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 1;
    header[2] = 300;
    std::fwrite(header.data(), 4, header.size(), bad);
    std::vector<uint16_t> ids(300, 5);
    ids[123] = 999;
    std::fwrite(ids.data(), 2, ids.size(), bad);
    std::fclose(bad);
  }
  const FedmeshOutput bad = run_fedmesh({"train", "--model", "gpt-nano", "--data", "tokens:" + (dir_ / "bad.bin").string(),
                                         "--steps", "1", "--json"});
  EXPECT_EQ(bad.exit_code, 2) << bad.text;
  EXPECT_NE(bad.last.value("message", "").find("token 123"), std::string::npos) << bad.text;

  std::string lines;
  for (int i = 0; i < 40; ++i) lines += "{\"id\": " + std::to_string(i) + ", \"text\": \"the quick brown fox jumps over the lazy dog, line " + std::to_string(i) + ". the quick brown fox jumps over the lazy dog.\"}\n";
  spit(dir_ / "corpus.jsonl", lines);
  const FedmeshOutput jsonl = run_fedmesh({"train", "--model", "gpt-nano", "--data", "jsonl:" + (dir_ / "corpus.jsonl").string(),
                                           "--steps", "5", "--batch-size", "4", "--json"});
  ASSERT_EQ(jsonl.exit_code, 0) << jsonl.text;
  EXPECT_TRUE(jsonl.last.contains("val_bits_per_byte")) << jsonl.last.dump();
  spit(dir_ / "broken.jsonl", "{\"text\": \"fine\"}\n{\"text\": 3}\n");
  const FedmeshOutput broken = run_fedmesh({"train", "--model", "gpt-nano", "--data", "jsonl:" + (dir_ / "broken.jsonl").string(),
                                            "--steps", "1", "--json"});
  EXPECT_EQ(broken.exit_code, 2) << broken.text;
  EXPECT_NE(broken.last.value("message", "").find("line 2"), std::string::npos) << broken.text;
}

}  // namespace
