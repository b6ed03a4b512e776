// The NCCL backend of Communicator (GPU ranks). Built when the CUDA toolkit
// and NCCL were found (FEDMESH_HAVE_NCCL); otherwise every call explains
// that this build has none.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "train/parallel/communicator.h"

#if FEDMESH_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace fedmesh::train {

#if FEDMESH_HAVE_NCCL

namespace {

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  return unavailable(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

Status nccl_status(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return Status::ok();
  return unavailable(std::string(what) + ": " + ncclGetErrorString(result));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int device, int rank, int size)
      : comm_(comm), stream_(stream), device_(device), rank_(rank), size_(size) {}
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }

  Status all_reduce_sum(std::span<float> values) override {
    return run("all-reduce", [&] {
      return ncclAllReduce(values.data(), values.data(), values.size(), ncclFloat, ncclSum, comm_, stream_);
    });
  }
  Status reduce_scatter_sum(std::span<const float> input, std::span<float> output) override {
    if (input.size() != output.size() * static_cast<size_t>(size_)) {
      return invalid_argument("reduce-scatter: the input must hold size() blocks of the output's length");
    }
    return run("reduce-scatter", [&] {
      return ncclReduceScatter(input.data(), output.data(), output.size(), ncclFloat, ncclSum, comm_, stream_);
    });
  }
  Status all_gather(std::span<const float> mine, std::span<float> output) override {
    if (output.size() != mine.size() * static_cast<size_t>(size_)) {
      return invalid_argument("all-gather: the output must hold size() blocks of the input's length");
    }
    return run("all-gather", [&] { return ncclAllGather(mine.data(), output.data(), mine.size(), ncclFloat, comm_, stream_); });
  }
  Status broadcast(std::span<float> values, int root) override {
    if (root < 0 || root >= size_) return invalid_argument("broadcast: root " + std::to_string(root) + " is not a rank");
    return run("broadcast", [&] {
      return ncclBroadcast(values.data(), values.data(), values.size(), ncclFloat, root, comm_, stream_);
    });
  }
  Status barrier() override {
    if (scratch_ == nullptr) FEDMESH_RETURN_IF_ERROR(cuda_status(cudaMalloc(&scratch_, sizeof(float)), "barrier scratch"));
    return run("barrier", [&] { return ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream_); });
  }

 private:
  // Issues one collective on our stream and waits for it on the device.
  template <typename F>
  Status run(const char* what, F&& issue) {
    FEDMESH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), what));
    FEDMESH_RETURN_IF_ERROR(nccl_status(issue(), what));
    return cuda_status(cudaStreamSynchronize(stream_), what);
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int device_, rank_, size_;
  float* scratch_ = nullptr;
};

// Rank 0 publishes the unique id (written aside, then renamed, so a reader
// never sees half of it); the others wait for it.
Status share_unique_id(const RendezvousOptions& options, ncclUniqueId& id) {
  const std::filesystem::path file = std::filesystem::path(options.directory) / "nccl-unique-id";
  if (options.rank == 0) {
    FEDMESH_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    const std::filesystem::path aside = file.string() + ".tmp";
    {
      std::ofstream out(aside, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
      if (!out) return io_error("cannot write " + aside.string());
    }
    std::error_code error;
    std::filesystem::rename(aside, file, error);
    if (error) return io_error("cannot publish " + file.string() + ": " + error.message());
    return Status::ok();
  }
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(file, std::ios::binary);
    if (in && in.read(reinterpret_cast<char*>(&id), sizeof id)) return Status::ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return unavailable("rank 0 published no NCCL id in " + options.directory);
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const RendezvousOptions& options, int device) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return unavailable("no CUDA device " + std::to_string(device) + " (" + std::to_string(count) + " found)");
  }
  std::error_code error;
  std::filesystem::create_directories(options.directory, error);
  if (error) return io_error("cannot create the rendezvous directory " + options.directory + ": " + error.message());
  ncclUniqueId id{};
  FEDMESH_RETURN_IF_ERROR(share_unique_id(options, id));
  FEDMESH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  cudaStream_t stream = nullptr;
  FEDMESH_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ncclComm_t comm = nullptr;
  if (Status s = nccl_status(ncclCommInitRank(&comm, options.size, id, options.rank), "ncclCommInitRank"); !s.is_ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(comm, stream, device, options.rank, options.size));
}

#else

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const RendezvousOptions& options, int) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  return unavailable("this build has no NCCL (configure with CUDA and NCCL present: see meson_options.txt)");
}

#endif

}  // namespace fedmesh::train
