// cuda::gemm through cuBLASLt (kernels/cuda_ops.h), with its bias and GELU
// epilogues where cuBLASLt takes the combination and fedmesh's own epilogue
// kernel where it does not.
//
// Row-major to column-major: a row-major (r, c) matrix with leading dimension
// ld is the column-major (c, r) matrix with the same ld, i.e. its transpose.
// So row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T: cuBLASLt
// multiplies "A" = our b by "B" = our a into an (n, m) column-major D, and a
// bias of length n (D's rows) is added to every row of our c, as add_bias does.
#include "kernels/cuda/cuda_check.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda_ops.h"

namespace fedmesh::cuda {
namespace {

// Per stream (two streams must not share one while their GEMMs overlap);
// PyTorch and llm.c use 32 MiB on Hopper too.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF32: break;
  }
  return CUDA_R_32F;
}

// The largest power of two (up to 256) dividing the address: what the
// heuristic may assume about a buffer's alignment (it never sees the pointer).
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// One cuBLASLt handle per process, and one workspace per stream, made on
// first use; the mutex serializes the host side of every GEMM (the handle's
// descriptors and the workspace map).
class LtContext {
 public:
  static LtContext& get() {
    static auto* context = new LtContext();  // never destroyed (see allocator.cu)
    return *context;
  }
  std::mutex& mutex() { return mutex_; }
  cublasLtHandle_t handle() const { return handle_; }
  void* workspace(Stream stream) {
    void*& workspace = workspaces_[stream];
    if (workspace == nullptr) workspace = allocate(kWorkspaceBytes, stream);
    return workspace;
  }

 private:
  LtContext() { FEDMESH_CUBLAS_CHECK(cublasLtCreate(&handle_)); }
  std::mutex mutex_;
  cublasLtHandle_t handle_ = nullptr;
  std::unordered_map<Stream, void*> workspaces_;
};

struct GemmCall {
  Stream stream;
  bool transpose_a, transpose_b;
  int64_t m, n, k;
  float alpha;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  DType ab_type;
  float beta;
  void* c;
  DType c_type;
  int64_t ldc;
  // gemm_strided_batched: `batch` products, operand i at i * stride elements.
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
};

// The descriptors of one cublasLtMatmul, destroyed with it.
class LtDescriptors {
 public:
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    // Destroy calls only fail on a null descriptor; nothing to report here.
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (operation) cublasLtMatmulDescDestroy(operation);
  }
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A, B and C = D
  cublasLtMatmulPreference_t preference = nullptr;
};

template <class T>
void set_attribute(cublasLtMatmulDesc_t description, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  FEDMESH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(description, attribute, &value, sizeof(value)));
}

template <class T>
void set_preference(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
                    const T& value) {
  FEDMESH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
}

std::string describe(const GemmCall& call) {
  return "gemm m " + std::to_string(call.m) + " n " + std::to_string(call.n) + " k " + std::to_string(call.k) +
         (call.transpose_a ? " a^T" : "") + (call.transpose_b ? " b^T" : "") + " " + dtype_name(call.ab_type) + " -> " +
         dtype_name(call.c_type) + (call.batch > 1 ? " x " + std::to_string(call.batch) : "");
}

