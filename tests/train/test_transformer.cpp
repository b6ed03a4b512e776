// The GPT-style transformer on the CPU (train/layers/transformer.h):
// - gradients of the mean next-token cross-entropy with respect to every
//   parameter (token and position embeddings, with the tied projection's
//   share landing in the token table; layer norms; attention and MLP
//   projections) against central finite differences, on a tiny model;
// - causality: a token changes no logit of an earlier position, exactly;
// - bf16 compute (fp32 master weights) stays close to fp32;
// - the named sizes have the parameter counts their configs say (GPT-2
//   small: 124,439,808 with the tied projection counted once).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/loss.h"
#include "train/model.h"
#include "tests/support/gradient_check.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::expect_gradient_matches;

TransformerConfig tiny() {
  TransformerConfig c;
  c.vocabulary = 11;
  c.context = 6;
  c.width = 8;
  c.heads = 2;
  c.layers = 2;
  return c;
}

Tensor token_batch(const std::vector<int32_t>& ids, int64_t batch, int64_t seq) {
  Tensor x = Tensor::empty({batch, seq});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(ids[static_cast<size_t>(i)]);
  return x;
}

TEST(Transformer, GradientsMatchFiniteDifferences) {
  const TransformerConfig c = tiny();
  std::unique_ptr<Sequential> model = make_transformer("tiny", c, 3);
  // Larger weights than GPT-2's 0.02 so that every path carries a gradient
  // well above the finite differences' noise.
  Rng rng(4);
  for (Parameter* p : model->parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += 0.3f * static_cast<float>(rng.normal());
  }
  model->refresh_compute();
  const int64_t batch = 2, seq = c.context;
  std::vector<int32_t> ids, targets;
  for (int64_t i = 0; i < batch * seq; ++i) {
    ids.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocabulary))));
    targets.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocabulary))));
  }
  const Tensor x = token_batch(ids, batch, seq);
  const double rows = static_cast<double>(batch * seq);
  const auto loss = [&] {
    const Tensor logits = model->forward(x, /*training=*/false);
    return softmax_cross_entropy(logits, targets, nullptr).loss_sum / rows;
  };
  model->zero_grad();
  const Tensor logits = model->forward(x, /*training=*/true);
  ASSERT_EQ(logits.shape(), (Shape{batch * seq, c.vocabulary}));
  Tensor dlogits = Tensor::empty(logits.shape());
  softmax_cross_entropy(logits, targets, &dlogits, 1.0f, static_cast<float>(rows));
  model->backward(dlogits);
  int checked = 0;
  for (Parameter* p : model->parameters()) {
    const Tensor analytic = p->grad.clone();
    double largest = 0.0;
    for (int64_t i = 0; i < analytic.numel(); ++i) largest = std::max(largest, std::fabs(double(analytic.data<float>()[i])));
    EXPECT_GT(largest, 1e-4) << p->name << " gets no gradient";
    // Step 1e-2 on weights of order 0.3: truncation about 1e-5 of the loss;
    // fp32 loss rounding about 1e-7 / 1e-2. atol 2e-3, rtol 3e-2.
    expect_gradient_matches(p->name, p->value.data<float>(), analytic.data<float>(), p->value.numel(), loss,
                            [&] { model->refresh_compute(); }, rng, 8, 1e-2, 2e-3, 3e-2);
    ++checked;
  }
  EXPECT_EQ(checked, 2 + 12 * 2 + 2) << "wte, wpe, 12 per block, ln_f";
}

TEST(Transformer, NoPositionSeesTheFuture) {
  const TransformerConfig c = tiny();
  std::unique_ptr<Sequential> model = make_transformer("tiny", c, 5);
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  const Tensor before = model->forward(token_batch(ids, 1, 6), false).clone();
  ids[3] = 9;
  const Tensor after = model->forward(token_batch(ids, 1, 6), false).clone();
  for (int64_t row = 0; row < 6; ++row) {
    bool same = true;
    for (int64_t v = 0; v < c.vocabulary; ++v) same &= before.data<float>()[row * c.vocabulary + v] == after.data<float>()[row * c.vocabulary + v];
    if (row < 3) EXPECT_TRUE(same) << "position " << row << " changed with the token at position 3";
    else EXPECT_FALSE(same) << "position " << row << " should see the token at position 3";
  }
}

TEST(Transformer, Bf16ComputeStaysCloseToFp32) {
  std::unique_ptr<Sequential> model = std::move(make_model("gpt-nano", 6).value());
  Rng rng(7);
  const int64_t seq = 64;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < 2 * seq; ++i) ids.push_back(static_cast<int32_t>(rng.below(256)));
  const Tensor x = token_batch(ids, 2, seq);
  const Tensor reference = model->forward(x, false).clone();
  model->set_compute_dtype(DType::kBF16);
  const Tensor low = model->forward(x, false);
  ASSERT_EQ(low.dtype(), DType::kBF16);
  double worst = 0.0, scale = 0.0;
  for (int64_t i = 0; i < reference.numel(); ++i) {
    worst = std::max(worst, std::fabs(double(to_float(low.data<bf16>()[i])) - reference.data<float>()[i]));
    scale = std::max(scale, std::fabs(double(reference.data<float>()[i])));
  }
  // bf16 keeps 8 bits: each stored activation is off by up to 2^-9
  // relatively, and a few layers compound it.
  EXPECT_LT(worst, 0.05 * scale + 0.02) << "largest logit " << scale;
}

TEST(Transformer, NamedSizesHaveTheirParameterCounts) {
  for (const char* name : {"gpt-nano", "gpt-tiny", "gpt-small"}) {
    std::unique_ptr<Sequential> model = std::move(make_model(name, 1).value());
    EXPECT_EQ(model->parameter_count(), language_model_config(name)->parameters()) << name;
  }
  EXPECT_EQ(language_model_config("gpt2")->parameters(), 124'439'808);
  EXPECT_FALSE(language_model_config("mlp").has_value());
  const int64_t tiny_count = language_model_config("gpt-tiny")->parameters();
  EXPECT_GT(tiny_count, 1'000'000);
  EXPECT_LT(tiny_count, 10'000'000);
}

}  // namespace
}  // namespace fedmesh::train
