#include "kernels/conv.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/convert.h"
#include "kernels/device_ops.h"
#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {

namespace {

// Output positions j in [0, outputs) whose input position j*stride - offset
// falls inside [0, size): the part of a row that is not padding.
std::pair<int64_t, int64_t> valid_output_range(int64_t offset, int64_t stride, int64_t size, int64_t outputs) {
  // j*stride >= offset  and  j*stride - offset <= size - 1
  const int64_t first = offset <= 0 ? 0 : (offset + stride - 1) / stride;
  const int64_t last = (size - 1 + offset) < 0 ? -1 : (size - 1 + offset) / stride;  // inclusive
  const int64_t begin = std::min(first, outputs);
  const int64_t end = std::max(begin, std::min(outputs, last + 1));
  return {begin, end};
}

}  // namespace

void im2col(const Conv2dGeometry& g, const Tensor& x, float* col) {
  device::require_host("im2col", {&x});
  const int64_t oh = g.out_height(), ow = g.out_width(), plane = oh * ow;
  const int64_t k = g.kernel, columns = g.columns();
  visit_dtype(x.dtype(), [&]<class T>() {
    const T* in = x.data<T>();
    // One task per (channel, kernel row, kernel column) row of the column matrix.
    parallel_for(g.patch_size(), 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t c = r / (k * k), ki = (r / k) % k, kj = r % k;
        float* out_row = col + r * columns;
        for (int64_t b = 0; b < g.batch; ++b) {
          const T* image = in + (b * g.in_channels + c) * g.height * g.width;
          float* out = out_row + b * plane;
          for (int64_t i = 0; i < oh; ++i) {
            const int64_t hi = i * g.stride - g.padding + ki;
            float* out_line = out + i * ow;
            if (hi < 0 || hi >= g.height) {
              std::memset(out_line, 0, static_cast<size_t>(ow) * sizeof(float));
              continue;
            }
            const T* line = image + hi * g.width;
            // Output columns [j0, j1) read inside the image; the rest is padding.
            const auto [j0, j1] = valid_output_range(g.padding - kj, g.stride, g.width, ow);
            std::fill(out_line, out_line + j0, 0.0f);
            if (g.stride == 1) {
              const T* src = line + j0 - g.padding + kj;
              for (int64_t j = j0; j < j1; ++j) out_line[j] = to_float(src[j - j0]);
            } else {
              for (int64_t j = j0; j < j1; ++j) out_line[j] = to_float(line[j * g.stride - g.padding + kj]);
            }
            std::fill(out_line + j1, out_line + ow, 0.0f);
          }
        }
      }
    });
  });
}

void col2im(const Conv2dGeometry& g, const float* dcol, Tensor& dx) {
  device::require_host("col2im", {&dx});
  const int64_t oh = g.out_height(), ow = g.out_width(), plane = oh * ow;
  const int64_t k = g.kernel, columns = g.columns(), image_plane = g.height * g.width;
  visit_dtype(dx.dtype(), [&]<class T>() {
    T* out = dx.data<T>();
    // One task per (image, channel) plane: each owns its output, no races.
    parallel_for(g.batch * g.in_channels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> accumulator(static_cast<size_t>(image_plane));
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / g.in_channels, c = p % g.in_channels;
        std::fill(accumulator.begin(), accumulator.end(), 0.0f);
        for (int64_t ki = 0; ki < k; ++ki) {
          for (int64_t kj = 0; kj < k; ++kj) {
            const float* in = dcol + ((c * k + ki) * k + kj) * columns + b * plane;
            for (int64_t i = 0; i < oh; ++i) {
              const int64_t hi = i * g.stride - g.padding + ki;
              if (hi < 0 || hi >= g.height) continue;
              float* line = accumulator.data() + hi * g.width;
              const float* src = in + i * ow;
              const auto [j0, j1] = valid_output_range(g.padding - kj, g.stride, g.width, ow);
              if (g.stride == 1) {
                float* dst = line - g.padding + kj;
                for (int64_t j = j0; j < j1; ++j) dst[j] += src[j];
              } else {
                for (int64_t j = j0; j < j1; ++j) line[j * g.stride - g.padding + kj] += src[j];
              }
            }
          }
        }
        T* target = out + p * image_plane;
        for (int64_t i = 0; i < image_plane; ++i) target[i] = from_float<T>(accumulator[i]);
      }
    });
  });
}

