// Update compression with error feedback (protocol/compressor.h): the
// properties every method must have, on the CPU backend.
//  - error feedback conserves the total: sum over rounds of what the receiver
//    decoded, plus the final residual, equals the sum of the deltas;
//  - decode(encode(x)) stays within each method's bound;
//  - what the compressor believes was sent is what the codec decodes;
//  - deterministic for a seed; PowerSGD recovers a low-rank update exactly;
//  - specs parse, print back, and bad ones are refused by name.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "base/random.h"
#include "kernels/half.h"
#include "protocol/compressor.h"

namespace fedmesh::protocol {
namespace {

std::vector<TensorShape> test_manifest() {
  return {{"fc1.weight", {64, 300}}, {"fc1.bias", {64}}, {"fc2.weight", {10, 64}}};
}

std::vector<std::vector<float>> random_update(const std::vector<TensorShape>& manifest, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<float>> update;
  for (const TensorShape& shape : manifest) {
    std::vector<float>& values = update.emplace_back(shape.element_count());
    for (float& v : values) v = static_cast<float>(rng.normal() * 0.01);
  }
  return update;
}

std::vector<std::span<const float>> spans(const std::vector<std::vector<float>>& tensors) {
  return {tensors.begin(), tensors.end()};
}

UpdateCompressor make(const std::string& spec_text, uint64_t seed = 7, uint64_t dense_below = 0) {
  Result<CompressionSpec> spec = parse_compression_spec(spec_text);
  EXPECT_TRUE(spec.is_ok()) << spec.status().message();
  CompressionPlan plan;
  plan.default_spec = *spec;
  plan.dense_below = dense_below;
  Result<UpdateCompressor> made = UpdateCompressor::create(plan, test_manifest(), seed, kernels::cpu_compression_kernels());
  EXPECT_TRUE(made.is_ok()) << made.status().message();
  return std::move(*made);
}

const std::vector<float>* residual_of(UpdateCompressor& compressor, const std::string& name) {
  for (const UpdateCompressor::StateTensor& t : compressor.state_tensors()) {
    if (t.role == "residual" && t.name == name) return t.values;
  }
  return nullptr;
}

class EveryMethod : public testing::TestWithParam<const char*> {};

TEST_P(EveryMethod, ErrorFeedbackConservesTheTotal) {
  UpdateCompressor compressor = make(GetParam());
  const std::vector<TensorShape> manifest = test_manifest();
  std::vector<std::vector<double>> inputs(manifest.size()), sent(manifest.size());
  for (size_t t = 0; t < manifest.size(); ++t) {
    inputs[t].assign(manifest[t].element_count(), 0.0);
    sent[t].assign(manifest[t].element_count(), 0.0);
  }
  for (int round = 0; round < 12; ++round) {
    const std::vector<std::vector<float>> delta = random_update(manifest, 100 + round);
    Result<CompressedUpdate> update = compressor.compress(spans(delta));
    ASSERT_TRUE(update.is_ok()) << update.status().message();
    for (size_t t = 0; t < manifest.size(); ++t) {
      for (size_t i = 0; i < delta[t].size(); ++i) {
        inputs[t][i] += delta[t][i];
        sent[t][i] += update->decoded[t][i];
      }
    }
  }
  for (size_t t = 0; t < manifest.size(); ++t) {
    const std::vector<float>* residual = residual_of(compressor, manifest[t].name);
    for (size_t i = 0; i < inputs[t].size(); ++i) {
      const double kept = residual ? (*residual)[i] : 0.0;
      // Each round adds one fp32 rounding of a - decoded (|a| < 1): 12 rounds
      // stay far below 1e-5.
      ASSERT_NEAR(sent[t][i] + kept, inputs[t][i], 1e-5) << GetParam() << " " << manifest[t].name << "[" << i << "]";
    }
  }
}

TEST_P(EveryMethod, DecodedIsWhatTheCodecDecodesAndTheSameSeedGivesTheSameBytes) {
  const std::vector<std::vector<float>> delta = random_update(test_manifest(), 3);
  UpdateCompressor first = make(GetParam(), 11), second = make(GetParam(), 11);
  Result<CompressedUpdate> a = first.compress(spans(delta));
  Result<CompressedUpdate> b = second.compress(spans(delta));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  const std::vector<TensorShape> manifest = test_manifest();
  ASSERT_EQ(a->tensors.size(), manifest.size());
  for (size_t t = 0; t < manifest.size(); ++t) {
    std::vector<float> decoded(manifest[t].element_count(), 0.0f);
    for (const EncodedSegment& segment : a->tensors[t].segments) {
      ASSERT_TRUE(decode_segment(segment.view(), manifest, decoded).is_ok());
      const EncodedSegment& twin = b->tensors[t].segments[&segment - a->tensors[t].segments.data()];
      EXPECT_EQ(segment.values, twin.values);
      EXPECT_EQ(segment.indices, twin.indices);
      EXPECT_EQ(segment.scales, twin.scales);
    }
    EXPECT_EQ(decoded, a->decoded[t]) << manifest[t].name;
  }
}

// compress() folds a lent delta into the residual in the pass that steps it;
// a delta handed over does the same from its own buffers; begin() + finish()
// forms a first, then steps it. All three compress to the same bytes and
// leave the same residuals, bit for bit, round after round.
TEST_P(EveryMethod, FoldedHandedOverAndBegunDeltasGiveTheSameBytes) {
  UpdateCompressor lent = make(GetParam(), 5), handed = make(GetParam(), 5), begun = make(GetParam(), 5);
  auto same = [](const CompressedUpdate& a, const CompressedUpdate& b) {
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (size_t t = 0; t < a.tensors.size(); ++t) {
      ASSERT_EQ(a.tensors[t].segments.size(), b.tensors[t].segments.size());
      for (size_t k = 0; k < a.tensors[t].segments.size(); ++k) {
        EXPECT_EQ(a.tensors[t].segments[k].values, b.tensors[t].segments[k].values);
        EXPECT_EQ(a.tensors[t].segments[k].indices, b.tensors[t].segments[k].indices);
        EXPECT_EQ(a.tensors[t].segments[k].scales, b.tensors[t].segments[k].scales);
      }
    }
    EXPECT_EQ(a.decoded, b.decoded);
  };
  auto same_state = [](UpdateCompressor& a, UpdateCompressor& b) {
    const std::vector<UpdateCompressor::StateTensor> x = a.state_tensors(), y = b.state_tensors();
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(*x[i].values, *y[i].values) << x[i].role << " " << x[i].name;
  };
  for (uint64_t round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> delta = random_update(test_manifest(), 40 + round);
    ASSERT_TRUE(begun.begin(spans(delta)).is_ok());
    Result<CompressedUpdate> c = begun.finish();
    Result<CompressedUpdate> a = lent.compress(spans(delta));
    Result<CompressedUpdate> b = handed.compress(std::move(delta));
    ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
    same(*a, *b);
    same(*a, *c);
    same_state(lent, handed);
    same_state(lent, begun);
  }
  // A bad delta handed over is refused like a lent one, the state untouched.
  std::vector<std::vector<float>> bad = random_update(test_manifest(), 60);
  bad[0][1] = NAN;
  EXPECT_FALSE(handed.compress(std::move(bad)).is_ok());
  same_state(lent, handed);
}

INSTANTIATE_TEST_SUITE_P(Compressors, EveryMethod,
                         testing::Values("identity", "fp16", "bf16", "int8", "int4", "int8:stochastic",
                                         "int4:stochastic:block=100", "topk:0.01", "topk:0.05+int8",
                                         "topk:0.3+fp32", "topk:0.01+fp16:warmup=3", "dct-sign:32", "dct-sign:400"));

TEST(Compressor, DecodeErrorStaysWithinEachMethodsBound) {
  const std::vector<TensorShape> manifest = test_manifest();
  const std::vector<std::vector<float>> x = random_update(manifest, 21);
  const auto max_abs = [](std::span<const float> v, size_t first, size_t last) {
    float m = 0.0f;
    for (size_t i = first; i < std::min(last, v.size()); ++i) m = std::max(m, std::fabs(v[i]));
    return m;
  };
  for (const int bits : {8, 4}) {
    UpdateCompressor c = make(bits == 8 ? "int8:block=256" : "int4:block=256");
    Result<CompressedUpdate> u = c.compress(spans(x));
    ASSERT_TRUE(u.is_ok());
    for (size_t t = 0; t < x.size(); ++t) {
      for (size_t i = 0; i < x[t].size(); ++i) {
        const float scale = max_abs(x[t], i / 256 * 256, i / 256 * 256 + 256) / (bits == 8 ? 127.0f : 7.0f);
        ASSERT_LE(std::fabs(u->decoded[t][i] - x[t][i]), scale / 2 * 1.0001f) << bits << " " << t << " " << i;
      }
    }
  }
  {  // fp16 and bf16: relative 2^-11 and 2^-8
    UpdateCompressor h = make("fp16"), b = make("bf16");
    Result<CompressedUpdate> uh = h.compress(spans(x)), ub = b.compress(spans(x));
    for (size_t t = 0; t < x.size(); ++t) {
      for (size_t i = 0; i < x[t].size(); ++i) {
        ASSERT_LE(std::fabs(uh->decoded[t][i] - x[t][i]), std::ldexp(std::fabs(x[t][i]), -11) + 6e-8f);
        ASSERT_LE(std::fabs(ub->decoded[t][i] - x[t][i]), std::ldexp(std::fabs(x[t][i]), -8));
      }
    }
  }
  {  // top-k fp32: the k kept are exact, everything else 0, and k = round(F n)
    UpdateCompressor k = make("topk:0.02+fp32");
    Result<CompressedUpdate> u = k.compress(spans(x));
    for (size_t t = 0; t < x.size(); ++t) {
      size_t kept = 0;
      for (size_t i = 0; i < x[t].size(); ++i) {
        if (u->decoded[t][i] != 0.0f) {
          ++kept;
          ASSERT_EQ(u->decoded[t][i], x[t][i]);
        }
      }
      EXPECT_EQ(kept, std::max<size_t>(1, static_cast<size_t>(std::llround(0.02 * static_cast<double>(x[t].size())))));
    }
  }
  {  // dct-sign: a contraction, ||a - D(C(a))|| < ||a|| (the kept coefficients'
     // energy minus k times the mean magnitude squared is removed)
    UpdateCompressor d = make("dct-sign:64");
    Result<CompressedUpdate> u = d.compress(spans(x));
    for (size_t t = 0; t < x.size(); ++t) {
      double error = 0.0, energy = 0.0;
      for (size_t i = 0; i < x[t].size(); ++i) {
        error += std::pow(u->decoded[t][i] - x[t][i], 2);
        energy += std::pow(x[t][i], 2);
      }
      EXPECT_LT(error, energy) << t;
    }
  }
}

TEST(Compressor, TopKWarmsUpAndPicksTheSmallerIndexForm) {
  CompressionSpec spec = *parse_compression_spec("topk:0.01:warmup=3");
  EXPECT_NEAR(topk_density(spec, 0), std::pow(0.01, 0.25), 1e-12);
  EXPECT_NEAR(topk_density(spec, 2), std::pow(0.01, 0.75), 1e-12);
  EXPECT_EQ(topk_density(spec, 3), 0.01);
  EXPECT_EQ(topk_density(spec, 50), 0.01);
  const std::vector<std::vector<float>> x = random_update(test_manifest(), 5);
  UpdateCompressor sparse = make("topk:0.01"), dense = make("topk:0.5");
  Result<CompressedUpdate> s = sparse.compress(spans(x)), d = dense.compress(spans(x));
  EXPECT_EQ(s->tensors[0].descriptor.encoding, Encoding::kSparseF16);
  EXPECT_EQ(d->tensors[0].descriptor.encoding, Encoding::kSparseBitmapF16);
  // 1% of 19200 elements in fp16 plus about 1-2 bytes of index each.
  EXPECT_LT(s->payload_bytes, 192u * 4u + 64u * 4u);
}

TEST(Compressor, AnUndeliveredUpdateGoesBackIntoTheResidual) {
  UpdateCompressor c = make("topk:0.01+int8");
  const std::vector<std::vector<float>> first = random_update(test_manifest(), 30), second = random_update(test_manifest(), 31);
  ASSERT_TRUE(c.compress(spans(first)).is_ok());
  const std::vector<float> residual_before = *residual_of(c, "fc1.weight");
  Result<CompressedUpdate> lost = c.compress(spans(second));
  ASSERT_TRUE(lost.is_ok());
  c.rollback();
  // e <- a = e_before + delta.
  const std::vector<float>& residual = *residual_of(c, "fc1.weight");
  for (size_t i = 0; i < residual.size(); ++i) {
    ASSERT_NEAR(residual[i], residual_before[i] + second[0][i], 1e-7) << i;
  }
}

// The residual holds a = e + delta while an update is compressed, and
// e <- a - D(C(a)) after; giving an update back adds D(C(a)) again. For
// round-to-nearest quantization, top-k and half casts D is within a factor of
// 2 of a (or 0), so a - D is exact and e returns to a bit for bit.
class ExactGiveBack : public testing::TestWithParam<const char*> {};

TEST_P(ExactGiveBack, AnUndeliveredUpdateRestoresTheResidualBitForBit) {
  UpdateCompressor c = make(GetParam());
  const std::vector<std::vector<float>> first = random_update(test_manifest(), 40),
                                        second = random_update(test_manifest(), 41);
  ASSERT_TRUE(c.compress(spans(first)).is_ok());
  std::vector<std::vector<float>> expected;  // a = e + delta, as begin forms it
  for (size_t t = 0; t < test_manifest().size(); ++t) {
    const std::vector<float>& e = *residual_of(c, test_manifest()[t].name);
    std::vector<float>& a = expected.emplace_back(e.size());
    for (size_t i = 0; i < e.size(); ++i) a[i] = e[i] + second[t][i];
  }
  ASSERT_TRUE(c.compress(spans(second)).is_ok());
  auto expect_residuals = [&](const std::vector<std::vector<float>>& want) {
    for (size_t t = 0; t < want.size(); ++t) {
      const std::vector<float>& e = *residual_of(c, test_manifest()[t].name);
      for (size_t i = 0; i < e.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(e[i]), std::bit_cast<uint32_t>(want[t][i]))
            << test_manifest()[t].name << " element " << i << ": " << e[i] << " vs " << want[t][i];
      }
    }
  };
  c.rollback();
  expect_residuals(expected);
  c.rollback();  // given back once only
  expect_residuals(expected);
}

INSTANTIATE_TEST_SUITE_P(Methods, ExactGiveBack,
                         testing::Values("int8", "int4", "topk:0.01+int8", "topk:0.05+fp16", "fp16", "bf16"));

TEST(Compressor, AfterReleaseNothingIsGivenBack) {
  for (const char* method : {"int8", "topk:0.01+int8", "fp16", "int8:stochastic"}) {
    SCOPED_TRACE(method);
    UpdateCompressor c = make(method);
    ASSERT_TRUE(c.compress(spans(random_update(test_manifest(), 50))).is_ok());
    const std::vector<float> after = *residual_of(c, "fc1.weight");
    c.release_buffers();
    c.rollback();
    EXPECT_EQ(*residual_of(c, "fc1.weight"), after);
    // And the next update compresses as usual from the residual kept.
    ASSERT_TRUE(c.compress(spans(random_update(test_manifest(), 51))).is_ok());
  }
}

// Stochastic rounding can round a small value to a whole step away from it:
// there e - D then + D is within a rounding of a, not always a itself.
TEST(Compressor, AStochasticUpdateGivenBackIsWithinARoundingOfItsInput) {
  UpdateCompressor c = make("int8:stochastic");
  const std::vector<std::vector<float>> second = random_update(test_manifest(), 61);
  ASSERT_TRUE(c.compress(spans(random_update(test_manifest(), 60))).is_ok());
  const std::vector<float> before = *residual_of(c, "fc1.weight");
  ASSERT_TRUE(c.compress(spans(second)).is_ok());
  c.rollback();
  const std::vector<float>& e = *residual_of(c, "fc1.weight");
  for (size_t i = 0; i < e.size(); ++i) {
    const float a = before[i] + second[0][i];
    ASSERT_LE(std::fabs(e[i] - a), 2.0f * std::numeric_limits<float>::epsilon() * 0.05f) << i;
  }
}

TEST(Compressor, TopKMomentumCorrectionMasksWhatWasSent) {
  UpdateCompressor c = make("topk:0.1+fp32:momentum=0.9");
  const std::vector<std::vector<float>> x = random_update(test_manifest(), 6);
  Result<CompressedUpdate> u = c.compress(spans(x));
  ASSERT_TRUE(u.is_ok());
  const std::vector<float>* momentum = nullptr;
  for (const UpdateCompressor::StateTensor& t : c.state_tensors()) {
    if (t.role == "momentum" && t.name == "fc1.weight") momentum = t.values;
  }
  ASSERT_NE(momentum, nullptr);
  for (size_t i = 0; i < x[0].size(); ++i) {
    // Sent positions are cleared; the rest hold the delta (u = 0.9 * 0 + delta).
    EXPECT_EQ((*momentum)[i], u->decoded[0][i] != 0.0f ? 0.0f : x[0][i]) << i;
  }
}

TEST(Compressor, PowerSgdRecoversALowRankUpdateWithASharedP) {
  CompressionPlan plan;
  plan.default_spec = *parse_compression_spec("powersgd:2");
  const std::vector<TensorShape> manifest = test_manifest();
  // Three sites whose fc1.weight deltas lie in the same rank-2 column space.
  Rng rng(9);
  std::vector<float> u(64 * 2), q(300 * 2);
  for (float& v : u) v = static_cast<float>(rng.normal());
  for (float& v : q) v = static_cast<float>(rng.normal());
  std::vector<UpdateCompressor> sites;
  std::vector<std::vector<std::vector<float>>> deltas;
  for (int s = 0; s < 3; ++s) {
    Result<UpdateCompressor> c = UpdateCompressor::create(plan, manifest, 1, kernels::cpu_compression_kernels());
    ASSERT_TRUE(c.is_ok());
    sites.push_back(std::move(*c));
    std::vector<std::vector<float>> delta = random_update(manifest, 40 + s);
    std::vector<float> v(300 * 2);
    for (float& x : v) x = static_cast<float>(rng.normal());
    for (int i = 0; i < 64; ++i) {
      for (int j = 0; j < 300; ++j) delta[0][i * 300 + j] = 0.01f * (u[i * 2] * v[j * 2] + u[i * 2 + 1] * v[j * 2 + 1]);
    }
    deltas.push_back(std::move(delta));
  }
  ASSERT_EQ(sites[0].powersgd_tensors(), (std::vector<size_t>{0, 2}));
  // The shared Q of both PowerSGD tensors (fc1.weight 64x300, fc2.weight 10x64).
  std::vector<std::vector<float>> shared_q = {std::vector<float>(300 * 2), std::vector<float>(64 * 2)};
  for (auto& sq : shared_q) {
    for (float& x : sq) x = static_cast<float>(rng.normal());
  }
  std::vector<std::vector<float>> shared_p = {std::vector<float>(64 * 2, 0.0f), std::vector<float>(10 * 2, 0.0f)};
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(sites[static_cast<size_t>(s)].begin(spans(deltas[static_cast<size_t>(s)])).is_ok());
    Result<std::vector<std::vector<float>>> p = sites[static_cast<size_t>(s)].powersgd_p(shared_q);
    ASSERT_TRUE(p.is_ok());
    for (size_t i = 0; i < 2; ++i) {
      for (size_t e = 0; e < shared_p[i].size(); ++e) shared_p[i][e] += (*p)[i][e] / 3.0f;
    }
  }
  for (size_t i = 0; i < 2; ++i) {
    kernels::cpu_compression_kernels().orthonormalize_columns(shared_p[i], static_cast<int64_t>(shared_p[i].size() / 2), 2);
  }
  for (int s = 0; s < 3; ++s) {
    Result<CompressedUpdate> update = sites[static_cast<size_t>(s)].finish(shared_p);
    ASSERT_TRUE(update.is_ok()) << update.status().message();
    // The rank-2 tensor comes back whole: its residual is (nearly) zero.
    double error = 0.0, norm = 0.0;
    for (size_t e = 0; e < deltas[static_cast<size_t>(s)][0].size(); ++e) {
      error += std::pow(update->decoded[0][e] - deltas[static_cast<size_t>(s)][0][e], 2);
      norm += std::pow(deltas[static_cast<size_t>(s)][0][e], 2);
    }
    EXPECT_LT(error, 1e-8 * norm) << "site " << s;
    // fc1.bias is 1-D: dense and exact. The wire carries Q_i (300 x 2), not 64 x 300.
    EXPECT_EQ(update->decoded[1], deltas[static_cast<size_t>(s)][1]);
    EXPECT_EQ(update->tensors[0].descriptor.name, "fc1.weight@powersgd.q");
    EXPECT_EQ(update->tensors[0].descriptor.dims, (std::vector<int64_t>{300, 2}));
  }
  EXPECT_FALSE(sites[0].compress(spans(deltas[0])).is_ok()) << "PowerSGD refuses the one-step path";
}

