// The device, streams, copies and the caching allocator of kernels/cuda_ops.h.
#include "kernels/cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/cuda_ops.h"
#include "kernels/step_profile.h"

namespace fedmesh::cuda {
namespace {

// Size classes: multiples of kSmallRounding up to kSmallLimit, of
// kLargeRounding above (a large tensor wastes under 2 MiB, and slightly
// different large requests share a class).
constexpr size_t kSmallLimit = size_t{1} << 20;
constexpr size_t kSmallRounding = 512;
constexpr size_t kLargeRounding = size_t{2} << 20;

size_t size_class(size_t bytes) {
  const size_t unit = bytes <= kSmallLimit ? kSmallRounding : kLargeRounding;
  return (bytes + unit - 1) / unit * unit;
}

std::string cuda_error_text(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) + ")";
}

__global__ void probe_kernel() {}

Status probe_device() {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear the error for later callers
    return unavailable("no usable CUDA device: " + cuda_error_text(error));
  }
  if (count == 0) return unavailable("no CUDA device (0 found)");
  int device = 0;
  error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaFree(nullptr);  // creates the context
  if (error != cudaSuccess) {
    cudaGetLastError();
    return unavailable("CUDA device " + std::to_string(device) + " cannot be used: " + cuda_error_text(error));
  }
  // The build holds kernels for the architectures of -Dgpu_archs only.
  cudaFuncAttributes attributes{};
  error = cudaFuncGetAttributes(&attributes, probe_kernel);
  if (error != cudaSuccess) {
    cudaGetLastError();
    cudaDeviceProp properties{};
    const bool named = cudaGetDeviceProperties(&properties, device) == cudaSuccess;
    return unavailable("CUDA device " + std::to_string(device) +
                       (named ? " (" + std::string(properties.name) + ", compute capability " +
                                    std::to_string(properties.major) + "." + std::to_string(properties.minor) + ")"
                              : std::string()) +
                       " cannot run this build's kernels: " + cuda_error_text(error) +
                       "; reconfigure with -Dgpu_archs naming its architecture");
  }
  return Status::ok();
}

class CachingDeviceAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override { return allocate_for(bytes, default_stream()); }
  void deallocate(void* pointer, size_t) override { release(pointer); }
  Device device() const override { return Device::kCuda; }

  void* allocate_for(size_t bytes, Stream stream) {
    if (bytes == 0) return nullptr;
    const size_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    check_device();
    void* pointer = nullptr;
    auto pool = free_.find({stream, size});
    if (pool != free_.end() && !pool->second.empty()) {
      pointer = pool->second.back();
      pool->second.pop_back();
      stats_.bytes_cached -= size;
    } else {
      pointer = device_malloc(size, bytes);
    }
    live_.emplace(pointer, Block{size, stream});
    stats_.bytes_in_use += size;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes_in_use);
    return pointer;
  }

  void release(void* pointer) {
    if (pointer == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(pointer);
    FEDMESH_CHECK(it != live_.end(),
                  "cuda::deallocate: a pointer the device allocator did not hand out (or freed twice)");
    const Block block = it->second;
    live_.erase(it);
    free_[{block.stream, block.size}].push_back(pointer);
    stats_.bytes_in_use -= block.size;
    stats_.bytes_cached += block.size;
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached();
  }

 private:
  struct Block {
    size_t size;
    Stream stream;
  };

  // One device per process: blocks of another device would be wrong there.
  void check_device() {
    int current = 0;
    FEDMESH_CUDA_CHECK(cudaGetDevice(&current));
    if (device_ < 0) device_ = current;
    FEDMESH_CHECK(current == device_, "the CUDA device allocator serves device " + std::to_string(device_) +
                                          ", but device " + std::to_string(current) + " is current");
  }

  void* device_malloc(size_t size, size_t requested) {
    void* pointer = nullptr;
    cudaError_t error = cudaMalloc(&pointer, size);
    if (error == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it and retry with the pool released
      release_cached();
      error = cudaMalloc(&pointer, size);
    }
    if (error != cudaSuccess) cudaGetLastError();
    FEDMESH_CHECK(error == cudaSuccess,
                  "cudaMalloc of " + std::to_string(size) + " bytes (for a request of " + std::to_string(requested) +
                      ") failed after releasing the cache: " + cuda_error_text(error) + "; in use " +
                      std::to_string(stats_.bytes_in_use) + " bytes, peak " + std::to_string(stats_.peak_bytes));
    ++stats_.device_mallocs;
    return pointer;
  }

  // Queued work may still use a cached block (its stream reuses it in order,
  // cudaFree does not wait for that): wait for the device first.
  void release_cached() {
    FEDMESH_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& [key, pointers] : free_) {
      for (void* pointer : pointers) FEDMESH_CUDA_CHECK(cudaFree(pointer));
    }
    free_.clear();
    stats_.bytes_cached = 0;
  }

  std::mutex mutex_;
  int device_ = -1;
  std::map<std::pair<Stream, size_t>, std::vector<void*>> free_;  // (stream, size class) -> blocks
  std::unordered_map<void*, Block> live_;
  AllocatorStats stats_;
};

// Never destroyed: static destructors may run after the CUDA runtime shut down.
CachingDeviceAllocator& caching_allocator() {
  static auto* allocator = new CachingDeviceAllocator();
  return *allocator;
}

}  // namespace

Status available() {
  static const Status status = probe_device();
  return status;
}

Result<int> use_device_for_rank(int rank) {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return unavailable("no usable CUDA device: " + cuda_error_text(error));
  }
  if (count == 0) return unavailable("no CUDA device (0 found)");
  const int device = rank % count;
  error = cudaSetDevice(device);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return unavailable("CUDA device " + std::to_string(device) + " (rank " + std::to_string(rank) +
                       ") cannot be used: " + cuda_error_text(error));
  }
  return device;
}

Stream default_stream() {
  static const Stream stream = [] {
    cudaStream_t created = nullptr;
    FEDMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return static_cast<Stream>(created);
  }();
  return stream;
}

Stream create_stream() {
  cudaStream_t created = nullptr;
  FEDMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
  return created;
}

void destroy_stream(Stream stream) {
  synchronize(stream);
  FEDMESH_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
}

void synchronize(Stream stream) {
  const ProfileScope waiting(StepTime::kDeviceWait);
  FEDMESH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

Allocator& device_allocator() { return caching_allocator(); }
void* allocate(size_t bytes, Stream stream) { return caching_allocator().allocate_for(bytes, stream); }
void deallocate(void* pointer) { caching_allocator().release(pointer); }
AllocatorStats allocator_stats() { return caching_allocator().stats(); }
void empty_cache() { caching_allocator().empty_cache(); }

void copy_to_device(const void* host, void* device, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  const ProfileScope waiting(StepTime::kDeviceWait);  // pageable memory: the stream is synchronized first
  FEDMESH_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
}

void copy_to_host(const void* device, void* host, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  FEDMESH_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  synchronize(stream);
}

void copy_on_device(const void* source, void* destination, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  FEDMESH_CUDA_CHECK(
      cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}

void set_zero(void* device, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  FEDMESH_CUDA_CHECK(cudaMemsetAsync(device, 0, bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace fedmesh::cuda
