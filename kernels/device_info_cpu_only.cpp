// The device query of a build without the CUDA backend.
#include "kernels/device_info.h"

namespace fedmesh {

CudaReport query_cuda() {
  CudaReport report;
  report.unavailable_reason = "this build has no CUDA backend (configure with -Dcuda=enabled where nvcc is present)";
  return report;
}

}  // namespace fedmesh
