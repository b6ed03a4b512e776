// train/initial_weights: `fedmesh train --init FILE` in both layouts, and
// every refusal (missing, misshapen, unknown, non-float, non-finite array)
// naming the array and leaving the model as it was. Files are safetensors
// bytes made here.
#include "train/initial_weights.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/model.h"
#include "train/predict.h"

namespace fedmesh::train {
namespace {

namespace fs = std::filesystem;

struct Array {
  std::string name;
  std::string dtype;  // "F32", "F64", "F16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

Array f32(std::string name, std::vector<int64_t> shape, const std::vector<float>& values) {
  Array a{std::move(name), "F32", std::move(shape), std::vector<uint8_t>(values.size() * sizeof(float))};
  std::memcpy(a.bytes.data(), values.data(), a.bytes.size());
  return a;
}

std::vector<float> values_of(const Tensor& t) {
  const Tensor host = t.host();
  return std::vector<float>(host.data<float>(), host.data<float>() + host.numel());
}

class InitialWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() / ("fedmesh-initial-weights-" + std::to_string(::getpid()));
    fs::remove_all(directory_);
    fs::create_directories(directory_);
    auto made = make_model("gpt-nano", 3, 256);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    model_ = std::move(*made);
  }
  void TearDown() override { fs::remove_all(directory_); }

  std::string write(const std::string& name, const std::vector<Array>& arrays) {
    nlohmann::json header = nlohmann::json::object();
    size_t offset = 0;
    for (const Array& a : arrays) {
      header[a.name] = {{"dtype", a.dtype}, {"shape", a.shape}, {"data_offsets", {offset, offset + a.bytes.size()}}};
      offset += a.bytes.size();
    }
    std::string text = header.dump();
    while (text.size() % 8 != 0) text += ' ';
    const fs::path path = directory_ / name;
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof length);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Array& a : arrays) out.write(reinterpret_cast<const char*>(a.bytes.data()), static_cast<std::streamsize>(a.bytes.size()));
    return path.string();
  }

  // Every parameter of a second model (seed 9) under fedmesh's names.
  std::vector<Array> other_weights(bool hf_layout) {
    auto other = make_model("gpt-nano", 9, 256);
    EXPECT_TRUE(other.is_ok());
    std::vector<Array> arrays;
    for (Parameter* p : (*other)->parameters()) {
      std::vector<int64_t> shape(p->value.shape().begin(), p->value.shape().end());
      std::vector<float> v = values_of(p->value);
      std::string name = p->name;
      if (hf_layout) {
        const bool conv1d = name.find(".c_attn.weight") != std::string::npos ||
                            name.find(".c_proj.weight") != std::string::npos ||
                            name.find(".c_fc.weight") != std::string::npos;
        if (conv1d) {  // stored (in, out)
          std::vector<float> t(v.size());
          for (int64_t r = 0; r < shape[0]; ++r) {
            for (int64_t c = 0; c < shape[1]; ++c) t[c * shape[0] + r] = v[r * shape[1] + c];
          }
          v = std::move(t);
          std::swap(shape[0], shape[1]);
        }
        if (name.size() > 1 && name[0] == 'h' && std::isdigit(static_cast<unsigned char>(name[1]))) {
          name = "h." + name.substr(1);
        }
        name = "transformer." + name;
      }
      arrays.push_back(f32(name, shape, v));
    }
    expected_.clear();
    for (Parameter* p : (*other)->parameters()) expected_.push_back(values_of(p->value));
    return arrays;
  }

  void expect_weights(const std::vector<std::vector<float>>& expected) {
    const std::vector<Parameter*> parameters = model_->parameters();
    ASSERT_EQ(parameters.size(), expected.size());
    for (size_t i = 0; i < parameters.size(); ++i) {
      EXPECT_EQ(values_of(parameters[i]->value), expected[i]) << parameters[i]->name;
    }
  }

  std::vector<std::vector<float>> current() {
    std::vector<std::vector<float>> out;
    for (Parameter* p : model_->parameters()) out.push_back(values_of(p->value));
    return out;
  }

  // `arrays` is refused with a message containing `needle`, and the model keeps its weights.
  void refused(const std::vector<Array>& arrays, const std::string& needle, InitFormat format = InitFormat::kFedmesh) {
    const auto before = current();
    const Status s = load_initial_weights(*model_, write("bad.safetensors", arrays), format);
    EXPECT_FALSE(s.is_ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    expect_weights(before);
  }

  fs::path directory_;
  std::unique_ptr<Sequential> model_;
  std::vector<std::vector<float>> expected_;
};