void set_batch(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride) {
  const int32_t count = static_cast<int32_t>(batch);
  FEDMESH_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  FEDMESH_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

// Says on stderr, once per process for each epilogue and bias dtype, that
// cuBLASLt declined an epilogue, so that a profile showing fedmesh's epilogue
// kernel can be explained; returns false for lt_matmul to pass on.
bool declined(const GemmCall& call, cublasLtEpilogue_t epilogue, DType bias_type, const char* how,
              cublasStatus_t status) {
  static std::mutex mutex;
  static std::set<std::pair<int, int>> said;
  std::lock_guard<std::mutex> lock(mutex);
  if (said.emplace(static_cast<int>(epilogue), static_cast<int>(bias_type)).second) {
    std::fprintf(stderr, "fedmesh: cuBLASLt declined epilogue %d with a %s bias for %s (%s: %s) (said once)\n",
                 static_cast<int>(epilogue), dtype_name(bias_type), describe(call).c_str(), how,
                 cublasLtGetStatusName(status));
  }
  return false;
}

// One cublasLtMatmul with `epilogue` (bias and aux as that epilogue reads
// them). With `may_decline` (an epilogue cuBLASLt might not take) a
// combination it refuses returns false and enqueues nothing; every other
// failure aborts.
bool lt_matmul(const GemmCall& call, cublasLtEpilogue_t epilogue, const void* bias, DType bias_type, void* aux,
               bool may_decline) {
  LtContext& context = LtContext::get();
  std::lock_guard<std::mutex> lock(context.mutex());
  LtDescriptors descriptors;
  FEDMESH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&descriptors.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t op_a = call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const int32_t op_b = call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // and its B our a
  set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(epilogue));
  if (bias != nullptr) {
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                  static_cast<int32_t>(cuda_data_type(bias_type)));
  }
  if (aux != nullptr) {
    // (n, m) column-major with ld n: our dense (m, n); its dtype is D's.
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(call.n));
  }
  const cudaDataType_t ab_type = cuda_data_type(call.ab_type);
  FEDMESH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&descriptors.a, ab_type, call.transpose_b ? call.k : call.n,
                                                  call.transpose_b ? call.n : call.k, call.ldb));
  FEDMESH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&descriptors.b, ab_type, call.transpose_a ? call.m : call.k,
                                                  call.transpose_a ? call.k : call.m, call.lda));
  FEDMESH_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&descriptors.d, cuda_data_type(call.c_type), call.n, call.m, call.ldc));
  if (call.batch > 1) {
    set_batch(descriptors.a, call.batch, call.stride_b);
    set_batch(descriptors.b, call.batch, call.stride_a);
    set_batch(descriptors.d, call.batch, call.stride_c);
  }

  FEDMESH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&descriptors.preference));
  set_preference(descriptors.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{kWorkspaceBytes});
  set_preference(descriptors.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(call.b));
  set_preference(descriptors.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(call.a));
  set_preference(descriptors.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(call.c));
  set_preference(descriptors.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(call.c));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(context.handle(), descriptors.operation, descriptors.a, descriptors.b,
                                     descriptors.d, descriptors.d, descriptors.preference, 1, &heuristic, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    if (may_decline) return declined(call, epilogue, bias_type, "no algorithm", status);
    FEDMESH_CHECK(false, "cuBLASLt has no algorithm for " + describe(call) + ": " + cublasLtGetStatusName(status));
  }
  const cublasStatus_t run =
      cublasLtMatmul(context.handle(), descriptors.operation, &call.alpha, call.b, descriptors.a, call.a, descriptors.b,
                     &call.beta, call.c, descriptors.d, call.c, descriptors.d, &heuristic.algo,
                     context.workspace(call.stream), kWorkspaceBytes, to_cuda(call.stream));
  // An unsupported epilogue combination may only show here ("If set for an
  // unsupported ... combination, calling cublasLtMatmul() will return
  // CUBLAS_STATUS_INVALID_VALUE", cublasLt.h); nothing was enqueued then.
  if (may_decline && (run == CUBLAS_STATUS_NOT_SUPPORTED || run == CUBLAS_STATUS_INVALID_VALUE)) {
    return declined(call, epilogue, bias_type, "cublasLtMatmul refused it", run);
  }
  FEDMESH_CUBLAS_CHECK(run);
  return true;
}

