// Data parallelism with Gloo among real processes: 2 ranks (32 + 32 images
// a step) and 3 ranks (an uneven 21 + 21 + 22) train the mlp for 6 SGD steps
// with momentum, each on its part of every 64-image batch, and end with the
// weights one process gets on the whole batches: equal to it within 1e-5
// (fp32 sums in another order) and bit-identical across the ranks. Both by
// hand (train_step on the rank's part) and through fit() with
// TrainOptions::data_parallel_rank/ranks, which shuffles as one process
// would and gives each rank its part of every batch (the last one short);
// with gradient buckets all-reduced during the backward pass; and with
// ZeRO-1 (sharded optimizer state), bit-identical to unsharded.
// Tensor parallelism on the (emulated) CUDA device: a small GPT's blocks
// split over 2 ranks train to one device process's weights.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "base/random.h"
#include "train/model.h"
#include "train/data/text_corpus.h"
#include "train/parallel/data_parallel.h"
#include "train/parallel/tensor_parallel_model.h"
#include "train/parallel/zero.h"

namespace fedmesh::train {
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
  for (Parameter* p : model.parameters()) {
    const Tensor host = p->value.host();
    out.insert(out.end(), host.data<float>(), host.data<float>() + host.numel());
  }
  return out;
}

// Under the host emulation of the CUDA backend (tests/support/
// host_cuda_backend, linked into this test) "device" memory is host memory,
// so Gloo can stand for NCCL, which reads device memory: this says so.
class EmulatedDeviceCommunicator final : public Communicator {
 public:
  explicit EmulatedDeviceCommunicator(Communicator& gloo) : gloo_(gloo) {}
  int rank() const override { return gloo_.rank(); }
  int size() const override { return gloo_.size(); }
  const char* backend() const override { return "gloo on emulated device memory"; }
  bool device_memory() const override { return true; }
  Status all_reduce_sum(std::span<float> values) override { return gloo_.all_reduce_sum(values); }
  Status reduce_scatter_sum(std::span<const float> input, std::span<float> output) override {
    return gloo_.reduce_scatter_sum(input, output);
  }
  Status all_gather(std::span<const float> mine, std::span<float> output) override {
    return gloo_.all_gather(mine, output);
  }
  Status broadcast(std::span<float> values, int root) override { return gloo_.broadcast(values, root); }
  Status barrier() override { return gloo_.barrier(); }

 private:
  Communicator& gloo_;
};

