// Training on the CUDA device against training on the CPU (mlp, cnn, the
// gpt-nano transformer, and a config-defined ResNet with group norm, SiLU,
// average pooling, dropout and residual blocks; fp32 and bf16/fp16): the same model,
// data, options and seed, moved to Device::kCuda with Sequential::to_device,
// give the CPU's losses, accuracy and weights within the tolerances below;
// a checkpoint committed from the device and restored onto it continues the
// run exactly; a step waits for the device once (its loss, norm and
// found-inf flag in one read); device memory stops growing after the first step; a CPU-only
// kernel given a device tensor, or a device op given a host one, aborts by
// name.
//
// Built twice. test_device_training links tests/support/host_cuda_backend (a
// host emulation of kernels/cuda_ops.h) and runs everywhere: it exercises the
// device path of the layers, the trainer, the optimizers and the checkpoint
// code, not the CUDA kernels. test_device_training_cuda links the real
// backend and skips, saying why, without a GPU; there the tolerances are
// those of a different summation order (cuBLAS and the device reductions).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>

#include <unistd.h>

#include "kernels/attention.h"
#include "kernels/convert.h"
#include "kernels/embedding.h"
#include "kernels/cuda_ops.h"
#include "kernels/device_ops.h"
#include "kernels/elementwise.h"
#include "train/data/batch.h"
#include "train/data/text_corpus.h"
#include "train/trainer.h"
#include "train/training_checkpoint.h"
#include "store/checkpoint_store.h"
#include "tests/support/attention_testing.h"
#include "tests/support/fashion_data.h"
#include "tests/support/tensor_testing.h"
#ifdef FEDMESH_HOST_CUDA_EMULATION
#include "tests/support/host_cuda_backend.h"
#endif