// The epilogue of the fallback path, and the widening of a low-precision c:
// out[i, j] = f(in[i, j] + bias[j]) over a (rows, cols) matrix, with f GELU
// or the identity; aux (ld cols) receives in + bias when given. Each value
// is rounded once, to out's (and aux's) dtype.
__global__ void epilogue_kernel(const void* in, DType in_type, int64_t ld_in, int64_t rows, int64_t cols,
                                const float* bias, bool gelu, void* aux, DType aux_type, void* out, DType out_type,
                                int64_t ld_out) {
  const int64_t count = rows * cols;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t i = index / cols, j = index % cols;
    float v = load(in, in_type, i * ld_in + j);
    if (bias != nullptr) v = __fadd_rn(v, bias[j]);
    if (aux != nullptr) store(aux, aux_type, index, v);
    store(out, out_type, i * ld_out + j, gelu ? device_gelu(v) : v);
  }
}

void launch_epilogue(Stream stream, const void* in, DType in_type, int64_t ld_in, int64_t rows, int64_t cols,
                     const float* bias, bool gelu, void* aux, DType aux_type, void* out, DType out_type,
                     int64_t ld_out) {
  launch(epilogue_kernel, grid_for(rows * cols), kThreads, stream, in, in_type, ld_in, rows, cols, bias, gelu, aux,
         aux_type, out, out_type, ld_out);
}

cublasLtEpilogue_t lt_epilogue(const GemmEpilogue& epilogue) {
  if (epilogue.kind == GemmEpilogueKind::kBias) return CUBLASLT_EPILOGUE_BIAS;
  const bool bias = epilogue.bias != nullptr, aux = epilogue.gelu_input_out != nullptr;
  if (bias) return aux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
  return aux ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU;
}

// The plain GEMM, then epilogue_kernel on its fp32 result.
void gemm_then_epilogue(const GemmCall& call, const GemmEpilogue& epilogue) {
  const bool gelu = epilogue.kind == GemmEpilogueKind::kGeluBias;
  void* aux = gelu ? epilogue.gelu_input_out : nullptr;
  if (call.c_type == DType::kF32) {
    lt_matmul(call, CUBLASLT_EPILOGUE_DEFAULT, nullptr, DType::kF32, nullptr, /*may_decline=*/false);
    launch_epilogue(call.stream, call.c, DType::kF32, call.ldc, call.m, call.n, epilogue.bias, gelu, aux, DType::kF32,
                    call.c, DType::kF32, call.ldc);
    return;
  }
  // A low-precision c: the product (plus beta * c) in an fp32 buffer first,
  // so that the bias and GELU see it before the one rounding, as cuBLASLt's
  // epilogue does.
  DeviceBuffer product(static_cast<size_t>(call.m * call.n) * sizeof(float), call.stream);
  if (call.beta != 0.0f) {
    launch_epilogue(call.stream, call.c, call.c_type, call.ldc, call.m, call.n, nullptr, false, nullptr, DType::kF32,
                    product.data(), DType::kF32, call.n);
  }
  GemmCall widened = call;
  widened.c = product.data();
  widened.c_type = DType::kF32;
  widened.ldc = call.n;
  lt_matmul(widened, CUBLASLT_EPILOGUE_DEFAULT, nullptr, DType::kF32, nullptr, /*may_decline=*/false);
  launch_epilogue(call.stream, product.data(), DType::kF32, call.n, call.m, call.n, epilogue.bias, gelu, aux,
                  call.c_type, call.c, call.c_type, call.ldc);
}

// cuBLASLt's fast kernels want every stored matrix's rows 16-byte aligned:
// its leading dimension and the length of its rows (m, n or k, whichever is
// stored contiguously) a multiple of 16 bytes. A vocabulary of 50 257 bf16
// values is neither, in the logits and in the logits' gradient, which sends
// cuBLASLt to Turing-era align-1 kernels, about ten times slower. A product
// at least this large then runs as the padded problem: m, n and k rounded up
// to 16 bytes' worth of elements, each operand that does not fit copied into
// a zero-padded buffer (zeros in the padding of k add nothing; c's padding
// rows and columns are dropped when it is copied back). The copies cost far
// less than the slow kernel.
constexpr int64_t kPaddedProductMinimum = int64_t{1} << 27;  // m * n * k
constexpr int64_t kRowAlignmentBytes = 16;