TEST(CompressionSpecs, ParseAndPrintBack) {
  for (const char* text : {"identity", "fp16", "bf16", "int8", "int4:stochastic", "int8:block=256",
                           "topk:0.01+fp16", "topk:0.001+int8:warmup=5", "topk:0.1+fp32:momentum=0.9",
                           "powersgd:4", "dct-sign:32",
                           // fuzz_specs found that ten digits ("topk:0.0995") read back as another density
                           "topk:0.09949999999999+fp16:momentum=0.123456789012345"}) {
    Result<CompressionSpec> spec = parse_compression_spec(text);
    ASSERT_TRUE(spec.is_ok()) << text << ": " << spec.status().message();
    EXPECT_EQ(*parse_compression_spec(spec->to_string()), *spec) << text;
  }
  EXPECT_EQ(parse_compression_spec("topk:0.1+fp32:momentum=0.9")->to_string(), "topk:0.1+fp32:momentum=0.9")
      << "the shortest text that reads back the same";
  EXPECT_EQ(parse_compression_spec("topk:0.01")->values, Encoding::kSparseF16);
  EXPECT_EQ(parse_compression_spec("topk:0.01+int8:warmup=2")->warmup_rounds, 2);
  for (const char* bad : {"", "zip", "topk", "topk:0", "topk:1.5", "topk:abc", "topk:0.1+int4", "int8+fp16",
                          "int8:block=0", "int8:fast", "powersgd", "powersgd:0", "powersgd:65", "dct-sign:5000",
                          "topk:0.1:warmup=-1", "topk:0.1:momentum=1", "fp16:3"}) {
    Result<CompressionSpec> spec = parse_compression_spec(bad);
    EXPECT_FALSE(spec.is_ok()) << "'" << bad << "' was accepted";
    if (!spec.is_ok()) {
      EXPECT_NE(spec.status().message().find("compression spec"), std::string::npos);
    }
  }
}

