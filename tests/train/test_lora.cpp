// train/lora: LoRA adapters as the federation averages them. The first
// model is the base model exactly; only the B factors train and the frozen
// weights stay bit for bit; dL/dB folded from dL/dW is the true gradient
// (finite differences); averaging B is averaging the merged weights (the
// rule the federation relies on); the fingerprint changes with the base, A's
// seed and the options; and the refusals name what was wrong.
#include "train/lora.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/elementwise.h"
#include "kernels/loss.h"
#include "tests/support/gradient_check.h"
#include "train/data/text_corpus.h"
#include "train/initial_weights.h"
#include "train/model.h"
#include "train/trainer.h"

namespace fedmesh::train {
namespace {

std::vector<float> values_of(const Tensor& t) {
  const Tensor host = t.host();
  return std::vector<float>(host.data<float>(), host.data<float>() + host.numel());
}

LoraOptions lora(int64_t rank, std::vector<std::string> targets = {}, float alpha = 0.0f) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.targets = std::move(targets);
  return o;
}

std::unique_ptr<Sequential> nano(uint64_t seed, const LoraOptions& options, uint64_t lora_seed) {
  std::unique_ptr<Sequential> model = std::move(make_model("gpt-nano", seed, 256).value());
  const Status attached = model->attach_lora(options, lora_seed);
  EXPECT_TRUE(attached.is_ok()) << attached.to_string();
  return model;
}

Tensor token_batch(int64_t batch, int64_t context, uint64_t seed) {
  Rng rng(seed);
  Tensor x = Tensor::empty({batch, context});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(rng.below(256));
  return x;
}

// Adapting the attention and MLP weights of gpt-nano: the trainable
// parameters are their B factors alone, the model starts as the base model
// bit for bit, and after training the frozen weights are unchanged and every
// adapted weight is W0 + scale · B · A.
TEST(Lora, StartsAsTheBaseAndTrainsOnlyTheBFactors) {
  std::unique_ptr<Sequential> base = std::move(make_model("gpt-nano", 3, 256).value());
  const LoraOptions options = lora(4, {"h*.attn.c_attn.weight", "h*.mlp.*.weight"}, 8.0f);
  std::unique_ptr<Sequential> model = nano(3, options, 3);
  const std::vector<Parameter*> trainable = model->parameters();
  ASSERT_EQ(trainable.size(), 6u);  // 2 blocks x (c_attn, c_fc, mlp c_proj)
  int64_t expected = 0;
  for (Parameter* p : trainable) {
    EXPECT_TRUE(p->name.ends_with(".lora_b")) << p->name;
    EXPECT_EQ(p->value.dim(1), 4) << p->name;
    expected += p->value.numel();
  }
  EXPECT_EQ(model->trainable_count(), expected);
  EXPECT_EQ(expected, 2 * (192 + 256 + 64) * 4);
  EXPECT_EQ(model->parameter_count(), base->parameter_count());

  const Tensor x = token_batch(2, 64, 5);
  EXPECT_EQ(values_of(model->forward(x, false)), values_of(base->forward(x, false)))
      << "B starts at zero: the first model is the base model";

  // Train on a repeating text.
  std::string text;
  while (text.size() < 20000) text += "in the beginning was the word, and the word was with god. ";
  data::TextWindows windows(data::byte_tokens(text), 64, 32);
  TrainOptions o;
  o.optimizer = "adamw";
  o.lr = 1e-2f;
  o.batch_size = 8;
  o.max_steps = 30;
  o.weight_decay = 0.0f;
  Trainer trainer(*model, o);
  std::vector<float> frozen_before;
  std::vector<std::vector<float>> bases;
  for (size_t i = 0; i < model->layer_count(); ++i)
    for (Parameter* p : model->layer(i).parameters()) bases.push_back(values_of(p->value));
  double first = 0.0, last = 0.0;
  for (int step = 0; step < o.max_steps; ++step) {
    std::vector<int64_t> indices(8);
    std::iota(indices.begin(), indices.end(), (step * 8) % (windows.size() - 8));
    const StepResult r = trainer.train_step(windows, indices, o.lr);
    ASSERT_TRUE(r.applied);
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  std::printf("gpt-nano LoRA rank 4: loss %.3f -> %.3f in 30 steps, %lld trainable of %lld\n", first, last,
              static_cast<long long>(model->trainable_count()), static_cast<long long>(model->parameter_count()));
  EXPECT_LT(last, first - 0.5) << "training the B factors alone lowers the loss";

  size_t k = 0;
  for (size_t i = 0; i < model->layer_count(); ++i) {
    for (Parameter* p : model->layer(i).parameters()) {
      LowRankAdapter* adapter = nullptr;
      for (LowRankAdapter* a : model->adapters())
        if (&a->target() == p) adapter = a;
      if (adapter == nullptr) {
        EXPECT_EQ(values_of(p->value), bases[k]) << p->name << " is frozen";
      } else {
        EXPECT_EQ(values_of(adapter->base()), bases[k]) << p->name << "'s W0 is frozen";
        // W = W0 + scale B A, recomputed here in double.
        const std::vector<float> b = values_of(adapter->factor_b().value), a = values_of(adapter->factor_a()),
                                 w = values_of(p->value);
        const int64_t rows = adapter->rows(), cols = adapter->cols(), rank = 4;
        double worst = 0.0, moved = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            double update = 0.0;
            for (int64_t j = 0; j < rank; ++j) update += static_cast<double>(b[r * rank + j]) * a[j * cols + c];
            const double want = bases[k][r * cols + c] + 2.0 * update;  // alpha 8 / rank 4
            worst = std::max(worst, std::fabs(want - w[r * cols + c]));
            moved = std::max(moved, std::fabs(2.0 * update));
          }
        }
        EXPECT_LT(worst, 1e-5) << p->name;
        EXPECT_GT(moved, 1e-3) << p->name << " should have moved";
      }
      ++k;
    }
  }
}