int64_t round_up(int64_t value, int64_t unit) { return (value + unit - 1) / unit * unit; }

bool rows_aligned(const void* pointer, int64_t ld, DType dtype) {
  return alignment_of(pointer) >= kRowAlignmentBytes &&
         ld * static_cast<int64_t>(dtype_size(dtype)) % kRowAlignmentBytes == 0;
}

// A row-major (rows, columns) matrix at `from` (leading dimension from_ld)
// copied into one at `to` (to_ld), on the stream.
void copy_matrix(Stream stream, const void* from, int64_t from_ld, void* to, int64_t to_ld, int64_t rows,
                 int64_t columns, DType dtype) {
  if (rows == 0 || columns == 0) return;
  const size_t size = dtype_size(dtype);
  FEDMESH_CUDA_CHECK(cudaMemcpy2DAsync(to, static_cast<size_t>(to_ld) * size, from, static_cast<size_t>(from_ld) * size,
                                       static_cast<size_t>(columns) * size, static_cast<size_t>(rows),
                                       cudaMemcpyDeviceToDevice, to_cuda(stream)));
}

// A stored operand of the padded problem: (rows, columns) of it are the
// caller's, the rest up to (padded_rows, ld) zeros.
struct PaddedMatrix {
  PaddedMatrix(Stream stream, const void* from, int64_t from_ld, int64_t rows, int64_t columns, int64_t padded_rows,
               int64_t ld, DType dtype, bool copy_in)
      : ld(ld), buffer(static_cast<size_t>(std::max<int64_t>(padded_rows * ld, 1)) * dtype_size(dtype), stream) {
    const size_t size = dtype_size(dtype);
    char* base = static_cast<char*>(buffer.data());
    if (copy_in) copy_matrix(stream, from, from_ld, base, ld, rows, columns, dtype);
    if (ld > columns && rows > 0) {  // the padding columns of the caller's rows
      FEDMESH_CUDA_CHECK(cudaMemset2DAsync(base + static_cast<size_t>(columns) * size, static_cast<size_t>(ld) * size, 0,
                                           static_cast<size_t>(ld - columns) * size, static_cast<size_t>(rows),
                                           to_cuda(stream)));
    }
    if (padded_rows > rows) {  // the padding rows
      set_zero(base + static_cast<size_t>(rows * ld) * size, static_cast<size_t>((padded_rows - rows) * ld) * size,
               stream);
    }
  }
  int64_t ld;
  DeviceBuffer buffer;
};