namespace fedmesh::train {
namespace {

using fedmesh::testing::attention_pass;
using fedmesh::testing::AttentionPass;
using fedmesh::testing::fashion_split;
using fedmesh::testing::relative_l2;

#ifdef FEDMESH_HOST_CUDA_EMULATION
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

#define REQUIRE_DEVICE()                                                         \
  do {                                                                           \
    if (Status s = cuda::available(); !s.is_ok()) GTEST_SKIP() << s.message();  \
  } while (false)

// A config-defined model with every layer the built-in ones lack: group
// norm, SiLU, overlapping average pooling (3 every 2), dropout, residual
// blocks (one with a 1x1 shortcut) and global average pooling.
std::string spec_model_file() {
  static const std::string path = [] {
    const std::string file = ::testing::TempDir() + "device-spec-" + std::to_string(::getpid()) + ".toml";
    std::FILE* out = std::fopen(file.c_str(), "w");
    std::fputs(R"(name = "spec-resnet"
layers = [
  { type = "conv2d", out = 8 }, { type = "groupnorm", groups = 4 }, { type = "silu" },
  { type = "avgpool", size = 3, stride = 2 },
  { type = "residual", layers = [
      { type = "conv2d", out = 8 }, { type = "groupnorm", groups = 2 }, { type = "silu" },
      { type = "dropout", p = 0.25 }, { type = "conv2d", out = 8 } ] },
  { type = "residual", layers = [
      { type = "conv2d", out = 16, stride = 2 }, { type = "groupnorm", groups = 4 }, { type = "relu" } ] },
  { type = "global_avgpool" },
  { type = "linear" },
]
)", out);
    std::fclose(out);
    return file;
  }();
  return path;
}

std::unique_ptr<Sequential> model(const std::string& name, Device device) {
  auto m = make_model(name, 11);
  EXPECT_TRUE(m.is_ok());
  std::unique_ptr<Sequential> net = std::move(m).value();
  net->to_device(device);
  return net;
}

std::vector<Tensor> host_weights(Sequential& net) {
  std::vector<Tensor> result;
  for (Parameter* p : net.parameters()) result.push_back(p->value.to(Device::kCpu));
  return result;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<Tensor> weights;
  EvalResult eval;
};

// Byte-token windows of an English text for the language models.
const data::TextWindows& text_windows() {
  static const data::TextWindows windows = [] {
    std::string text;
    const char* sentences[] = {"In the beginning the federation trained on its own data. ",
                               "Every site kept its text and shipped only its update. ",
                               "The aggregator summed what the sites sent and announced the next round. ",
                               "A node that crashed came back and resumed from its last checkpoint. "};
    for (int i = 0; i < 64; ++i) text += sentences[(i * 7 + i / 3) % 4];
    return data::TextWindows(data::byte_tokens(text), 64, 17);
  }();
  return windows;
}

Outcome train(const std::string& name, Device device, const TrainOptions& options, int64_t steps) {
  const bool text = language_model_config(name).has_value();
  const data::ImageDataset image_set = fashion_split(data::Split::kTrain).head(512);
  const data::ImageDataset test_image_set = fashion_split(data::Split::kTest).head(256);
  const data::ImageBatches images(image_set), test_images(test_image_set);
  const data::Dataset& train_set = text ? static_cast<const data::Dataset&>(text_windows())
                                        : static_cast<const data::Dataset&>(images);
  const data::Dataset& test_set = text ? static_cast<const data::Dataset&>(text_windows())
                                       : static_cast<const data::Dataset&>(test_images);
  auto net = model(name == "spec" ? spec_model_file() : name, device);
  Trainer trainer(*net, options);
  Outcome run;
  std::vector<int64_t> indices(static_cast<size_t>(options.batch_size * options.grad_accumulation));
  const int64_t span = train_set.size() - static_cast<int64_t>(indices.size());
  EXPECT_GT(span, 0);
  for (int64_t step = 0; step < steps; ++step) {
    std::iota(indices.begin(), indices.end(), (step * 29) % span);
    run.losses.push_back(trainer.train_step(train_set, indices, options.lr).loss);
  }
  run.weights = host_weights(*net);
  run.eval = trainer.evaluate(test_set);
  return run;
}

struct Case {
  const char* label;
  const char* model;
  DType precision;
  const char* optimizer;
  // Relative weight difference allowed after the steps: emulated (the CPU's
  // kernels, bias added before or after the GEMM's rounding), real device.
  double emulated_tolerance, device_tolerance;
};

class DeviceTraining : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceTraining, MatchesTheCpu) {
  REQUIRE_DEVICE();
  const Case& c = GetParam();
  TrainOptions options;
  options.batch_size = 32;
  options.grad_accumulation = 2;
  options.optimizer = c.optimizer;
  options.lr = c.optimizer == std::string("sgd") ? 0.05f : 2e-3f;
  options.clip_grad_norm = 1.0f;
  options.precision = c.precision;
  options.seed = 5;
  constexpr int64_t kSteps = 12;
  const Outcome cpu = train(c.model, Device::kCpu, options, kSteps);
  const Outcome gpu = train(c.model, Device::kCuda, options, kSteps);
  const double tolerance = kEmulated ? c.emulated_tolerance : c.device_tolerance;
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(gpu.losses[static_cast<size_t>(s)], cpu.losses[static_cast<size_t>(s)],
                tolerance * 10 * cpu.losses[static_cast<size_t>(s)])
        << c.label << " step " << s;
  }
  EXPECT_LT(cpu.losses.back(), cpu.losses.front()) << "the run learns";
  const double difference = relative_l2(gpu.weights, cpu.weights);
  EXPECT_LE(difference, tolerance) << c.label;
  std::printf("%s: weights differ by %.3g (relative L2), final loss %.6f vs %.6f on the CPU\n", c.label,
              difference, gpu.losses.back(), cpu.losses.back());
  EXPECT_EQ(gpu.eval.count, cpu.eval.count);
  EXPECT_NEAR(gpu.eval.loss, cpu.eval.loss, tolerance * 10 * cpu.eval.loss);
  EXPECT_NEAR(gpu.eval.accuracy, cpu.eval.accuracy, 0.01) << "at most 1% of the test targets change their answer";
}

