// Models described in a file (train/model_spec.h): a spec that writes out a
// built-in model builds it exactly (names, shapes, values for the seed, and
// fingerprint); shapes follow the data; every flaw of a spec, and every
// spec that does not fit the data, is refused naming the layer (and both
// shapes); a spec model's gradients match finite differences; every spec
// layer has a CUDA version (tests/train/test_device_training.cpp trains
// them on the device).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "tests/support/model_gradient_check.h"
#include "tests/support/text_files.h"
#include "train/model.h"
#include "train/model_spec.h"

namespace fedmesh::train {
namespace {

namespace fs = std::filesystem;

class ModelSpecs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fedmesh_model_spec_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& file, const std::string& text) {
    fedmesh::testing::spit(dir_ / file, text);
    return (dir_ / file).string();
  }
  fs::path dir_;
};

Result<ModelSpec> parse(const std::string& text) { return parse_model_spec(text, "spec.toml", "spec"); }

void expect_refused(const std::string& text, const std::string& says) {
  Result<ModelSpec> spec = parse(text);
  ASSERT_FALSE(spec.is_ok()) << text;
  EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(spec.status().message().find(says), std::string::npos) << spec.status().message();
}

TEST_F(ModelSpecs, ASpecOfTheCnnBuildsTheBuiltInCnn) {
  const std::string path = write("cnn.toml", R"(name = "cnn"
layers = [
  { type = "conv2d", out = 32, kernel = 3, padding = 1 },
  { type = "relu" },
  { type = "maxpool", size = 2 },
  { type = "conv2d", out = 64 },
  { type = "relu" },
  { type = "maxpool" },
  { type = "flatten" },
  { type = "linear", out = 128 },
  { type = "relu" },
  { type = "linear" },
]
)");
  ModelInput input{0, {3, 20, 24}, 7, false};
  auto from_file = make_model(path, 11, input);
  auto built_in = make_model("cnn", 11, input);
  ASSERT_TRUE(from_file.is_ok()) << from_file.status().to_string();
  ASSERT_TRUE(built_in.is_ok()) << built_in.status().to_string();
  const auto a = (*from_file)->parameters(), b = (*built_in)->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]->name, b[i]->name);
    ASSERT_EQ(a[i]->value.shape(), b[i]->value.shape()) << a[i]->name;
    EXPECT_EQ(0, std::memcmp(a[i]->value.data<float>(), b[i]->value.data<float>(), a[i]->value.nbytes())) << a[i]->name;
  }
  EXPECT_EQ(read_model_spec(path)->fingerprint(), preset_model_spec("cnn")->fingerprint())
      << "the same model, the same fingerprint";
  // fc1 takes what the convolutions leave of 20 x 24: 64 x 5 x 6.
  EXPECT_EQ(a[4]->value.shape(), (Shape{128, 64 * 5 * 6}));
}

TEST_F(ModelSpecs, ShapesFollowTheDataAndThePlanCountsEveryLayer) {
  Result<ModelSpec> spec = parse(R"(layers = [
    { type = "conv2d", out = 8, stride = 2, name = "stem" },
    { type = "silu" },
    { type = "avgpool", size = 2 },
    { type = "global_avgpool" },
    { type = "layernorm" },
    { type = "dropout", p = 0.2 },
    { type = "linear", out = 16 },
    { type = "gelu" },
    { type = "linear" },
  ])");
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  std::vector<BuiltLayer> plan;
  auto model = build_model(*spec, 1, ModelInput{0, {3, 16, 16}, 5, false}, &plan);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  ASSERT_EQ(plan.size(), 9u);
  EXPECT_EQ(plan[0].name, "stem");
  EXPECT_EQ(plan[0].output, (Shape{8, 8, 8}));
  EXPECT_EQ(plan[0].parameters, 8 * 3 * 9 + 8);
  EXPECT_EQ(plan[0].flops, 2 * 9 * 3 * 8 * 8 * 8);
  EXPECT_EQ(plan[2].output, (Shape{8, 4, 4}));
  EXPECT_EQ(plan[3].output, (Shape{8}));
  EXPECT_EQ(plan[4].name, "ln1");
  EXPECT_EQ(plan[6].name, "fc1");
  EXPECT_EQ(plan[8].name, "fc2");
  EXPECT_EQ(plan[8].output, (Shape{5}));
  int64_t counted = 0;
  for (const BuiltLayer& b : plan) counted += b.parameters;
  EXPECT_EQ(counted, (*model)->parameter_count());
  EXPECT_EQ((*model)->device_problem(Device::kCuda), "") << "every layer of a spec has a CUDA version";
  EXPECT_EQ((*model)->device_problem(Device::kCpu), "");
  // A table: the same spec without the image layers.
  Result<ModelSpec> table = parse(R"(layers = [{ type = "linear", out = 4 }, { type = "relu" }, { type = "linear" }])");
  auto regression = build_model(*table, 1, ModelInput{0, {30}, 1, true});
  ASSERT_TRUE(regression.is_ok()) << regression.status().to_string();
  EXPECT_EQ((*regression)->parameter_count(), 30 * 4 + 4 + 4 + 1);
}

