// The device query of a CUDA build: runtime, driver, cuBLAS, NCCL and GPUs.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#if FEDMESH_HAVE_NCCL
#include <nccl.h>
#endif

#include "kernels/device_info.h"

namespace fedmesh {

CudaReport query_cuda() {
  CudaReport report;
  report.compiled = true;
  cudaRuntimeGetVersion(&report.runtime_version);
  cudaDriverGetVersion(&report.driver_version);
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS) {
    report.cublas_version = major * 10000 + minor * 100 + patch;
  }
#if FEDMESH_HAVE_NCCL
  ncclGetVersion(&report.nccl_version);
#endif
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    report.unavailable_reason = std::string("no usable CUDA device: ") + cudaGetErrorName(status) + " (" +
                                cudaGetErrorString(status) + ")";
    cudaGetLastError();  // clear the sticky error for later callers
    return report;
  }
  if (count == 0) report.unavailable_reason = "the CUDA runtime found no device";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, i) != cudaSuccess) continue;
    report.gpus.push_back(GpuInfo{i, properties.name, properties.major, properties.minor,
                                  static_cast<uint64_t>(properties.totalGlobalMem)});
  }
  return report;
}

}  // namespace fedmesh
