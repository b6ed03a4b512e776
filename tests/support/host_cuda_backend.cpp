// See host_cuda_backend.h. Every function of kernels/cuda_ops.h, on host
// memory, by the CPU kernels.
#include "tests/support/host_cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/convert.h"
#include "kernels/cuda_ops.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optimizer.h"

namespace fedmesh::cuda {
namespace {

struct Pool {
  std::mutex mutex;
  std::map<const char*, size_t> blocks;  // live device blocks: start -> bytes
  emulation::Counters counters;
  AllocatorStats stats;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: tensors may be freed at exit
  return *p;
}

// Aborts unless [pointer, pointer + bytes) lies in one live device block.
void check_device(const void* pointer, size_t bytes, const char* op) {
  if (bytes == 0) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  const char* c = static_cast<const char*>(pointer);
  auto it = p.blocks.upper_bound(c);
  const bool inside = it != p.blocks.begin() && (--it, c >= it->first && c + bytes <= it->first + it->second);
  FEDMESH_CHECK(inside, std::string("emulated cuda::") + op + ": a pointer that is not device memory (or " +
                            std::to_string(bytes) + " bytes past a device block's end)");
}

void count_op() {
  std::lock_guard<std::mutex> lock(pool().mutex);
  ++pool().counters.ops;
}

size_t bytes_of(DType dtype, int64_t n) { return static_cast<size_t>(n) * dtype_size(dtype); }

// A CPU view of device memory, checked first.
Tensor view(const void* pointer, Shape shape, DType dtype, const char* op) {
  const int64_t n = shape_numel(shape);
  check_device(pointer, bytes_of(dtype, n), op);
  return Tensor::view_of(const_cast<void*>(pointer), std::move(shape), dtype, Device::kCpu);
}

Tensor view_f32(const float* pointer, Shape shape, const char* op) { return view(pointer, std::move(shape), DType::kF32, op); }

void* emulated_allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (pointer == nullptr) throw std::bad_alloc();
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.blocks[static_cast<const char*>(pointer)] = bytes;
  ++p.counters.live_blocks;
  p.counters.live_bytes += static_cast<int64_t>(bytes);
  p.stats.bytes_in_use += bytes;
  p.stats.peak_bytes = std::max(p.stats.peak_bytes, p.stats.bytes_in_use);
  ++p.stats.device_mallocs;
  return pointer;
}

void emulated_free(void* pointer) {
  if (pointer == nullptr) return;
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    auto it = p.blocks.find(static_cast<const char*>(pointer));
    FEDMESH_CHECK(it != p.blocks.end(), "emulated cuda::deallocate of a pointer that is not a live device block");
    --p.counters.live_blocks;
    p.counters.live_bytes -= static_cast<int64_t>(it->second);
    p.stats.bytes_in_use -= it->second;
    p.blocks.erase(it);
  }
  std::free(pointer);
}

class EmulatedAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override { return emulated_allocate(bytes); }
  void deallocate(void* pointer, size_t) override { emulated_free(pointer); }
  Device device() const override { return Device::kCuda; }
};

int stream_token;

}  // namespace

namespace emulation {
Counters counters() {
  std::lock_guard<std::mutex> lock(pool().mutex);
  return pool().counters;
}
}  // namespace emulation

Status available() { return Status::ok(); }
Result<int> use_device_for_rank(int) { return 0; }  // one emulated device
Stream default_stream() { return &stream_token; }
Stream create_stream() { return &stream_token; }
void destroy_stream(Stream) {}
void synchronize(Stream) {
  std::lock_guard<std::mutex> lock(pool().mutex);
  ++pool().counters.waits;
}

Allocator& device_allocator() {
  static EmulatedAllocator allocator;
  return allocator;
}
void* allocate(size_t bytes, Stream) { return emulated_allocate(bytes); }
void deallocate(void* pointer) { emulated_free(pointer); }
AllocatorStats allocator_stats() {
  std::lock_guard<std::mutex> lock(pool().mutex);
  return pool().stats;
}
void empty_cache() {}