// dL/dB as the adapters fold it from dL/dW, against central differences of
// the loss in B (the merged weights recomputed after every change), for an
// mlp and gpt-nano.
TEST(Lora, FoldedGradientIsTheGradientInB) {
  Rng rng(11);
  for (const char* name : {"mlp", "gpt-nano"}) {
    std::unique_ptr<Sequential> model = std::move(make_model(name, 2, std::string(name) == "mlp" ? 0 : 256).value());
    ASSERT_TRUE(model->attach_lora(lora(3), 7).is_ok());
    // B away from zero so that A's gradient path and the products are exercised.
    for (Parameter* p : model->parameters())
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] = static_cast<float>(rng.normal() * 0.05);
    model->merge_adapters();
    const bool text = std::string(name) != "mlp";
    const Tensor x = text ? token_batch(2, 64, 3) : testing::random_tensor({4, 1, 28, 28}, rng);
    std::vector<int32_t> labels(static_cast<size_t>(text ? 2 * 64 : 4));
    for (int32_t& l : labels) l = static_cast<int32_t>(rng.below(text ? 256 : 10));
    const auto batch = static_cast<float>(labels.size());
    const auto loss = [&] {
      const Tensor logits = model->forward(x, false);
      return softmax_cross_entropy(logits, labels, nullptr).loss_sum / batch;
    };
    model->zero_grad();
    const Tensor logits = model->forward(x, true);
    Tensor dlogits = Tensor::empty(logits.shape());
    softmax_cross_entropy(logits, labels, &dlogits, 1.0f, batch);
    model->backward(dlogits);
    double largest = 0.0;
    for (Parameter* p : model->parameters()) largest = std::max(largest, static_cast<double>(max_abs(p->grad)));
    EXPECT_GT(largest, 2e-2) << name << ": the check needs gradients well above its tolerance";
    for (Parameter* p : model->parameters()) {
      const Tensor analytic = p->grad.clone();
      testing::expect_gradient_matches(std::string(name) + " " + p->name, p->value.data<float>(),
                                       analytic.data<float>(), p->value.numel(), loss,
                                       [&] { model->merge_adapters(); }, rng, 6, 5e-3, 2e-3, 5e-2);
    }
  }
}

// What the federation relies on: with A shared (same seed and name), the
// model merged from the average of two sites' B factors is the average of
// their merged models.
TEST(Lora, AveragingTheBFactorsAveragesTheWeights) {
  const LoraOptions options = lora(4, {"h*"});
  std::unique_ptr<Sequential> one = nano(3, options, 21), two = nano(3, options, 21), mean = nano(3, options, 21);
  Rng rng(4);
  const std::vector<Parameter*> b1 = one->parameters(), b2 = two->parameters(), bm = mean->parameters();
  for (size_t i = 0; i < b1.size(); ++i) {
    for (int64_t k = 0; k < b1[i]->value.numel(); ++k) {
      const float u = static_cast<float>(rng.normal() * 0.1), v = static_cast<float>(rng.normal() * 0.1);
      b1[i]->value.data<float>()[k] = u;
      b2[i]->value.data<float>()[k] = v;
      bm[i]->value.data<float>()[k] = 0.5f * (u + v);
    }
  }
  for (Sequential* m : {one.get(), two.get(), mean.get()}) m->refresh_compute();
  const std::vector<LowRankAdapter*> a1 = one->adapters(), a2 = two->adapters(), am = mean->adapters();
  ASSERT_EQ(a1.size(), 8u);  // 2 blocks x 4 weights
  double worst = 0.0, spread = 0.0;
  for (size_t i = 0; i < a1.size(); ++i) {
    const std::vector<float> w1 = values_of(a1[i]->target().value), w2 = values_of(a2[i]->target().value),
                             wm = values_of(am[i]->target().value);
    for (size_t k = 0; k < w1.size(); ++k) {
      worst = std::max(worst, std::fabs(0.5 * (static_cast<double>(w1[k]) + w2[k]) - wm[k]));
      spread = std::max(spread, std::fabs(static_cast<double>(w1[k]) - w2[k]));
    }
  }
  std::printf("merged from the mean B vs the mean of the merged weights: %.3g (the two sites differ by up to %.3g)\n",
              worst, spread);
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(spread, 1e-2);
}