TEST_F(InitialWeights, LoadsEveryParameterByName) {
  const std::vector<Array> arrays = other_weights(false);
  ASSERT_TRUE(load_initial_weights(*model_, write("w.safetensors", arrays)).is_ok());
  expect_weights(expected_);
}

TEST_F(InitialWeights, ReadsHuggingFaceGpt2Layout) {
  std::vector<Array> arrays = other_weights(true);
  // What GPT2LMHeadModel's state dict adds: mask buffers and the tied head.
  arrays.push_back(f32("transformer.h.0.attn.bias", {1, 1, 2, 2}, {1, 0, 1, 1}));
  arrays.push_back(f32("transformer.h.1.attn.masked_bias", {}, {-1e4f}));
  const Array& wte = arrays.front();
  ASSERT_EQ(wte.name, "transformer.wte.weight");
  arrays.push_back(Array{"lm_head.weight", "F32", wte.shape, wte.bytes});
  ASSERT_TRUE(load_initial_weights(*model_, write("hf.safetensors", arrays), InitFormat::kHfGpt2).is_ok());
  expect_weights(expected_);
  // Read as fedmesh's names, the file is refused with a hint.
  refused(arrays, "--init-format hf-gpt2");
}

// --init-partial: what fits is taken, the rest listed; the seeded values of
// what was left out stay.
TEST_F(InitialWeights, PartialTakesWhatFitsAndListsTheRest) {
  std::vector<Array> arrays = other_weights(false);
  const auto seeded = current();
  const std::string dropped = arrays.back().name;
  arrays.pop_back();
  const std::string reshaped = arrays[2].name;
  arrays[2].shape.push_back(1);
  arrays.push_back(f32("head.weight", {2}, {1, 2}));
  InitReport report;
  ASSERT_TRUE(load_initial_weights(*model_, write("partial.safetensors", arrays), InitFormat::kFedmesh,
                                   /*partial=*/true, &report)
                  .is_ok());
  const std::vector<Parameter*> parameters = model_->parameters();
  EXPECT_EQ(report.loaded, static_cast<int64_t>(parameters.size()) - 2);
  EXPECT_EQ(report.seeded, (std::vector<std::string>{reshaped, dropped}));
  EXPECT_EQ(report.ignored, (std::vector<std::string>{reshaped, "head.weight"}));
  for (size_t i = 0; i < parameters.size(); ++i) {
    const bool left_out = parameters[i]->name == dropped || parameters[i]->name == reshaped;
    EXPECT_EQ(values_of(parameters[i]->value), left_out ? seeded[i] : expected_[i]) << parameters[i]->name;
  }
  // Non-finite values are refused even so.
  std::vector<Array> bad = other_weights(false);
  const float inf = INFINITY;
  std::memcpy(bad[0].bytes.data(), &inf, sizeof inf);
  EXPECT_FALSE(load_initial_weights(*model_, write("bad-partial.safetensors", bad), InitFormat::kFedmesh, true).is_ok());
}

