// libFuzzer target for csv:FILE tables, fedmesh::train::data::parse_table
// (the whole of load_table after the files are read). How to build and run
// it: tests/fuzz/README.md.
//
// Input layout (every byte string is a valid input):
//   byte 0     flags: bits 0-1 data.missing (0 refuse, 1 mean, 2 zero, 3 refuse),
//              bit 2 normalize "none" (else "standard"), bit 3 a test file,
//              bit 4 column "c" categorical with categories a, b, NA,
//              bit 5 classes 0, 1, 2 given (else taken from the file),
//              bit 6 drop column "id", bit 7 row limits (train 3, test 2)
//   bytes 1-2  where the test file starts, big-endian u16, clamped to what
//              follows (with bit 3; otherwise ignored)
//   byte 3     seed, and test_fraction = (1 + byte % 9) / 10; bit 7 also
//              data.task = "regression" (the label a real-valued target)
//   rest       the table (label column "y"), then the test file
// For every input the result must be
//   - accepted: train and test non-empty, sample_shape {features} with
//     features > 0, a one-line canonical text, every value of every batch
//     finite and every target a class id (regression: no class ids, one
//     finite value per sample, classes 1); or
//   - refused: kCorrupt or kInvalidArgument with a message that begins with
//     one of the two paths and holds no control character.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "train/data/table.h"

namespace {

using fedmesh::Result;
using fedmesh::StatusCode;
using namespace fedmesh::train::data;

constexpr size_t kInputHeaderBytes = 4;
const std::string kPath = "fuzz.csv", kTestPath = "fuzz_test.csv";

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_table: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

void check_split(const Dataset& dataset, int64_t features, int64_t classes, bool regression, const char* name) {
  if (dataset.size() < 1) violated(std::string(name) + " split is empty");
  std::vector<int64_t> indices(static_cast<size_t>(dataset.size()));
  std::iota(indices.begin(), indices.end(), 0);
  fedmesh::Tensor inputs;
  std::vector<int32_t> targets;
  dataset.make_batch(indices, fedmesh::DType::kF32, inputs, targets);
  if (inputs.shape() != fedmesh::Shape{dataset.size(), features}) violated(std::string(name) + " batch shape");
  for (int64_t i = 0; i < inputs.numel(); ++i) {
    if (!std::isfinite(inputs.data<float>()[i])) violated(std::string(name) + " holds a value that is not finite");
  }
  for (const int32_t target : targets) {
    if (target < 0 || target >= classes) violated(std::string(name) + " holds a target that is not a class id");
  }
  if (dataset.regression() != regression) violated(std::string(name) + " is not of the task asked for");
  std::vector<float> values;
  dataset.batch_values(indices, values);
  if (regression) {
    if (!targets.empty()) violated(std::string(name) + " gives class ids for regression");
    if (values.size() != indices.size()) violated(std::string(name) + " gives a value count other than its size");
    for (const float v : values) {
      if (!std::isfinite(v)) violated(std::string(name) + " holds a target value that is not finite");
    }
    if (!(dataset.target_scale() > 0.0) || !std::isfinite(dataset.target_scale())) violated("target scale");
  } else if (!values.empty()) {
    violated(std::string(name) + " gives target values for classification");
  }
  dataset.make_batch(indices, fedmesh::DType::kBF16, inputs, targets);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kInputHeaderBytes) return -1;  // not added to the corpus
  const uint8_t flags = data[0];
  const std::string_view rest(reinterpret_cast<const char*>(data) + kInputHeaderBytes, size - kInputHeaderBytes);
  TableSpec spec;
  spec.path = kPath;
  spec.label = "y";
  spec.missing = (flags & 3) == 1 ? "mean" : (flags & 3) == 2 ? "zero" : "refuse";
  spec.normalize = (flags & 4) ? "none" : "standard";
  std::string_view text = rest, test_text;
  if (flags & 8) {
    const size_t split = std::min<size_t>((size_t{data[1]} << 8) | data[2], rest.size());
    text = rest.substr(0, split);
    test_text = rest.substr(split);
    spec.test_path = kTestPath;
  }
  if (flags & 16) spec.categories["c"] = {"a", "b", "NA"};
  if (flags & 32) spec.classes = {"0", "1", "2"};
  if (flags & 64) spec.drop = {"id"};
  if (flags & 128) {
    spec.train_limit = 3;
    spec.test_limit = 2;
  }
  spec.seed = data[3];
  spec.regression = (data[3] & 0x80) != 0;
  spec.test_fraction = (1 + data[3] % 9) / 10.0;

  Result<LoadedData> got = parse_table(text, spec, test_text);
  if (got.is_ok()) {
    const LoadedData& loaded = got.value();
    const DataSchema& schema = loaded.schema;
    if (schema.sample_shape.size() != 1 || schema.sample_shape[0] < 1) violated("sample shape is not {features}");
    if (schema.classes < 1) violated("no classes");
    if (schema.regression != spec.regression || (spec.regression && schema.classes != 1)) violated("regression schema");
    if (!spec.classes.empty() && schema.classes != 3) violated("classes differ from the spec's");
    if (!schema.canonical.starts_with("table v1 ")) violated("canonical text does not start with its format");
    for (const char c : schema.canonical) {
      if (static_cast<unsigned char>(c) < 0x20) violated("canonical text holds a control character");
    }
    if (loaded.train == nullptr || loaded.test == nullptr) violated("a split is missing");
    check_split(*loaded.train, schema.sample_shape[0], schema.classes, spec.regression, "train");
    check_split(*loaded.test, schema.sample_shape[0], schema.classes, spec.regression, "test");
    if (spec.train_limit > 0 && loaded.train->size() > spec.train_limit) violated("train limit ignored");
    if (spec.test_limit > 0 && loaded.test->size() > spec.test_limit) violated("test limit ignored");
    return 0;
  }
  const StatusCode code = got.status().code();
  const std::string& message = got.status().message();
  if (code != StatusCode::kCorrupt && code != StatusCode::kInvalidArgument) {
    violated("refused with an unexpected code: " + got.status().to_string());
  }
  if (!message.starts_with(kPath + ": ") && !message.starts_with(kTestPath + ": ")) {
    violated("message names neither file: '" + message + "'");
  }
  for (const char c : message) {
    if (static_cast<unsigned char>(c) < 0x20) violated("message holds a control character: '" + message + "'");
  }
  return 0;
}
