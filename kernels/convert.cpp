#include "kernels/convert.h"

#include <cstring>

#include "kernels/device_ops.h"
#include "kernels/half_arrays.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {
namespace {
constexpr int64_t kConvertGrain = 1 << 15;
}

void widen_to_f32(const void* src, DType src_dtype, float* dst, int64_t n) {
  if (n <= 0) return;  // empty buffers may be null, and memcpy(null, null, 0) is undefined
  visit_dtype(src_dtype, [&]<class T>() {
    const T* in = static_cast<const T*>(src);
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, in, static_cast<size_t>(n) * sizeof(float));
    } else {
      parallel_for(n, kConvertGrain, [&](int64_t begin, int64_t end) {
        half_to_fp32(in + begin, dst + begin, static_cast<size_t>(end - begin), std::is_same_v<T, bf16>);
      });
    }
  });
}

void narrow_from_f32(const float* src, void* dst, DType dst_dtype, int64_t n) {
  if (n <= 0) return;  // empty buffers may be null, and memcpy(null, null, 0) is undefined
  visit_dtype(dst_dtype, [&]<class T>() {
    T* out = static_cast<T*>(dst);
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(out, src, static_cast<size_t>(n) * sizeof(float));
    } else {
      parallel_for(n, kConvertGrain, [&](int64_t begin, int64_t end) {
        fp32_to_half(src + begin, out + begin, static_cast<size_t>(end - begin), std::is_same_v<T, bf16>);
      });
    }
  });
}

void convert(const Tensor& src, Tensor& dst) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dst)) return device::convert(src, dst);
  FEDMESH_CHECK(src.numel() == dst.numel(), "convert: element counts differ");
  if (src.dtype() == dst.dtype()) {
    if (src.raw() != dst.raw()) std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
  if (src.dtype() == DType::kF32) {
    narrow_from_f32(src.data<float>(), dst.raw(), dst.dtype(), src.numel());
  } else if (dst.dtype() == DType::kF32) {
    widen_to_f32(src.raw(), src.dtype(), dst.data<float>(), src.numel());
  } else {
    visit_dtype(src.dtype(), [&]<class In>() {
      visit_dtype(dst.dtype(), [&]<class Out>() {
        const In* in = src.data<In>();
        Out* out = dst.data<Out>();
        for (int64_t i = 0; i < src.numel(); ++i) out[i] = from_float<Out>(to_float(in[i]));
      });
    });
  }
}

Tensor to_dtype(const Tensor& src, DType dtype) {
  Tensor out = Tensor::empty(src.shape(), dtype, src.device());
  convert(src, out);
  return out;
}

}  // namespace fedmesh