void copy_to_device(const void* host, void* device, size_t bytes, Stream) {
  check_device(device, bytes, "copy_to_device");
  if (bytes) std::memcpy(device, host, bytes);
  count_op();
}
void copy_to_host(const void* device, void* host, size_t bytes, Stream) {
  check_device(device, bytes, "copy_to_host");
  if (bytes) std::memcpy(host, device, bytes);
  std::lock_guard<std::mutex> lock(pool().mutex);
  ++pool().counters.waits;
}
void copy_on_device(const void* source, void* destination, size_t bytes, Stream) {
  check_device(source, bytes, "copy_on_device");
  check_device(destination, bytes, "copy_on_device");
  if (bytes) std::memmove(destination, source, bytes);
  count_op();
}
void set_zero(void* device, size_t bytes, Stream) {
  check_device(device, bytes, "set_zero");
  if (bytes) std::memset(device, 0, bytes);
  count_op();
}

void gemm(Stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
          DType a_type, int64_t lda, const void* b, DType b_type, int64_t ldb, float beta, void* c, DType c_type,
          int64_t ldc, const GemmEpilogue& epilogue) {
  FEDMESH_CHECK(a_type == b_type && (c_type == a_type || c_type == DType::kF32), "emulated cuda::gemm: dtypes");
  const Shape a_shape = transpose_a ? Shape{k, m} : Shape{m, k};
  const Shape b_shape = transpose_b ? Shape{n, k} : Shape{k, n};
  FEDMESH_CHECK(lda == a_shape[1] && ldb == b_shape[1] && ldc == n, "emulated cuda::gemm: dense operands only");
  const Tensor av = view(a, a_shape, a_type, "gemm a");
  const Tensor bv = view(b, b_shape, b_type, "gemm b");
  Tensor cv = view(c, {m, n}, c_type, "gemm c");
  // The product and the epilogue in fp32, rounded once to c's dtype.
  Tensor product = c_type == DType::kF32 ? cv : Tensor::empty({m, n});
  if (c_type != DType::kF32 && beta != 0.0f) convert(cv, product);
  fedmesh::gemm(transpose_a, transpose_b, alpha, av, bv, beta, product);
  if (epilogue.kind != GemmEpilogueKind::kNone && epilogue.bias != nullptr) {
    fedmesh::add_bias(product, view_f32(epilogue.bias, {n}, "gemm bias"));
  }
  if (epilogue.kind == GemmEpilogueKind::kGeluBias) {
    if (epilogue.gelu_input_out != nullptr) {
      Tensor saved = view(epilogue.gelu_input_out, {m, n}, c_type, "gemm gelu_input_out");
      convert(product, saved);
    }
    fedmesh::gelu_forward(product, product);
  }
  if (c_type != DType::kF32) convert(product, cv);
  count_op();
}

void fill(Stream, void* x, DType x_type, int64_t n, float value) {
  Tensor v = view(x, {n}, x_type, "fill");
  fedmesh::fill(v, value);
  count_op();
}
void scale(Stream, void* x, DType x_type, int64_t n, float factor) {
  Tensor v = view(x, {n}, x_type, "scale");
  fedmesh::scale(v, factor);
  count_op();
}
void axpy(Stream, float alpha, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  Tensor yv = view(y, {n}, y_type, "axpy y");
  fedmesh::axpy(alpha, view(x, {n}, x_type, "axpy x"), yv);
  count_op();
}
void cast(Stream, const void* src, DType src_type, void* dst, DType dst_type, int64_t n) {
  Tensor d = view(dst, {n}, dst_type, "cast dst");
  convert(view(src, {n}, src_type, "cast src"), d);
  count_op();
}

void add_bias(Stream, void* y, DType y_type, int64_t rows, int64_t n, const float* bias) {
  Tensor yv = view(y, {rows, n}, y_type, "add_bias");
  fedmesh::add_bias(yv, view_f32(bias, {n}, "add_bias bias"));
  count_op();
}
void bias_grad(Stream, const void* dy, DType dy_type, int64_t rows, int64_t n, float* db, bool accumulate) {
  Tensor dbv = view_f32(db, {n}, "bias_grad db");
  fedmesh::bias_grad(view(dy, {rows, n}, dy_type, "bias_grad dy"), dbv, accumulate);
  count_op();
}
void channel_bias_grad(Stream, const void* dy, DType dy_type, int64_t batch, int64_t channels, int64_t positions,
                       float* db, bool accumulate) {
  Tensor dbv = view_f32(db, {channels}, "channel_bias_grad db");
  fedmesh::channel_bias_grad(view(dy, {batch, channels, positions}, dy_type, "channel_bias_grad dy"), dbv, accumulate);
  count_op();
}

