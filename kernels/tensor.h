// Tensor: a contiguous n-dimensional array with a dtype and a device, owning
// its storage (through the device's allocator) or viewing someone else's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/half.h"

namespace fedmesh {

enum class DType : uint8_t { kF32, kBF16, kF16 };
enum class Device : uint8_t { kCpu, kCuda };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
Result<DType> parse_dtype(std::string_view text);  // "fp32" | "bf16" | "fp16"
const char* device_name(Device device);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::kF32; }
template <>
constexpr DType dtype_of<bf16>() { return DType::kBF16; }
template <>
constexpr DType dtype_of<fp16>() { return DType::kF16; }

// Calls fn.template operator()<T>() with T the C++ type of `dtype`.
template <class Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: return fn.template operator()<bf16>();
    case DType::kF16: return fn.template operator()<fp16>();
    case DType::kF32: break;
  }
  return fn.template operator()<float>();
}

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* pointer, size_t bytes) = 0;
  virtual Device device() const = 0;
};

// 64-byte aligned host memory.
Allocator& cpu_allocator();

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& shape);
std::string shape_to_string(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // On Device::kCuda the storage comes from the CUDA backend's caching
  // allocator (kernels/cuda_ops.h; ask cuda::available() first).
  static Tensor empty(Shape shape, DType dtype = DType::kF32, Device device = Device::kCpu);
  // On the host, kZeroMappedBytes or more are fresh pages of their own
  // (mmap): zero until written, so a buffer never written (the gradient of
  // a model that is not trained here) takes no memory.
  static Tensor zeros(Shape shape, DType dtype = DType::kF32, Device device = Device::kCpu);
  static constexpr size_t kZeroMappedBytes = size_t{16} << 20;
  // Non-owning view of memory that must outlive the tensor and its views.
  static Tensor view_of(void* data, Shape shape, DType dtype, Device device = Device::kCpu);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int axis) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  template <class T>
  T* data() {
    check_type(dtype_of<T>());
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    check_type(dtype_of<T>());
    return static_cast<const T*>(data_);
  }

  // Same storage, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along axis 0, sharing storage.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A deep copy (same dtype and device).
  Tensor clone() const;
  // A deep copy on `device` (the same dtype); on the CPU from a CUDA tensor
  // it returns once the bytes are there.
  Tensor to(Device device) const;
  // This tensor when it is on the CPU (the same storage, no copy), else
  // to(Device::kCpu): for reading a tensor on the host wherever it lives.
  Tensor host() const;
  // Copies src's bytes into this tensor (same dtype and element count), across
  // devices where they differ.
  void copy_from(const Tensor& src);

  // Makes `slot` a (shape, dtype) tensor, keeping its memory when it already
  // has that element count and dtype (contents then unspecified), else
  // allocating (on `device`). For buffers rewritten on every step.
  static Tensor& reuse(Tensor& slot, const Shape& shape, DType dtype, Device device = Device::kCpu);

 private:
  struct Storage;
  static Tensor allocated(Shape shape, DType dtype, Device device, Allocator& allocator);
  void check_type(DType requested) const;

  std::shared_ptr<Storage> storage_;
  void* data_ = nullptr;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
};

}  // namespace fedmesh
