// A whole model's gradients against finite differences: d(mean
// cross-entropy)/d(parameters) of `net` on the batch `x` with `labels`,
// shared by the built-in models' and the spec models' tests.
#pragma once

#include <string>
#include <vector>

#include "kernels/loss.h"
#include "tests/support/gradient_check.h"
#include "train/model.h"

namespace fedmesh::testing {

inline void expect_model_gradients_match(const std::string& what, train::Sequential& net, const Tensor& x,
                                         const std::vector<int32_t>& labels, Rng& rng) {
  const auto batch = static_cast<int64_t>(labels.size());
  const auto loss = [&] {
    const Tensor logits = net.forward(x, /*training=*/false);
    return softmax_cross_entropy(logits, labels, nullptr).loss_sum / static_cast<double>(batch);
  };
  net.zero_grad();
  const Tensor logits = net.forward(x, /*training=*/true);
  Tensor dlogits = Tensor::empty(logits.shape());
  softmax_cross_entropy(logits, labels, &dlogits, 1.0f, static_cast<float>(batch));
  net.backward(dlogits);
  for (Parameter* p : net.parameters()) {
    const Tensor analytic = p->grad.clone();
    // Smaller step: a model is deeper than a layer, so curvature is larger;
    // tolerance scaled to the small gradients of a mean loss.
    expect_gradient_matches(what + " " + p->name, p->value.data<float>(), analytic.data<float>(), p->value.numel(),
                            loss, [] {}, rng, 6, 5e-3, 2e-3, 5e-2);
  }
}

}  // namespace fedmesh::testing