// The fingerprint every process of a federation compares: the same model,
// seed and options agree; another base, another seed for A, or other
// options do not.
TEST(Lora, FingerprintCoversTheBaseTheFactorsAndTheOptions) {
  const LoraOptions options = lora(4, {"h*.attn.*"});
  const std::string fingerprint = nano(3, options, 1)->frozen_fingerprint();
  EXPECT_TRUE(fingerprint.starts_with("blake2b:")) << fingerprint;
  EXPECT_EQ(nano(3, options, 1)->frozen_fingerprint(), fingerprint);
  EXPECT_NE(nano(4, options, 1)->frozen_fingerprint(), fingerprint) << "another base";
  EXPECT_NE(nano(3, options, 2)->frozen_fingerprint(), fingerprint) << "another A";
  EXPECT_NE(nano(3, lora(8, {"h*.attn.*"}), 1)->frozen_fingerprint(), fingerprint) << "another rank";
  EXPECT_NE(nano(3, lora(4, {"h*.attn.*"}, 16.0f), 1)->frozen_fingerprint(), fingerprint) << "another alpha";
  EXPECT_EQ(make_model("gpt-nano", 3, 256).value()->frozen_fingerprint(), "") << "no LoRA, no fingerprint";
  // A from the seed and the name alone: the same in every process.
  EXPECT_EQ(lora_factor_a(5, "h0.attn.c_attn.weight", 2, 64), lora_factor_a(5, "h0.attn.c_attn.weight", 2, 64));
  EXPECT_NE(lora_factor_a(5, "h0.attn.c_attn.weight", 2, 64), lora_factor_a(5, "h1.attn.c_attn.weight", 2, 64));
}

TEST(Lora, RefusesWhatItCannotAdapt) {
  std::unique_ptr<Sequential> model = std::move(make_model("mlp", 1).value());
  const Status none = model->attach_lora(lora(4, {"h*.attn.*"}), 1);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.message().find("h*.attn.*"), std::string::npos) << none.to_string();
  EXPECT_NE(none.message().find("fc1.weight"), std::string::npos) << "the message lists the weights: " << none.to_string();
  EXPECT_TRUE(model->parameters().size() == 6u) << "a refused attach changes nothing";
  // Biases (1-D) are never adapted, even when a glob names them.
  ASSERT_TRUE(model->attach_lora(lora(2, {"fc1.*"}), 1).is_ok());
  ASSERT_EQ(model->parameters().size(), 1u);
  EXPECT_EQ(model->parameters()[0]->name, "fc1.weight.lora_b");

  EXPECT_FALSE(lora(-1).validate().is_ok());
  EXPECT_FALSE(lora(kMaxLoraRank + 1).validate().is_ok());
  EXPECT_FALSE(lora(4, {}, -1.0f).validate().is_ok());
  EXPECT_FALSE(lora(4, {""}).validate().is_ok());
  EXPECT_FALSE(lora(0, {"fc1.*"}).validate().is_ok()) << "targets without a rank";
  EXPECT_FALSE(lora(4, std::vector<std::string>(kMaxLoraTargets + 1, "x")).validate().is_ok());
  EXPECT_FLOAT_EQ(lora(8).scale(), 2.0f);
  EXPECT_FLOAT_EQ(lora(8, {}, 8.0f).scale(), 1.0f);

  // The recorded form reads back; a malformed one is refused by key.
  const LoraOptions options = lora(8, {"h*.attn.*", "h*.mlp.c_fc.weight"}, 4.0f);
  Result<LoraOptions> back = lora_from_json(options.to_json(), "store");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), options.to_json());
  EXPECT_FALSE(lora_from_json(nlohmann::json{{"rank", "8"}}, "store").is_ok());
  EXPECT_FALSE(lora_from_json(nlohmann::json{{"rank", 8}, {"ranks", 8}}, "store").is_ok());
  EXPECT_FALSE(lora_from_json(nlohmann::json{{"rank", 8}, {"targets", {1}}}, "store").is_ok());
}

}  // namespace
}  // namespace fedmesh::train