void relu_forward(Stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  Tensor yv = view(y, {n}, y_type, "relu_forward y");
  fedmesh::relu_forward(view(x, {n}, x_type, "relu_forward x"), yv);
  count_op();
}
void relu_backward(Stream, const void* y, DType y_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  Tensor dxv = view(dx, {n}, dx_type, "relu_backward dx");
  fedmesh::relu_backward(view(y, {n}, y_type, "relu_backward y"), view(dy, {n}, dy_type, "relu_backward dy"), dxv);
  count_op();
}
void gelu_forward(Stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  Tensor yv = view(y, {n}, y_type, "gelu_forward y");
  fedmesh::gelu_forward(view(x, {n}, x_type, "gelu_forward x"), yv);
  count_op();
}
void gelu_backward(Stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  Tensor dxv = view(dx, {n}, dx_type, "gelu_backward dx");
  fedmesh::gelu_backward(view(x, {n}, x_type, "gelu_backward x"), view(dy, {n}, dy_type, "gelu_backward dy"), dxv);
  count_op();
}

void silu_forward(Stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  Tensor yv = view(y, {n}, y_type, "silu_forward y");
  fedmesh::silu_forward(view(x, {n}, x_type, "silu_forward x"), yv);
  count_op();
}
void silu_backward(Stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  Tensor dxv = view(dx, {n}, dx_type, "silu_backward dx");
  fedmesh::silu_backward(view(x, {n}, x_type, "silu_backward x"), view(dy, {n}, dy_type, "silu_backward dy"), dxv);
  count_op();
}
void multiply(Stream, const void* a, DType a_type, const float* b, void* out, DType out_type, int64_t n) {
  Tensor o = view(out, {n}, out_type, "multiply out");
  fedmesh::mul(view(a, {n}, a_type, "multiply a"), view_f32(b, {n}, "multiply b"), o);
  count_op();
}

void squared_l2_norm(Stream, const float* x, int64_t n, double* out) {
  check_device(out, sizeof(double), "squared_l2_norm out");
  *out += fedmesh::squared_l2_norm(view_f32(x, {n}, "squared_l2_norm"));
  count_op();
}

void layernorm_forward(Stream, const void* x, DType x_type, const float* gamma, const float* beta, void* y,
                       DType y_type, float* mean, float* rstd, int64_t rows, int64_t n, float epsilon) {
  Tensor yv = view(y, {rows, n}, y_type, "layernorm_forward y");
  Tensor meanv = view_f32(mean, {rows}, "layernorm_forward mean"), rstdv = view_f32(rstd, {rows}, "layernorm rstd");
  fedmesh::layernorm_forward(view(x, {rows, n}, x_type, "layernorm_forward x"), view_f32(gamma, {n}, "layernorm gamma"),
                             view_f32(beta, {n}, "layernorm beta"), yv, meanv, rstdv, epsilon);
  count_op();
}
void layernorm_backward(Stream, const void* x, DType x_type, const void* dy, DType dy_type, const float* gamma,
                        const float* mean, const float* rstd, void* dx, DType dx_type, float* dgamma, float* dbeta,
                        int64_t rows, int64_t n) {
  Tensor dxv = view(dx, {rows, n}, dx_type, "layernorm_backward dx");
  Tensor dg = view_f32(dgamma, {n}, "layernorm dgamma"), db = view_f32(dbeta, {n}, "layernorm dbeta");
  fedmesh::layernorm_backward(view(x, {rows, n}, x_type, "layernorm_backward x"),
                              view(dy, {rows, n}, dy_type, "layernorm_backward dy"),
                              view_f32(gamma, {n}, "layernorm gamma"), view_f32(mean, {rows}, "layernorm mean"),
                              view_f32(rstd, {rows}, "layernorm rstd"), dxv, dg, db);
  count_op();
}