namespace {

// fp32 view of a weight tensor, widening low-precision weights into `scratch`.
const float* weight_as_f32(const Tensor& weight, std::vector<float>& scratch) {
  if (weight.dtype() == DType::kF32) return weight.data<float>();
  scratch.resize(static_cast<size_t>(weight.numel()));
  widen_to_f32(weight.raw(), weight.dtype(), scratch.data(), weight.numel());
  return scratch.data();
}

}  // namespace

void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                    std::vector<float>& col) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("conv2d_forward (column vector)", {&x, &weight, &bias, &y});
  const int64_t patch = g.patch_size(), columns = g.columns();
  const int64_t plane = g.out_height() * g.out_width();
  FEDMESH_CHECK(x.numel() == g.batch * g.in_channels * g.height * g.width, "conv2d: input shape");
  FEDMESH_CHECK(weight.numel() == g.out_channels * patch && bias.numel() == g.out_channels, "conv2d: weight shape");
  FEDMESH_CHECK(y.numel() == g.batch * g.out_channels * plane, "conv2d: output shape");
  col.resize(static_cast<size_t>(patch * columns));
  im2col(g, x, col.data());

  thread_local std::vector<float> weight_scratch, product;
  const float* w = weight_as_f32(weight, weight_scratch);
  product.resize(static_cast<size_t>(g.out_channels * columns));
  sgemm(false, false, g.out_channels, columns, patch, 1.0f, w, patch, col.data(), columns, 0.0f, product.data(),
        columns);

  // (out_channels, batch, plane) -> (batch, out_channels, plane), adding the bias.
  // thread_local buffers must not be named inside the parallel body (each
  // worker would see its own, empty one): take plain pointers first.
  const float* product_data = product.data();
  const float* b = bias.data<float>();
  visit_dtype(y.dtype(), [&]<class T>() {
    T* out = y.data<T>();
    parallel_for(g.batch * g.out_channels, 4, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t image = p / g.out_channels, oc = p % g.out_channels;
        const float* src = product_data + oc * columns + image * plane;
        T* dst = out + p * plane;
        for (int64_t i = 0; i < plane; ++i) dst[i] = from_float<T>(src[i] + b[oc]);
      }
    });
  });
}

void conv2d_backward(const Conv2dGeometry& g, const std::vector<float>& col, const Tensor& weight, const Tensor& dy,
                     Tensor& dweight, Tensor& dbias, Tensor* dx) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("conv2d_backward (column vector)", {&weight, &dy, &dweight, &dbias, dx});
  const int64_t patch = g.patch_size(), columns = g.columns();
  const int64_t plane = g.out_height() * g.out_width();
  FEDMESH_CHECK(dy.numel() == g.batch * g.out_channels * plane, "conv2d_backward: dy shape");
  FEDMESH_CHECK(static_cast<int64_t>(col.size()) == patch * columns, "conv2d_backward: no saved columns");

  // dy (batch, out_channels, plane) -> dy_t (out_channels, batch*plane), fp32.
  thread_local std::vector<float> dy_t, weight_scratch, dcol;
  dy_t.resize(static_cast<size_t>(g.out_channels * columns));
  float* dy_t_data = dy_t.data();  // see conv2d_forward on thread_local buffers
  float* db = dbias.data<float>();
  visit_dtype(dy.dtype(), [&]<class T>() {
    const T* in = dy.data<T>();
    parallel_for(g.out_channels, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t oc = c0; oc < c1; ++oc) {
        float total = 0.0f;
        for (int64_t image = 0; image < g.batch; ++image) {
          const T* src = in + (image * g.out_channels + oc) * plane;
          float* dst = dy_t_data + oc * columns + image * plane;
          for (int64_t i = 0; i < plane; ++i) {
            dst[i] = to_float(src[i]);
            total += dst[i];
          }
        }
        db[oc] += total;
      }
    });
  });

  // dweight (out_channels, patch) += dy_t · col^T
  sgemm(false, true, g.out_channels, patch, columns, 1.0f, dy_t.data(), columns, col.data(), columns, 1.0f,
        dweight.data<float>(), patch);
  if (dx == nullptr) return;
  // dcol (patch, columns) = weight^T · dy_t
  const float* w = weight_as_f32(weight, weight_scratch);
  dcol.resize(static_cast<size_t>(patch * columns));
  sgemm(true, false, patch, columns, g.out_channels, 1.0f, w, patch, dy_t.data(), columns, 0.0f, dcol.data(),
        columns);
  col2im(g, dcol.data(), *dx);
}

void maxpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y, std::vector<int32_t>& argmax) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("maxpool2d_forward (argmax vector)", {&x, &y});
  const int64_t oh = g.out_height(), ow = g.out_width();
  const int64_t planes = g.batch * g.channels, in_plane = g.height * g.width, out_plane = oh * ow;
  FEDMESH_CHECK(x.numel() == planes * in_plane && y.numel() == planes * out_plane, "maxpool2d: shapes");
  argmax.resize(static_cast<size_t>(planes * out_plane));
  visit_dtype(x.dtype(), [&]<class In>() {
    visit_dtype(y.dtype(), [&]<class Out>() {
      const In* in = x.data<In>();
      Out* out = y.data<Out>();
      parallel_for(planes, 8, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          const In* src = in + p * in_plane;
          if (g.kernel == 2 && g.stride == 2) {  // the common case, without the generic window loops
            for (int64_t i = 0; i < oh; ++i) {
              const In* top = src + 2 * i * g.width;
              const In* bottom = top + g.width;
              Out* dst = out + p * out_plane + i * ow;
              int32_t* chosen = argmax.data() + p * out_plane + i * ow;
              for (int64_t j = 0; j < ow; ++j) {
                const float a = to_float(top[2 * j]), b = to_float(top[2 * j + 1]);
                const float c = to_float(bottom[2 * j]), d = to_float(bottom[2 * j + 1]);
                // First maximum in row-major window order, as the generic path
                // picks; selects rather than branches (random data mispredicts).
                const bool right_top = b > a;
                const float top_best = right_top ? b : a;
                const bool right_bottom = d > c;
                const float bottom_best = right_bottom ? d : c;
                const bool below = bottom_best > top_best;
                const int64_t base = 2 * i * g.width + 2 * j;
                const int64_t index = below ? base + g.width + right_bottom : base + right_top;
                dst[j] = from_float<Out>(below ? bottom_best : top_best);
                chosen[j] = static_cast<int32_t>(index);
              }
            }
            continue;
          }
          for (int64_t i = 0; i < oh; ++i) {
            for (int64_t j = 0; j < ow; ++j) {
              float best = -std::numeric_limits<float>::infinity();
              int32_t best_index = static_cast<int32_t>((i * g.stride) * g.width + j * g.stride);
              for (int64_t ki = 0; ki < g.kernel; ++ki) {
                for (int64_t kj = 0; kj < g.kernel; ++kj) {
                  const int64_t index = (i * g.stride + ki) * g.width + j * g.stride + kj;
                  const float v = to_float(src[index]);
                  if (v > best) {
                    best = v;
                    best_index = static_cast<int32_t>(index);
                  }
                }
              }
              out[p * out_plane + i * ow + j] = from_float<Out>(best);
              argmax[static_cast<size_t>(p * out_plane + i * ow + j)] = best_index;
            }
          }
        }
      });
    });
  });
}

void maxpool2d_backward(const Pool2dGeometry& g, const std::vector<int32_t>& argmax, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("maxpool2d_backward (argmax vector)", {&dy, &dx});
  const int64_t planes = g.batch * g.channels, in_plane = g.height * g.width;
  const int64_t out_plane = g.out_height() * g.out_width();
  FEDMESH_CHECK(dy.numel() == planes * out_plane && dx.numel() == planes * in_plane, "maxpool2d_backward: shapes");
  visit_dtype(dy.dtype(), [&]<class In>() {
    visit_dtype(dx.dtype(), [&]<class Out>() {
      const In* grad = dy.data<In>();
      Out* out = dx.data<Out>();
      parallel_for(planes, 8, [&](int64_t p0, int64_t p1) {
        std::vector<float> accumulator(static_cast<size_t>(in_plane));
        for (int64_t p = p0; p < p1; ++p) {
          std::fill(accumulator.begin(), accumulator.end(), 0.0f);
          for (int64_t i = 0; i < out_plane; ++i)
            accumulator[static_cast<size_t>(argmax[static_cast<size_t>(p * out_plane + i)])] +=
                to_float(grad[p * out_plane + i]);
          for (int64_t i = 0; i < in_plane; ++i) out[p * in_plane + i] = from_float<Out>(accumulator[i]);
        }
      });
    });
  });
}

