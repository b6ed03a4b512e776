// Differential privacy with the real binary:
// - `fedmesh train --dp-clip 1 --dp-noise 1.1` on the mlp reports the
//   (epsilon, delta) the RDP accountant gives for its steps and sampling
//   rate, still learns (over 50% test accuracy after 40 steps), and commits
//   a ledger entry with every checkpoint, epsilon rising, which
//   `fedmesh privacy report` prints;
// - `--dp-target-epsilon` stops before the step that would pass it;
// - flags that cannot be private are refused by name;
// - `fedmesh sim --mode private --dp-noise 1 --db P.db` commits one ledger
//   entry per released round (mechanism dp-fedavg-seeded), and `fedmesh
//   privacy report P.db` gives the sim's epsilon and says the noise was
//   seeded for replay; the text outputs of both show epsilon;
// - DP-FedAvg whose noise swamps the signal (4 sites, sigma 1 on the mlp's
//   535 818 parameters) warns with an event and on stderr; a small sigma
//   does not;
// - `--dp-seeded-noise` replays DP-SGD exactly and says it is not private,
//   while the CSPRNG's runs differ.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "privacy/rdp_accountant.h"
#include "store/checkpoint_store.h"
#include "support/fedmesh_run.h"
#include "support/process.h"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

using Output = fedmesh::testing::FedmeshOutput;

Output run(std::vector<std::string> args) { return fedmesh::testing::run_fedmesh(std::move(args)); }

std::vector<std::string> private_training(const fs::path& db, int64_t steps) {
  std::vector<std::string> args = {"train", "--model", "mlp", "--steps", std::to_string(steps), "--batch-size", "64",
                                   "--train-limit", "4000", "--test-limit", "500", "--optimizer", "sgd", "--lr", "0.5",
                                   "--momentum", "0", "--schedule", "constant", "--threads", "2", "--seed", "4",
                                   "--dp-clip", "1.0", "--dp-noise", "1.1", "--json", "--log-every", "1000"};
  if (!db.empty()) {
    for (const std::string& flag : {std::string("--db"), db.string(), std::string("--checkpoint-every"), std::string("10")}) {
      args.push_back(flag);
    }
  }
  return args;
}

double expected_epsilon(int64_t steps) {
  fedmesh::privacy::RdpAccountant accountant;
  // The noise multiplier flag is held in fp32, as the trainer uses it.
  EXPECT_TRUE(accountant.add(64.0 / 4000.0, static_cast<double>(1.1f), steps).is_ok());
  return accountant.spent(1e-5).epsilon;
}

class Privacy : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-privacy-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(Privacy, DpSgdReportsItsBudgetLearnsAndKeepsALedger) {
  const fs::path db = dir_ / "dp.db";
  const Output trained = run(private_training(db, 40));
  ASSERT_EQ(trained.exit_code, 0) << trained.text;
  EXPECT_NEAR(trained.last["epsilon"].get<double>(), expected_epsilon(40), 1e-9);
  EXPECT_EQ(trained.last["delta"].get<double>(), 1e-5);
  EXPECT_GT(trained.last["test_accuracy"].get<double>(), 0.5) << "DP-SGD still learns";
  std::printf("DP-SGD mlp, 40 steps: test accuracy %.3f at (epsilon %.4f, delta 1e-5)\n",
              trained.last["test_accuracy"].get<double>(), trained.last["epsilon"].get<double>());

  auto store = fedmesh::store::CheckpointStore::open_existing(db.string());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  const std::vector<fedmesh::store::PrivacyEntry> ledger = store->privacy_ledger().value();
  ASSERT_EQ(ledger.size(), 4u) << "one entry per checkpoint: steps 10, 20, 30, 40";
  for (size_t i = 0; i < ledger.size(); ++i) {
    EXPECT_EQ(ledger[i].round, static_cast<int64_t>(10 * (i + 1)));
    EXPECT_EQ(ledger[i].mechanism, "dp-sgd");
    EXPECT_NEAR(ledger[i].epsilon, expected_epsilon(ledger[i].round), 1e-9);
    if (i > 0) {
      EXPECT_GT(ledger[i].epsilon, ledger[i - 1].epsilon);
    }
  }