TEST_F(ModelSpecs, ASpecThatDoesNotFitTheDataIsRefusedNamingTheLayerAndShapes) {
  const auto refused = [](const std::string& text, const ModelInput& input, const std::string& says) {
    Result<ModelSpec> spec = parse(text);
    ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
    auto model = build_model(*spec, 1, input);
    ASSERT_FALSE(model.is_ok()) << text;
    EXPECT_EQ(model.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find(says), std::string::npos) << model.status().message();
  };
  const ModelInput table{0, {30}, 2, false}, images{0, {1, 8, 8}, 10, false};
  refused(R"(layers = [{ type = "conv2d", out = 8 }, { type = "flatten" }, { type = "linear" }])", table,
          "layer 1 (conv2d) takes images (channels, height, width); it would get (30)");
  refused(R"(layers = [{ type = "maxpool", size = 16 }, { type = "flatten" }, { type = "linear" }])", images,
          "layer 1 (maxpool) takes images (channels, height, width) of at least 16x16; it would get (1, 8, 8)");
  refused(R"(layers = [{ type = "conv2d", out = 8 }])", images, "its output is (8, 8, 8) per sample; the data's 10 classes need (10)");
  refused(R"(layers = [{ type = "linear", out = 3 }])", images, "need (10)");
  refused(R"(layers = [{ type = "linear", out = 1048576 }, { type = "linear" }])", ModelInput{0, {3, 64, 64}, 2, false},
          "at most 2^30 weights");
}

TEST_F(ModelSpecs, EveryFlawOfASpecIsRefusedByName) {
  expect_refused(R"(layers = [{ type = "linear", out = 4 }, { type = "conv3d" }])", "layer 2: unknown type 'conv3d'");
  expect_refused(R"(layers = [{ type = "conv2d", out = 4, kernal = 3 }])",
                 "layer 1 (conv2d): unknown key 'kernal' (conv2d takes out, kernel, stride, padding, name)");
  expect_refused(R"(layers = [{ out = 4 }])", "layer 1: needs type");
  expect_refused(R"(layers = [{ type = "conv2d" }])", "layer 1 (conv2d): needs out");
  expect_refused(R"(layers = [{ type = "linear" }, { type = "relu" }, { type = "linear" }])",
                 "layer 1 (linear): needs out");
  expect_refused(R"(layers = [{ type = "linear", out = 0 }])", "out = 0 is outside");
  expect_refused(R"(layers = [{ type = "linear", out = "wide" }])", "out must be an integer");
  expect_refused(R"(layers = [{ type = "conv2d", out = 4, kernel = 3, padding = 3 }])", "padding = 3 is outside [0, 2]");
  expect_refused(R"(layers = [{ type = "dropout", p = 1.0 }])", "p must be a number in [0, 1)");
  expect_refused(R"(layers = [{ type = "linear", out = 4, name = "a" }, { type = "linear", name = "a" }])",
                 "the name 'a' is used twice");
  expect_refused(R"(layers = [{ type = "linear", name = "x y" }])", "name must be");
  expect_refused(R"(layers = [])", "layers must be a list of 1 to 256 tables");
  expect_refused(R"(layers = [1, 2])", "layer 1 is not a table");
  expect_refused(R"(name = "m")", "has neither");
  expect_refused("gpt = { layers = 2, heads = 3, width = 32, context = 8 }\nlayers = [{ type = \"relu\" }]", "not both");
  expect_refused(R"(gpt = { layers = 2, heads = 3, width = 32, context = 8 })", "width 32 is not a multiple of heads 3");
  expect_refused(R"(gpt = { layers = 2, heads = 2, width = 32 })", "gpt: needs context");
  expect_refused(R"(gpt = { layers = 2, heads = 2, width = 32, context = 8, dropout = 0.1 })", "unknown key 'dropout'");
  expect_refused(R"(model = "mlp")", "unknown key 'model'");
  expect_refused("layers = [", "spec.toml");  // TOML syntax: the file named
  EXPECT_FALSE(read_model_spec((dir_ / "missing.toml").string()).is_ok());
}

