// The step-time breakdown (kernels/step_profile.h): GEMMs and the other
// kernels are told apart, a GEMM inside a convolution counts as GEMM and the
// rest of the convolution as kernels (exclusive time, so the parts never add
// up to more than the time they were measured in), nothing is counted while
// disabled, paused, or on another thread, and enabling starts from zero.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "base/random.h"
#include "kernels/conv.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/step_profile.h"
#include "tests/support/tensor_testing.h"

namespace fedmesh {
namespace {

using fedmesh::testing::random_tensor;

double seconds_of(const std::function<void()>& work) {
  const auto start = std::chrono::steady_clock::now();
  work();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(StepProfile, SplitsGemmFromTheOtherKernels) {
  Rng rng(1);
  const Tensor a = random_tensor({128, 128}, DType::kF32, rng), b = random_tensor({128, 128}, DType::kF32, rng);
  Tensor c = Tensor::zeros({128, 128});
  enable_step_profile();
  gemm(false, false, 1.0f, a, b, 0.0f, c);
  const StepTimes after_gemm = step_profile_totals();
  EXPECT_GT(after_gemm.gemm_seconds, 0.0);
  EXPECT_EQ(after_gemm.kernel_seconds, 0.0);
  relu_forward(c, c);
  const StepTimes after_relu = step_profile_totals();
  EXPECT_EQ(after_relu.gemm_seconds, after_gemm.gemm_seconds);
  EXPECT_GT(after_relu.kernel_seconds, 0.0);
  EXPECT_EQ(after_relu.communication_seconds, 0.0);
  disable_step_profile();
}

TEST(StepProfile, AConvolutionsGemmIsGemmAndThePartsFitItsTime) {
  Rng rng(2);
  Conv2dGeometry g;
  g.batch = 8;
  g.in_channels = 3;
  g.height = g.width = 28;
  g.out_channels = 16;
  g.kernel = 3;
  g.padding = 1;
  const Tensor x = random_tensor({g.batch, g.in_channels, g.height, g.width}, DType::kF32, rng);
  const Tensor weight = random_tensor({g.out_channels, g.patch_size()}, DType::kF32, rng);
  const Tensor bias = random_tensor({g.out_channels}, DType::kF32, rng);
  Tensor y = Tensor::empty({g.batch, g.out_channels, g.out_height(), g.out_width()});
  std::vector<float> columns;
  enable_step_profile();
  const double wall = seconds_of([&] { conv2d_forward(g, x, weight, bias, y, columns); });
  const StepTimes t = step_profile_totals();
  disable_step_profile();
  EXPECT_GT(t.gemm_seconds, 0.0) << "the im2col GEMM";
  EXPECT_GT(t.kernel_seconds, 0.0) << "im2col and the bias";
  EXPECT_LE(t.gemm_seconds + t.kernel_seconds, wall) << "exclusive times: nothing counted twice";
}

TEST(StepProfile, NothingCountsWhenDisabledPausedOrOnAnotherThread) {
  Rng rng(3);
  Tensor x = random_tensor({1024}, DType::kF32, rng);
  enable_step_profile();
  disable_step_profile();
  relu_forward(x, x);
  EXPECT_EQ(step_profile_totals().kernel_seconds, 0.0) << "disabled";

  enable_step_profile();
  {
    const ProfilePause pause;
    relu_forward(x, x);
    scale(x, 0.5f);
  }
  EXPECT_EQ(step_profile_totals().kernel_seconds, 0.0) << "paused";
  std::thread other([&] {
    Tensor y = Tensor::zeros({1024});
    relu_forward(y, y);
  });
  other.join();
  EXPECT_EQ(step_profile_totals().kernel_seconds, 0.0) << "another thread";
  relu_forward(x, x);
  EXPECT_GT(step_profile_totals().kernel_seconds, 0.0) << "the profiled thread, after the pause";
  enable_step_profile();
  EXPECT_EQ(step_profile_totals().kernel_seconds, 0.0) << "enabling starts from zero";
  disable_step_profile();
}

}  // namespace
}  // namespace fedmesh
