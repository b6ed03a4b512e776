// 2-D convolution (im2col + one GEMM over the whole batch) and max pooling,
// NCHW layout.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"

namespace fedmesh {

struct Conv2dGeometry {
  int64_t batch = 0, in_channels = 0, height = 0, width = 0;
  int64_t out_channels = 0, kernel = 0, stride = 1, padding = 0;

  int64_t out_height() const { return (height + 2 * padding - kernel) / stride + 1; }
  int64_t out_width() const { return (width + 2 * padding - kernel) / stride + 1; }
  int64_t patch_size() const { return in_channels * kernel * kernel; }  // rows of the column matrix
  int64_t columns() const { return batch * out_height() * out_width(); }
};

// col (patch_size, batch*out_h*out_w) fp32 from x (batch, in_channels, height, width) of any dtype.
void im2col(const Conv2dGeometry& g, const Tensor& x, float* col);
// dx (batch, in_channels, height, width), any dtype, overwritten with the scatter-add of dcol.
void col2im(const Conv2dGeometry& g, const float* dcol, Tensor& dx);

// y (batch, out_channels, out_h, out_w) = conv(x, weight (out_channels, patch_size)) + bias (out_channels).
// `col` receives the column matrix and is kept for the backward pass.
void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                    std::vector<float>& col);
// Accumulates dweight (fp32) and dbias (fp32); writes dx if dx is defined.
void conv2d_backward(const Conv2dGeometry& g, const std::vector<float>& col, const Tensor& weight, const Tensor& dy,
                     Tensor& dweight, Tensor& dbias, Tensor* dx);

struct Pool2dGeometry {
  int64_t batch = 0, channels = 0, height = 0, width = 0;
  int64_t kernel = 2, stride = 2;
  int64_t out_height() const { return (height - kernel) / stride + 1; }
  int64_t out_width() const { return (width - kernel) / stride + 1; }
};

// y (batch, channels, out_h, out_w); argmax holds, per output, the flat index
// of the chosen input within its (height*width) plane.
void maxpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y, std::vector<int32_t>& argmax);
// dx overwritten: dy routed to the positions chosen in the forward pass.
void maxpool2d_backward(const Pool2dGeometry& g, const std::vector<int32_t>& argmax, const Tensor& dy, Tensor& dx);

// y (batch, channels, out_h, out_w): the mean of each kernel x kernel window
// (torch.nn.AvgPool2d without padding): the window's values summed in fp32
// in row-major order, times 1 / kernel².
void avgpool2d_forward(const Pool2dGeometry& g, const Tensor& x, Tensor& y);
// dx (batch, channels, height, width) overwritten: each input the sum, in
// row-major order of the windows that hold it, of their dy times 1 / kernel²
// (gathered per input, so a device computes the same sum).
void avgpool2d_backward(const Pool2dGeometry& g, const Tensor& dy, Tensor& dx);
// Global average pooling: y (planes) = the mean of each plane of x (planes,
// area), summed in fp64 and rounded once; the area is x's elements over y's.
void plane_mean_forward(const Tensor& x, Tensor& y);
// dx (planes, area) = dy[plane] / area (in fp32).
void plane_mean_backward(const Tensor& dy, Tensor& dx);

}  // namespace fedmesh
