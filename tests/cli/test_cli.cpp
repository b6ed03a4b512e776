// The real `fedmesh` binary, run as a user would run it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/fedmesh_run.h"

namespace {

using fedmesh::testing::CommandRun;

CommandRun run(const std::string& arguments, bool with_stderr = true) {
  return fedmesh::testing::run_command(arguments, with_stderr);
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

// The shipped binary has no option that writes a private-mode site's
// unmasked input or kills the process (tests get those from their own build,
// tests/support/fedmesh_with_faults.cpp): neither in the help nor hidden.
TEST(Cli, ShippedNodeHasNoTestFaultOptions) {
  const CommandRun help = run("node --help");
  EXPECT_EQ(help.exit_code, 0);
  for (const char* flag : {"--secure-dump", "--secure-exit-at"}) {
    EXPECT_EQ(help.output.find(flag), std::string::npos) << flag;
    const CommandRun given = run(std::string("node --config /nonexistent.toml ") + flag + " x");
    EXPECT_NE(given.exit_code, 0) << flag;
    EXPECT_NE(given.output.find("not expected"), std::string::npos) << given.output;
    EXPECT_NE(given.output.find(flag), std::string::npos) << given.output;
  }
}

TEST(Cli, DoctorReportsTheBuild) {
  const CommandRun doctor = run("doctor --json", /*with_stderr=*/false);
  ASSERT_EQ(doctor.exit_code, 0) << doctor.output;
  const auto lines = json_lines(doctor.output);
  ASSERT_EQ(lines.size(), 1u);
  const auto& report = lines[0];
  EXPECT_EQ(report["event"], "summary");
  EXPECT_TRUE(report.contains("cuda_compiled"));
  EXPECT_TRUE(report.contains("gpu_count"));
  EXPECT_NE(report["blas"].get<std::string>().find("OpenBLAS"), std::string::npos);
  if (report["gpu_count"] == 0) {
    EXPECT_FALSE(report["gpu_unavailable_reason"].get<std::string>().empty());
    EXPECT_EQ(report["attention_path"], "none");
  } else {
    const std::string attention = report["attention_path"].get<std::string>();
    EXPECT_TRUE(attention == "flash" || attention == "gemm") << attention;
  }
}

TEST(Cli, TrainPrintsJsonLinesEndingInASummary) {
  const CommandRun train = run(
      "train --model mlp --steps 60 --train-limit 3840 --test-limit 500 --log-every 20 --seed 3 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const auto lines = json_lines(train.output);
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
  EXPECT_NE(data.output.find("csv:FILE"), std::string::npos) << "how own data is named: " << data.output;

  const CommandRun model = run("train --model resnet");
  EXPECT_NE(model.exit_code, 0);
  EXPECT_NE(model.output.find("resnet"), std::string::npos) << model.output;

  const CommandRun schedule = run("train --schedule step:0:2 --steps 1");
  EXPECT_EQ(schedule.exit_code, 2);
  EXPECT_NE(schedule.output.find("EVERY"), std::string::npos) << schedule.output;

  // Without a GPU (or a CUDA build) the run is refused, naming the way out;
  // with one it trains.
  const CommandRun cuda = run("train --device cuda --steps 1 --train-limit 64 --test-limit 64");
  if (cuda.exit_code != 0) {
    EXPECT_EQ(cuda.exit_code, 2);
    EXPECT_NE(cuda.output.find("--device cpu"), std::string::npos) << cuda.output;
  }
  const CommandRun tpu = run("train --device tpu --steps 1");
  EXPECT_EQ(tpu.exit_code, 2);
  EXPECT_NE(tpu.output.find("unknown device 'tpu' (expected cpu or cuda)"), std::string::npos) << tpu.output;
  // ZeRO-1 keeps host shards: refused on the device (or, without a GPU, the device is).
  const CommandRun cuda_zero = run("train --device cuda --ranks 2 --zero-1 --steps 1");
  EXPECT_EQ(cuda_zero.exit_code, 2);
  EXPECT_TRUE(cuda_zero.output.find("--zero-1 with --device cuda") != std::string::npos ||
              cuda_zero.output.find("--device cpu") != std::string::npos)
      << cuda_zero.output;

  const CommandRun threads = run("train --threads 100000 --steps 1");
  EXPECT_EQ(threads.exit_code, 2);
  EXPECT_NE(threads.output.find("--threads"), std::string::npos) << threads.output;

  const CommandRun unknown = run("frobnicate");
  EXPECT_NE(unknown.exit_code, 0);
}

// Every argument error, whichever part of the command line notices it, exits
// 2 with one line on stderr that names the problem and where help is.
TEST(Cli, EveryArgumentErrorExitsTwoWithOneLine) {
  struct Case {
    const char* arguments;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"", "a command is required"},
      {"frobnicate", "unknown command 'frobnicate'"},
      {"train --model nosuch --steps 1", "nosuch"},
      {"train --batch-size abc --steps 1", "abc"},
      {"train --no-such-flag", "--no-such-flag"},
      {"train --steps", "--steps"},
      {"sim --deadline -1 --rounds 1", "--deadline"},
      {"roster", "a command is required"},
      {"checkpoint list", "DB is required"},
      {"keygen --name", "--name"},
  };
  for (const Case& c : cases) {
    const CommandRun r = run(c.arguments);
    EXPECT_EQ(r.exit_code, 2) << "fedmesh " << c.arguments << ": " << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << "fedmesh " << c.arguments << ": " << r.output;
    EXPECT_NE(r.output.find("--help"), std::string::npos) << "fedmesh " << c.arguments << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "fedmesh " << c.arguments << ": " << r.output;
  }
  EXPECT_EQ(run("--help").exit_code, 0);
  EXPECT_EQ(run("train --help").exit_code, 0);
  EXPECT_EQ(run("--version").exit_code, 0);
}

// The inspecting commands never turn a file into a store, and read a store
// they may not write (read-only media) as it is.
TEST(Cli, CheckpointCommandsRefuseNonStoresAndReadReadOnlyStores) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("fedmesh-cli-ro-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string empty = (dir / "empty.db").string();
  { std::ofstream(empty).flush(); }
  const CommandRun verify_empty = run("checkpoint verify " + empty);
  EXPECT_NE(verify_empty.exit_code, 0) << verify_empty.output;
  EXPECT_NE(verify_empty.output.find("not a fedmesh checkpoint database"), std::string::npos) << verify_empty.output;
  EXPECT_EQ(std::filesystem::file_size(empty), 0u) << "the empty file was turned into a store";

  const std::string db = (dir / "run.db").string();
  const CommandRun trained = run("train --model mlp --steps 4 --train-limit 256 --test-limit 128 --db " + db);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  // Everything committed into the database file itself (no log beside it).
  const CommandRun listed = run("checkpoint list " + db);
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  // Read-only media: a read-only bind mount of the folder (as root, whom
  // file modes do not stop), else the folder and file made read-only.
  const std::filesystem::path media = dir / "media";
  std::filesystem::create_directories(media);
  std::string read_only_db;
  bool mounted = false;
  if (geteuid() == 0) {
    const std::string bind = "mount --bind '" + dir.string() + "' '" + media.string() + "' 2>/dev/null && mount -o remount,ro,bind '" +
                             media.string() + "' 2>/dev/null";
    mounted = std::system(bind.c_str()) == 0;
    if (mounted) read_only_db = (media / "run.db").string();
    else std::system(("umount '" + media.string() + "' 2>/dev/null").c_str());
  } else {
    std::filesystem::permissions(db, std::filesystem::perms::owner_write, std::filesystem::perm_options::remove);
    std::filesystem::permissions(dir, std::filesystem::perms::owner_write, std::filesystem::perm_options::remove);
    read_only_db = db;
  }
  if (read_only_db.empty()) {
    GTEST_LOG_(INFO) << "no read-only mount here (root without mount rights): the read-only case is not run";
  } else {
    ASSERT_NE(::access(read_only_db.c_str(), W_OK), 0) << read_only_db << " is still writable";
    const CommandRun list = run("checkpoint list " + read_only_db);
    EXPECT_EQ(list.exit_code, 0) << list.output;
    std::string shown = list.output;
    const size_t at = shown.find("media/");
    if (at != std::string::npos) shown.erase(at, 6);
    EXPECT_EQ(shown, listed.output) << "what the read-only store shows differs";
    const CommandRun verify = run("checkpoint verify " + read_only_db);
    EXPECT_EQ(verify.exit_code, 0) << verify.output;
  }
  if (mounted) std::system(("umount '" + media.string() + "'").c_str());
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all, std::filesystem::perm_options::add);
  std::filesystem::permissions(db, std::filesystem::perms::owner_write, std::filesystem::perm_options::add);
  std::filesystem::remove_all(dir);
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

std::string make_temp_directory() {
  char directory_template[] = "/tmp/fedmesh-cli-XXXXXX";
  if (mkdtemp(directory_template) == nullptr) return "";
  return directory_template;
}

std::string read_text(const std::string& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

unsigned file_mode(const std::string& file) {
  struct stat info {};
  if (::stat(file.c_str(), &info) != 0) return 0;
  return info.st_mode & 07777;
}

TEST(Cli, KeygenWritesAPrivateKeyAndRefusesToOverwrite) {
  const std::string directory = make_temp_directory();
  ASSERT_FALSE(directory.empty());
  const CommandRun keygen = run("keygen --name site-a --out " + directory + "/keys --json", /*with_stderr=*/false);
  ASSERT_EQ(keygen.exit_code, 0) << keygen.output;
  const auto lines = json_lines(keygen.output);
  ASSERT_EQ(lines.size(), 1u);
  const auto& report = lines[0];
  EXPECT_EQ(report["event"], "summary");
  EXPECT_EQ(report["name"], "site-a");
  EXPECT_EQ(report["sign_public"].get<std::string>().size(), 64u);
  EXPECT_EQ(report["box_public"].get<std::string>().size(), 64u);
  const std::string key_file = report["key_file"];
  const std::string pub_file = report["pub_file"];
  EXPECT_EQ(key_file, directory + "/keys/site-a.key");
  EXPECT_EQ(file_mode(key_file), 0600u);
  EXPECT_EQ(file_mode(pub_file), 0644u);
  const std::string pub = read_text(pub_file);
  EXPECT_NE(pub.find(report["sign_public"].get<std::string>()), std::string::npos);
  EXPECT_EQ(pub.find("secret"), std::string::npos);
  const std::string key = read_text(key_file);

  // Without --json the public part is what is printed.
  const CommandRun human = run("keygen --name site-b --out " + directory + "/keys", /*with_stderr=*/false);
  ASSERT_EQ(human.exit_code, 0);
  EXPECT_EQ(human.output, read_text(directory + "/keys/site-b.pub"));

  const CommandRun again = run("keygen --name site-a --out " + directory + "/keys");
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.output.find("already exists"), std::string::npos) << again.output;
  EXPECT_EQ(read_text(key_file), key);  // untouched

  const CommandRun again_json = run("keygen --name site-a --out " + directory + "/keys --json", false);
  EXPECT_EQ(again_json.exit_code, 2);
  const auto error_lines = json_lines(again_json.output);
  ASSERT_EQ(error_lines.size(), 1u);
  EXPECT_EQ(error_lines[0]["event"], "error");

  const CommandRun bad_name = run("keygen --name 'Site A' --out " + directory);
  EXPECT_EQ(bad_name.exit_code, 2);
  EXPECT_NE(bad_name.output.find("--name"), std::string::npos) << bad_name.output;
  std::system(("rm -rf " + directory).c_str());
}

TEST(Cli, RosterInitAddSignVerify) {
  const std::string directory = make_temp_directory();
  ASSERT_FALSE(directory.empty());
  const std::string keys = directory + "/keys";
  const std::string roster = directory + "/roster.toml";
  for (const char* name : {"admin", "site-a", "agg"}) {
    ASSERT_EQ(run("keygen --name " + std::string(name) + " --out " + keys).exit_code, 0);
  }
  const CommandRun help = run("roster --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("pins the admin's public key"), std::string::npos) << help.output;
  for (const char* sub : {"init", "add", "sign", "verify"}) EXPECT_NE(help.output.find(sub), std::string::npos);

  const CommandRun init =
      run("roster init --federation fed-demo --admin-public " + keys + "/admin.pub --out " + roster);
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const CommandRun init_again =
      run("roster init --federation fed-demo --admin-public " + keys + "/admin.pub --out " + roster);
  EXPECT_EQ(init_again.exit_code, 2) << init_again.output;

  const CommandRun unsigned_verify = run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub");
  EXPECT_EQ(unsigned_verify.exit_code, 1);
  EXPECT_NE(unsigned_verify.output.find("unsigned"), std::string::npos) << unsigned_verify.output;

  const CommandRun add_site = run("roster add --roster " + roster + " --public " + keys +
                                  "/site-a.pub --role site --address tcp://10.0.0.5:7400 --json",
                                  /*with_stderr=*/false);
  ASSERT_EQ(add_site.exit_code, 0) << add_site.output;
  const auto added = json_lines(add_site.output);
  ASSERT_EQ(added.size(), 1u);
  EXPECT_EQ(added[0]["sites"], 1);
  EXPECT_EQ(added[0]["signature_removed"], false);

  const CommandRun sign = run("roster sign --roster " + roster + " --admin-key " + keys + "/admin.key");
  ASSERT_EQ(sign.exit_code, 0) << sign.output;
  const CommandRun verify = run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub");
  ASSERT_EQ(verify.exit_code, 0) << verify.output;
  EXPECT_NE(verify.output.find("roster OK: federation fed-demo, 1 sites, signed by "), std::string::npos)
      << verify.output;

  // Adding a site voids the signature, and says so.
  const CommandRun add_aggregator = run("roster add --roster " + roster + " --public " + keys +
                                        "/agg.pub --role aggregator --address tcp://10.0.0.1:7500");
  ASSERT_EQ(add_aggregator.exit_code, 0) << add_aggregator.output;
  EXPECT_NE(add_aggregator.output.find("removed the roster's signature"), std::string::npos) << add_aggregator.output;
  EXPECT_EQ(run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub").exit_code, 1);
  ASSERT_EQ(run("roster sign --roster " + roster + " --admin-key " + keys + "/admin.key").exit_code, 0);
  const CommandRun verify_json = run(
      "roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub --json", /*with_stderr=*/false);
  ASSERT_EQ(verify_json.exit_code, 0) << verify_json.output;
  const auto verified = json_lines(verify_json.output);
  ASSERT_EQ(verified.size(), 1u);
  EXPECT_EQ(verified[0]["event"], "summary");
  EXPECT_EQ(verified[0]["federation"], "fed-demo");
  EXPECT_EQ(verified[0]["sites"], 2);

  // Pinning another key: signed by a different admin.
  const CommandRun other = run("roster verify --roster " + roster + " --admin-public " + keys + "/site-a.pub");
  EXPECT_EQ(other.exit_code, 1);
  EXPECT_NE(other.output.find("different admin"), std::string::npos) << other.output;

  // Bad input: exit 2 with a reason.
  const CommandRun duplicate = run("roster add --roster " + roster + " --public " + keys + "/agg.pub --role peer");
  EXPECT_EQ(duplicate.exit_code, 2);
  EXPECT_NE(duplicate.output.find("already on"), std::string::npos) << duplicate.output;
  const CommandRun role = run("roster add --roster " + roster + " --public " + keys + "/admin.pub --role boss");
  EXPECT_EQ(role.exit_code, 2);
  EXPECT_NE(role.output.find("unknown role 'boss'"), std::string::npos) << role.output;
  const CommandRun secret = run("roster add --roster " + roster + " --public " + keys + "/admin.key --role peer");
  EXPECT_EQ(secret.exit_code, 2);
  EXPECT_NE(secret.output.find("pass the .pub file"), std::string::npos) << secret.output;
  ASSERT_EQ(::chmod((keys + "/admin.key").c_str(), 0644), 0);
  const CommandRun exposed = run("roster sign --roster " + roster + " --admin-key " + keys + "/admin.key");
  EXPECT_EQ(exposed.exit_code, 2);
  EXPECT_NE(exposed.output.find("chmod 600"), std::string::npos) << exposed.output;
  std::system(("rm -rf " + directory).c_str());
}

TEST(Cli, RosterVerifyFailsAfterTheFileIsEdited) {
  const std::string directory = make_temp_directory();
  ASSERT_FALSE(directory.empty());
  const std::string keys = directory + "/keys";
  const std::string roster = directory + "/roster.toml";
  ASSERT_EQ(run("keygen --name admin --out " + keys).exit_code, 0);
  ASSERT_EQ(run("keygen --name site-a --out " + keys).exit_code, 0);
  ASSERT_EQ(run("roster init --federation fed --admin-public " + keys + "/admin.pub --out " + roster).exit_code, 0);
  ASSERT_EQ(run("roster add --roster " + roster + " --public " + keys +
                "/site-a.pub --role site --address tcp://10.0.0.5:7400")
                .exit_code,
            0);
  ASSERT_EQ(run("roster sign --roster " + roster + " --admin-key " + keys + "/admin.key").exit_code, 0);
  ASSERT_EQ(run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub").exit_code, 0);

  std::string text = read_text(roster);
  const size_t at = text.find("10.0.0.5");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 8, "10.6.6.6");
  { std::ofstream(roster, std::ios::trunc) << text; }
  const CommandRun verify = run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub");
  EXPECT_EQ(verify.exit_code, 1);
  EXPECT_NE(verify.output.find("signature does not verify"), std::string::npos) << verify.output;
  const CommandRun verify_json =
      run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub --json", false);
  EXPECT_EQ(verify_json.exit_code, 1);
  const auto lines = json_lines(verify_json.output);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["event"], "error");
  EXPECT_EQ(lines[0]["reason"], "tampered");

  // Garbage is bad input, not a verification verdict.
  { std::ofstream(roster, std::ios::trunc) << "federation = = broken\n"; }
  const CommandRun broken = run("roster verify --roster " + roster + " --admin-public " + keys + "/admin.pub");
  EXPECT_EQ(broken.exit_code, 2);
  EXPECT_NE(broken.output.find("line 1"), std::string::npos) << broken.output;
  std::system(("rm -rf " + directory).c_str());
}

}  // namespace

TEST(Cli, SimPrintsRoundsAndASummaryAndRefusesBadFlags) {
  const CommandRun sim = run(
      "sim --sites 3 --rounds 2 --local-steps 5 --train-limit 1500 --test-limit 300 --partition dirichlet:0.5 "
      "--strategy fedadam --seed 4 --threads 2 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(sim.exit_code, 0) << sim.output;
  const auto lines = json_lines(sim.output);
  ASSERT_GE(lines.size(), 4u);
  EXPECT_EQ(lines.front()["event"], "start");
  int rounds = 0;
  for (const auto& line : lines) rounds += line["event"] == "round" ? 1 : 0;
  EXPECT_EQ(rounds, 2);
  const auto& summary = lines.back();
  ASSERT_EQ(summary["event"], "summary");
  for (const char* field : {"test_accuracy", "rounds", "bytes_sent", "bytes_received", "wall_seconds"}) {
    EXPECT_TRUE(summary.contains(field)) << field;
  }
  EXPECT_EQ(summary["rounds"], 2);
  EXPECT_GT(summary["test_accuracy"].get<double>(), 0.3);

  // A language model: text split by book, held-out bits per byte per round.
  const CommandRun text = run("sim --model gpt-nano --sites 2 --partition books --rounds 1 --local-steps 2 "
                              "--test-limit 20 --optimizer adamw --lr 0.003 --threads 2 --json",
                              /*with_stderr=*/false);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  const auto text_lines = json_lines(text.output);
  ASSERT_FALSE(text_lines.empty());
  EXPECT_EQ(text_lines.front()["partition"], "books");
  ASSERT_EQ(text_lines.back()["event"], "summary");
  EXPECT_GT(text_lines.back()["bits_per_byte"].get<double>(), 0.0);
  EXPECT_LT(text_lines.back()["bits_per_byte"].get<double>(), 9.0) << "bounded by about 8 bits for bytes at start";
  // The same text among gossip peers: bits per byte of the mean and the worst peer.
  const CommandRun text_gossip = run("sim --model gpt-nano --mode gossip --sites 2 --partition testament --rounds 1 "
                                     "--local-steps 2 --test-limit 20 --optimizer adamw --lr 0.003 --threads 2 --json",
                                     /*with_stderr=*/false);
  ASSERT_EQ(text_gossip.exit_code, 0) << text_gossip.output;
  const auto gossip_lines = json_lines(text_gossip.output);
  ASSERT_FALSE(gossip_lines.empty());
  EXPECT_EQ(gossip_lines.front()["partition"], "testament");
  // After AdamW, replicas default to dense int4: top-k loses what Adam spreads
  // over every coordinate (docs/gossip.md, "Which compression").
  EXPECT_EQ(gossip_lines.front()["compression"], "int4");
  ASSERT_EQ(gossip_lines.back()["event"], "summary");
  EXPECT_GT(gossip_lines.back()["bits_per_byte"].get<double>(), 0.0);
  EXPECT_LE(gossip_lines.back()["bits_per_byte"].get<double>(), gossip_lines.back()["max_bits_per_byte"].get<double>());
  EXPECT_LT(gossip_lines.back()["max_bits_per_byte"].get<double>(), 9.0);
  // After SGD they default to top-k; push-sum sends model states, dense.
  for (const auto& [flags, compression] :
       std::vector<std::pair<std::string, std::string>>{{"", "topk:0.015+int8"}, {"--merge push-sum", "identity"}}) {
    const CommandRun sgd_gossip = run("sim --mode gossip --sites 2 --rounds 1 --local-steps 1 --json " + flags,
                                      /*with_stderr=*/false);
    ASSERT_EQ(sgd_gossip.exit_code, 0) << flags << ": " << sgd_gossip.output;
    EXPECT_EQ(json_lines(sgd_gossip.output).front()["compression"], compression) << flags;
  }
  const CommandRun text_partition = run("sim --model gpt-nano --partition dirichlet:0.5 --rounds 1");
  EXPECT_EQ(text_partition.exit_code, 2);
  EXPECT_NE(text_partition.output.find("unknown text partition"), std::string::npos) << text_partition.output;

  const CommandRun help = run("sim --help");
  for (const char* flag : {"--sites", "--partition", "--strategy", "--rule", "--async", "--staleness", "--dropout",
                           "--straggler", "--rounds", "--seed", "--json"}) {
    EXPECT_NE(help.output.find(flag), std::string::npos) << flag;
  }
  for (const char* bad : {"--strategy fedsgd", "--rule mode", "--staleness linear", "--partition dirichlet:-1",
                          "--sites 0", "--dropout 1.5", "--straggler x", "--rule krum:z"}) {
    const CommandRun refused = run(std::string("sim --rounds 1 ") + bad);
    EXPECT_EQ(refused.exit_code, 2) << bad << ": " << refused.output;
    EXPECT_NE(refused.output.find("fedmesh sim:"), std::string::npos) << bad << ": " << refused.output;
  }
  // Compression flags: refused by name, before any training.
  for (const char* flag : {"--compress", "--compress-tensor", "--dense-below", "--compress-device"}) {
    EXPECT_NE(help.output.find(flag), std::string::npos) << flag;
  }
  const struct {
    const char* flags;
    const char* expected;
  } bad_compression[] = {
      {"--compress zip", "unknown method 'zip'"},
      {"--compress topk:2", "0 < F <= 1"},
      {"--compress int8+fp16", "only topk takes a +VALUES type"},
      {"--compress-tensor fc1.bias", "expected GLOB=SPEC"},
      {"--compress powersgd:2 --async 2", "powersgd needs the round's sites to share P"},
  };
  for (const auto& c : bad_compression) {
    const CommandRun refused = run(std::string("sim --rounds 1 ") + c.flags);
    EXPECT_EQ(refused.exit_code, 2) << c.flags << ": " << refused.output;
    EXPECT_NE(refused.output.find(c.expected), std::string::npos) << c.flags << ": " << refused.output;
  }
  // A compressed run reports its plan and sends far fewer bytes than the
  // dense run above (same sites, rounds and data).
  const CommandRun compressed = run(
      "sim --sites 3 --rounds 2 --local-steps 5 --train-limit 1500 --test-limit 300 --partition dirichlet:0.5 "
      "--strategy fedadam --seed 4 --threads 2 --json --compress topk:0.01+int8 --compress-tensor '*.bias=identity'",
      /*with_stderr=*/false);
  ASSERT_EQ(compressed.exit_code, 0) << compressed.output;
  const auto compressed_lines = json_lines(compressed.output);
  ASSERT_FALSE(compressed_lines.empty());
  EXPECT_EQ(compressed_lines.front()["compression"], "topk:0.01+int8; *.bias=identity") << compressed.output;
  ASSERT_EQ(compressed_lines.back()["event"], "summary");
  EXPECT_LT(compressed_lines.back()["bytes_sent"].get<int64_t>() * 50, summary["bytes_sent"].get<int64_t>());
}

// Config files are untrusted input: each mistake is refused by name with
// exit status 2 before anything starts listening or training.
TEST(Cli, FederationConfigsAreCheckedByName) {
  const std::string dir = ::testing::TempDir() + "fedmesh-configs-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const std::string base =
      "federation = \"fed\"\nkeys = \"k.key\"\nroster = \"r.toml\"\nadmin_public = \"00\"\n";
  const struct {
    const char* role;
    std::string text;
    const char* expected;
  } cases[] = {
      {"aggregator", base + "roundz = 3\n", "unknown key 'roundz'"},
      {"aggregator", base + "rounds = \"ten\"\n", "rounds must be an integer"},
      {"aggregator", base + "rounds_mode = \"gossip\"\n", "rounds_mode 'gossip'"},
      {"aggregator", base + "rule = \"mode\"\n", "rule 'mode'"},
      {"aggregator", base + "strategy = \"fedsgd\"\n", "fedsgd"},
      {"aggregator", "keys = \"k.key\"\n", "federation is required"},
      {"aggregator", base + "rounds = [\n", "not valid TOML"},
      {"aggregator", base + "transport.faults = \"loss=0.1\"\n", "unknown key 'loss'"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ntransport.faults = \"drop=2\"\n",
       "drop must be in [0, 1]"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ndata.index = 4\ndata.sites = 4\n",
       "data.index 4"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ntraining.lr = -1\n", "lr"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ndata.partition = \"dirichlet:-1\"\n",
       "dirichlet"},
      {"node", base + "name = \"s\"\n", "aggregator is required"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ncompression.default = \"zip\"\n",
       "unknown method 'zip'"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ncompression.default = \"powersgd:2\"\n",
       "powersgd needs a P shared"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ncompression.overrides = \"*.bias=identity\"\n",
       "compression.overrides must be an array of strings"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ncompression.device = \"tpu\"\n",
       "compression.device must be cpu, cuda or auto"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ntraining.device = \"tpu\"\n",
       "training.device must be cpu or cuda"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ntraining.device = \"cuda\"\n", "gossip peers train on the cpu"},
      {"node --gpus 2 --ranks 3", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\n",
       "--gpus 2 and --ranks 3 disagree"},
      // Gossip peers (mode = "gossip"): their own keys, checked the same way.
      {"node", base + "name = \"s\"\nmode = \"mesh\"\n", "mode must be \"aggregator\" or \"gossip\""},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.merge = \"push-sum\"\ngossip.topology = \"star\"\n", "topology 'star'"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.topology = \"ring\"\n", "sends every update to every member"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.merge = \"mean\"\n", "unknown merge rule 'mean'"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.merge = \"push-sum\"\ngossip.fanout = 0\n", "gossip.fanout"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\nswim.period_seconds = -1\n", "period"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.merge = \"pairwise\"\ncompression.default = \"topk:0.01\"\n",
       "gossip cannot carry"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ncompression.default = \"powersgd:2\"\n", "PowerSGD needs a factor"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\naggregator = \"tcp://127.0.0.1:1\"\n",
       "unknown key 'aggregator'"},
      {"node", base + "name = \"s\"\nmode = \"gossip\"\ngossip.roundz = 3\n", "unknown key 'gossip.roundz'"},
      // A BPE tokenizer is for the language models.
      {"aggregator", base + "tokenizer = \"t.json\"\n", "tokenizer applies to the language models"},
      {"node", base + "name = \"s\"\naggregator = \"tcp://127.0.0.1:1\"\ndata.tokenizer = \"t.json\"\n",
       "data.tokenizer applies to the language models"},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string path = write("config-" + std::to_string(i++) + ".toml", c.text);
    const CommandRun refused = run(std::string(c.role) + " --config " + path);
    EXPECT_EQ(refused.exit_code, 2) << c.text << refused.output;
    EXPECT_NE(refused.output.find(c.expected), std::string::npos) << c.text << refused.output;
  }
  const CommandRun missing = run("aggregator --config " + dir + "/absent.toml");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("cannot open config"), std::string::npos) << missing.output;
  // A status request to nothing says so instead of hanging or crashing.
  const CommandRun status = run("status --aggregator 127.0.0.1:1");
  EXPECT_EQ(status.exit_code, 1) << status.output;
  EXPECT_NE(status.output.find("no answer"), std::string::npos) << status.output;
  std::filesystem::remove_all(dir);
}
