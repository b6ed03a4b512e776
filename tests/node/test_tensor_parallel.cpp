// Tensor parallelism with Gloo among real processes: a Linear(32, 64) ->
// ReLU -> Linear(64, 16) block split over 2 ranks (column- then
// row-parallel) gives, on a batch of 8, the output and input gradient of the
// whole block on one process, and each rank's parameter gradients are its
// slices of the whole block's, within 1e-5 (fp32 sums in another order).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/random.h"
#include "node/parallel/tensor_parallel.h"

namespace fedmesh::node {
namespace {

constexpr int64_t kBatch = 8, kIn = 32, kHidden = 64, kOut = 16;

struct Block {
  Linear first{"fc1", kIn, kHidden};
  Linear second{"fc2", kHidden, kOut};
  Block() {
    Rng rng(3);
    first.initialize(rng);
    second.initialize(rng);
  }
};

Tensor random_tensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::zeros(std::move(shape));
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
  return t;
}

std::vector<float> values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

void write(const std::string& path, const std::vector<std::vector<float>>& parts) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : parts) {
    const uint64_t n = p.size();
    out.write(reinterpret_cast<const char*>(&n), sizeof n);
    out.write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(n * sizeof(float)));
  }
}

std::vector<std::vector<float>> read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::vector<float>> parts;
  uint64_t n = 0;
  while (in.read(reinterpret_cast<char*>(&n), sizeof n)) {
    parts.emplace_back(n);
    in.read(reinterpret_cast<char*>(parts.back().data()), static_cast<std::streamsize>(n * sizeof(float)));
  }
  return parts;
}

// Output, input gradient, then fc1 weight/bias and fc2 weight/bias gradients.
std::vector<std::vector<float>> whole_block() {
  Block block;
  ReLU relu;
  const Tensor z = block.second.forward(relu.forward(block.first.forward(random_tensor({kBatch, kIn}, 11), true), true), true);
  const std::vector<float> output = values(z);
  const Tensor dx = block.first.backward(relu.backward(block.second.backward(random_tensor({kBatch, kOut}, 12), true), true), true);
  return {output, values(dx), values(block.first.weight().grad), values(block.first.bias().grad),
          values(block.second.weight().grad), values(block.second.bias().grad)};
}

int run_rank(const std::string& dir, int rank, int size) {
  RendezvousOptions options;
  options.directory = dir + "/rendezvous";
  options.rank = rank;
  options.size = size;
  Result<std::unique_ptr<Communicator>> communicator = make_gloo_communicator(options);
  if (!communicator.is_ok()) return 2;
  Block block;
  Result<std::unique_ptr<TensorParallelMlp>> shard = TensorParallelMlp::shard(block.first, block.second, **communicator);
  if (!shard.is_ok()) return 3;
  Result<Tensor> z = (*shard)->forward(random_tensor({kBatch, kIn}, 11));
  if (!z.is_ok()) return 4;
  Result<Tensor> dx = (*shard)->backward(random_tensor({kBatch, kOut}, 12));
  if (!dx.is_ok()) return 5;
  write(dir + "/rank-" + std::to_string(rank),
        {values(*z), values(*dx), values((*shard)->column().weight().grad), values((*shard)->column().bias().grad),
         values((*shard)->row().weight().grad), values((*shard)->row().bias().grad)});
  return 0;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  EXPECT_LT(worst, 1e-5) << what;
}

TEST(TensorParallel, TwoRanksEqualOneOnTheWholeBlock) {
  const int size = 2;
  const std::string dir = ::testing::TempDir() + "fedmesh-tp-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // Every run in a child: the kernels' worker threads do not survive a fork.
  std::vector<pid_t> children;
  for (int rank = -1; rank < size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (rank < 0) {
        write(dir + "/whole", whole_block());
        ::_exit(0);
      }
      ::_exit(run_rank(dir, rank, size));
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a run failed with " << WEXITSTATUS(status);
  }
  const std::vector<std::vector<float>> whole = read(dir + "/whole");
  ASSERT_EQ(whole.size(), 6u);
  const int64_t slice = kHidden / size;
  for (int rank = 0; rank < size; ++rank) {
    const std::vector<std::vector<float>> mine = read(dir + "/rank-" + std::to_string(rank));
    ASSERT_EQ(mine.size(), 6u);
    const std::string who = "rank " + std::to_string(rank) + ": ";
    expect_near(mine[0], whole[0], who + "output");
    expect_near(mine[1], whole[1], who + "input gradient");
    const int64_t begin = rank * slice;
    // fc1: rows [begin, begin + slice) of the weight, the same slice of the bias.
    expect_near(mine[2], std::vector<float>(whole[2].begin() + begin * kIn, whole[2].begin() + (begin + slice) * kIn),
                who + "fc1.weight gradient");
    expect_near(mine[3], std::vector<float>(whole[3].begin() + begin, whole[3].begin() + begin + slice), who + "fc1.bias gradient");
    // fc2: columns [begin, begin + slice) of the weight; the bias on rank 0.
    std::vector<float> columns;
    for (int64_t o = 0; o < kOut; ++o) {
      columns.insert(columns.end(), whole[4].begin() + o * kHidden + begin, whole[4].begin() + o * kHidden + begin + slice);
    }
    expect_near(mine[4], columns, who + "fc2.weight gradient");
    expect_near(mine[5], rank == 0 ? whole[5] : std::vector<float>(kOut, 0.0f), who + "fc2.bias gradient");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fedmesh::node