INSTANTIATE_TEST_SUITE_P(
    Models, DeviceTraining,
    ::testing::Values(Case{"mlp fp32 adamw", "mlp", DType::kF32, "adamw", 1e-4, 1e-3},
                      Case{"mlp bf16 sgd", "mlp", DType::kBF16, "sgd", 2e-2, 5e-2},
                      Case{"cnn fp32 sgd", "cnn", DType::kF32, "sgd", 1e-4, 1e-3},
                      Case{"cnn fp16 adamw", "cnn", DType::kF16, "adamw", 2e-2, 5e-2},
                      Case{"gpt-nano fp32 adamw", "gpt-nano", DType::kF32, "adamw", 1e-4, 1e-3},
                      Case{"gpt-nano bf16 adamw", "gpt-nano", DType::kBF16, "adamw", 2e-2, 5e-2},
                      Case{"spec resnet fp32 adamw", "spec", DType::kF32, "adamw", 1e-4, 1e-3},
                      Case{"spec resnet bf16 sgd", "spec", DType::kBF16, "sgd", 2e-2, 5e-2}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string name = param_info.param.label;
      std::replace(name.begin(), name.end(), ' ', '_');
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// The device's attention (batched GEMMs around the softmax rows, head by head
// over chunks of sequences) against the CPU's on random inputs: in one chunk
// and in chunks of one sequence it gives the same values within rounding
// (not the same bits: cuBLASLt may sum batches of another count in another
// order, as it did on an H200), and the CPU's values within rounding (fp32:
// 1e-5 relative L2; bf16, whose probabilities and their gradients are rounded
// to bf16 for the GEMMs: 2e-2). Odd sizes: 19 positions, 3 sequences.
TEST(DeviceAttention, ChunksOfSequencesMatchTheCpu) {
  REQUIRE_DEVICE();
  const AttentionShape s{3, 19, 2, 8};
  const int64_t width = s.heads * s.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random = [&](Shape shape, DType dtype) {
    Tensor values = Tensor::empty(std::move(shape));
    for (int64_t i = 0; i < values.numel(); ++i) values.data<float>()[i] = normal(rng);
    return to_dtype(values, dtype);
  };
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const double tolerance = dtype == DType::kF32 ? 1e-5 : 2e-2;
    // Chunked against one chunk: fp32 rounding; in bf16 a value's last bit.
    const double chunking = dtype == DType::kF32 ? 1e-6 : 1e-2;
    const Tensor qkv = random({s.batch, s.seq, 3 * width}, dtype);
    const Tensor dout = random({s.batch, s.seq, width}, dtype);
    const AttentionPass cpu = attention_pass(s, qkv, dout);
    const Tensor device_qkv = qkv.to(Device::kCuda), device_dout = dout.to(Device::kCuda);
    const AttentionPass one = attention_pass(s, device_qkv, device_dout);
    const AttentionPass split = attention_pass(s, device_qkv, device_dout, /*workspace_bytes=*/1);

    EXPECT_LE(relative_l2(one.out, split.out), chunking) << "out";
    EXPECT_LE(relative_l2(one.saved, split.saved), 1e-6) << "log-sum-exps";
    EXPECT_LE(relative_l2(one.dqkv, split.dqkv), chunking) << "dqkv";
    EXPECT_LE(relative_l2(one.out, cpu.out), tolerance) << "out";
    EXPECT_LE(relative_l2(one.saved, cpu.saved), 1e-5) << "log-sum-exps (fp32 arithmetic)";
    EXPECT_LE(relative_l2(one.dqkv, cpu.dqkv), tolerance) << "dqkv";
    std::printf("attention %s: out %.3g, dqkv %.3g (relative L2 to the CPU); chunked: out %.3g, dqkv %.3g\n",
                dtype_name(dtype), relative_l2(one.out, cpu.out), relative_l2(one.dqkv, cpu.dqkv),
                relative_l2(one.out, split.out), relative_l2(one.dqkv, split.dqkv));
  }
}

// Checkpoint committed from the device at step 4, restored into a fresh
// device model and trainer, run to step 8: the weights equal those of a run
// never interrupted, bit for bit.
TEST(DeviceTraining, CheckpointRoundTripsThroughTheStore) {
  REQUIRE_DEVICE();
  const data::ImageDataset train_set = fashion_split(data::Split::kTrain).head(256);
  TrainOptions options;
  options.batch_size = 32;
  options.precision = DType::kBF16;
  options.max_steps = 8;
  options.seed = 9;
  const auto path = std::filesystem::temp_directory_path() / ("fedmesh_device_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  const std::string db = (path / "run.db").string();

  auto whole = model("mlp", Device::kCuda);
  Trainer whole_trainer(*whole, options);
  whole_trainer.fit(train_set, nullptr, {});

  {
    auto first = model("mlp", Device::kCuda);
    Trainer trainer(*first, options);
    auto store = store::CheckpointStore::open(db);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    TrainCallbacks callbacks;
    callbacks.on_step = [&](const StepProgress& p) {
      if (p.step == 4) {
        ASSERT_TRUE(commit_training_checkpoint(*store, *first, trainer, nlohmann::json::object()).is_ok());
        throw std::runtime_error("interrupted");
      }
    };
    EXPECT_THROW(trainer.fit(train_set, nullptr, callbacks), std::runtime_error);
  }
  auto resumed = model("mlp", Device::kCuda);
  Trainer trainer(*resumed, options);
  auto store = store::CheckpointStore::open_existing(db);
  ASSERT_TRUE(store.is_ok());
  auto latest = store->load_latest();
  ASSERT_TRUE(latest.is_ok()) << latest.status().to_string();
  ASSERT_TRUE(restore_training_checkpoint(*latest, *resumed, trainer).is_ok());
  EXPECT_EQ(resumed->parameters().front()->value.device(), Device::kCuda) << "restored onto the device";
  trainer.fit(train_set, nullptr, {});
  const std::vector<Tensor> a = host_weights(*resumed), b = host_weights(*whole);
  for (size_t t = 0; t < a.size(); ++t) {
    EXPECT_EQ(std::memcmp(a[t].raw(), b[t].raw(), a[t].nbytes()), 0) << "tensor " << t;
  }
  std::filesystem::remove_all(path);
}

// fp16 from a loss scale far too large: the first steps overflow and are
// skipped on the device as on the CPU (the optimizer's kernels gated by
// found_inf, AdamW's step count taken back), the scale halves the same way,
// and the runs end equal within the fp16 tolerance.
TEST(DeviceTraining, OverflowingStepsAreSkippedAsOnTheCpu) {
  REQUIRE_DEVICE();
  const data::ImageDataset image_set = fashion_split(data::Split::kTrain).head(256);
  const data::ImageBatches images(image_set);
  TrainOptions options;
  options.batch_size = 32;
  options.precision = DType::kF16;
  options.loss_scaling.initial_scale = 1e9f;
  std::vector<int64_t> indices(32);
  std::vector<Tensor> weights[2];
  int64_t skipped[2] = {0, 0}, optimizer_steps[2] = {0, 0};
  float scales[2] = {0.0f, 0.0f};
  for (const Device device : {Device::kCpu, Device::kCuda}) {
    const int d = device == Device::kCpu ? 0 : 1;
    auto net = model("mlp", device);
    Trainer trainer(*net, options);
    for (int64_t step = 0; step < 20; ++step) {
      std::iota(indices.begin(), indices.end(), (step * 32) % 224);
      trainer.train_step(images, indices, 1e-3f);
    }
    weights[d] = host_weights(*net);
    skipped[d] = trainer.loss_scaler().skipped_steps();
    optimizer_steps[d] = trainer.optimizer().steps_taken();
    scales[d] = trainer.loss_scaler().scale();
  }
  EXPECT_GT(skipped[0], 0) << "the scale should overflow at first";
  EXPECT_EQ(skipped[1], skipped[0]);
  EXPECT_EQ(optimizer_steps[1], optimizer_steps[0]);
  EXPECT_EQ(optimizer_steps[0], 20 - skipped[0]) << "a skipped step does not count for AdamW";
  EXPECT_EQ(scales[1], scales[0]);
  // Against how far the steps moved the weights: AdamW's first steps move
  // each weight by about ±lr whatever its gradient's size, so fp16's
  // rounding differences (the bias added in the GEMM's epilogue on the
  // device, after it on the CPU) flip some small gradients' signs.
  const std::vector<Tensor> start = host_weights(*model("mlp", Device::kCpu));
  double moved = 0.0, apart = 0.0;
  for (size_t t = 0; t < start.size(); ++t) {
    for (int64_t i = 0; i < start[t].numel(); ++i) {
      const double cpu = weights[0][t].data<float>()[i], gpu = weights[1][t].data<float>()[i];
      moved += (cpu - start[t].data<float>()[i]) * (cpu - start[t].data<float>()[i]);
      apart += (cpu - gpu) * (cpu - gpu);
    }
  }
  std::printf("fp16 with skipped steps: %lld skipped; the runs end %.3g apart, the CPU's moved %.3g\n",
              static_cast<long long>(skipped[0]), std::sqrt(apart), std::sqrt(moved));
  EXPECT_LE(std::sqrt(apart), (kEmulated ? 0.3 : 0.5) * std::sqrt(moved));
}

#ifdef FEDMESH_HOST_CUDA_EMULATION
// The step enqueues all its work (the norm, the factor and found_inf gating
// the optimizer's kernels on the device) and waits once, to read its
// scalars. Its device memory is reused from the second step on.
TEST(DeviceTraining, AStepWaitsOnceAndReusesItsMemory) {
  const data::ImageDataset train_set = fashion_split(data::Split::kTrain).head(256);
  TrainOptions options;
  options.batch_size = 32;
  options.grad_accumulation = 2;
  options.precision = DType::kF16;
  auto net = model("cnn", Device::kCuda);
  Trainer trainer(*net, options);
  std::vector<int64_t> indices(64);
  std::iota(indices.begin(), indices.end(), 0);
  trainer.train_step(train_set, indices, options.lr);
  trainer.train_step(train_set, indices, options.lr);
  const cuda::emulation::Counters before = cuda::emulation::counters();
  for (int i = 0; i < 3; ++i) trainer.train_step(train_set, indices, options.lr);
  const cuda::emulation::Counters after = cuda::emulation::counters();
  EXPECT_EQ(after.waits - before.waits, 3 * 1);
  EXPECT_GT(after.ops - before.ops, 3 * 40) << "the layers' work was enqueued on the device";
  EXPECT_EQ(after.live_blocks, before.live_blocks);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
}
#endif

TEST(DeviceTraining, KernelsRefuseTensorsOnTheOtherDevice) {
  REQUIRE_DEVICE();
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  Tensor host = Tensor::zeros({4, 8});
  Tensor on_device = Tensor::zeros({4, 8}, DType::kF32, Device::kCuda);
  EXPECT_DEATH(fedmesh::sum(on_device), "runs on the CPU only");
  EXPECT_DEATH(fedmesh::relu_forward(host, on_device), "a CPU tensor among CUDA ones");
  const std::vector<int32_t> ids = {0, 1};
  Tensor table = Tensor::zeros({4, 8}, DType::kF32, Device::kCuda);
  Tensor rows = Tensor::zeros({2, 8}, DType::kF32, Device::kCuda);
  EXPECT_DEATH(embedding_forward(table, ids, rows), "embedding_forward runs on the CPU only");
}

}  // namespace
}  // namespace fedmesh::train