// The plain GEMM as the padded problem; false (nothing enqueued) when every
// stored matrix's rows are aligned already or the product is small.
bool padded_matmul(const GemmCall& call) {
  if (call.batch != 1 || call.m * call.n * call.k < kPaddedProductMinimum) return false;
  const int64_t unit = kRowAlignmentBytes / static_cast<int64_t>(std::min(dtype_size(call.ab_type), dtype_size(call.c_type)));
  const int64_t m = round_up(call.m, unit), n = round_up(call.n, unit), k = round_up(call.k, unit);
  // Each operand as stored: (rows, columns) now and in the padded problem.
  const int64_t a_rows = call.transpose_a ? call.k : call.m, a_columns = call.transpose_a ? call.m : call.k;
  const int64_t a_padded_rows = call.transpose_a ? k : m, a_padded_columns = call.transpose_a ? m : k;
  const int64_t b_rows = call.transpose_b ? call.n : call.k, b_columns = call.transpose_b ? call.k : call.n;
  const int64_t b_padded_rows = call.transpose_b ? n : k, b_padded_columns = call.transpose_b ? k : n;
  // An operand is used in place when its columns need no padding and its
  // rows are aligned (extra rows of a or b would only be read for padding
  // that is not there: those operands are copied too).
  const bool a_fits = a_columns == a_padded_columns && a_rows == a_padded_rows &&
                      rows_aligned(call.a, call.lda, call.ab_type);
  const bool b_fits = b_columns == b_padded_columns && b_rows == b_padded_rows &&
                      rows_aligned(call.b, call.ldb, call.ab_type);
  const bool c_fits = call.n == n && call.m == m && rows_aligned(call.c, call.ldc, call.c_type);
  if (a_fits && b_fits && c_fits) return false;

  GemmCall padded = call;
  padded.m = m;
  padded.n = n;
  padded.k = k;
  std::optional<PaddedMatrix> a, b, c;
  if (!a_fits) {
    a.emplace(call.stream, call.a, call.lda, a_rows, a_columns, a_padded_rows, a_padded_columns, call.ab_type, true);
    padded.a = a->buffer.data();
    padded.lda = a->ld;
  }
  if (!b_fits) {
    b.emplace(call.stream, call.b, call.ldb, b_rows, b_columns, b_padded_rows, b_padded_columns, call.ab_type, true);
    padded.b = b->buffer.data();
    padded.ldb = b->ld;
  }
  if (!c_fits) {
    c.emplace(call.stream, call.c, call.ldc, call.m, call.n, m, n, call.c_type, /*copy_in=*/call.beta != 0.0f);
    padded.c = c->buffer.data();
    padded.ldc = c->ld;
  }
  lt_matmul(padded, CUBLASLT_EPILOGUE_DEFAULT, nullptr, DType::kF32, nullptr, /*may_decline=*/false);
  if (!c_fits) copy_matrix(call.stream, c->buffer.data(), c->ld, call.c, call.ldc, call.m, call.n, call.c_type);
  return true;
}

void check_gemm(const GemmCall& call, const char* op) {
  const std::string name = std::string("cuda::") + op;
  FEDMESH_CHECK(call.m >= 0 && call.n >= 0 && call.k >= 0, name + ": negative size in " + describe(call));
  FEDMESH_CHECK(call.c_type == call.ab_type || call.c_type == DType::kF32,
                name + ": c must be fp32 or the operands' dtype in " + describe(call));
  FEDMESH_CHECK(call.lda >= std::max<int64_t>(1, call.transpose_a ? call.m : call.k) &&
                    call.ldb >= std::max<int64_t>(1, call.transpose_b ? call.k : call.n) &&
                    call.ldc >= std::max<int64_t>(1, call.n),
                name + ": leading dimension too small in " + describe(call));
}

void check_same_dtype(DType a_type, DType b_type, const char* op) {
  FEDMESH_CHECK(a_type == b_type, std::string("cuda::") + op + ": a and b must have one dtype (" +
                                      dtype_name(a_type) + " vs " + dtype_name(b_type) + ")");
}

}  // namespace

