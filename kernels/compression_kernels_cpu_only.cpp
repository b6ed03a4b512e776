// cuda_compression_kernels() in a build without the CUDA backend.
#include "kernels/compression_kernels.h"

namespace fedmesh::kernels {

Result<CompressionKernels*> cuda_compression_kernels() {
  return unavailable("this build has no CUDA backend (configure with -Dcuda=enabled on a machine with nvcc)");
}

}  // namespace fedmesh::kernels
