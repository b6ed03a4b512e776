// The checking macros of the CUDA backend, shared by every .cu file under
// kernels/cuda/. A failed CUDA, cuBLAS or cuBLASLt call inside the backend is
// a programming or device error: it aborts naming the call and the error
// (FEDMESH_CHECK stays on in release builds).
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <string>

// nvcc's front end reads Status's class-level [[nodiscard]] as applying to
// the assignment `status_ = Status(...)` inside Result (warning 2810); g++ and
// clang do not.
#ifdef __NVCC__
#pragma nv_diag_suppress 2810
#endif
#include "base/status.h"

#define FEDMESH_CUDA_CHECK(call)                                                                                 \
  do {                                                                                                           \
    const cudaError_t cuda_error_ = (call);                                                                      \
    FEDMESH_CHECK(cuda_error_ == cudaSuccess, std::string(#call) + ": " + cudaGetErrorName(cuda_error_) + " (" + \
                                                  cudaGetErrorString(cuda_error_) + ")");                        \
  } while (0)

// cuBLASLt calls return cublasStatus_t as well: one macro for both.
#define FEDMESH_CUBLAS_CHECK(call)                                                                           \
  do {                                                                                                       \
    const cublasStatus_t cublas_status_ = (call);                                                            \
    FEDMESH_CHECK(cublas_status_ == CUBLAS_STATUS_SUCCESS, std::string(#call) + ": " +                       \
                                                               cublasGetStatusName(cublas_status_) + " (" +  \
                                                               cublasGetStatusString(cublas_status_) + ")"); \
  } while (0)

// After a kernel launch: a bad configuration is reported here, not later.
#define FEDMESH_CUDA_CHECK_LAUNCH() FEDMESH_CUDA_CHECK(cudaGetLastError())
