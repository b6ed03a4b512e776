// Data parallelism with Gloo among real processes: 2 ranks (32 + 32 images
// a step) and 3 ranks (an uneven 21 + 21 + 22) train the mlp for 6 SGD steps
// with momentum, each on its part of every 64-image batch, and end with the
// weights one process gets on the whole batches: equal to it within 1e-5
// (fp32 sums in another order) and bit-identical across the ranks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "base/random.h"
#include "node/model.h"
#include "node/parallel/data_parallel.h"

namespace fedmesh::node {
namespace {

constexpr int kSteps = 6;
constexpr int64_t kBatch = 64;

data::ImageDataset synthetic_images() {
  data::ImageDataset d;
  d.count = kSteps * kBatch;
  d.rows = d.cols = 28;
  Rng rng(5);
  d.pixels.resize(static_cast<size_t>(d.count * 28 * 28));
  d.labels.resize(static_cast<size_t>(d.count));
  for (size_t i = 0; i < d.labels.size(); ++i) {
    d.labels[i] = static_cast<uint8_t>(rng.below(10));
    // A class-dependent pattern plus noise, so that the steps learn something.
    for (size_t k = 0; k < 784; ++k) {
      const double base = (k % 10 == d.labels[i]) ? 180.0 : 40.0;
      d.pixels[i * 784 + k] = static_cast<uint8_t>(std::clamp(base + 40.0 * rng.normal(), 0.0, 255.0));
    }
  }
  return d;
}

TrainOptions options() {
  TrainOptions o;
  o.optimizer = "sgd";
  o.lr = 0.05f;
  o.momentum = 0.9f;
  o.weight_decay = 0.0f;
  o.batch_size = kBatch;
  o.max_steps = kSteps;
  return o;
}

std::vector<float> flatten(Sequential& model) {
  std::vector<float> out;
  for (Parameter* p : model.parameters()) out.insert(out.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  return out;
}

// Trains kSteps steps on the rank's share of each batch (all of it for one
// process with no communicator).
std::vector<float> train(const data::ImageDataset& data, Communicator* communicator, int rank, int size) {
  std::unique_ptr<Sequential> model = std::move(make_model("mlp", 1).value());
  Trainer trainer(*model, options());
  if (communicator != nullptr) trainer.set_gradient_hook(data_parallel_hook(*communicator));
  for (int step = 0; step < kSteps; ++step) {
    std::vector<int64_t> batch;
    for (int64_t i = 0; i < kBatch; ++i) {
      // Rank r takes [r * 64 / size, (r + 1) * 64 / size) of the batch.
      if (i >= kBatch * rank / size && i < kBatch * (rank + 1) / size) batch.push_back(step * kBatch + i);
    }
    const StepResult r = trainer.train_step(data, batch, options().lr);
    if (!r.applied) {
      std::fprintf(stderr, "rank %d: step %d not applied: %s\n", rank, step, trainer.last_hook_status().message().c_str());
      return {};
    }
  }
  return flatten(*model);
}

void write(const std::string& path, const std::vector<float>& values) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(values.data()),
                                              static_cast<std::streamsize>(values.size() * sizeof(float)));
}

std::vector<float> read(const std::string& path, size_t count) {
  std::vector<float> values(count);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(values.data()),
                                             static_cast<std::streamsize>(count * sizeof(float)));
  return values;
}

// Every run happens in a child process: a process that has started the
// kernels' worker threads cannot fork a child that uses them.
TEST(DataParallel, RanksEqualOneProcessOnTheCombinedBatch) {
  const data::ImageDataset data = synthetic_images();
  const size_t count = flatten(*make_model("mlp", 1).value()).size();
  const std::string reference_file = ::testing::TempDir() + "fedmesh-dp-reference-" + std::to_string(::getpid());
  const pid_t one = ::fork();
  if (one == 0) {
    const std::vector<float> weights = train(data, nullptr, 0, 1);
    if (weights.empty()) ::_exit(3);
    write(reference_file, weights);
    ::_exit(0);
  }
  int one_status = 0;
  ::waitpid(one, &one_status, 0);
  ASSERT_TRUE(WIFEXITED(one_status) && WEXITSTATUS(one_status) == 0) << "the one-process run failed";
  const std::vector<float> reference = read(reference_file, count);
  std::filesystem::remove(reference_file);
  const std::vector<float> start = flatten(*make_model("mlp", 1).value());
  double moved = 0.0;
  for (size_t i = 0; i < start.size(); ++i) moved = std::max(moved, std::fabs(static_cast<double>(reference[i]) - start[i]));
  ASSERT_GT(moved, 1e-3) << "the reference run should move the weights";

  for (const int size : {2, 3}) {
    const std::string dir = ::testing::TempDir() + "fedmesh-dp-" + std::to_string(::getpid()) + "-" + std::to_string(size);
    std::filesystem::remove_all(dir);
    std::vector<pid_t> children;
    for (int rank = 0; rank < size; ++rank) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        RendezvousOptions rendezvous;
        rendezvous.directory = dir + "/rendezvous";
        rendezvous.rank = rank;
        rendezvous.size = size;
        Result<std::unique_ptr<Communicator>> communicator = make_gloo_communicator(rendezvous);
        if (!communicator.is_ok()) ::_exit(2);
        const std::vector<float> mine = train(data, communicator->get(), rank, size);
        if (mine.empty()) ::_exit(3);
        write(dir + "/rank-" + std::to_string(rank), mine);
        ::_exit(0);
      }
      children.push_back(pid);
    }
    for (const pid_t pid : children) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << size << " ranks: a rank failed";
    }
    const std::vector<float> rank0 = read(dir + "/rank-0", reference.size());
    double worst = 0.0;
    for (size_t i = 0; i < reference.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
    EXPECT_LT(worst, 1e-5) << size << " ranks against one process on the whole batches";
    for (int rank = 1; rank < size; ++rank) {
      EXPECT_EQ(read(dir + "/rank-" + std::to_string(rank), reference.size()), rank0) << "rank " << rank << " differs from rank 0";
    }
    std::printf("%d ranks: largest difference from one process %.3g (weights moved up to %.3g)\n", size, worst, moved);
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace fedmesh::node