TEST_F(ModelSpecs, AGptSpecBuildsTheSameModelAsTheBuiltInOfItsSizes) {
  const std::string path = write("nano.toml", "name = \"gpt-nano\"\ngpt = { layers = 2, heads = 4, width = 64, context = 64 }\n");
  ASSERT_TRUE(language_model_config(path).has_value()) << "a GPT spec file is a language model everywhere";
  EXPECT_EQ(language_model_config(path)->vocabulary, 256);
  auto from_file = make_model(path, 3);
  auto built_in = make_model("gpt-nano", 3);
  ASSERT_TRUE(from_file.is_ok()) << from_file.status().to_string();
  const auto a = (*from_file)->parameters(), b = (*built_in)->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]->name, b[i]->name);
    EXPECT_EQ(0, std::memcmp(a[i]->value.data<float>(), b[i]->value.data<float>(), a[i]->value.nbytes())) << a[i]->name;
  }
  auto tokenized = make_model(path, 3, 500);  // a tokenizer's vocabulary sizes it
  ASSERT_TRUE(tokenized.is_ok());
  EXPECT_EQ((*tokenized)->parameters()[0]->value.shape(), (Shape{500, 64}));
}

TEST_F(ModelSpecs, ResidualBlocksAndGroupNormBuildAResNet) {
  Result<ModelSpec> spec = parse(R"(layers = [
    { type = "conv2d", out = 8 },
    { type = "groupnorm", groups = 4 },
    { type = "relu" },
    { type = "residual", layers = [
        { type = "conv2d", out = 8 }, { type = "groupnorm", groups = 2 }, { type = "relu" },
        { type = "conv2d", out = 8 }, { type = "groupnorm", groups = 2 } ] },
    { type = "relu" },
    { type = "residual", name = "down", layers = [
        { type = "conv2d", out = 16, stride = 2 }, { type = "relu" }, { type = "conv2d", out = 16 } ] },
    { type = "global_avgpool" },
    { type = "linear" },
  ])");
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  EXPECT_NE(spec->canonical().find("residual\n  conv2d out=8"), std::string::npos) << spec->canonical();
  std::vector<BuiltLayer> plan;
  auto model = build_model(*spec, 1, ModelInput{0, {3, 9, 9}, 10, false}, &plan);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  std::vector<std::string> names;
  for (Parameter* p : (*model)->parameters()) names.push_back(p->name);
  const std::vector<std::string> expected = {
      "conv1.weight", "conv1.bias", "gn1.weight", "gn1.bias",
      "res1.conv1.weight", "res1.conv1.bias", "res1.gn1.weight", "res1.gn1.bias",
      "res1.conv2.weight", "res1.conv2.bias", "res1.gn2.weight", "res1.gn2.bias",
      "down.conv1.weight", "down.conv1.bias", "down.conv2.weight", "down.conv2.bias",
      "down.shortcut.weight", "down.shortcut.bias", "fc1.weight", "fc1.bias"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(plan[3].name, "res1");
  EXPECT_EQ(plan[3].output, (Shape{8, 9, 9}));
  EXPECT_EQ(plan[5].output, (Shape{16, 5, 5})) << "9 -> 5 with stride 2 and padding 1; the shortcut likewise";
  const auto refused = [&](const std::string& text, const ModelInput& input, const std::string& says) {
    Result<ModelSpec> s = parse(text);
    if (!s.is_ok()) {
      EXPECT_NE(s.status().message().find(says), std::string::npos) << s.status().message();
      return;
    }
    auto m = build_model(*s, 1, input);
    ASSERT_FALSE(m.is_ok()) << text;
    EXPECT_NE(m.status().message().find(says), std::string::npos) << m.status().message();
  };
  const ModelInput images{0, {3, 8, 8}, 10, false};
  refused(R"(layers = [{ type = "residual", layers = [{ type = "flatten" }] }, { type = "linear" }])", images,
          "layer 1 (residual): its body turns (3, 8, 8) into (192)");
  refused(R"(layers = [{ type = "residual", layers = [{ type = "residual", layers = [{ type = "relu" }] }] }])", images,
          "a residual block inside a residual block");
  refused(R"(layers = [{ type = "residual", layers = [{ type = "conv2d", out = 4, kernel = 9, padding = 0 }] }])",
          images, "layer 1 (residual), layer 1 (conv2d) takes images of at least 9x9");
  refused(R"(layers = [{ type = "groupnorm", groups = 2 }, { type = "flatten" }, { type = "linear" }])", images,
          "2 groups: channels (the first dimension) divisible by them");
  refused(R"(layers = [{ type = "groupnorm" }])", images, "needs groups");
  refused(R"(layers = [{ type = "residual" }])", images, "layers must be a list");
}

