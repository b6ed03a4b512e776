#include "kernels/layernorm.h"

#include <algorithm>
#include <cmath>
#include <string>
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

namespace {

void check_groupnorm(const GroupNormShape& s, const Tensor& x, const Tensor& gamma, const Tensor& mean, const char* op) {
  FEDMESH_CHECK(s.batch > 0 && s.channels > 0 && s.positions > 0 && s.groups > 0 && s.channels % s.groups == 0 &&
                    x.numel() == s.batch * s.channels * s.positions && gamma.numel() == s.channels &&
                    mean.numel() == s.batch * s.groups,
                std::string(op) + ": shapes do not match");
}

}  // namespace

void groupnorm_forward(const GroupNormShape& s, const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                       Tensor& mean, Tensor& rstd, float epsilon) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::groupnorm_forward(s, x, gamma, beta, y, mean, rstd, epsilon);
  check_groupnorm(s, x, gamma, mean, "groupnorm_forward");
  FEDMESH_CHECK(y.numel() == x.numel() && beta.numel() == s.channels && rstd.numel() == mean.numel(),
                "groupnorm_forward: shapes do not match");
  const int64_t size = s.group_size(), per_group = s.channels / s.groups;
  const float* g = gamma.data<float>();
  const float* b = beta.data<float>();
  float* mu = mean.data<float>();
  float* rs = rstd.data<float>();
  visit_dtype(x.dtype(), [&]<class In>() {
    visit_dtype(y.dtype(), [&]<class Out>() {
      const In* in = x.data<In>();
      Out* out = y.data<Out>();
      parallel_for(s.batch * s.groups, 4, [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const In* src = in + q * size;
          double total = 0.0, squares = 0.0;
          for (int64_t k = 0; k < size; ++k) {
            const double v = to_float(src[k]);
            total += v;
            squares += v * v;
          }
          const double m = total / static_cast<double>(size);
          const auto r = static_cast<float>(1.0 / std::sqrt(std::max(0.0, squares / static_cast<double>(size) - m * m) +
                                                            static_cast<double>(epsilon)));
          const auto m32 = static_cast<float>(m);
          mu[q] = m32;
          rs[q] = r;
          const int64_t first_channel = (q % s.groups) * per_group;
          for (int64_t k = 0; k < size; ++k) {
            const int64_t c = first_channel + k / s.positions;
            out[q * size + k] = from_float<Out>((to_float(src[k]) - m32) * r * g[c] + b[c]);
          }
        }
      });
    });
  });
}

void groupnorm_backward(const GroupNormShape& s, const Tensor& x, const Tensor& dy, const Tensor& gamma,
                        const Tensor& mean, const Tensor& rstd, Tensor* dx, Tensor& dgamma, Tensor& dbeta) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dgamma)) return device::groupnorm_backward(s, x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  check_groupnorm(s, x, gamma, mean, "groupnorm_backward");
  FEDMESH_CHECK(dy.numel() == x.numel() && (dx == nullptr || dx->numel() == x.numel()) &&
                    dgamma.numel() == s.channels && dbeta.numel() == s.channels,
                "groupnorm_backward: shapes do not match");
  const int64_t size = s.group_size(), per_group = s.channels / s.groups;
  const float* g = gamma.data<float>();
  const float* mu = mean.data<float>();
  const float* rs = rstd.data<float>();
  float* dg = dgamma.data<float>();
  float* db = dbeta.data<float>();
  visit_dtype(x.dtype(), [&]<class In>() {
    visit_dtype(dy.dtype(), [&]<class Grad>() {
      const In* in = x.data<In>();
      const Grad* grad = dy.data<Grad>();
      // dgamma, dbeta: per channel over samples and positions.
      parallel_for(s.channels, 4, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          double scale_sum = 0.0, shift_sum = 0.0;
          for (int64_t n = 0; n < s.batch; ++n) {
            const int64_t q = n * s.groups + c / per_group;
            const int64_t at = (n * s.channels + c) * s.positions;
            for (int64_t k = 0; k < s.positions; ++k) {
              const float d = to_float(grad[at + k]);
              scale_sum += static_cast<double>(d) * ((to_float(in[at + k]) - mu[q]) * rs[q]);
              shift_sum += d;
            }
          }
          dg[c] += static_cast<float>(scale_sum);
          db[c] += static_cast<float>(shift_sum);
        }
      });
      if (dx == nullptr) return;
      visit_dtype(dx->dtype(), [&]<class Out>() {
        Out* out = static_cast<Out*>(dx->raw());
        parallel_for(s.batch * s.groups, 4, [&](int64_t q0, int64_t q1) {
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t first_channel = (q % s.groups) * per_group;
            double mean_d = 0.0, mean_dx = 0.0;
            for (int64_t k = 0; k < size; ++k) {
              const int64_t i = q * size + k;
              const double d = static_cast<double>(to_float(grad[i])) * g[first_channel + k / s.positions];
              mean_d += d;
              mean_dx += d * ((to_float(in[i]) - mu[q]) * rs[q]);
            }
            mean_d /= static_cast<double>(size);
            mean_dx /= static_cast<double>(size);
            for (int64_t k = 0; k < size; ++k) {
              const int64_t i = q * size + k;
              const float normalized = (to_float(in[i]) - mu[q]) * rs[q];
              const double d = static_cast<double>(to_float(grad[i])) * g[first_channel + k / s.positions];
              out[i] = from_float<Out>(rs[q] * static_cast<float>(d - mean_d - normalized * mean_dx));
            }
          }
        });
      });
    });
  });
}

}  // namespace fedmesh