namespace {

// f(in, out, p) for every plane p of `planes`, split over the threads, with
// in and out the tensors' data typed by their dtypes.
template <class F>
void for_each_plane(const Tensor& from, Tensor& to, int64_t planes, int64_t grain, F f) {
  visit_dtype(from.dtype(), [&]<class In>() {
    visit_dtype(to.dtype(), [&]<class Out>() {
      const In* in = static_cast<const In*>(from.raw());
      Out* out = static_cast<Out*>(to.raw());
      parallel_for(planes, grain, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) f(in, out, p);
      });
    });
  });
}

template <class T>
using Element = std::remove_cvref_t<decltype(*std::declval<T>())>;

}  // namespace

void avgpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::avgpool2d_forward(g, x, y);
  const int64_t oh = g.out_height(), ow = g.out_width();
  const int64_t planes = g.batch * g.channels, in_plane = g.height * g.width, out_plane = oh * ow;
  FEDMESH_CHECK(x.numel() == planes * in_plane && y.numel() == planes * out_plane, "avgpool2d: shapes");
  const float scale = 1.0f / static_cast<float>(g.kernel * g.kernel);
  for_each_plane(x, y, planes, 8, [&](auto in, auto out, int64_t p) {
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        float total = 0.0f;
        for (int64_t a = 0; a < g.kernel; ++a) {
          const auto row = in + p * in_plane + (i * g.stride + a) * g.width + j * g.stride;
          for (int64_t b = 0; b < g.kernel; ++b) total += to_float(row[b]);
        }
        out[p * out_plane + i * ow + j] = from_float<Element<decltype(out)>>(total * scale);
      }
    }
  });
}

void avgpool2d_backward(const Pool2dGeometry& g, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::avgpool2d_backward(g, dy, dx);
  const int64_t oh = g.out_height(), ow = g.out_width();
  const int64_t planes = g.batch * g.channels, in_plane = g.height * g.width, out_plane = oh * ow;
  FEDMESH_CHECK(dx.numel() == planes * in_plane && dy.numel() == planes * out_plane, "avgpool2d_backward: shapes");
  const float scale = 1.0f / static_cast<float>(g.kernel * g.kernel);
  for_each_plane(dy, dx, planes, 8, [&](auto grad, auto out, int64_t p) {
    for (int64_t r = 0; r < g.height; ++r) {
      // The windows holding row r: i with i * stride <= r < i * stride + kernel.
      const int64_t i0 = r < g.kernel ? 0 : (r - g.kernel) / g.stride + 1, i1 = std::min(oh - 1, r / g.stride);
      for (int64_t c = 0; c < g.width; ++c) {
        const int64_t j0 = c < g.kernel ? 0 : (c - g.kernel) / g.stride + 1, j1 = std::min(ow - 1, c / g.stride);
        float total = 0.0f;
        for (int64_t i = i0; i <= i1; ++i) {
          for (int64_t j = j0; j <= j1; ++j) total += to_float(grad[p * out_plane + i * ow + j]) * scale;
        }
        out[p * in_plane + r * g.width + c] = from_float<Element<decltype(out)>>(total);
      }
    }
  });
}

void plane_mean_forward(const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::plane_mean_forward(x, y);
  const int64_t planes = y.numel();
  FEDMESH_CHECK(planes > 0 && x.numel() % planes == 0, "plane_mean: the planes do not divide the input");
  const int64_t area = x.numel() / planes;
  for_each_plane(x, y, planes, 64, [&](auto in, auto out, int64_t p) {
    double total = 0.0;
    for (int64_t k = 0; k < area; ++k) total += to_float(in[p * area + k]);
    out[p] = from_float<Element<decltype(out)>>(static_cast<float>(total / static_cast<double>(area)));
  });
}

void plane_mean_backward(const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::plane_mean_backward(dy, dx);
  const int64_t planes = dy.numel();
  FEDMESH_CHECK(planes > 0 && dx.numel() % planes == 0, "plane_mean_backward: the planes do not divide the input");
  const int64_t area = dx.numel() / planes;
  for_each_plane(dy, dx, planes, 64, [&](auto grad, auto out, int64_t p) {
    const auto g = from_float<Element<decltype(out)>>(to_float(grad[p]) / static_cast<float>(area));
    for (int64_t k = 0; k < area; ++k) out[p * area + k] = g;
  });
}

}  // namespace fedmesh
