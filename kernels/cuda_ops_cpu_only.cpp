// kernels/cuda_ops.h in a build without the CUDA backend: available() says
// why, the allocator and every op abort naming themselves (a caller must ask
// available() first), and deallocate(nullptr) stays a no-op so that an empty
// DeviceBuffer can be destroyed.
#include <string>

#include "kernels/cuda_ops.h"

namespace fedmesh::cuda {
namespace {

constexpr const char* kNoBackend =
    "this build has no CUDA backend (configure with -Dcuda=enabled on a machine with nvcc)";

[[noreturn]] void no_backend(const char* op) {
  FEDMESH_CHECK(false, std::string("cuda::") + op + ": " + kNoBackend);
  __builtin_unreachable();
}

class NoDeviceAllocator final : public Allocator {
 public:
  void* allocate(size_t) override { no_backend("device_allocator().allocate"); }
  void deallocate(void* pointer, size_t) override { cuda::deallocate(pointer); }
  Device device() const override { return Device::kCuda; }
};

}  // namespace

Status available() { return unavailable(kNoBackend); }
Result<int> use_device_for_rank(int) { return unavailable(kNoBackend); }

Stream default_stream() { no_backend("default_stream"); }
Stream create_stream() { no_backend("create_stream"); }
void destroy_stream(Stream) { no_backend("destroy_stream"); }
void synchronize(Stream) { no_backend("synchronize"); }

Allocator& device_allocator() {
  static NoDeviceAllocator allocator;
  return allocator;
}
void* allocate(size_t, Stream) { no_backend("allocate"); }
void deallocate(void* pointer) {
  if (pointer != nullptr) no_backend("deallocate");
}
AllocatorStats allocator_stats() { return {}; }
void empty_cache() {}

void copy_to_device(const void*, void*, size_t, Stream) { no_backend("copy_to_device"); }
void copy_to_host(const void*, void*, size_t, Stream) { no_backend("copy_to_host"); }
void copy_on_device(const void*, void*, size_t, Stream) { no_backend("copy_on_device"); }
void set_zero(void*, size_t, Stream) { no_backend("set_zero"); }

void gemm(Stream, bool, bool, int64_t, int64_t, int64_t, float, const void*, DType, int64_t, const void*, DType,
          int64_t, float, void*, DType, int64_t, const GemmEpilogue&) {
  no_backend("gemm");
}
void gemm_strided_batched(Stream, bool, bool, int64_t, int64_t, int64_t, float, const void*, DType, int64_t, int64_t,
                          const void*, DType, int64_t, int64_t, float, void*, DType, int64_t, int64_t, int64_t) {
  no_backend("gemm_strided_batched");
}

void fill(Stream, void*, DType, int64_t, float) { no_backend("fill"); }
void scale(Stream, void*, DType, int64_t, float) { no_backend("scale"); }
void axpy(Stream, float, const void*, DType, void*, DType, int64_t) { no_backend("axpy"); }
void cast(Stream, const void*, DType, void*, DType, int64_t) { no_backend("cast"); }
void add_bias(Stream, void*, DType, int64_t, int64_t, const float*) { no_backend("add_bias"); }
void bias_grad(Stream, const void*, DType, int64_t, int64_t, float*, bool) { no_backend("bias_grad"); }
void channel_bias_grad(Stream, const void*, DType, int64_t, int64_t, int64_t, float*, bool) {
  no_backend("channel_bias_grad");
}
void relu_forward(Stream, const void*, DType, void*, DType, int64_t) { no_backend("relu_forward"); }
void relu_backward(Stream, const void*, DType, const void*, DType, void*, DType, int64_t) {
  no_backend("relu_backward");
}
void gelu_forward(Stream, const void*, DType, void*, DType, int64_t) { no_backend("gelu_forward"); }
void gelu_backward(Stream, const void*, DType, const void*, DType, void*, DType, int64_t) {
  no_backend("gelu_backward");
}
void silu_forward(Stream, const void*, DType, void*, DType, int64_t) { no_backend("silu_forward"); }
void silu_backward(Stream, const void*, DType, const void*, DType, void*, DType, int64_t) {
  no_backend("silu_backward");
}
void multiply(Stream, const void*, DType, const float*, void*, DType, int64_t) { no_backend("multiply"); }
void squared_l2_norm(Stream, const float*, int64_t, double*) { no_backend("squared_l2_norm"); }

void layernorm_forward(Stream, const void*, DType, const float*, const float*, void*, DType, float*, float*, int64_t,
                       int64_t, float) {
  no_backend("layernorm_forward");
}
void layernorm_backward(Stream, const void*, DType, const void*, DType, const float*, const float*, const float*, void*,
                        DType, float*, float*, int64_t, int64_t) {
  no_backend("layernorm_backward");
}
void groupnorm_forward(Stream, const GroupNormShape&, const void*, DType, const float*, const float*, void*, DType,
                       float*, float*, float) {
  no_backend("groupnorm_forward");
}
void groupnorm_backward(Stream, const GroupNormShape&, const void*, DType, const void*, DType, const float*,
                        const float*, const float*, void*, DType, float*, float*) {
  no_backend("groupnorm_backward");
}

void softmax_cross_entropy(Stream, const void*, DType, const int32_t*, int64_t, int64_t, void*, DType, float, float,
                           double*, int64_t*) {
  no_backend("softmax_cross_entropy");
}

void im2col(Stream, const Conv2dGeometry&, const void*, DType, float*) { no_backend("im2col"); }
void col2im(Stream, const Conv2dGeometry&, const float*, void*, DType) { no_backend("col2im"); }
void conv2d_forward(Stream, const Conv2dGeometry&, const void*, DType, const void*, DType, const float*, void*, DType,
                    float*) {
  no_backend("conv2d_forward");
}
void conv2d_backward(Stream, const Conv2dGeometry&, const float*, const void*, DType, const void*, DType, float*,
                     float*, void*, DType) {
  no_backend("conv2d_backward");
}
void maxpool2d_forward(Stream, const Pool2dGeometry&, const void*, DType, void*, DType, int32_t*) {
  no_backend("maxpool2d_forward");
}
void maxpool2d_backward(Stream, const Pool2dGeometry&, const int32_t*, const void*, DType, void*, DType) {
  no_backend("maxpool2d_backward");
}
void avgpool2d_forward(Stream, const Pool2dGeometry&, const void*, DType, void*, DType) {
  no_backend("avgpool2d_forward");
}
void avgpool2d_backward(Stream, const Pool2dGeometry&, const void*, DType, void*, DType) {
  no_backend("avgpool2d_backward");
}
void plane_mean_forward(Stream, const void*, DType, void*, DType, int64_t, int64_t) { no_backend("plane_mean_forward"); }
void plane_mean_backward(Stream, const void*, DType, void*, DType, int64_t, int64_t) {
  no_backend("plane_mean_backward");
}

void embedding_forward(Stream, const void*, DType, int64_t, int64_t, const int32_t*, int64_t, void*, DType) {
  no_backend("embedding_forward");
}
void embedding_backward(Stream, const int32_t*, int64_t, const void*, DType, float*, int64_t, int64_t) {
  no_backend("embedding_backward");
}

void causal_softmax(Stream, const float*, int64_t, int64_t, float, float*, int64_t, void*, DType) {
  no_backend("causal_softmax");
}
void causal_probabilities(Stream, const float*, int64_t, int64_t, float, const float*, int64_t, void*, DType) {
  no_backend("causal_probabilities");
}
void causal_softmax_backward(Stream, void*, DType, const float*, int64_t, int64_t, float) {
  no_backend("causal_softmax_backward");
}
bool flash_attention_supported(const AttentionShape&, DType) { return false; }
void flash_attention_forward(Stream, const AttentionShape&, DType, const void*, void*, float*) {
  no_backend("flash_attention_forward");
}
void flash_attention_backward(Stream, const AttentionShape&, DType, const void*, const void*, const float*, const void*,
                              void*) {
  no_backend("flash_attention_backward");
}
void token_ids(Stream, const float*, int64_t, int64_t, int32_t*) { no_backend("token_ids"); }

void sgd_step(Stream, float*, const float*, float*, void*, DType, int64_t, float, const SgdOptions&, const float*,
              const int*) {
  no_backend("sgd_step");
}
void adamw_step(Stream, float*, const float*, float*, float*, void*, DType, int64_t, int64_t, float,
                const AdamWOptions&, const float*, const int*) {
  no_backend("adamw_step");
}

void unscale_and_check(Stream, float*, int64_t, float, int*) { no_backend("unscale_and_check"); }
void gradient_scale_factor(Stream, const double*, float, float, float*, int*) { no_backend("gradient_scale_factor"); }

void delta(Stream, const float*, const float*, float*, int64_t) { no_backend("delta"); }
void weighted_accumulate(Stream, double*, const float*, double, int64_t) { no_backend("weighted_accumulate"); }

}  // namespace fedmesh::cuda
