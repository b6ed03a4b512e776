#include "kernels/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels/cuda_ops.h"

namespace fedmesh {

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view text) {
  if (text == "fp32" || text == "f32" || text == "float32") return DType::kF32;
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  if (text == "fp16" || text == "f16" || text == "float16") return DType::kF16;
  return invalid_argument("unknown precision '" + std::string(text) + "' (expected fp32, bf16 or fp16)");
}

const char* device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

namespace {

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    constexpr size_t kAlignment = 64;
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* pointer = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (pointer == nullptr) throw std::bad_alloc();
    return pointer;
  }
  void deallocate(void* pointer, size_t) override { std::free(pointer); }
  Device device() const override { return Device::kCpu; }
};

// Fresh anonymous pages, zero until written and given back when freed.
class ZeroPagesAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) throw std::bad_alloc();
    return mapped;
  }
  void deallocate(void* pointer, size_t bytes) override { ::munmap(pointer, bytes); }
  Device device() const override { return Device::kCpu; }
};

ZeroPagesAllocator& zero_pages_allocator() {
  static ZeroPagesAllocator allocator;
  return allocator;
}

}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator allocator;
  return allocator;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    FEDMESH_CHECK(d >= 0, "negative dimension in shape " + shape_to_string(shape));
    n *= d;
  }
  return n;
}

std::string shape_to_string(const Shape& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + ")";
}

struct Tensor::Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Allocator* allocator = nullptr;  // null for a view
  ~Storage() {
    if (allocator) allocator->deallocate(data, bytes);
  }
};

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  return allocated(std::move(shape), dtype, device,
                   device == Device::kCpu ? cpu_allocator() : cuda::device_allocator());
}

Tensor Tensor::allocated(Shape shape, DType dtype, Device device, Allocator& allocator) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->bytes = t.nbytes();
  t.storage_->allocator = &allocator;
  t.storage_->data = t.storage_->allocator->allocate(t.storage_->bytes);
  t.data_ = t.storage_->data;
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  if (device == Device::kCpu && static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype) >= kZeroMappedBytes) {
    return allocated(std::move(shape), dtype, device, zero_pages_allocator());
  }
  Tensor t = empty(std::move(shape), dtype, device);
  if (device == Device::kCpu) {
    std::memset(t.data_, 0, t.nbytes());
  } else {
    cuda::set_zero(t.data_, t.nbytes(), cuda::default_stream());
  }
  return t;
}

Tensor Tensor::view_of(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = t.nbytes();
  t.data_ = data;
  return t;
}

int64_t Tensor::dim(int axis) const {
  FEDMESH_CHECK(axis >= 0 && axis < rank(), "axis " + std::to_string(axis) + " out of range for shape " +
                                                shape_to_string(shape_));
  return shape_[static_cast<size_t>(axis)];
}

Tensor Tensor::reshape(Shape shape) const {
  FEDMESH_CHECK(shape_numel(shape) == numel_,
                "cannot reshape " + shape_to_string(shape_) + " to " + shape_to_string(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  FEDMESH_CHECK(rank() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
                "bad row slice of " + shape_to_string(shape_));
  Tensor t = *this;
  const int64_t row_elements = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.shape_[0] = end - begin;
  t.numel_ = row_elements * (end - begin);
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row_elements) * dtype_size(dtype_);
  return t;
}

Tensor& Tensor::reuse(Tensor& slot, const Shape& shape, DType dtype, Device device) {
  if (slot.defined() && slot.dtype() == dtype && slot.device() == device && slot.numel() == shape_numel(shape)) {
    slot = slot.reshape(shape);
  } else {
    slot = empty(shape, dtype, device);
  }
  return slot;
}

Tensor Tensor::clone() const { return to(device_); }

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::host() const { return device_ == Device::kCpu ? *this : to(Device::kCpu); }

void Tensor::copy_from(const Tensor& src) {
  FEDMESH_CHECK(src.dtype_ == dtype_ && src.numel_ == numel_,
                std::string("copy_from: ") + dtype_name(src.dtype_) + " " + shape_to_string(src.shape_) + " into " +
                    dtype_name(dtype_) + " " + shape_to_string(shape_));
  const size_t bytes = nbytes();
  if (bytes == 0) return;
  if (device_ == Device::kCpu && src.device_ == Device::kCpu) {
    std::memcpy(data_, src.data_, bytes);
  } else if (device_ == Device::kCpu) {
    cuda::copy_to_host(src.data_, data_, bytes, cuda::default_stream());
  } else if (src.device_ == Device::kCpu) {
    cuda::copy_to_device(src.data_, data_, bytes, cuda::default_stream());
  } else {
    cuda::copy_on_device(src.data_, data_, bytes, cuda::default_stream());
  }
}

void Tensor::check_type(DType requested) const {
  FEDMESH_CHECK(requested == dtype_, std::string("tensor holds ") + dtype_name(dtype_) + ", asked for " +
                                         dtype_name(requested));
}

}  // namespace fedmesh