TEST_F(ModelSpecs, ASpecWrittenAsAFileReadsBackToTheSameSpec) {
  std::vector<ModelSpec> specs = {*preset_model_spec("mlp"), *preset_model_spec("cnn"), *preset_model_spec("gpt2")};
  Result<ModelSpec> every = parse(R"(name = "every-layer"
layers = [
  { type = "conv2d", out = 8, kernel = 5, stride = 2, padding = 0, name = "stem" },
  { type = "groupnorm", groups = 4 }, { type = "silu" }, { type = "dropout", p = 0.1 }, { type = "dropout" },
  { type = "residual", name = "block", layers = [{ type = "conv2d", out = 8 }, { type = "gelu" }] },
  { type = "avgpool", size = 3, stride = 1 }, { type = "maxpool" }, { type = "global_avgpool" },
  { type = "layernorm", name = "norm" }, { type = "linear", out = 7 }, { type = "relu" }, { type = "linear" },
])");
  ASSERT_TRUE(every.is_ok()) << every.status().to_string();
  specs.push_back(*every);
  for (const ModelSpec& spec : specs) {
    Result<ModelSpec> again = parse(spec.to_toml());
    ASSERT_TRUE(again.is_ok()) << spec.to_toml() << again.status().to_string();
    EXPECT_EQ(again->canonical(), spec.canonical()) << spec.to_toml();
    EXPECT_EQ(again->name, spec.name);
  }
}

TEST_F(ModelSpecs, TheCanonicalTextSpellsOutEveryDefault) {
  Result<ModelSpec> a = parse(R"(layers = [{ type = "conv2d", out = 4 }, { type = "flatten" }, { type = "linear" }])");
  Result<ModelSpec> b = parse(R"(layers = [
    { type = "conv2d", out = 4, kernel = 3, stride = 1, padding = 1 }, { type = "flatten" }, { type = "linear" }])");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(a->canonical(), b->canonical());
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  Result<ModelSpec> c = parse(R"(layers = [{ type = "conv2d", out = 4, padding = 0 }, { type = "flatten" }, { type = "linear" }])");
  EXPECT_NE(a->fingerprint(), c->fingerprint()) << "another padding is another model";
}

// A spec model trains like a built-in one: its gradients against finite
// differences (overlapping average pooling windows and global pooling
// among its layers).
TEST_F(ModelSpecs, ASpecModelsGradientsMatchFiniteDifferences) {
  Result<ModelSpec> spec = parse(R"(layers = [
    { type = "conv2d", out = 4 }, { type = "groupnorm", groups = 2 }, { type = "silu" },
    { type = "residual", layers = [{ type = "conv2d", out = 4 }, { type = "gelu" }] },
    { type = "residual", layers = [{ type = "conv2d", out = 6, stride = 2 }] },
    { type = "avgpool", size = 2, stride = 1 }, { type = "global_avgpool" },
    { type = "layernorm" }, { type = "linear", out = 6 }, { type = "gelu" }, { type = "linear" }])");
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  auto model = build_model(*spec, 21, ModelInput{0, {2, 6, 6}, 4, false});
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  Rng rng(22);
  fedmesh::testing::expect_model_gradients_match("spec", **model, fedmesh::testing::random_tensor({3, 2, 6, 6}, rng),
                                                 {1, 3, 0}, rng);
}

}  // namespace
}  // namespace fedmesh::train