// Trains kSteps steps on the rank's share of each batch (all of it for one
// process with no communicator). Returns the weights, then each step's
// reported loss (after the sync: the whole batch's).
// With zero_one, the optimizer state is sharded (ZeRO-1); each rank then
// checks that it holds state for its 1/size of the parameters only.
// With device kCuda the model trains on the (emulated) CUDA device and its
// gradient buckets live there.
std::vector<float> train(const data::ImageDataset& data, Communicator* communicator, int rank, int size,
                         DataParallelOptions parallel, const std::string& optimizer = "sgd", bool zero_one = false,
                         Device device = Device::kCpu, const LoraOptions& lora = {}) {
  std::unique_ptr<Sequential> model = std::move(make_model("mlp", 1).value());
  if (!model->attach_lora(lora, 1).is_ok()) return {};
  model->to_device(device);
  TrainOptions o = options();
  o.optimizer = optimizer;
  if (optimizer == "adamw") o.lr = 1e-3f;
  Trainer trainer(*model, o);
  std::unique_ptr<DataParallel> sync;
  std::unique_ptr<EmulatedDeviceCommunicator> on_device;
  if (communicator != nullptr && device == Device::kCuda) {
    on_device = std::make_unique<EmulatedDeviceCommunicator>(*communicator);
    communicator = on_device.get();
  }
  if (communicator != nullptr) {
    sync = std::make_unique<DataParallel>(*communicator, *model, parallel);
    trainer.set_gradient_sync(sync.get());
  }
  ShardedOptimizer* sharded = nullptr;
  if (zero_one) {
    auto optimizer_shards = std::make_unique<ShardedOptimizer>(o, *communicator);
    sharded = optimizer_shards.get();
    trainer.set_optimizer(std::move(optimizer_shards));
  }
  std::vector<float> losses;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<int64_t> batch;
    for (int64_t i = 0; i < kBatch; ++i) {
      // Rank r takes [r * 64 / size, (r + 1) * 64 / size) of the batch.
      if (i >= kBatch * rank / size && i < kBatch * (rank + 1) / size) batch.push_back(step * kBatch + i);
    }
    const StepResult r = trainer.train_step(data, batch, o.lr);
    if (!r.applied) {
      std::fprintf(stderr, "rank %d: step %d not applied: %s\n", rank, step, trainer.last_hook_status().message().c_str());
      return {};
    }
    if (r.samples != kBatch) {
      std::fprintf(stderr, "rank %d: step %d reports %lld samples, not the whole batch\n", rank, step,
                   static_cast<long long>(r.samples));
      return {};
    }
    losses.push_back(static_cast<float>(r.loss));
  }
  if (sharded != nullptr) {
    const int64_t total = model->parameter_count(), shard = (total + size - 1) / size;
    int64_t held = 0;
    for (const OptimizerStateTensor& t : trainer.optimizer().state_tensors(model->parameters())) held += t.tensor->numel();
    const int64_t expected = (optimizer == "adamw" ? 2 : 1) * (sharded->shard_end() - sharded->shard_begin());
    if (!sharded->status().is_ok() || sharded->shard_end() - sharded->shard_begin() > shard || held != expected) {
      std::fprintf(stderr, "rank %d: ZeRO-1 holds %lld state values for a shard of [%lld, %lld) of %lld: %s\n", rank,
                   static_cast<long long>(held), static_cast<long long>(sharded->shard_begin()),
                   static_cast<long long>(sharded->shard_end()), static_cast<long long>(total),
                   sharded->status().message().c_str());
      return {};
    }
  }
  std::vector<float> out = flatten(*model);
  out.insert(out.end(), losses.begin(), losses.end());
  return out;
}

void write(const std::string& path, const std::vector<float>& values) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(values.data()),
                                              static_cast<std::streamsize>(values.size() * sizeof(float)));
}

std::vector<float> read(const std::string& path, size_t count) {
  std::vector<float> values(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(count * sizeof(float)));
  if (!in) ADD_FAILURE() << "cannot read " << count << " weights from " << path;
  return values;
}

// Runs `train_rank(rank, size)` in `size` forked ranks meeting in `dir`
// (size 1: no communicator), each writing its weights to dir/rank-R. Every
// run happens in a child process: a process that has started the kernels'
// worker threads cannot fork a child that uses them.
void launch(const std::string& dir, int size,
            const std::function<std::vector<float>(Communicator*, int, int)>& train_rank) {
  std::filesystem::create_directories(dir);
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::unique_ptr<Communicator> communicator;
      if (size > 1) {
        RendezvousOptions rendezvous;
        rendezvous.directory = dir + "/rendezvous";
        rendezvous.rank = rank;
        rendezvous.size = size;
        Result<std::unique_ptr<Communicator>> made = make_gloo_communicator(rendezvous);
        if (!made.is_ok()) ::_exit(2);
        communicator = std::move(*made);
      }
      const std::vector<float> mine = train_rank(communicator.get(), rank, size);
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
}

