// `fedmesh train --db` killed with SIGKILL at random moments, over and over,
// and resumed each time: the store stays intact, no committed step is lost or
// repeated, and the final weights equal those of a run that never stopped,
// bit for bit. Then the operator commands on the store it left behind; and
// the same for `fedmesh sim --db`, whose rounds are committed before they
// are reported.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/checkpoint_store.h"
#include "tests/support/process.h"

namespace {

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using namespace std::chrono_literals;

std::string binary() {
  const char* path = std::getenv("FEDMESH_BINARY");
  return path ? path : "fedmesh";
}

// A small run: the mlp, 640 images, 8 epochs of 20 steps; every step a checkpoint.
constexpr int64_t kSteps = 160;
std::vector<std::string> train_command(const fs::path& db, int64_t checkpoint_every) {
  return {binary(), "train", "--model", "mlp", "--steps", std::to_string(kSteps), "--train-limit", "640", "--test-limit", "200",
          "--batch-size", "32", "--threads", "2", "--seed", "5", "--log-every", "1000", "--json",
          "--db", db.string(), "--checkpoint-every", std::to_string(checkpoint_every)};
}

struct RunOutput {
  std::vector<int64_t> checkpoint_steps;  // in the order the run reported them
  int64_t resumed_from = -1;              // -1: not resumed (or killed before it said)
  bool started = false;                   // printed "start": data loaded, store opened
  bool finished = false;                  // printed its summary
  nlohmann::json summary;
};

// Reads JSON events into `output` until stdout closes (or, with
// until_started, until the run has printed "start").
void read_events(ChildProcess& child, RunOutput& output, std::chrono::milliseconds timeout, bool until_started) {
  while (auto line = child.read_line(timeout)) {
    const nlohmann::json event = nlohmann::json::parse(*line, nullptr, false);
    if (!event.is_object()) continue;  // a line cut by the kill
    if (event["event"] == "checkpoint") output.checkpoint_steps.push_back(event["step"].get<int64_t>());
    if (event["event"] == "round") output.checkpoint_steps.push_back(event["round"].get<int64_t>());
    if (event["event"] == "resume") output.resumed_from = event["step"].get<int64_t>();
    if (event["event"] == "summary" && event.contains("resumed_from_round")) {
      output.resumed_from = event["resumed_from_round"].get<int64_t>();
    }
    if (event["event"] == "start") output.started = true;
    if (event["event"] == "summary") {
      output.finished = true;
      output.summary = event;
    }
    if (until_started && (output.started || output.finished)) return;
  }
}

RunOutput parse_output(ChildProcess& child, std::chrono::milliseconds timeout) {
  RunOutput output;
  read_events(child, output, timeout, /*until_started=*/false);
  return output;
}

fs::path fresh_directory(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("fedmesh-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

fedmesh::store::LoadedCheckpoint load_newest(const fs::path& db) {
  auto store = fedmesh::store::CheckpointStore::open_existing(db.string());
  EXPECT_TRUE(store.is_ok()) << store.status().to_string();
  auto loaded = store->load_latest();
  EXPECT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  return std::move(loaded).value();
}

std::string run_to_string(const std::string& arguments) {
  std::string output;
  FILE* pipe = popen((binary() + " " + arguments + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  output += "\nexit " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return output;
}

class TrainCrash : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    directory_ = fresh_directory("train-crash");
    // The reference: one run that is never interrupted.
    ChildProcess reference(train_command(directory_ / "reference.db", 1000));
    ASSERT_TRUE(reference.started());
    const RunOutput output = parse_output(reference, 120s);
    ASSERT_EQ(reference.wait(), 0);
    ASSERT_TRUE(output.finished);
  }
  static fs::path directory_;
};
fs::path TrainCrash::directory_;

TEST_F(TrainCrash, KilledAtRandomMomentsResumesToTheSameWeightsBitForBit) {
  const fs::path db = directory_ / "crashed.db";
  std::mt19937 random(20261123);
  // Each run is killed a random time after it has loaded the data and opened
  // the store: a few steps in, most often inside a commit (an fsynced
  // transaction every step is where the run spends most of its time), and
  // now and then before it printed anything or while it loads.
  std::uniform_int_distribution<int> delay_ms(0, 400);
  constexpr int kKills = 24;
  std::vector<int64_t> all_steps;  // every step reported committed, over every run
  int64_t newest_committed = -1;
  int kills_that_hit = 0;
  for (int attempt = 0; attempt < kKills; ++attempt) {
    ChildProcess run(train_command(db, 1));
    ASSERT_TRUE(run.started());
    RunOutput output;
    if (attempt % 5 != 4) read_events(run, output, 60s, /*until_started=*/true);  // else: kill it while it loads
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(random)));
    run.signal(SIGKILL);
    read_events(run, output, 10s, /*until_started=*/false);
    const int status = run.wait();
    if (status == 128 + SIGKILL) ++kills_that_hit;
    // A resumed run starts at or after the newest step any earlier run reported committed.
    if (output.resumed_from >= 0) {
      EXPECT_GE(output.resumed_from, newest_committed) << "run " << attempt << " lost a committed step";
    } else if (output.started) {
      EXPECT_EQ(newest_committed, -1) << "run " << attempt << " started over although steps were committed";
    }
    all_steps.insert(all_steps.end(), output.checkpoint_steps.begin(), output.checkpoint_steps.end());
    if (!output.checkpoint_steps.empty()) newest_committed = output.checkpoint_steps.back();

    if (!fs::exists(db)) continue;  // killed before the store was created
    auto store = fedmesh::store::CheckpointStore::open_existing(db.string());
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    ASSERT_TRUE(store->integrity_check().is_ok()) << "after kill " << attempt;
    auto rounds = store->rounds();
    ASSERT_TRUE(rounds.is_ok());
    if (!rounds->empty()) {
      EXPECT_GE(rounds->back().round, newest_committed) << "a reported commit is missing after kill " << attempt;
      newest_committed = rounds->back().round;
      EXPECT_TRUE(store->verify_round(rounds->back().round).is_ok());
    }
  }
  EXPECT_GE(kills_that_hit, kKills / 2) << "most runs should have been killed, not finished";

  // Reported commit steps strictly increase across all runs: nothing applied twice.
  for (size_t i = 1; i < all_steps.size(); ++i) {
    EXPECT_LT(all_steps[i - 1], all_steps[i]) << "step " << all_steps[i] << " was committed twice";
  }

  ChildProcess last(train_command(db, 1));
  const RunOutput output = parse_output(last, 120s);
  ASSERT_EQ(last.wait(), 0);
  ASSERT_TRUE(output.finished);
  EXPECT_EQ(output.summary["steps"], kSteps);

  const auto reference = load_newest(directory_ / "reference.db");
  const auto resumed = load_newest(db);
  EXPECT_EQ(reference.round.round, kSteps);
  EXPECT_EQ(resumed.round.round, kSteps);
  ASSERT_EQ(reference.tensors.size(), resumed.tensors.size());
  for (const auto& tensor : reference.tensors) {
    const auto* other = resumed.find(tensor.info.role, tensor.info.name);
    ASSERT_NE(other, nullptr) << tensor.info.name;
    ASSERT_EQ(other->value.nbytes(), tensor.value.nbytes());
    EXPECT_EQ(std::memcmp(other->value.raw(), tensor.value.raw(), tensor.value.nbytes()), 0)
        << tensor.info.role << "/" << tensor.info.name << " differs from the uninterrupted run";
  }
  const auto reference_metrics = nlohmann::json::parse(reference.round.metrics_json);
  const auto resumed_metrics = nlohmann::json::parse(resumed.round.metrics_json);
  EXPECT_EQ(reference_metrics["test_accuracy"], resumed_metrics["test_accuracy"]);
  EXPECT_GT(reference_metrics["test_accuracy"].get<double>(), 0.5);

  // Running the finished run again changes nothing and says so.
  const std::string again = run_to_string("train --model mlp --steps 160 --train-limit 640 --test-limit 200 "
                                          "--batch-size 32 --threads 2 --seed 5 --db " + db.string());
  EXPECT_NE(again.find("already complete"), std::string::npos) << again;
  EXPECT_NE(again.find("exit 0"), std::string::npos) << again;
}

TEST_F(TrainCrash, ResumingWithDifferentFlagsIsRefusedByName) {
  const std::string output = run_to_string("train --model mlp --steps 160 --train-limit 640 --test-limit 200 "
                                           "--batch-size 32 --threads 2 --seed 5 --lr 0.01 --db " +
                                           (directory_ / "reference.db").string());
  EXPECT_NE(output.find("--lr"), std::string::npos) << output;
  EXPECT_NE(output.find("exit 2"), std::string::npos) << output;
  const std::string missing = run_to_string("train --model mlp --resume --db " + (directory_ / "absent.db").string());
  EXPECT_NE(missing.find("no such checkpoint database"), std::string::npos) << missing;
  EXPECT_NE(missing.find("exit 2"), std::string::npos) << missing;
}

TEST_F(TrainCrash, ASecondRunOnTheSameStoreIsRefusedWhileTheFirstRuns) {
  const fs::path db = directory_ / "busy.db";
  ChildProcess first({binary(), "train", "--model", "mlp", "--steps", "100000", "--train-limit", "640",
                      "--test-limit", "100", "--threads", "1", "--json", "--db", db.string()});
  RunOutput output;
  read_events(first, output, 60s, /*until_started=*/true);
  ASSERT_TRUE(output.started);
  const std::string second = run_to_string("train --model mlp --steps 100000 --train-limit 640 --test-limit 100 "
                                           "--threads 1 --db " + db.string());
  EXPECT_NE(second.find("in use by another process"), std::string::npos) << second;
  EXPECT_NE(second.find("exit 2"), std::string::npos) << second;
  // Inspecting it is fine while it runs.
  const std::string list = run_to_string("checkpoint list " + db.string());
  EXPECT_NE(list.find("exit 0"), std::string::npos) << list;
  first.signal(SIGKILL);
  first.wait();
}

TEST_F(TrainCrash, OperatorCommandsListVerifyAndExport) {
  const fs::path db = directory_ / "reference.db";
  const std::string list = run_to_string("checkpoint list --json " + db.string());
  EXPECT_NE(list.find("\"round\":160"), std::string::npos) << list;
  EXPECT_NE(list.find("exit 0"), std::string::npos) << list;
  const std::string verify = run_to_string("checkpoint verify " + db.string());
  EXPECT_NE(verify.find("integrity check: ok"), std::string::npos) << verify;
  EXPECT_NE(verify.find("exit 0"), std::string::npos) << verify;

  const fs::path exported = directory_ / "model.safetensors";
  const std::string out = run_to_string("checkpoint export " + db.string() + " --out " + exported.string());
  ASSERT_NE(out.find("exit 0"), std::string::npos) << out;
  // Read the file back as a safetensors reader would and compare every value.
  std::ifstream file(exported, std::ios::binary);
  ASSERT_TRUE(file.good());
  uint8_t length_bytes[8];
  file.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  ASSERT_LT(header_length, 1u << 20);
  std::string header_text(header_length, '\0');
  file.read(header_text.data(), static_cast<std::streamsize>(header_length));
  const nlohmann::json header = nlohmann::json::parse(header_text);
  const std::string data((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto checkpoint = load_newest(db);
  int model_tensors = 0;
  for (const auto& tensor : checkpoint.tensors) {
    if (tensor.info.role != "model") {
      EXPECT_FALSE(header.contains(tensor.info.name)) << "optimizer state exported as model weights";
      continue;
    }
    ++model_tensors;
    ASSERT_TRUE(header.contains(tensor.info.name)) << tensor.info.name;
    const auto& entry = header[tensor.info.name];
    EXPECT_EQ(entry["dtype"], "F32");
    EXPECT_EQ(entry["shape"].get<std::vector<int64_t>>(), tensor.value.shape());
    const auto begin = entry["data_offsets"][0].get<size_t>(), end = entry["data_offsets"][1].get<size_t>();
    ASSERT_EQ(end - begin, tensor.value.nbytes());
    ASSERT_LE(end, data.size());
    EXPECT_EQ(std::memcmp(data.data() + begin, tensor.value.raw(), tensor.value.nbytes()), 0) << tensor.info.name;
  }
  EXPECT_EQ(model_tensors, 6);  // three Linear layers: weight and bias each
  EXPECT_EQ(header.size(), 7u);  // and __metadata__
  // The file says what it holds: the run's recorded settings.
  ASSERT_TRUE(header["__metadata__"].contains("train_config")) << header["__metadata__"].dump();
  const nlohmann::json run = nlohmann::json::parse(header["__metadata__"]["train_config"].get<std::string>());
  EXPECT_EQ(run["model"], "mlp") << run.dump();

  // An independent reader: NumPy, from Debian's python3-numpy, which deploy/setup.sh installs
  // (for Debian's own interpreter, so that one is asked for first).
  const char* checker = std::getenv("FEDMESH_EXPORT_CHECKER");
  const std::string python = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  if (checker == nullptr || std::system((python + " -c 'import numpy' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "python3-numpy not installed: the NumPy cross-check of the export did not run";
  }
  const fs::path npy = directory_ / "npy";
  const std::string npy_out =
      run_to_string("checkpoint export " + db.string() + " --format npy --out " + npy.string());
  ASSERT_NE(npy_out.find("exit 0"), std::string::npos) << npy_out;
  const std::string check = [&] {
    std::string output;
    FILE* pipe = popen((python + " " + std::string(checker) + " " + exported.string() + " " + npy.string() + " 2>&1").c_str(), "r");
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
    output += "\nexit " + std::to_string(WEXITSTATUS(pclose(pipe)));
    return output;
  }();
  EXPECT_NE(check.find("6 tensors agree"), std::string::npos) << check;
  EXPECT_NE(check.find("exit 0"), std::string::npos) << check;
}

TEST(SimCrash, KilledAtRandomMomentsResumesToTheSameModel) {
  const fs::path dir = fresh_directory("sim-crash");
  const auto command = [&](const fs::path& db) {
    return std::vector<std::string>{binary(), "sim", "--sites", "4", "--rounds", "12", "--local-steps", "10",
                                    "--train-limit", "4000", "--test-limit", "300", "--partition", "dirichlet:0.5",
                                    "--strategy", "fedadam", "--dropout", "0.2", "--seed", "6", "--threads", "2",
                                    // Compressed: every site's residual, the top-k warm-up count and
                                    // PowerSGD's shared Q must come back from the store too.
                                    "--compress", "topk:0.05+int8:warmup=3", "--compress-tensor",
                                    "fc1.weight=powersgd:2", "--json", "--db", db.string()};
  };
  {
    ChildProcess reference(command(dir / "reference.db"));
    const RunOutput output = parse_output(reference, 120s);
    ASSERT_EQ(reference.wait(), 0);
    ASSERT_TRUE(output.finished);
  }
  const fs::path db = dir / "crashed.db";
  std::mt19937 random(77);
  std::uniform_int_distribution<int> delay_ms(0, 300);
  std::vector<int64_t> reported;  // rounds reported, over every run: each only after its commit
  for (int attempt = 0; attempt < 8; ++attempt) {
    ChildProcess run(command(db));
    RunOutput output;
    read_events(run, output, 60s, /*until_started=*/true);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(random)));
    run.signal(SIGKILL);
    read_events(run, output, 10s, /*until_started=*/false);
    run.wait();
    reported.insert(reported.end(), output.checkpoint_steps.begin(), output.checkpoint_steps.end());
    if (!fs::exists(db)) continue;
    auto store = fedmesh::store::CheckpointStore::open_existing(db.string());
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    ASSERT_TRUE(store->integrity_check().is_ok());
    auto rounds = store->rounds();
    ASSERT_TRUE(rounds.is_ok());
    if (!reported.empty()) {
      ASSERT_FALSE(rounds->empty());
      EXPECT_GE(rounds->back().round, reported.back()) << "a reported round is not in the store";
    }
  }
  for (size_t i = 1; i < reported.size(); ++i) {
    EXPECT_LT(reported[i - 1], reported[i]) << "round " << reported[i] << " was reported twice";
  }
  ChildProcess last(command(db));
  const RunOutput output = parse_output(last, 120s);
  ASSERT_EQ(last.wait(), 0);
  ASSERT_TRUE(output.finished);
  const auto reference = load_newest(dir / "reference.db");
  const auto resumed = load_newest(db);
  EXPECT_EQ(resumed.round.round, reference.round.round);
  ASSERT_EQ(reference.tensors.size(), resumed.tensors.size());
  for (const auto& tensor : reference.tensors) {
    const auto* other = resumed.find(tensor.info.role, tensor.info.name);
    ASSERT_NE(other, nullptr) << tensor.info.name;
    EXPECT_EQ(std::memcmp(other->value.raw(), tensor.value.raw(), tensor.value.nbytes()), 0)
        << tensor.info.role << "/" << tensor.info.name << " differs from the uninterrupted simulation";
  }
}

}  // namespace

// `train --init` an exported round: the new run starts from exactly
// those weights. With a step too small to move any fp32 weight (SGD at
// lr 1e-30), its evaluation repeats the checkpoint's held-out loss to the
// last bit; a file that does not fit the model is refused by name.
TEST_F(TrainCrash, InitFromAnExportStartsFromItsWeights) {
  const fs::path db = directory_ / "reference.db";
  const fs::path exported = directory_ / "init.safetensors";
  const std::string out = run_to_string("checkpoint export " + db.string() + " --out " + exported.string());
  ASSERT_NE(out.find("exit 0"), std::string::npos) << out;
  const nlohmann::json metrics = nlohmann::json::parse(load_newest(db).round.metrics_json);
  ASSERT_TRUE(metrics.contains("test_loss")) << metrics.dump();

  const std::string run = run_to_string("train --model mlp --steps 1 --optimizer sgd --lr 1e-30 --momentum 0 "
                                        "--weight-decay 0 --train-limit 640 --test-limit 200 --batch-size 32 "
                                        "--threads 2 --json --init " + exported.string());
  ASSERT_NE(run.find("exit 0"), std::string::npos) << run;
  EXPECT_NE(run.find("\"init\""), std::string::npos) << run;  // the start event says so
  std::optional<double> test_loss;
  std::istringstream lines(run);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json event = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (event.is_object() && event.value("event", "") == "summary") test_loss = event.at("test_loss").get<double>();
  }
  ASSERT_TRUE(test_loss.has_value()) << run;
  EXPECT_EQ(*test_loss, metrics.at("test_loss").get<double>());

  const std::string wrong_model = run_to_string("train --model cnn --steps 1 --init " + exported.string());
  EXPECT_NE(wrong_model.find("has no array \"conv1.weight\""), std::string::npos) << wrong_model;
  EXPECT_NE(wrong_model.find("exit 2"), std::string::npos) << wrong_model;
  const std::string missing = run_to_string("train --model mlp --steps 1 --init " +
                                            (directory_ / "absent.safetensors").string());
  EXPECT_NE(missing.find("--init"), std::string::npos) << missing;
  EXPECT_NE(missing.find("exit 2"), std::string::npos) << missing;
}