  const Output report = run({"privacy", "report", db.string(), "--json"});
  ASSERT_EQ(report.exit_code, 0) << report.text;
  EXPECT_EQ(report.last["rounds"], 4);
  EXPECT_NEAR(report.last["epsilon"].get<double>(), expected_epsilon(40), 1e-9);
  EXPECT_EQ(report.last["private"], true);
  const Output plain = run({"privacy", "report", db.string()});
  EXPECT_NE(plain.text.find("dp-sgd"), std::string::npos) << plain.text;
}

TEST_F(Privacy, ATargetBudgetStopsTrainingBeforeItIsPassed) {
  std::vector<std::string> args = private_training({}, 400);
  args.push_back("--dp-target-epsilon");
  args.push_back("1.0");
  const Output trained = run(args);
  ASSERT_EQ(trained.exit_code, 0) << trained.text;
  const int64_t steps = trained.last["steps"].get<int64_t>();
  EXPECT_LT(steps, 400);
  EXPECT_GT(steps, 0);
  EXPECT_LE(trained.last["epsilon"].get<double>(), 1.0);
  EXPECT_GT(expected_epsilon(steps + 1), 1.0) << "one more step would have passed the budget";
}

TEST_F(Privacy, FlagsThatCannotBePrivateAreRefused) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--dp-noise", "1"}, {"--dp-clip", "1", "--precision", "fp16"},
        {"--dp-clip", "1", "--dp-delta", "0"}, {"--dp-target-epsilon", "1"},
        {"--dp-clip", "1", "--dp-noise", "0.01", "--dp-target-epsilon", "0.001"}}) {
    std::vector<std::string> args = {"train", "--model", "mlp", "--steps", "5", "--train-limit", "256", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const Output refused = run(args);
    EXPECT_EQ(refused.exit_code, 2) << extra.front() << ": " << refused.text;
    EXPECT_NE(refused.last.value("message", "").find("--dp"), std::string::npos) << refused.text;
  }
  const Output missing = run({"privacy", "report", (dir_ / "none.db").string(), "--json"});
  EXPECT_EQ(missing.exit_code, 2);
}

std::vector<std::string> private_simulation(const fs::path& db, const std::string& sites, const std::string& sigma) {
  std::vector<std::string> args = {"sim", "--mode", "private", "--sites", sites, "--rounds", "3", "--local-steps", "4",
                                   "--train-limit", "2000", "--test-limit", "200", "--seed", "3", "--threads", "2",
                                   "--dp-noise", sigma};
  if (!db.empty()) {
    args.push_back("--db");
    args.push_back(db.string());
  }
  return args;
}

// stdout and stderr together, for what a person sees.
std::string run_with_stderr(const std::vector<std::string>& args) {
  std::string command = fedmesh::testing::fedmesh_under_test();
  for (const std::string& a : args) command += " '" + a + "'";
  command += " 2>&1";
  fedmesh::testing::ChildProcess child({"/bin/sh", "-c", command});
  std::string text;
  for (const std::string& line : child.read_all(300s)) text += line + "\n";
  EXPECT_EQ(child.wait(), 0) << text;
  return text;
}