void gemm(Stream stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, DType a_type, int64_t lda, const void* b, DType b_type, int64_t ldb, float beta, void* c,
          DType c_type, int64_t ldc, const GemmEpilogue& epilogue) {
  check_same_dtype(a_type, b_type, "gemm");
  const GemmCall call{stream, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, a_type, beta, c, c_type, ldc};
  check_gemm(call, "gemm");
  const bool bias_needed = epilogue.kind == GemmEpilogueKind::kBias;
  FEDMESH_CHECK(!bias_needed || epilogue.bias != nullptr, "cuda::gemm: a kBias epilogue without a bias");
  FEDMESH_CHECK(epilogue.gelu_input_out == nullptr || epilogue.kind == GemmEpilogueKind::kGeluBias,
                "cuda::gemm: gelu_input_out goes with kGeluBias");
  if (m == 0 || n == 0) return;

  // No product: c = beta * c (0 when beta is 0, as sgemm does), then the
  // epilogue (rounding a low-precision c twice in this degenerate case).
  if (k == 0) {
    const size_t row_bytes = static_cast<size_t>(n) * dtype_size(c_type);
    const int64_t pieces = ldc == n ? 1 : m;  // c in one piece, or row by row
    const int64_t piece_elements = ldc == n ? m * n : n;
    for (int64_t i = 0; i < pieces; ++i) {
      void* piece = static_cast<char*>(c) + static_cast<size_t>(i * ldc) * dtype_size(c_type);
      if (beta == 0.0f) {
        set_zero(piece, static_cast<size_t>(piece_elements / n) * row_bytes, stream);
      } else {
        scale(stream, piece, c_type, piece_elements, beta);
      }
    }
    if (epilogue.kind != GemmEpilogueKind::kNone) {
      launch_epilogue(stream, c, c_type, ldc, m, n, epilogue.bias, epilogue.kind == GemmEpilogueKind::kGeluBias,
                      epilogue.gelu_input_out, c_type, c, c_type, ldc);
    }
    return;
  }

  if (epilogue.kind == GemmEpilogueKind::kNone) {
    if (!padded_matmul(call)) {
      lt_matmul(call, CUBLASLT_EPILOGUE_DEFAULT, nullptr, DType::kF32, nullptr, /*may_decline=*/false);
    }
    return;
  }
  // cuBLASLt's epilogue only where it is known to behave: a dense c (its bias
  // epilogue has dropped the bias with ldc > rows on some GPUs, see
  // github.com/dfyz/cublaslt-bias-epilogue), and an aux leading dimension that
  // is a multiple of 8 (cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD).
  const bool fusable = epilogue.use_cublaslt_epilogue && ldc == n && (epilogue.gelu_input_out == nullptr || n % 8 == 0);
  if (fusable && lt_matmul(call, lt_epilogue(epilogue), epilogue.bias, DType::kF32, epilogue.gelu_input_out,
                           /*may_decline=*/true)) {
    return;
  }
  // cuBLASLt may want the bias in c's dtype when c is bf16 or fp16 (H200,
  // cuBLAS 13.1: an fp32 bias with a bf16 c has no algorithm). The bias is
  // then rounded to c's dtype first, as PyTorch's autocast rounds it.
  if (fusable && epilogue.bias != nullptr && c_type != DType::kF32) {
    DeviceBuffer rounded_bias(static_cast<size_t>(n) * dtype_size(c_type), stream);
    cast(stream, epilogue.bias, DType::kF32, rounded_bias.data(), c_type, n);
    if (lt_matmul(call, lt_epilogue(epilogue), rounded_bias.data(), c_type, epilogue.gelu_input_out,
                  /*may_decline=*/true)) {
      return;
    }
  }
  gemm_then_epilogue(call, epilogue);
}

void gemm_strided_batched(Stream stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const void* a, DType a_type, int64_t lda, int64_t stride_a, const void* b,
                          DType b_type, int64_t ldb, int64_t stride_b, float beta, void* c, DType c_type, int64_t ldc,
                          int64_t stride_c, int64_t batch) {
  check_same_dtype(a_type, b_type, "gemm_strided_batched");
  GemmCall call{stream, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, a_type, beta, c, c_type, ldc};
  call.batch = batch;
  call.stride_a = stride_a;
  call.stride_b = stride_b;
  call.stride_c = stride_c;
  check_gemm(call, "gemm_strided_batched");
  FEDMESH_CHECK(batch >= 0 && batch <= INT32_MAX && stride_a >= 0 && stride_b >= 0 && stride_c >= 0,
                "cuda::gemm_strided_batched: batch or stride out of range in " + describe(call));
  if (m == 0 || n == 0 || batch == 0) return;
  FEDMESH_CHECK(k > 0, "cuda::gemm_strided_batched: k is 0 in " + describe(call));
  lt_matmul(call, CUBLASLT_EPILOGUE_DEFAULT, nullptr, DType::kF32, nullptr, /*may_decline=*/false);
}

}  // namespace fedmesh::cuda
