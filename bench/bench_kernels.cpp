// Kernel and training-step throughput (Google Benchmark). The PyTorch
// comparison of whole training runs is bench/compare_torch.sh.
#include <benchmark/benchmark.h>

#include <numeric>

#include "base/random.h"
#include "kernels/conv.h"
#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "train/data/fashion_mnist.h"
#include "train/trainer.h"

namespace fedmesh {
namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// (m, n, k) of the mlp's and cnn's largest GEMMs at batch 64.
void BM_Sgemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const auto a = random_floats(static_cast<size_t>(m * k), 1), b = random_floats(static_cast<size_t>(k * n), 2);
  std::vector<float> c(static_cast<size_t>(m * n));
  for (auto _ : state) {
    sgemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * n * k * state.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Sgemm)->Args({64, 512, 784})->Args({64, 12544, 288})->Args({288, 12544, 64})->UseRealTime();

void BM_Conv2dForwardBackward(benchmark::State& state) {
  Conv2dGeometry g;
  g.batch = 64;
  g.in_channels = 32;
  g.height = g.width = 14;
  g.out_channels = 64;
  g.kernel = 3;
  g.padding = 1;
  Tensor x = Tensor::empty({g.batch, g.in_channels, g.height, g.width});
  Tensor w = Tensor::empty({g.out_channels, g.patch_size()}), b = Tensor::zeros({g.out_channels});
  Tensor y = Tensor::empty({g.batch, g.out_channels, g.out_height(), g.out_width()});
  Tensor dw = Tensor::zeros(w.shape()), db = Tensor::zeros(b.shape()), dx = Tensor::empty(x.shape());
  const auto xs = random_floats(static_cast<size_t>(x.numel()), 3), ws = random_floats(static_cast<size_t>(w.numel()), 4);
  std::copy(xs.begin(), xs.end(), x.data<float>());
  std::copy(ws.begin(), ws.end(), w.data<float>());
  std::vector<float> col;
  for (auto _ : state) {
    conv2d_forward(g, x, w, b, y, col);
    conv2d_backward(g, col, w, y, dw, db, &dx);
  }
  state.counters["images/s"] = benchmark::Counter(static_cast<double>(g.batch * state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Conv2dForwardBackward)->UseRealTime();

void BM_TrainStep(benchmark::State& state, const char* model_name) {
  auto dataset = train::data::load_fashion_mnist(train::data::kDefaultFashionMnistDir, train::data::Split::kTest);
  if (!dataset.is_ok()) {
    state.SkipWithError(dataset.status().to_string().c_str());
    return;
  }
  auto model = train::make_model(model_name, 0);
  train::TrainOptions options;
  train::Trainer trainer(**model, options);
  std::vector<int64_t> indices(64);
  int64_t offset = 0;
  for (auto _ : state) {
    std::iota(indices.begin(), indices.end(), offset);
    offset = (offset + 64) % (dataset->count - 64);
    trainer.train_step(*dataset, indices, options.lr);
  }
  state.counters["samples/s"] = benchmark::Counter(64.0 * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK_CAPTURE(BM_TrainStep, mlp, "mlp")->UseRealTime();
BENCHMARK_CAPTURE(BM_TrainStep, cnn, "cnn")->UseRealTime();

}  // namespace
}  // namespace fedmesh

BENCHMARK_MAIN();