TEST_F(Privacy, APrivateSimulationKeepsALedgerThatTheReportReads) {
  const fs::path db = dir_ / "P.db";
  std::vector<std::string> args = private_simulation(db, "4", "1");
  args.push_back("--json");
  const Output simulated = run(args);
  ASSERT_EQ(simulated.exit_code, 0) << simulated.text;
  const double epsilon = simulated.last["epsilon"].get<double>();
  EXPECT_GT(epsilon, 0.0);
  EXPECT_EQ(simulated.last["dp_noise"], "seeded");
  EXPECT_NE(simulated.last.value("dp_noise_note", "").find("not a privacy guarantee"), std::string::npos);

  auto store = fedmesh::store::CheckpointStore::open_existing(db.string());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  const std::vector<fedmesh::store::PrivacyEntry> ledger = store->privacy_ledger().value();
  ASSERT_FALSE(ledger.empty());
  for (const fedmesh::store::PrivacyEntry& e : ledger) EXPECT_EQ(e.mechanism, "dp-fedavg-seeded");
  EXPECT_DOUBLE_EQ(ledger.back().epsilon, epsilon);

  const Output report = run({"privacy", "report", db.string(), "--json"});
  ASSERT_EQ(report.exit_code, 0) << report.text;
  EXPECT_EQ(report.last["private"], true);
  EXPECT_EQ(report.last["rounds"], ledger.size());
  EXPECT_EQ(report.last["seeded_noise_rounds"], ledger.size());
  EXPECT_DOUBLE_EQ(report.last["epsilon"].get<double>(), epsilon);

  const Output text = run({"privacy", "report", db.string()});
  EXPECT_EQ(text.text.find("not differentially private"), std::string::npos) << text.text;
  EXPECT_NE(text.text.find("dp-fedavg-seeded"), std::string::npos) << text.text;
  EXPECT_NE(text.text.find("spent: (epsilon"), std::string::npos) << text.text;
  EXPECT_NE(text.text.find("not a privacy guarantee"), std::string::npos) << text.text;

  // The sim's own text output shows epsilon, per round and at the end.
  const std::string plain = run_with_stderr(private_simulation({}, "4", "1"));
  EXPECT_NE(plain.find("  epsilon "), std::string::npos) << plain;
  EXPECT_NE(plain.find("differential privacy (DP-FedAvg"), std::string::npos) << plain;
  EXPECT_NE(plain.find("seeded for replay"), std::string::npos) << plain;
}

TEST_F(Privacy, NoiseThatSwampsTheSignalIsWarnedAbout) {
  // sigma sqrt(d / R) / k = 1 x sqrt(535 818 / 3) / 4 = 106: far above 1.
  std::vector<std::string> args = private_simulation({}, "4", "1");
  args.push_back("--json");
  const Output swamped = run(args);
  ASSERT_EQ(swamped.exit_code, 0) << swamped.text;
  const nlohmann::json* warning = nullptr;
  for (const nlohmann::json& e : swamped.events) {
    if (e.value("event", "") == "warning" && e.value("kind", "") == "dp_noise_swamps_signal") warning = &e;
  }
  ASSERT_NE(warning, nullptr) << swamped.text;
  EXPECT_NEAR((*warning)["noise_to_signal"].get<double>(), std::sqrt(535818.0 / 3.0) / 4.0, 1e-6);
  EXPECT_EQ((*warning)["sites_needed"], static_cast<int64_t>(std::ceil(std::sqrt(535818.0 / 3.0))));
  const std::string seen = run_with_stderr(private_simulation({}, "4", "1"));
  EXPECT_NE(seen.find("warning: DP-FedAvg noise swamps the signal"), std::string::npos) << seen;

  // sigma 0.001: 0.001 x sqrt(535 818 / 3) / 4 = 0.11, no warning.
  const std::string quiet = run_with_stderr(private_simulation({}, "4", "0.001"));
  EXPECT_EQ(quiet.find("swamps"), std::string::npos) << quiet;
}

TEST_F(Privacy, SeededDpSgdReplaysAndSaysItIsNotPrivate) {
  const auto training = [&](bool seeded) {
    std::vector<std::string> args = private_training({}, 3);
    if (seeded) args.push_back("--dp-seeded-noise");
    const Output out = run(args);
    EXPECT_EQ(out.exit_code, 0) << out.text;
    return out.last;
  };
  const nlohmann::json a = training(true), b = training(true);
  EXPECT_EQ(a["test_loss"], b["test_loss"]) << "seeded noise replays";
  EXPECT_EQ(a["dp_noise"], "seeded");
  EXPECT_NE(a.value("dp_noise_note", "").find("not a privacy guarantee"), std::string::npos);
  const nlohmann::json c = training(false), d = training(false);
  EXPECT_EQ(c["dp_noise"], "csprng");
  EXPECT_NE(c["test_loss"], d["test_loss"]) << "two CSPRNG runs drew the same noise";
}

}  // namespace