// One bucket after the backward pass, and one bucket per layer all-reduced
// on the communication thread while the backward pass goes on: both equal
// one process on the whole batches (weights within 1e-5, each step's
// reported loss within 1e-4), and the ranks are bit-identical.
TEST(DataParallel, RanksEqualOneProcessOnTheCombinedBatch) {
  const data::ImageDataset data = synthetic_images();
  const size_t count = flatten(*make_model("mlp", 1).value()).size();
  const std::vector<float> start = flatten(*make_model("mlp", 1).value());
  const std::string base = ::testing::TempDir() + "fedmesh-dp-" + std::to_string(::getpid());
  launch(base + "-1", 1, [&](Communicator*, int, int) { return train(data, nullptr, 0, 1, {}); });
  const std::vector<float> reference = read(base + "-1/rank-0", count + kSteps);
  double moved = 0.0;
  for (size_t i = 0; i < count; ++i) moved = std::max(moved, std::fabs(static_cast<double>(reference[i]) - start[i]));
  ASSERT_GT(moved, 1e-3) << "the reference run should move the weights";
  DataParallelOptions one_bucket;
  one_bucket.bucket_bytes = SIZE_MAX;
  one_bucket.overlap = false;
  DataParallelOptions per_layer;
  per_layer.bucket_bytes = 1;  // every layer its own bucket (3 for the mlp)
  per_layer.overlap = true;
  for (const auto& [label, parallel] : {std::pair{"one bucket", one_bucket}, std::pair{"overlapped buckets", per_layer}}) {
    for (const int size : {2, 3}) {
      const std::string dir = base + "-" + std::to_string(size);
      const DataParallelOptions& options = parallel;  // (clang before 16 cannot capture a structured binding)
      launch(dir, size, [&](Communicator* c, int rank, int n) { return train(data, c, rank, n, options); });
      const std::vector<float> rank0 = read(dir + "/rank-0", reference.size());
      double worst = 0.0, worst_loss = 0.0;
      for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
      for (size_t i = count; i < reference.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
      }
      EXPECT_LT(worst, 1e-5) << label << ", " << size << " ranks against one process on the whole batches";
      EXPECT_LT(worst_loss, 1e-4) << label << ", " << size << " ranks: the reported loss is the whole batch's";
      for (int rank = 1; rank < size; ++rank) {
        EXPECT_EQ(read(dir + "/rank-" + std::to_string(rank), reference.size()), rank0) << "rank " << rank << " differs from rank 0";
      }
      std::printf("%s, %d ranks: largest difference from one process %.3g in the weights (moved up to %.3g), %.3g "
                  "in the loss\n", label, size, worst, moved, worst_loss);
      std::filesystem::remove_all(dir);
    }
  }
  std::filesystem::remove_all(base + "-1");
}