void groupnorm_forward(Stream, const GroupNormShape& s, const void* x, DType x_type, const float* gamma,
                       const float* beta, void* y, DType y_type, float* mean, float* rstd, float epsilon) {
  const int64_t n = s.batch * s.channels * s.positions, stats = s.batch * s.groups;
  Tensor yv = view(y, {n}, y_type, "groupnorm_forward y");
  Tensor meanv = view_f32(mean, {stats}, "groupnorm mean"), rstdv = view_f32(rstd, {stats}, "groupnorm rstd");
  fedmesh::groupnorm_forward(s, view(x, {n}, x_type, "groupnorm_forward x"), view_f32(gamma, {s.channels}, "groupnorm gamma"),
                             view_f32(beta, {s.channels}, "groupnorm beta"), yv, meanv, rstdv, epsilon);
  count_op();
}
void groupnorm_backward(Stream, const GroupNormShape& s, const void* x, DType x_type, const void* dy, DType dy_type,
                        const float* gamma, const float* mean, const float* rstd, void* dx, DType dx_type,
                        float* dgamma, float* dbeta) {
  const int64_t n = s.batch * s.channels * s.positions, stats = s.batch * s.groups;
  Tensor dxv = dx != nullptr ? view(dx, {n}, dx_type, "groupnorm_backward dx") : Tensor();
  Tensor dg = view_f32(dgamma, {s.channels}, "groupnorm dgamma"), db = view_f32(dbeta, {s.channels}, "groupnorm dbeta");
  fedmesh::groupnorm_backward(s, view(x, {n}, x_type, "groupnorm_backward x"), view(dy, {n}, dy_type, "groupnorm dy"),
                              view_f32(gamma, {s.channels}, "groupnorm gamma"), view_f32(mean, {stats}, "groupnorm mean"),
                              view_f32(rstd, {stats}, "groupnorm rstd"), dx != nullptr ? &dxv : nullptr, dg, db);
  count_op();
}

void softmax_cross_entropy(Stream, const void* logits, DType logits_type, const int32_t* labels, int64_t rows,
                           int64_t classes, void* dlogits, DType dlogits_type, float grad_scale, float normalizer,
                           double* loss_sum, int64_t* correct) {
  check_device(labels, static_cast<size_t>(rows) * sizeof(int32_t), "softmax_cross_entropy labels");
  Tensor d;
  if (dlogits != nullptr) d = view(dlogits, {rows, classes}, dlogits_type, "softmax_cross_entropy dlogits");
  const CrossEntropyResult ce = fedmesh::softmax_cross_entropy(
      view(logits, {rows, classes}, logits_type, "softmax_cross_entropy logits"),
      std::span<const int32_t>(labels, static_cast<size_t>(rows)), dlogits ? &d : nullptr, grad_scale, normalizer);
  if (loss_sum != nullptr) {
    check_device(loss_sum, sizeof(double), "softmax_cross_entropy loss_sum");
    *loss_sum += ce.loss_sum;
  }
  if (correct != nullptr) {
    check_device(correct, sizeof(int64_t), "softmax_cross_entropy correct");
    *correct += ce.correct;
  }
  count_op();
}