TEST(CompressionSpecs, OverridesAndSmallTensorsGoTheirOwnWay) {
  CompressionPlan plan;
  plan.default_spec = *parse_compression_spec("topk:0.01");
  plan.overrides.push_back(*parse_tensor_override("*.bias=identity"));
  plan.overrides.push_back(*parse_tensor_override("fc2.*=int8"));
  plan.dense_below = 1000;
  const std::vector<int64_t> big{64, 300}, small{10, 64}, bias{64};
  EXPECT_EQ(plan.for_tensor("fc1.weight", big).method, CompressionMethod::kTopK);
  EXPECT_EQ(plan.for_tensor("fc1.bias", bias).method, CompressionMethod::kIdentity);
  EXPECT_EQ(plan.for_tensor("fc2.weight", small).method, CompressionMethod::kBlock) << "an override beats dense_below";
  EXPECT_EQ(plan.for_tensor("fc3.weight", small).method, CompressionMethod::kIdentity) << "640 < dense_below";
  CompressionPlan power;
  power.default_spec = *parse_compression_spec("powersgd:4");
  EXPECT_EQ(power.for_tensor("fc1.bias", bias).method, CompressionMethod::kIdentity) << "1-D goes dense";
  EXPECT_EQ(power.for_tensor("fc1.weight", big).method, CompressionMethod::kPowerSgd);
  EXPECT_FALSE(parse_tensor_override("no-equals").is_ok());
  EXPECT_FALSE(parse_tensor_override("=int8").is_ok());
  EXPECT_FALSE(parse_tensor_override("x=bogus").is_ok());
  EXPECT_EQ(plan.to_string(), "topk:0.01+fp16; *.bias=identity; fc2.*=int8; dense_below=1000");
}

}  // namespace
}  // namespace fedmesh::protocol
