// Differential privacy with the real binary:
// - `fedmesh train --dp-clip 1 --dp-noise 1.1` on the mlp reports the
//   (epsilon, delta) the RDP accountant gives for its steps and sampling
//   rate, still learns (over 50% test accuracy after 40 steps), and commits
//   a ledger entry with every checkpoint, epsilon rising, which
//   `fedmesh privacy report` prints;
// - `--dp-target-epsilon` stops before the step that would pass it;
// - flags that cannot be private are refused by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "privacy/rdp_accountant.h"
#include "store/checkpoint_store.h"
#include "support/fedmesh_run.h"

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

}  // namespace