void im2col(Stream, const Conv2dGeometry& g, const void* x, DType x_type, float* col) {
  check_device(col, static_cast<size_t>(g.patch_size() * g.columns()) * sizeof(float), "im2col col");
  fedmesh::im2col(g, view(x, {g.batch, g.in_channels, g.height, g.width}, x_type, "im2col x"), col);
  count_op();
}
void col2im(Stream, const Conv2dGeometry& g, const float* dcol, void* dx, DType dx_type) {
  check_device(dcol, static_cast<size_t>(g.patch_size() * g.columns()) * sizeof(float), "col2im dcol");
  Tensor dxv = view(dx, {g.batch, g.in_channels, g.height, g.width}, dx_type, "col2im dx");
  fedmesh::col2im(g, dcol, dxv);
  count_op();
}
void conv2d_forward(Stream, const Conv2dGeometry& g, const void* x, DType x_type, const void* weight,
                    DType weight_type, const float* bias, void* y, DType y_type, float* col) {
  const size_t col_bytes = static_cast<size_t>(g.patch_size() * g.columns()) * sizeof(float);
  check_device(col, col_bytes, "conv2d_forward col");
  Tensor yv = view(y, {g.batch, g.out_channels, g.out_height(), g.out_width()}, y_type, "conv2d_forward y");
  std::vector<float> columns;
  fedmesh::conv2d_forward(g, view(x, {g.batch, g.in_channels, g.height, g.width}, x_type, "conv2d_forward x"),
                          view(weight, {g.out_channels, g.patch_size()}, weight_type, "conv2d_forward weight"),
                          view_f32(bias, {g.out_channels}, "conv2d_forward bias"), yv, columns);
  std::memcpy(col, columns.data(), col_bytes);
  count_op();
}
void conv2d_backward(Stream, const Conv2dGeometry& g, const float* col, const void* weight, DType weight_type,
                     const void* dy, DType dy_type, float* dweight, float* dbias, void* dx, DType dx_type) {
  const size_t col_bytes = static_cast<size_t>(g.patch_size() * g.columns()) * sizeof(float);
  check_device(col, col_bytes, "conv2d_backward col");
  const std::vector<float> columns(col, col + col_bytes / sizeof(float));
  Tensor dw = view_f32(dweight, {g.out_channels, g.patch_size()}, "conv2d_backward dweight");
  Tensor db = view_f32(dbias, {g.out_channels}, "conv2d_backward dbias");
  Tensor dxv;
  if (dx != nullptr) dxv = view(dx, {g.batch, g.in_channels, g.height, g.width}, dx_type, "conv2d_backward dx");
  fedmesh::conv2d_backward(g, columns, view(weight, {g.out_channels, g.patch_size()}, weight_type, "conv2d weight"),
                           view(dy, {g.batch, g.out_channels, g.out_height(), g.out_width()}, dy_type, "conv2d dy"),
                           dw, db, dx ? &dxv : nullptr);
  count_op();
}
void maxpool2d_forward(Stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type,
                       int32_t* argmax) {
  const int64_t outputs = g.batch * g.channels * g.out_height() * g.out_width();
  check_device(argmax, static_cast<size_t>(outputs) * sizeof(int32_t), "maxpool2d_forward argmax");
  Tensor yv = view(y, {g.batch, g.channels, g.out_height(), g.out_width()}, y_type, "maxpool2d_forward y");
  std::vector<int32_t> chosen;
  fedmesh::maxpool2d_forward(g, view(x, {g.batch, g.channels, g.height, g.width}, x_type, "maxpool2d_forward x"), yv,
                             chosen);
  std::memcpy(argmax, chosen.data(), chosen.size() * sizeof(int32_t));
  count_op();
}
void maxpool2d_backward(Stream, const Pool2dGeometry& g, const int32_t* argmax, const void* dy, DType dy_type,
                        void* dx, DType dx_type) {
  const int64_t outputs = g.batch * g.channels * g.out_height() * g.out_width();
  check_device(argmax, static_cast<size_t>(outputs) * sizeof(int32_t), "maxpool2d_backward argmax");
  const std::vector<int32_t> chosen(argmax, argmax + outputs);
  Tensor dxv = view(dx, {g.batch, g.channels, g.height, g.width}, dx_type, "maxpool2d_backward dx");
  fedmesh::maxpool2d_backward(g, chosen, view(dy, {g.batch, g.channels, g.out_height(), g.out_width()}, dy_type,
                                              "maxpool2d_backward dy"),
                              dxv);
  count_op();
}

void avgpool2d_forward(Stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type) {
  Tensor yv = view(y, {g.batch, g.channels, g.out_height(), g.out_width()}, y_type, "avgpool2d_forward y");
  fedmesh::avgpool2d_forward(g, view(x, {g.batch, g.channels, g.height, g.width}, x_type, "avgpool2d_forward x"), yv);
  count_op();
}
void avgpool2d_backward(Stream, const Pool2dGeometry& g, const void* dy, DType dy_type, void* dx, DType dx_type) {
  Tensor dxv = view(dx, {g.batch, g.channels, g.height, g.width}, dx_type, "avgpool2d_backward dx");
  fedmesh::avgpool2d_backward(
      g, view(dy, {g.batch, g.channels, g.out_height(), g.out_width()}, dy_type, "avgpool2d_backward dy"), dxv);
  count_op();
}
void plane_mean_forward(Stream, const void* x, DType x_type, void* y, DType y_type, int64_t planes, int64_t area) {
  Tensor yv = view(y, {planes}, y_type, "plane_mean_forward y");
  fedmesh::plane_mean_forward(view(x, {planes, area}, x_type, "plane_mean_forward x"), yv);
  count_op();
}
void plane_mean_backward(Stream, const void* dy, DType dy_type, void* dx, DType dx_type, int64_t planes, int64_t area) {
  Tensor dxv = view(dx, {planes, area}, dx_type, "plane_mean_backward dx");
  fedmesh::plane_mean_backward(view(dy, {planes}, dy_type, "plane_mean_backward dy"), dxv);
  count_op();
}

void embedding_forward(Stream, const void* table, DType table_type, int64_t vocabulary, int64_t dim,
                       const int32_t* ids, int64_t count, void* out, DType out_type) {
  check_device(ids, static_cast<size_t>(count) * sizeof(int32_t), "embedding_forward ids");
  Tensor o = view(out, {count, dim}, out_type, "embedding_forward out");
  fedmesh::embedding_forward(view(table, {vocabulary, dim}, table_type, "embedding_forward table"),
                             std::span<const int32_t>(ids, static_cast<size_t>(count)), o);
  count_op();
}
void embedding_backward(Stream, const int32_t* ids, int64_t count, const void* dout, DType dout_type, float* dtable,
                        int64_t vocabulary, int64_t dim) {
  check_device(ids, static_cast<size_t>(count) * sizeof(int32_t), "embedding_backward ids");
  Tensor t = view_f32(dtable, {vocabulary, dim}, "embedding_backward dtable");
  fedmesh::embedding_backward(std::span<const int32_t>(ids, static_cast<size_t>(count)),
                              view(dout, {count, dim}, dout_type, "embedding_backward dout"), t);
  count_op();
}

