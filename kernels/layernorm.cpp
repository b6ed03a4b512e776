#include "kernels/layernorm.h"

#include <cmath>
#include <vector>

#include "kernels/device_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y, Tensor& mean,
                       Tensor& rstd, float epsilon) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::layernorm_forward(x, gamma, beta, y, mean, rstd, epsilon);
  const int64_t n = gamma.numel();
  FEDMESH_CHECK(n > 0 && x.numel() % n == 0 && y.numel() == x.numel() && beta.numel() == n,
                "layernorm_forward: shapes do not match");
  const int64_t rows = x.numel() / n;
  FEDMESH_CHECK(mean.numel() == rows && rstd.numel() == rows, "layernorm_forward: statistics shape");
  const float* g = gamma.data<float>();
  const float* b = beta.data<float>();
  float* mu = mean.data<float>();
  float* rs = rstd.data<float>();
  visit_dtype(x.dtype(), [&]<class In>() {
    visit_dtype(y.dtype(), [&]<class Out>() {
      const In* in = x.data<In>();
      Out* out = y.data<Out>();
      parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const In* row = in + r * n;
          double total = 0.0;
          for (int64_t j = 0; j < n; ++j) total += to_float(row[j]);
          const double m = total / static_cast<double>(n);
          double variance = 0.0;
          for (int64_t j = 0; j < n; ++j) {
            const double d = to_float(row[j]) - m;
            variance += d * d;
          }
          variance /= static_cast<double>(n);
          const float inv = static_cast<float>(1.0 / std::sqrt(variance + epsilon));
          mu[r] = static_cast<float>(m);
          rs[r] = inv;
          for (int64_t j = 0; j < n; ++j) {
            const float normalized = (to_float(row[j]) - mu[r]) * inv;
            out[r * n + j] = from_float<Out>(normalized * g[j] + b[j]);
          }
        }
      });
    });
  });
}

void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::layernorm_backward(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  const int64_t n = gamma.numel();
  const int64_t rows = x.numel() / n;
  FEDMESH_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && dgamma.numel() == n && dbeta.numel() == n,
                "layernorm_backward: shapes do not match");
  const float* g = gamma.data<float>();
  const float* mu = mean.data<float>();
  const float* rs = rstd.data<float>();
  float* dg = dgamma.data<float>();
  float* db = dbeta.data<float>();
  visit_dtype(x.dtype(), [&]<class In>() {
    visit_dtype(dy.dtype(), [&]<class Grad>() {
      visit_dtype(dx.dtype(), [&]<class Out>() {
        const In* in = x.data<In>();
        const Grad* grad = dy.data<Grad>();
        Out* out = dx.data<Out>();
        std::vector<float> xhat(static_cast<size_t>(n)), dxhat(static_cast<size_t>(n));
        for (int64_t r = 0; r < rows; ++r) {
          double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
          for (int64_t j = 0; j < n; ++j) {
            const float gy = to_float(grad[r * n + j]);
            xhat[j] = (to_float(in[r * n + j]) - mu[r]) * rs[r];
            dxhat[j] = gy * g[j];
            dg[j] += gy * xhat[j];
            db[j] += gy;
            sum_dxhat += dxhat[j];
            sum_dxhat_xhat += static_cast<double>(dxhat[j]) * xhat[j];
          }
          const float mean_dxhat = static_cast<float>(sum_dxhat / static_cast<double>(n));
          const float mean_dxhat_xhat = static_cast<float>(sum_dxhat_xhat / static_cast<double>(n));
          for (int64_t j = 0; j < n; ++j) {
            out[r * n + j] = from_float<Out>(rs[r] * (dxhat[j] - mean_dxhat - xhat[j] * mean_dxhat_xhat));
          }
        }
      });
    });
  });
}

}  // namespace fedmesh
