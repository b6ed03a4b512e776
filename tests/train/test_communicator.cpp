// The Gloo communicator among real processes: each test forks its ranks,
// which meet through a fresh rendezvous directory and check every
// collective against what it must compute; a rank that never arrives makes
// the others fail after the timeout instead of hanging.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "train/parallel/communicator.h"

namespace fedmesh::train {
namespace {

std::string fresh_directory(const std::string& name) {
  static int launches = 0;
  const std::string dir = ::testing::TempDir() + "fedmesh-rendezvous-" + name + "-" + std::to_string(::getpid()) +
                          "-" + std::to_string(++launches);
  std::filesystem::remove_all(dir);
  return dir;
}

// Runs `body(rank)` in `ranks` child processes; returns how many exited 0.
int run_ranks(int ranks, const std::function<int(int)>& body) {
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::fflush(stdout);
      ::_exit(body(r));
    }
    children.push_back(pid);
  }
  int ok = 0;
  for (const pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) ++ok;
  }
  return ok;
}

// A rank's check failed: say which and exit non-zero.
int fail(int rank, const std::string& what) {
  std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
  return 1;
}

int check_collectives(const std::string& dir, int rank, int size) {
  RendezvousOptions options;
  options.directory = dir;
  options.rank = rank;
  options.size = size;
  Result<std::unique_ptr<Communicator>> made = make_gloo_communicator(options);
  if (!made.is_ok()) return fail(rank, made.status().message());
  Communicator& c = **made;
  if (c.rank() != rank || c.size() != size) return fail(rank, "wrong rank or size");
  // All-reduce: sum over ranks of (rank + 1) * (i + 1).
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((rank + 1) * (i + 1));
  if (!c.all_reduce_sum(values).is_ok()) return fail(rank, "all-reduce failed");
  const float ranks_sum = static_cast<float>(size * (size + 1) / 2);
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != ranks_sum * static_cast<float>(i + 1)) return fail(rank, "all-reduce value " + std::to_string(i));
  }
  // Reduce-scatter: block b of every rank's input is (b + 1) * 10 + rank.
  const size_t block = 7;
  std::vector<float> input(block * static_cast<size_t>(size)), output(block);
  for (size_t i = 0; i < input.size(); ++i) input[i] = static_cast<float>((i / block + 1) * 10 + static_cast<size_t>(rank));
  if (!c.reduce_scatter_sum(input, output).is_ok()) return fail(rank, "reduce-scatter failed");
  const float expected = static_cast<float>(size * (rank + 1) * 10 + size * (size - 1) / 2);
  for (const float v : output) {
    if (v != expected) return fail(rank, "reduce-scatter got " + std::to_string(v) + ", not " + std::to_string(expected));
  }
  // All-gather: rank r contributes {r, r + 0.5}.
  std::vector<float> mine = {static_cast<float>(rank), static_cast<float>(rank) + 0.5f};
  std::vector<float> all(2 * static_cast<size_t>(size));
  if (!c.all_gather(mine, all).is_ok()) return fail(rank, "all-gather failed");
  for (int r = 0; r < size; ++r) {
    if (all[2 * r] != static_cast<float>(r) || all[2 * r + 1] != static_cast<float>(r) + 0.5f) return fail(rank, "all-gather");
  }
  // Broadcast from the last rank.
  std::vector<float> shared(33, static_cast<float>(rank));
  if (!c.broadcast(shared, size - 1).is_ok()) return fail(rank, "broadcast failed");
  for (const float v : shared) {
    if (v != static_cast<float>(size - 1)) return fail(rank, "broadcast");
  }
  if (!c.barrier().is_ok()) return fail(rank, "barrier failed");
  // Shapes that do not fit are refused, not sent.
  std::vector<float> wrong(block + 1);
  if (c.reduce_scatter_sum(input, wrong).code() != StatusCode::kInvalidArgument) return fail(rank, "bad shape accepted");
  if (c.broadcast(shared, size).code() != StatusCode::kInvalidArgument) return fail(rank, "bad root accepted");
  return 0;
}

TEST(GlooCommunicator, TwoAndThreeProcessesComputeEveryCollective) {
  for (const int size : {2, 3}) {
    const std::string dir = fresh_directory("collectives");
    EXPECT_EQ(run_ranks(size, [&](int rank) { return check_collectives(dir, rank, size); }), size) << size << " ranks";
    std::filesystem::remove_all(dir);
  }
}

TEST(GlooCommunicator, OneRankNeedsNoPeers) {
  const std::string dir = fresh_directory("alone");
  RendezvousOptions options;
  options.directory = dir;
  Result<std::unique_ptr<Communicator>> made = make_gloo_communicator(options);
  ASSERT_TRUE(made.is_ok()) << made.status().message();
  std::vector<float> values = {1.0f, 2.0f};
  ASSERT_TRUE((*made)->all_reduce_sum(values).is_ok());
  EXPECT_EQ(values, (std::vector<float>{1.0f, 2.0f}));
  std::filesystem::remove_all(dir);
}

TEST(GlooCommunicator, AMissingRankFailsTheOthersAfterTheTimeout) {
  const std::string dir = fresh_directory("missing");
  // Rank 1 of 2 never comes: rank 0 must give up with kUnavailable.
  const int ok = run_ranks(1, [&](int) {
    RendezvousOptions options;
    options.directory = dir;
    options.rank = 0;
    options.size = 2;
    options.timeout = std::chrono::milliseconds(1500);
    Result<std::unique_ptr<Communicator>> made = make_gloo_communicator(options);
    if (made.is_ok()) {
      std::vector<float> values(4, 1.0f);
      return (*made)->all_reduce_sum(values).code() == StatusCode::kUnavailable ? 0 : 1;
    }
    return made.status().code() == StatusCode::kUnavailable ? 0 : fail(0, "expected kUnavailable: " + made.status().message());
  });
  EXPECT_EQ(ok, 1);
  std::filesystem::remove_all(dir);
}

TEST(GlooCommunicator, BadOptionsAreRefusedByName) {
  RendezvousOptions options;
  EXPECT_NE(make_gloo_communicator(options).status().message().find("rendezvous directory"), std::string::npos);
  options.directory = fresh_directory("bad");
  options.size = 2;
  options.rank = 2;
  EXPECT_NE(make_gloo_communicator(options).status().message().find("rank 2"), std::string::npos);
}

}  // namespace
}  // namespace fedmesh::train