// Attention's pieces (device_ops.cpp puts them together), in plain loops:
// fp32 sums, one rounding per stored value, as the device does.
namespace {

// Element `offset` of a buffer of `type`.
const void* element_at(const void* p, DType type, int64_t offset) {
  return static_cast<const char*>(p) + bytes_of(type, offset);
}
void* element_at(void* p, DType type, int64_t offset) { return static_cast<char*>(p) + bytes_of(type, offset); }

void causal_softmax_rows(const float* scores, int64_t batch, int64_t seq, float scale, const float* lse_in,
                         float* lse_out, int64_t lse_stride, void* probabilities, DType p_type, const char* op) {
  check_device(scores, bytes_of(DType::kF32, batch * seq * seq), op);
  check_device(probabilities, bytes_of(p_type, batch * seq * seq), op);
  for (int64_t pair = 0; pair < batch; ++pair) {
    check_device(lse_in != nullptr ? lse_in + pair * lse_stride : lse_out + pair * lse_stride,
                 bytes_of(DType::kF32, seq), op);
    for (int64_t t = 0; t < seq; ++t) {
      const float* row = scores + (pair * seq + t) * seq;
      float lse;
      if (lse_out != nullptr) {
        float max_value = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j <= t; ++j) max_value = std::max(max_value, scale * row[j]);
        for (int64_t j = 0; j <= t; ++j) sum += std::exp(scale * row[j] - max_value);
        lse = max_value + std::log(sum);
        lse_out[pair * lse_stride + t] = lse;
      } else {
        lse = lse_in[pair * lse_stride + t];
      }
      std::vector<float> p(static_cast<size_t>(seq), 0.0f);
      for (int64_t j = 0; j <= t; ++j) p[static_cast<size_t>(j)] = std::exp(scale * row[j] - lse);
      narrow_from_f32(p.data(), element_at(probabilities, p_type, (pair * seq + t) * seq), p_type, seq);
    }
  }
  count_op();
}

}  // namespace

void gemm_strided_batched(Stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                          const void* a, DType a_type, int64_t lda, int64_t stride_a, const void* b, DType b_type,
                          int64_t ldb, int64_t stride_b, float beta, void* c, DType c_type, int64_t ldc,
                          int64_t stride_c, int64_t batch) {
  FEDMESH_CHECK(a_type == b_type && (c_type == a_type || c_type == DType::kF32),
                "emulated cuda::gemm_strided_batched: dtypes");
  if (m == 0 || n == 0 || batch == 0) return;
  const int64_t a_rows = transpose_a ? k : m, a_cols = transpose_a ? m : k;
  const int64_t b_rows = transpose_b ? n : k, b_cols = transpose_b ? k : n;
  for (int64_t i = 0; i < batch; ++i) {
    check_device(element_at(a, a_type, i * stride_a), bytes_of(a_type, (a_rows - 1) * lda + a_cols),
                 "gemm_strided_batched a");
    check_device(element_at(b, b_type, i * stride_b), bytes_of(b_type, (b_rows - 1) * ldb + b_cols),
                 "gemm_strided_batched b");
    check_device(element_at(c, c_type, i * stride_c), bytes_of(c_type, (m - 1) * ldc + n), "gemm_strided_batched c");
    // Each operand widened into a dense fp32 copy, then the CPU's sgemm.
    const auto dense = [](const void* p, DType type, int64_t offset, int64_t rows, int64_t cols, int64_t ld) {
      std::vector<float> out(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r) {
        widen_to_f32(element_at(p, type, offset + r * ld), type, out.data() + r * cols, cols);
      }
      return out;
    };
    const std::vector<float> x = dense(a, a_type, i * stride_a, a_rows, a_cols, lda);
    const std::vector<float> y = dense(b, b_type, i * stride_b, b_rows, b_cols, ldb);
    std::vector<float> product =
        beta != 0.0f ? dense(c, c_type, i * stride_c, m, n, ldc) : std::vector<float>(static_cast<size_t>(m * n));
    // cuBLASLt picks its algorithm by the whole problem, batch count
    // included, so the same matrices in batches of another count may be
    // summed in another order (split-K, other tiles): on an H200 one chunk of
    // 3 sequences and chunks of 1 gave different bits. The emulation does the
    // same, so that no test here relies on bits a GPU does not keep: batches
    // of more than one sum K in two halves.
    const int64_t split = batch > 1 && k > 1 ? k / 2 : k;
    const int64_t lda_dense = std::max<int64_t>(a_cols, 1), ldb_dense = std::max<int64_t>(b_cols, 1);
    sgemm(transpose_a, transpose_b, m, n, split, alpha, x.data(), lda_dense, y.data(), ldb_dense, beta,
          product.data(), n);
    if (split < k) {
      const float* a_rest = transpose_a ? x.data() + split * a_cols : x.data() + split;
      const float* b_rest = transpose_b ? y.data() + split : y.data() + split * b_cols;
      sgemm(transpose_a, transpose_b, m, n, k - split, alpha, a_rest, lda_dense, b_rest, ldb_dense, 1.0f,
            product.data(), n);
    }
    for (int64_t r = 0; r < m; ++r) {
      narrow_from_f32(product.data() + r * n, element_at(c, c_type, i * stride_c + r * ldc), c_type, n);
    }
  }
  count_op();
}