// The same with the model and its gradient buckets on the CUDA device (the
// host emulation of the backend, so the device path of the buckets, the
// counts riding in the last one and the trainer's reading of the step's
// loss before its last backward pass run here): equal to one CPU process on
// the whole batches within the same 1e-5, the ranks bit-identical, and
// broadcast_parameters and check_replicas_equal work on device parameters.
TEST(DataParallel, RanksOnTheDeviceEqualOneProcessOnTheCombinedBatch) {
  const data::ImageDataset data = synthetic_images();
  const size_t count = flatten(*make_model("mlp", 1).value()).size();
  const std::string base = ::testing::TempDir() + "fedmesh-dp-device-" + std::to_string(::getpid());
  launch(base + "-1", 1, [&](Communicator*, int, int) { return train(data, nullptr, 0, 1, {}); });
  const std::vector<float> reference = read(base + "-1/rank-0", count + kSteps);
  DataParallelOptions per_layer;
  per_layer.bucket_bytes = 1;
  per_layer.overlap = true;
  const std::string dir = base + "-2";
  launch(dir, 2, [&](Communicator* c, int rank, int n) {
    // Rank 1 starts from other weights: the broadcast makes them rank 0's.
    std::unique_ptr<Sequential> model = std::move(make_model("mlp", rank == 0 ? 1 : 2).value());
    model->to_device(Device::kCuda);
    EmulatedDeviceCommunicator device_communicator(*c);
    if (!broadcast_parameters(device_communicator, *model).is_ok()) return std::vector<float>{};
    if (!check_replicas_equal(device_communicator, *model).is_ok()) return std::vector<float>{};
    return train(data, c, rank, n, per_layer, "sgd", false, Device::kCuda);
  });
  const std::vector<float> rank0 = read(dir + "/rank-0", reference.size());
  double worst = 0.0, worst_loss = 0.0;
  for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
  for (size_t i = count; i < reference.size(); ++i) {
    worst_loss = std::max(worst_loss, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
  }
  EXPECT_LT(worst, 1e-5) << "2 device ranks against one CPU process on the whole batches";
  EXPECT_LT(worst_loss, 1e-4);
  EXPECT_EQ(read(dir + "/rank-1", reference.size()), rank0) << "rank 1 differs from rank 0";
  std::printf("2 device ranks: largest difference from one CPU process %.3g in the weights, %.3g in the loss\n", worst,
              worst_loss);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(base + "-1");
}

// ZeRO-1 shards the optimizer state (SGD's momentum, AdamW's two moments)
// across the ranks: each holds state for its 1/size of the flattened
// parameters only, and the weights are bit-identical to those of unsharded
// data parallelism (the same elementwise arithmetic on the same gradients).
TEST(DataParallel, ZeroOneEqualsUnshardedDataParallel) {
  const data::ImageDataset data = synthetic_images();
  const size_t count = flatten(*make_model("mlp", 1).value()).size();
  const std::string base = ::testing::TempDir() + "fedmesh-zero-" + std::to_string(::getpid());
  for (const std::string optimizer : {"sgd", "adamw"}) {
    for (const int size : {2, 3}) {
      const std::string plain_dir = base + "-plain", zero_dir = base + "-zero";
      launch(plain_dir, size, [&](Communicator* c, int rank, int n) { return train(data, c, rank, n, {}, optimizer); });
      launch(zero_dir, size, [&](Communicator* c, int rank, int n) { return train(data, c, rank, n, {}, optimizer, true); });
      const std::vector<float> plain = read(plain_dir + "/rank-0", count + kSteps);
      for (int rank = 0; rank < size; ++rank) {
        EXPECT_EQ(read(zero_dir + "/rank-" + std::to_string(rank), count + kSteps), plain)
            << optimizer << ", " << size << " ranks: ZeRO-1 rank " << rank << " differs from unsharded data parallelism";
      }
      std::filesystem::remove_all(plain_dir);
      std::filesystem::remove_all(zero_dir);
    }
  }
}

TEST(DataParallel, FitWithRanksEqualsFitInOneProcess) {
  const data::ImageDataset data = synthetic_images();
  const size_t count = flatten(*make_model("mlp", 1).value()).size();
  const auto fit = [&](Communicator* communicator, int rank, int size) {
    std::unique_ptr<Sequential> model = std::move(make_model("mlp", 1).value());
    TrainOptions o = options();
    o.max_steps = 0;
    o.epochs = 1;
    o.batch_size = 50;  // 384 images: 7 steps of 50 and a short one of 34
    o.seed = 9;
    o.data_parallel_rank = rank;
    o.data_parallel_ranks = size;
    Trainer trainer(*model, o);
    std::unique_ptr<DataParallel> sync;
    if (communicator != nullptr) {
      sync = std::make_unique<DataParallel>(*communicator, *model);
      trainer.set_gradient_sync(sync.get());
    }
    trainer.fit(data, nullptr, {});
    return flatten(*model);
  };
  const std::string base = ::testing::TempDir() + "fedmesh-dp-fit-" + std::to_string(::getpid());
  launch(base + "-1", 1, fit);
  const std::vector<float> reference = read(base + "-1/rank-0", count);
  for (const int size : {2, 3}) {
    const std::string dir = base + "-" + std::to_string(size);
    launch(dir, size, fit);
    const std::vector<float> rank0 = read(dir + "/rank-0", count);
    double worst = 0.0;
    for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
    EXPECT_LT(worst, 1e-5) << size << " ranks through fit()";
    for (int rank = 1; rank < size; ++rank) EXPECT_EQ(read(dir + "/rank-" + std::to_string(rank), count), rank0);
    std::printf("fit() with %d ranks: largest difference from one process %.3g\n", size, worst);
    std::filesystem::remove_all(dir);
  }
  std::filesystem::remove_all(base + "-1");
  // A rank that is not one of the ranks is refused by name.
  TrainOptions bad = options();
  bad.data_parallel_rank = 2;
  bad.data_parallel_ranks = 2;
  EXPECT_NE(bad.validate().message().find("rank 2 of 2"), std::string::npos);
}

// LoRA under data parallelism: the adapters fold each layer's weight
// gradients into its B factors before the layer's bucket is reduced, so the
// buckets hold the B factors alone (not the frozen weights) and 2 ranks,
// with overlapped per-layer buckets, on the CPU and on the emulated device,
// train the B factors of one process on the whole batches.
TEST(DataParallel, LoraRanksEqualOneProcess) {
  const data::ImageDataset data = synthetic_images();
  LoraOptions lora;
  lora.rank = 4;
  std::unique_ptr<Sequential> probe = std::move(make_model("mlp", 1).value());
  ASSERT_TRUE(probe->attach_lora(lora, 1).is_ok());
  const size_t count = flatten(*probe).size();
  EXPECT_EQ(count, static_cast<size_t>((512 + 256 + 10) * 4)) << "the trainable parameters are the B factors";
  DataParallelOptions per_layer;
  per_layer.bucket_bytes = 1;
  per_layer.overlap = true;
  const std::string base = ::testing::TempDir() + "fedmesh-dp-lora-" + std::to_string(::getpid());
  launch(base + "-1", 1, [&](Communicator*, int, int) { return train(data, nullptr, 0, 1, {}, "sgd", false, Device::kCpu, lora); });
  const std::vector<float> reference = read(base + "-1/rank-0", count + kSteps);
  double moved = 0.0;
  for (size_t i = 0; i < count; ++i) moved = std::max(moved, std::fabs(static_cast<double>(reference[i])));
  ASSERT_GT(moved, 1e-4) << "the B factors should move from zero";
  for (const Device device : {Device::kCpu, Device::kCuda}) {
    const std::string dir = base + (device == Device::kCpu ? "-cpu" : "-device");
    launch(dir, 2, [&](Communicator* c, int rank, int n) { return train(data, c, rank, n, per_layer, "sgd", false, device, lora); });
    const std::vector<float> rank0 = read(dir + "/rank-0", reference.size());
    double worst = 0.0;
    for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
    EXPECT_LT(worst, 1e-5) << (device == Device::kCpu ? "cpu" : "device") << ": 2 LoRA ranks against one process";
    EXPECT_EQ(read(dir + "/rank-1", reference.size()), rank0) << "rank 1 differs from rank 0";
    std::printf("LoRA rank 4, 2 ranks on the %s: largest difference from one process %.3g (B moved up to %.3g)\n",
                device == Device::kCpu ? "cpu" : "emulated device", worst, moved);
    std::filesystem::remove_all(dir);
  }
  std::filesystem::remove_all(base + "-1");
}

// A small GPT (2 blocks of 4 heads, width 32) trained 6 AdamW steps with
// clipping on the (emulated) CUDA device, fp32 and bf16: one process, and its
// blocks split over 2 tensor ranks (the activations' sums, the gradient
// norm and the gathers through a communicator of device memory, as NCCL's),
// gathered whole at the end: the same weights within 1e-5 in fp32 (bf16:
// within twice bf16's own distance from fp32 on one process, as AdamW moves
// coordinates whose gradients are rounding noise by up to its learning
// rate), both ranks gather the same model, the same losses.
TEST(TensorParallel, RanksOnTheDeviceEqualOneProcess) {
  TransformerConfig config;
  config.vocabulary = 64;
  config.context = 16;
  config.width = 32;
  config.heads = 4;
  config.layers = 2;
  std::vector<int32_t> tokens;
  for (int i = 0; i < 4000; ++i) tokens.push_back(static_cast<int32_t>((i * 7 + i / 5) % 61));
  const data::TextWindows text(tokens, config.context, 3);
  constexpr int kGptSteps = 6;
  std::vector<float> fp32_reference;
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    const auto train_gpt = [&](Communicator* gloo, int, int) {
      std::unique_ptr<Sequential> model = make_transformer("tiny-gpt", config, 5);
      model->to_device(Device::kCuda);
      TrainOptions o;
      o.optimizer = "adamw";
      o.lr = 3e-3f;
      o.clip_grad_norm = 0.5f;
      o.precision = precision;
      o.batch_size = 8;
      Trainer trainer(*model, o);
      std::unique_ptr<EmulatedDeviceCommunicator> on_device;
      std::unique_ptr<TensorParallelModel> tensor;
      std::unique_ptr<TensorParallelSync> sync;
      if (gloo != nullptr) {
        on_device = std::make_unique<EmulatedDeviceCommunicator>(*gloo);
        Result<std::unique_ptr<TensorParallelModel>> sharded = TensorParallelModel::shard(*model, *on_device, &trainer.optimizer());
        if (!sharded.is_ok()) return std::vector<float>{};
        tensor = std::move(*sharded);
        sync = std::make_unique<TensorParallelSync>(*tensor, nullptr);
        trainer.set_gradient_sync(sync.get());
      }
      std::vector<float> losses;
      for (int step = 0; step < kGptSteps; ++step) {
        std::vector<int64_t> batch;
        for (int64_t i = 0; i < o.batch_size; ++i) batch.push_back((step * 37 + i * 11) % text.size());
        const StepResult r = trainer.train_step(text, batch, o.lr);
        if (!r.applied) return std::vector<float>{};
        losses.push_back(static_cast<float>(r.loss));
      }
      if (tensor && !tensor->gather(&trainer.optimizer()).is_ok()) return std::vector<float>{};
      std::vector<float> out = flatten(*model);
      out.insert(out.end(), losses.begin(), losses.end());
      return out;
    };
    const std::string base = ::testing::TempDir() + "fedmesh-tp-device-" + std::to_string(::getpid());
    launch(base + "-1", 1, train_gpt);
    const size_t count = flatten(*make_transformer("tiny-gpt", config, 5)).size();
    const std::vector<float> reference = read(base + "-1/rank-0", count + kGptSteps);
    launch(base + "-2", 2, train_gpt);
    const std::vector<float> rank0 = read(base + "-2/rank-0", count + kGptSteps);
    const std::vector<float> rank1 = read(base + "-2/rank-1", count + kGptSteps);
    ASSERT_EQ(rank0.size(), reference.size());
    double worst = 0.0, worst_loss = 0.0;
    for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
    for (size_t i = count; i < reference.size(); ++i) {
      worst_loss = std::max(worst_loss, std::fabs(static_cast<double>(rank0[i]) - reference[i]));
    }
    const bool fp32 = precision == DType::kF32;
    // bf16's bound: twice how far bf16 compute copies take one process from fp32.
    double bf16_bound = 0.0;
    if (fp32) fp32_reference = reference;
    for (size_t i = 0; i < count && !fp32; ++i) {
      bf16_bound = std::max(bf16_bound, 2.0 * std::fabs(static_cast<double>(reference[i]) - fp32_reference[i]));
    }
    EXPECT_LT(worst, fp32 ? 1e-5 : bf16_bound) << dtype_name(precision) << ": 2 tensor ranks against one device process";
    EXPECT_LT(worst_loss, fp32 ? 1e-5 : 1e-3);
    EXPECT_EQ(rank1, rank0) << "the ranks gathered different models";
    std::printf("2 tensor ranks on the device, %s: largest difference from one process %.3g in the weights, %.3g in "
                "the loss%s\n", dtype_name(precision), worst, worst_loss,
                fp32 ? "" : (" (bf16 against fp32 on one process: " + std::to_string(bf16_bound / 2.0) + ")").c_str());
    std::filesystem::remove_all(base + "-1");
    std::filesystem::remove_all(base + "-2");
  }
}

}  // namespace
}  // namespace fedmesh::train
