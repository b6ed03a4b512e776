// The NCCL communicator on a GPU: one rank on device 0 runs every
// collective on device buffers and gets what a single rank must (the data
// unchanged, copied, or broadcast). Skips, saying why, in a build without
// NCCL or on a machine without a GPU. (Several ranks need several GPUs: NCCL
// refuses two ranks on one device.)
#include <gtest/gtest.h>

#include <vector>

#include "train/parallel/communicator.h"

#if FEDMESH_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace fedmesh::train {
namespace {

TEST(NcclCommunicator, OneRankRunsEveryCollectiveOnTheDevice) {
  RendezvousOptions options;
  options.directory = ::testing::TempDir() + "fedmesh-nccl-" + std::to_string(::getpid());
  Result<std::unique_ptr<Communicator>> made = make_nccl_communicator(options, 0);
  if (!made.is_ok()) {
    ASSERT_EQ(made.status().code(), StatusCode::kUnavailable) << made.status().message();
    GTEST_SKIP() << made.status().message();
  }
#if FEDMESH_HAVE_NCCL
  Communicator& c = **made;
  EXPECT_STREQ(c.backend(), "nccl");
  ASSERT_EQ(c.size(), 1);
  std::vector<float> host(1024);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  float* a = nullptr;
  float* b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(c.all_reduce_sum({a, host.size()}).is_ok());
  ASSERT_TRUE(c.reduce_scatter_sum({a, host.size()}, {b, host.size()}).is_ok());
  std::vector<float> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), b, back.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host) << "one rank: the sum is the input, scattered whole";
  ASSERT_TRUE(c.all_gather({a, 16}, {b, 16}).is_ok());
  ASSERT_TRUE(c.broadcast({a, host.size()}, 0).is_ok());
  ASSERT_TRUE(c.barrier().is_ok());
  ASSERT_EQ(cudaMemcpy(back.data(), a, back.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  EXPECT_EQ(c.broadcast({a, host.size()}, 1).code(), StatusCode::kInvalidArgument);
  cudaFree(a);
  cudaFree(b);
#endif
}

}  // namespace
}  // namespace fedmesh::train