void causal_softmax(Stream, const float* scores, int64_t batch, int64_t seq, float scale, float* log_sum_exp,
                    int64_t lse_stride, void* probabilities, DType p_type) {
  causal_softmax_rows(scores, batch, seq, scale, nullptr, log_sum_exp, lse_stride, probabilities, p_type,
                      "causal_softmax");
}

void causal_probabilities(Stream, const float* scores, int64_t batch, int64_t seq, float scale,
                          const float* log_sum_exp, int64_t lse_stride, void* probabilities, DType p_type) {
  causal_softmax_rows(scores, batch, seq, scale, log_sum_exp, nullptr, lse_stride, probabilities, p_type,
                      "causal_probabilities");
}

void causal_softmax_backward(Stream, void* probabilities, DType p_type, const float* dprobabilities, int64_t batch,
                             int64_t seq, float scale) {
  check_device(probabilities, bytes_of(p_type, batch * seq * seq), "causal_softmax_backward p");
  check_device(dprobabilities, bytes_of(DType::kF32, batch * seq * seq), "causal_softmax_backward dp");
  std::vector<float> p(static_cast<size_t>(seq));
  for (int64_t row = 0; row < batch * seq; ++row) {
    const int64_t t = row % seq, base = row * seq;
    widen_to_f32(element_at(probabilities, p_type, base), p_type, p.data(), seq);
    float dot = 0.0f;
    for (int64_t j = 0; j <= t; ++j) dot += p[static_cast<size_t>(j)] * dprobabilities[base + j];
    for (int64_t j = 0; j < seq; ++j) {
      p[static_cast<size_t>(j)] = j <= t ? scale * p[static_cast<size_t>(j)] * (dprobabilities[base + j] - dot) : 0.0f;
    }
    narrow_from_f32(p.data(), element_at(probabilities, p_type, base), p_type, seq);
  }
  count_op();
}

// The fused attention kernels are not emulated: the emulated device takes
// the GEMM path (cuda::flash_attention_supported is false), and without
// these definitions a CPU-only build (-Dcuda=disabled) links
// kernels/cuda_ops_cpu_only.cpp's beside this file's (multiple definitions).
bool flash_attention_supported(const AttentionShape&, DType) { return false; }
void flash_attention_forward(Stream, const AttentionShape&, DType, const void*, void*, float*) {
  FEDMESH_CHECK(false, "emulated cuda::flash_attention_forward: not emulated (flash_attention_supported is false)");
}
void flash_attention_backward(Stream, const AttentionShape&, DType, const void*, const void*, const float*, const void*,
                              void*) {
  FEDMESH_CHECK(false, "emulated cuda::flash_attention_backward: not emulated (flash_attention_supported is false)");
}

void token_ids(Stream, const float* x, int64_t n, int64_t vocabulary, int32_t* ids) {
  check_device(x, static_cast<size_t>(n) * sizeof(float), "token_ids x");
  check_device(ids, static_cast<size_t>(n) * sizeof(int32_t), "token_ids ids");
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    ids[i] = (v >= 0.0f && v < static_cast<float>(vocabulary) && v == std::floor(v)) ? static_cast<int32_t>(v) : -1;
  }
  count_op();
}