TEST_F(InitialWeights, RefusesWhatDoesNotFitByName) {
  std::vector<Array> arrays = other_weights(false);
  Array dropped = arrays.back();
  arrays.pop_back();
  refused(arrays, "has no array \"" + dropped.name + "\"");
  arrays.push_back(dropped);

  std::vector<Array> extra = arrays;
  extra.push_back(f32("h0.attn.rotary", {2}, {1, 2}));
  refused(extra, "\"h0.attn.rotary\", which is no parameter");

  std::vector<Array> misshapen = arrays;
  std::swap(misshapen[2].shape[0], misshapen[2].shape.back());
  if (misshapen[2].shape == arrays[2].shape) misshapen[2].shape.push_back(1);
  refused(misshapen, "\"" + arrays[2].name + "\" is (");

  std::vector<Array> half = arrays;
  half[1].dtype = "F16";
  half[1].bytes.resize(half[1].bytes.size() / 2);
  refused(half, arrays[1].name + "' is of F16");  // the safetensors reader's own refusal

  std::vector<Array> integers = arrays;
  integers[1].dtype = "I32";
  refused(integers, "\"" + arrays[1].name + "\" is i4: weights must be f4 or f8");

  std::vector<Array> not_finite = arrays;
  const float nan = std::nanf("");
  std::memcpy(not_finite[0].bytes.data() + 4 * sizeof(float), &nan, sizeof nan);
  refused(not_finite, "non-finite value at element 4");

  std::vector<Array> flat_conv1d = other_weights(true);
  for (Array& a : flat_conv1d) {
    if (a.name == "transformer.h.0.mlp.c_fc.weight") a.shape = {a.shape[0] * a.shape[1]};
  }
  refused(flat_conv1d, "a Conv1D weight is 2-D", InitFormat::kHfGpt2);

  const Status missing = load_initial_weights(*model_, (directory_ / "absent.safetensors").string());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.to_string();
  EXPECT_FALSE(parse_init_format("onnx").is_ok());
}

// `fedmesh model predict` (train/predict.h): gpt-nano's logits from a
// weights file equal the model's own on the same ids, and every flaw of the
// input is refused naming it.
TEST_F(InitialWeights, PredictRunsTheWeightsAndRefusesBadInputByName) {
  const std::string weights = write("gpt.safetensors", other_weights(false));
  std::vector<float> ids(2 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<float>((i * 37) % 256);
  const std::string input = write("ids.safetensors", {f32("x", {2, 8}, ids)});
  PredictOptions options;
  options.model = "gpt-nano";
  options.weights.path = weights;
  options.input = input;
  Result<Prediction> prediction = predict(options);
  ASSERT_TRUE(prediction.is_ok()) << prediction.status().to_string();
  EXPECT_EQ(prediction->samples, 2);
  ASSERT_EQ(prediction->logits.shape(), (Shape{16, 256}));
  auto other = make_model("gpt-nano", 9, 256);
  const Tensor expected = (*other)->forward(Tensor::view_of(ids.data(), {2, 8}, DType::kF32), false);
  EXPECT_EQ(values_of(prediction->logits), values_of(expected));

  const auto refused = [&](const std::vector<Array>& arrays, const std::string& says) {
    PredictOptions bad = options;
    bad.input = write("bad.safetensors", arrays);
    Result<Prediction> r = predict(bad);
    ASSERT_FALSE(r.is_ok()) << says;
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().to_string();
  };
  refused({f32("y", {2, 8}, ids)}, "no array named x");
  refused({f32("x", {16}, ids)}, "one row per sample");
  refused({f32("x", {1, 80}, std::vector<float>(80, 1.0f))}, "at most 64");
  std::vector<float> outside = ids;
  outside[3] = 256.0f;
  refused({f32("x", {2, 8}, outside)}, "element 3 is 256");
  outside[3] = 1.5f;
  refused({f32("x", {2, 8}, outside)}, "not a token id");
  outside[3] = std::nanf("");
  refused({f32("x", {2, 8}, outside)}, "non-finite");
  PredictOptions no_weights = options;
  no_weights.weights.path.clear();
  EXPECT_FALSE(predict(no_weights).is_ok());
}

}  // namespace
}  // namespace fedmesh::train
