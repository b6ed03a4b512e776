// What the CUDA side of this build can see: used by `fedmesh doctor` and by
// the CUDA tests to decide whether to skip.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fedmesh {

struct GpuInfo {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  uint64_t memory_bytes = 0;
};

struct CudaReport {
  bool compiled = false;      // this build has the CUDA backend
  int runtime_version = 0;    // e.g. 13000 for CUDA 13.0
  int driver_version = 0;     // 0 when no driver is installed
  int cublas_version = 0;     // e.g. 130000
  int nccl_version = 0;       // 0 when built without NCCL
  std::vector<GpuInfo> gpus;  // empty without a usable device
  std::string unavailable_reason;  // why no GPU can be used, when gpus is empty
};

CudaReport query_cuda();

}  // namespace fedmesh