namespace {

// The optimizers' shared preamble and epilogue: the skipped step, the
// gradient factor, and the compute copy.
template <class Step>
void optimizer_step(const char* op, float* weights, const float* grads, void* compute_copy, DType compute_type,
                    int64_t n, const float* grad_scale_inverse, const int* found_inf, Step step) {
  check_device(weights, static_cast<size_t>(n) * sizeof(float), op);
  check_device(grads, static_cast<size_t>(n) * sizeof(float), op);
  count_op();
  if (found_inf != nullptr) {
    check_device(found_inf, sizeof(int), op);
    if (*found_inf != 0) return;
  }
  std::vector<float> scaled;
  const float* g = grads;
  if (grad_scale_inverse != nullptr) {
    check_device(grad_scale_inverse, sizeof(float), op);
    scaled.assign(grads, grads + n);
    for (float& v : scaled) v *= *grad_scale_inverse;
    g = scaled.data();
  }
  step(g);
  if (compute_copy != nullptr) {
    check_device(compute_copy, bytes_of(compute_type, n), op);
    narrow_from_f32(weights, compute_copy, compute_type, n);
  }
}

}  // namespace

void sgd_step(Stream, float* weights, const float* grads, float* momentum, void* compute_copy, DType compute_type,
              int64_t n, float lr, const SgdOptions& options, const float* grad_scale_inverse, const int* found_inf) {
  if (momentum != nullptr) check_device(momentum, static_cast<size_t>(n) * sizeof(float), "sgd_step momentum");
  optimizer_step("sgd_step", weights, grads, compute_copy, compute_type, n, grad_scale_inverse, found_inf,
                 [&](const float* g) { fedmesh::sgd_step(weights, g, momentum, n, lr, options); });
}

void adamw_step(Stream, float* weights, const float* grads, float* first_moment, float* second_moment,
                void* compute_copy, DType compute_type, int64_t n, int64_t step, float lr, const AdamWOptions& options,
                const float* grad_scale_inverse, const int* found_inf) {
  check_device(first_moment, static_cast<size_t>(n) * sizeof(float), "adamw_step first moment");
  check_device(second_moment, static_cast<size_t>(n) * sizeof(float), "adamw_step second moment");
  optimizer_step("adamw_step", weights, grads, compute_copy, compute_type, n, grad_scale_inverse, found_inf,
                 [&](const float* g) {
                   fedmesh::adamw_step(weights, g, first_moment, second_moment, n, step, lr, options);
                 });
}

void unscale_and_check(Stream, float* grads, int64_t n, float inverse_scale, int* found_inf) {
  check_device(grads, static_cast<size_t>(n) * sizeof(float), "unscale_and_check");
  check_device(found_inf, sizeof(int), "unscale_and_check found_inf");
  for (int64_t i = 0; i < n; ++i) {
    grads[i] *= inverse_scale;
    if (!std::isfinite(grads[i])) *found_inf = 1;
  }
  count_op();
}

void gradient_scale_factor(Stream, const double* squared_norm, float loss_scale, float clip_grad_norm, float* factor,
                           int* found_inf) {
  check_device(squared_norm, sizeof(double), "gradient_scale_factor");
  check_device(factor, sizeof(float), "gradient_scale_factor factor");
  double f = 1.0 / loss_scale;
  if (!std::isfinite(*squared_norm)) {
    if (found_inf != nullptr) *found_inf = 1;
  } else {
    const double norm = std::sqrt(*squared_norm) / loss_scale;
    if (clip_grad_norm > 0.0f && norm > clip_grad_norm) f *= clip_grad_norm / norm;
  }
  *factor = static_cast<float>(f);
  count_op();
}

void delta(Stream, const float* a, const float* b, float* out, int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  check_device(a, bytes, "delta a");
  check_device(b, bytes, "delta b");
  check_device(out, bytes, "delta out");
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] - b[i];
  count_op();
}

void weighted_accumulate(Stream, double* accumulator, const float* x, double weight, int64_t n) {
  check_device(accumulator, static_cast<size_t>(n) * sizeof(double), "weighted_accumulate accumulator");
  check_device(x, static_cast<size_t>(n) * sizeof(float), "weighted_accumulate x");
  for (int64_t i = 0; i < n; ++i) accumulator[i] += weight * static_cast<double>(x[i]);
  count_op();
}

}  // namespace fedmesh::cuda
