// The real `fedmesh` binary, run as a user would run it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

struct CommandRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  std::string stdout_only;
};

std::string binary() {
  const char* path = std::getenv("FEDMESH_BINARY");
  return path ? path : "fedmesh";
}

CommandRun run(const std::string& arguments, bool with_stderr = true) {
  CommandRun result;
  const std::string command = binary() + " " + arguments + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.stdout_only = result.output;
  return result;
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    lines.push_back(nlohmann::json::parse(line));  // every stdout line must be JSON
  }
  return lines;
}

TEST(Cli, HelpExplainsEverySubcommand) {
  const CommandRun top = run("--help");
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_NE(top.output.find("train"), std::string::npos);
  EXPECT_NE(top.output.find("doctor"), std::string::npos);
  const CommandRun train = run("train --help");
  EXPECT_EQ(train.exit_code, 0);
  for (const char* flag : {"--model", "--epochs", "--steps", "--batch-size", "--precision", "--seed", "--json",
                           "--grad-accumulation", "--clip-grad-norm", "--schedule", "--threads", "--data"}) {
    EXPECT_NE(train.output.find(flag), std::string::npos) << flag;
  }
}

TEST(Cli, DoctorReportsTheBuild) {
  const CommandRun doctor = run("doctor --json", /*with_stderr=*/false);
  ASSERT_EQ(doctor.exit_code, 0) << doctor.output;
  const auto lines = json_lines(doctor.stdout_only);
  ASSERT_EQ(lines.size(), 1u);
  const auto& report = lines[0];
  EXPECT_EQ(report["event"], "summary");
  EXPECT_TRUE(report.contains("cuda_compiled"));
  EXPECT_TRUE(report.contains("gpu_count"));
  EXPECT_NE(report["blas"].get<std::string>().find("OpenBLAS"), std::string::npos);
  if (report["gpu_count"] == 0) {
    EXPECT_FALSE(report["gpu_unavailable_reason"].get<std::string>().empty());
  }
}

TEST(Cli, TrainPrintsJsonLinesEndingInASummary) {
  const CommandRun train = run(
      "train --model mlp --steps 60 --train-limit 3840 --test-limit 500 --log-every 20 --seed 3 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const auto lines = json_lines(train.stdout_only);
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines.front()["event"], "start");
  int steps_reported = 0;
  for (const auto& line : lines) steps_reported += line["event"] == "step" ? 1 : 0;
  EXPECT_EQ(steps_reported, 3);
  const auto& summary = lines.back();
  ASSERT_EQ(summary["event"], "summary");
  for (const char* field : {"test_accuracy", "test_loss", "samples_per_second", "wall_seconds", "rounds",
                            "bytes_sent", "bytes_received"}) {
    EXPECT_TRUE(summary.contains(field)) << field;
  }
  EXPECT_EQ(summary["steps"], 60);
  EXPECT_GT(summary["test_accuracy"].get<double>(), 0.6);
  EXPECT_GT(summary["samples_per_second"].get<double>(), 0.0);
}

TEST(Cli, HumanOutputShowsProgressAndAResult) {
  const CommandRun train = run("train --model mlp --steps 20 --train-limit 1280 --test-limit 200 --log-every 10");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_NE(train.output.find("step 10/20"), std::string::npos) << train.output;
  EXPECT_NE(train.output.find("test accuracy"), std::string::npos);
  EXPECT_NE(train.output.find("samples/s"), std::string::npos);
}

TEST(Cli, BadInputGivesAClearErrorNotACrash) {
  const CommandRun precision = run("train --precision fp8 --steps 1");
  EXPECT_EQ(precision.exit_code, 2);
  EXPECT_NE(precision.output.find("unknown precision 'fp8'"), std::string::npos) << precision.output;

  const CommandRun data = run("train --data /nonexistent/fashion --steps 1");
  EXPECT_EQ(data.exit_code, 2);
  EXPECT_NE(data.output.find("/nonexistent/fashion"), std::string::npos) << data.output;
  EXPECT_NE(data.output.find("dataset-fashion-mnist"), std::string::npos) << data.output;

  const CommandRun model = run("train --model resnet");
  EXPECT_NE(model.exit_code, 0);
  EXPECT_NE(model.output.find("resnet"), std::string::npos) << model.output;

  const CommandRun schedule = run("train --schedule step:0:2 --steps 1");
  EXPECT_EQ(schedule.exit_code, 2);
  EXPECT_NE(schedule.output.find("EVERY"), std::string::npos) << schedule.output;

  const CommandRun cuda = run("train --device cuda --steps 1");
  EXPECT_EQ(cuda.exit_code, 2);
  EXPECT_NE(cuda.output.find("--device cpu"), std::string::npos) << cuda.output;

  const CommandRun threads = run("train --threads 100000 --steps 1");
  EXPECT_EQ(threads.exit_code, 2);
  EXPECT_NE(threads.output.find("--threads"), std::string::npos) << threads.output;

  const CommandRun unknown = run("frobnicate");
  EXPECT_NE(unknown.exit_code, 0);
}

TEST(Cli, CorruptDataFilesAreRejectedByName) {
  char directory_template[] = "/tmp/fedmesh-cli-XXXXXX";
  ASSERT_NE(mkdtemp(directory_template), nullptr);
  const std::string directory = directory_template;
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                           "t10k-labels-idx1-ubyte"}) {
    FILE* f = std::fopen((directory + "/" + name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fputs("this is not an IDX file", f);
    std::fclose(f);
  }
  const CommandRun train = run("train --data " + directory + " --steps 1");
  EXPECT_EQ(train.exit_code, 2);
  EXPECT_NE(train.output.find("train-images-idx3-ubyte"), std::string::npos) << train.output;
  EXPECT_NE(train.output.find("magic"), std::string::npos) << train.output;
  std::system(("rm -rf " + directory).c_str());
}

}  // namespace
