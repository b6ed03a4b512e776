// query_cuda() (kernels/device_info.h): a CPU-only build says why there is no
// GPU; a CUDA build on a machine without a usable GPU skips with the runtime's
// reason; a GPU, when present, is described sensibly.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "kernels/device_info.h"

namespace fedmesh {
namespace {

// Every test asks twice: the query clears CUDA's sticky error, so a second
// call must give the same answer. On a CUDA build without a usable GPU every
// test here skips, and the binary reports SKIP (tests/support/main.cpp).
void expect_same_answer(const CudaReport& first, const CudaReport& second) {
  EXPECT_EQ(first.compiled, second.compiled);
  EXPECT_EQ(first.gpus.size(), second.gpus.size());
  EXPECT_EQ(first.unavailable_reason, second.unavailable_reason);
}

TEST(DeviceInfo, CpuOnlyBuildExplainsWhy) {
  const CudaReport report = query_cuda();
  if (report.compiled) GTEST_SKIP() << "this build has the CUDA backend";
  EXPECT_FALSE(report.unavailable_reason.empty());
  EXPECT_TRUE(report.gpus.empty());
  EXPECT_EQ(report.runtime_version, 0);
  EXPECT_EQ(report.cublas_version, 0);
  EXPECT_EQ(report.nccl_version, 0);
  expect_same_answer(report, query_cuda());
}

TEST(DeviceInfo, CudaBuildDescribesEveryGpu) {
  const CudaReport report = query_cuda();
  if (!report.compiled) GTEST_SKIP() << "CPU-only build: " << report.unavailable_reason;
  EXPECT_GT(report.runtime_version, 0) << "a CUDA build links a runtime";
  expect_same_answer(report, query_cuda());
  if (report.gpus.empty()) {
    // No usable device (e.g. no driver: cudaErrorInsufficientDriver): the
    // report must say so, and GPU tests skip rather than fail.
    EXPECT_FALSE(report.unavailable_reason.empty());
    GTEST_SKIP() << "no usable GPU on this machine: " << report.unavailable_reason;
  }
  EXPECT_GT(report.driver_version, 0) << "GPUs were found, so a driver is installed";
  EXPECT_GT(report.cublas_version, 0);
  std::set<int> indices;
  for (const GpuInfo& gpu : report.gpus) {
    SCOPED_TRACE("GPU " + std::to_string(gpu.index) + " " + gpu.name);
    EXPECT_FALSE(gpu.name.empty());
    EXPECT_GT(gpu.memory_bytes, 0u);
    EXPECT_GE(gpu.compute_major, 5) << "Maxwell or newer";
    EXPECT_GE(gpu.compute_minor, 0);
    EXPECT_GE(gpu.index, 0);
    EXPECT_TRUE(indices.insert(gpu.index).second) << "indices are distinct";
  }
}

}  // namespace
}  // namespace fedmesh
