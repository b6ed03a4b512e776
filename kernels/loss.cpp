#include "kernels/loss.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/device_ops.h"
#include "kernels/step_profile.h"

namespace fedmesh {

CrossEntropyResult softmax_cross_entropy(const Tensor& logits, std::span<const int32_t> labels, Tensor* dlogits,
                                         float grad_scale, float normalizer) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("softmax_cross_entropy (labels on the host)", {&logits, dlogits});
  FEDMESH_CHECK(logits.rank() == 2 && static_cast<int64_t>(labels.size()) == logits.dim(0),
                "softmax_cross_entropy: logits " + shape_to_string(logits.shape()) + " vs " +
                    std::to_string(labels.size()) + " labels");
  FEDMESH_CHECK(dlogits == nullptr || dlogits->numel() == logits.numel(), "softmax_cross_entropy: dlogits shape");
  const int64_t rows = logits.dim(0), classes = logits.dim(1);
  const float grad_factor = grad_scale / normalizer;
  CrossEntropyResult result;
  std::vector<float> row_values(static_cast<size_t>(classes));
  visit_dtype(logits.dtype(), [&]<class T>() {
    const T* in = logits.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t label = labels[static_cast<size_t>(r)];
      FEDMESH_CHECK(label >= 0 && label < classes, "label " + std::to_string(label) + " out of range");
      float max_value = -std::numeric_limits<float>::infinity();
      int64_t argmax = 0;
      for (int64_t j = 0; j < classes; ++j) {
        const float v = to_float(in[r * classes + j]);
        row_values[static_cast<size_t>(j)] = v;
        if (v > max_value) {
          max_value = v;
          argmax = j;
        }
      }
      double denominator = 0.0;
      for (int64_t j = 0; j < classes; ++j) denominator += std::exp(static_cast<double>(row_values[j] - max_value));
      const double log_denominator = std::log(denominator);
      result.loss_sum += log_denominator - static_cast<double>(row_values[label] - max_value);
      result.correct += argmax == label ? 1 : 0;
      if (dlogits != nullptr) {
        visit_dtype(dlogits->dtype(), [&]<class G>() {
          G* out = dlogits->data<G>() + r * classes;
          for (int64_t j = 0; j < classes; ++j) {
            const double p = std::exp(static_cast<double>(row_values[j] - max_value) - log_denominator);
            const double g = (p - (j == label ? 1.0 : 0.0)) * grad_factor;
            out[j] = from_float<G>(static_cast<float>(g));
          }
        });
      }
    }
  });
  return result;
}

SquaredErrorResult squared_error(const Tensor& predictions, std::span<const float> values, Tensor* dpredictions,
                                 float grad_scale, float normalizer) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("squared_error (values on the host)", {&predictions, dpredictions});
  FEDMESH_CHECK(predictions.rank() == 2 && predictions.dim(1) == 1 &&
                    static_cast<int64_t>(values.size()) == predictions.dim(0),
                "squared_error: predictions " + shape_to_string(predictions.shape()) + " vs " +
                    std::to_string(values.size()) + " values");
  FEDMESH_CHECK(dpredictions == nullptr || dpredictions->numel() == predictions.numel(),
                "squared_error: dpredictions shape");
  const int64_t rows = predictions.dim(0);
  const double grad_factor = 2.0 * static_cast<double>(grad_scale) / static_cast<double>(normalizer);
  SquaredErrorResult result;
  visit_dtype(predictions.dtype(), [&]<class T>() {
    const T* in = predictions.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const double error = static_cast<double>(to_float(in[r])) - static_cast<double>(values[static_cast<size_t>(r)]);
      result.loss_sum += error * error;
      result.abs_sum += std::fabs(error);
      if (dpredictions != nullptr) {
        visit_dtype(dpredictions->dtype(), [&]<class G>() {
          dpredictions->data<G>()[r] = from_float<G>(static_cast<float>(error * grad_factor));
        });
      }
    }
  });
  return result;
}

}  // namespace fedmesh
