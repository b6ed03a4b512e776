// arrays:FILE: x and y read from .npy/.npz (stored and deflated members, the
// zip64 sizes NumPy writes) and safetensors bytes made here; the split, the
// class ids, standardization, the schema; and every flaw refused naming the
// file and the array.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "train/data/arrays.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

template <class T>
void append(Bytes& out, T value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

// A version-1 .npy of `values` (raw little-endian bytes) with this descr and shape.
Bytes npy(const std::string& descr, const std::string& shape, const Bytes& values, bool fortran = false) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                       ", 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  Bytes out = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  append<uint16_t>(out, static_cast<uint16_t>(header.size()));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), values.begin(), values.end());
  return out;
}

// A zip of the members, each stored or deflated, with the zip64 extra field
// NumPy's writer adds.
Bytes zip(const std::vector<std::pair<std::string, Bytes>>& members, bool deflated) {
  Bytes out;
  for (const auto& [name, body] : members) {
    Bytes data = body;
    if (deflated) {
      z_stream z{};
      deflateInit2(&z, 6, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
      data.resize(deflateBound(&z, static_cast<uLong>(body.size())));
      z.next_in = const_cast<Bytef*>(body.data());
      z.avail_in = static_cast<uInt>(body.size());
      z.next_out = data.data();
      z.avail_out = static_cast<uInt>(data.size());
      deflate(&z, Z_FINISH);
      data.resize(z.total_out);
      deflateEnd(&z);
    }
    append<uint32_t>(out, 0x04034b50);
    append<uint16_t>(out, 20);
    append<uint16_t>(out, 0);
    append<uint16_t>(out, deflated ? 8 : 0);
    append<uint32_t>(out, 0);
    append<uint32_t>(out, static_cast<uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size()))));
    append<uint32_t>(out, 0xFFFFFFFFu);  // the real sizes are in the zip64 field
    append<uint32_t>(out, 0xFFFFFFFFu);
    append<uint16_t>(out, static_cast<uint16_t>(name.size()));
    append<uint16_t>(out, 20);
    out.insert(out.end(), name.begin(), name.end());
    append<uint16_t>(out, 1);
    append<uint16_t>(out, 16);
    append<uint64_t>(out, body.size());
    append<uint64_t>(out, data.size());
    out.insert(out.end(), data.begin(), data.end());
  }
  append<uint32_t>(out, 0x02014b50);  // where a central directory would begin
  return out;
}

Bytes floats(const std::vector<float>& v) {
  Bytes out;
  for (float f : v) append(out, f);
  return out;
}
Bytes longs(const std::vector<int64_t>& v) {
  Bytes out;
  for (int64_t i : v) append(out, i);
  return out;
}

class ArraysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-arrays-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const Bytes& bytes) {
    std::ofstream(dir_ / name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                      static_cast<std::streamsize>(bytes.size()));
    return (dir_ / name).string();
  }
  fs::path dir_;
};

// 10 rows of 2 features: x = (i, 10 i), y = i % 2.
Bytes ten_rows_x() {
  std::vector<float> v;
  for (int i = 0; i < 10; ++i) v.insert(v.end(), {static_cast<float>(i), static_cast<float>(10 * i)});
  return npy("<f4", "(10, 2)", floats(v));
}
Bytes ten_rows_y() { return npy("<i8", "(10,)", longs({0, 1, 0, 1, 0, 1, 0, 1, 0, 1})); }

TEST_F(ArraysTest, StoredAndDeflatedNpzReadTheSame) {
  for (const bool deflated : {false, true}) {
    ArraysSpec spec;
    spec.path = write(deflated ? "d.npz" : "s.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", ten_rows_y()}}, deflated));
    spec.normalize = "none";
    spec.test_fraction = 0.3;
    Result<LoadedData> loaded = load_arrays(spec);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->train->size(), 7);
    EXPECT_EQ(loaded->test->size(), 3);
    EXPECT_EQ(loaded->schema.sample_shape, (Shape{2}));
    EXPECT_EQ(loaded->schema.classes, 2);
    Tensor inputs;
    std::vector<int32_t> targets;
    std::vector<int64_t> all = {0, 1, 2, 3, 4, 5, 6};
    loaded->train->make_batch(all, DType::kF32, inputs, targets);
    ASSERT_EQ(inputs.shape(), (Shape{7, 2}));
    for (int64_t i = 0; i < 7; ++i) {
      const float row = inputs.data<float>()[2 * i];
      EXPECT_EQ(inputs.data<float>()[2 * i + 1], 10 * row) << "x = (i, 10 i)";
      EXPECT_EQ(targets[static_cast<size_t>(i)], static_cast<int32_t>(row) % 2) << "y follows its row";
    }
  }
}

TEST_F(ArraysTest, SplitStandardizationAndSchema) {
  ArraysSpec spec;
  spec.path = write("a.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", ten_rows_y()}}, false));
  spec.test_fraction = 0.2;
  spec.seed = 3;
  Result<LoadedData> one = load_arrays(spec), again = load_arrays(spec);
  ASSERT_TRUE(one.is_ok() && again.is_ok());
  Tensor a, b;
  std::vector<int32_t> ta, tb;
  std::vector<int64_t> rows(8);
  for (int64_t i = 0; i < 8; ++i) rows[static_cast<size_t>(i)] = i;
  one->train->make_batch(rows, DType::kF32, a, ta);
  again->train->make_batch(rows, DType::kF32, b, tb);
  EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), 16 * sizeof(float)), 0) << "the seed fixes the split";
  double sum = 0, squares = 0;
  for (int64_t i = 0; i < 8; ++i) {
    sum += a.data<float>()[2 * i];
    squares += a.data<float>()[2 * i] * a.data<float>()[2 * i];
  }
  EXPECT_NEAR(sum / 8, 0.0, 1e-5) << "standardized on the training rows";
  EXPECT_NEAR(squares / 8, 1.0, 1e-4);
  spec.classes = {"even", "odd"};
  Result<LoadedData> named = load_arrays(spec);
  ASSERT_TRUE(named.is_ok());
  EXPECT_NE(named->schema.fingerprint(), one->schema.fingerprint()) << "class names are part of the schema";
  EXPECT_NE(named->schema.canonical.find("\"odd\""), std::string::npos) << named->schema.canonical;
}

TEST_F(ArraysTest, SafetensorsAndATestFile) {
  // safetensors: x (4, 1, 2, 2) uint8 and y (4) int32.
  const std::string header =
      "{\"x\":{\"dtype\":\"U8\",\"shape\":[4,1,2,2],\"data_offsets\":[0,16]},"
      "\"y\":{\"dtype\":\"I32\",\"shape\":[4],\"data_offsets\":[16,32]},\"__metadata__\":{\"by\":\"test\"}}";
  Bytes file;
  append<uint64_t>(file, header.size());
  file.insert(file.end(), header.begin(), header.end());
  for (int i = 0; i < 16; ++i) file.push_back(static_cast<uint8_t>(i * 10));
  for (int32_t label : {0, 1, 2, 1}) append(file, label);
  ArraysSpec spec;
  spec.path = write("train.safetensors", file);
  spec.test_path = spec.path;
  spec.normalize = "none";
  Result<LoadedData> loaded = load_arrays(spec);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->schema.sample_shape, (Shape{1, 2, 2})) << "images keep their shape";
  EXPECT_EQ(loaded->schema.classes, 3);
  EXPECT_EQ(loaded->train->size(), 4);
  EXPECT_EQ(loaded->test->size(), 4);
  Tensor inputs;
  std::vector<int32_t> targets;
  std::vector<int64_t> second = {1};
  loaded->test->make_batch(second, DType::kF32, inputs, targets);
  EXPECT_EQ(inputs.shape(), (Shape{1, 1, 2, 2}));
  EXPECT_EQ(inputs.data<float>()[0], 40.0f);
  EXPECT_EQ(targets[0], 1);
}

// Regression: y of any numeric type is the target, standardized by the
// training rows' mean and std; floats in y without it, classes with it,
// and a target that is not finite are refused.
TEST_F(ArraysTest, ARegressionTargetInYIsStandardized) {
  std::vector<float> targets;
  for (int i = 0; i < 10; ++i) targets.push_back(2.5f * static_cast<float>(i) + 1.0f);
  ArraysSpec spec;
  spec.path = write("r.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", npy("<f4", "(10,)", floats(targets))}}, true));
  spec.test_path = spec.path;  // every row in both: the statistics are the whole file's
  spec.regression = true;
  Result<LoadedData> loaded = load_arrays(spec);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_TRUE(loaded->schema.regression);
  EXPECT_EQ(loaded->schema.classes, 1);
  EXPECT_NE(loaded->schema.canonical.find("task=regression"), std::string::npos) << loaded->schema.canonical;
  ASSERT_TRUE(loaded->train->regression());
  const double mean = 2.5 * 4.5 + 1.0, deviation = 2.5 * std::sqrt(8.25);  // population std of 0..9 is sqrt(8.25)
  EXPECT_NEAR(loaded->train->target_scale(), deviation, 1e-5);
  std::vector<float> values;
  const std::vector<int64_t> rows = {0, 9};
  loaded->train->batch_values(rows, values);
  ASSERT_EQ(values.size(), 2u);
  EXPECT_NEAR(values[0], (1.0 - mean) / deviation, 1e-5);
  EXPECT_NEAR(values[1], (23.5 - mean) / deviation, 1e-5);
  Tensor inputs;
  std::vector<int32_t> ids = {3};
  loaded->train->make_batch(rows, DType::kF32, inputs, ids);
  EXPECT_TRUE(ids.empty()) << "a regression batch has no class ids";

  ArraysSpec classify = spec;
  classify.regression = false;
  Result<LoadedData> floats_as_ids = load_arrays(classify);
  ASSERT_FALSE(floats_as_ids.is_ok());
  EXPECT_NE(floats_as_ids.status().message().find("regression"), std::string::npos) << floats_as_ids.status().message();
  ArraysSpec with_classes = spec;
  with_classes.classes = {"a", "b"};
  EXPECT_FALSE(load_arrays(with_classes).is_ok());
  targets[4] = std::numeric_limits<float>::infinity();
  ArraysSpec infinite = spec;
  infinite.path = infinite.test_path =
      write("inf.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", npy("<f4", "(10,)", floats(targets))}}, false));
  Result<LoadedData> refused = load_arrays(infinite);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("y[4]"), std::string::npos) << refused.status().message();
}

TEST_F(ArraysTest, FlawsAreRefusedNamingTheFileAndArray) {
  const auto refused = [&](const std::string& name, const Bytes& bytes, const std::string& says) {
    ArraysSpec spec;
    spec.path = write(name, bytes);
    Result<LoadedData> loaded = load_arrays(spec);
    ASSERT_FALSE(loaded.is_ok()) << name;
    EXPECT_NE(loaded.status().message().find(name), std::string::npos) << loaded.status().message();
    EXPECT_NE(loaded.status().message().find(says), std::string::npos) << loaded.status().message();
  };
  refused("text.npz", Bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'}, "neither");
  refused("only_x.npz", zip({{"x.npy", ten_rows_x()}}, false), "'y'");
  refused("short.npz", zip({{"x.npy", npy("<f4", "(10, 2)", floats({1, 2, 3}))}, {"y.npy", ten_rows_y()}}, false),
          "needs more bytes");
  refused("fortran.npz", zip({{"x.npy", npy("<f4", "(10, 2)", floats(std::vector<float>(20)), true)}, {"y.npy", ten_rows_y()}}, false),
          "Fortran");
  refused("bigendian.npz", zip({{"x.npy", npy(">f4", "(10, 2)", floats(std::vector<float>(20)))}, {"y.npy", ten_rows_y()}}, false),
          "element type");
  refused("rows.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", npy("<i8", "(9,)", longs(std::vector<int64_t>(9)))}}, false),
          "one class id per row");
  refused("negative.npz", zip({{"x.npy", ten_rows_x()}, {"y.npy", npy("<i8", "(10,)", longs({0, 1, 0, 1, -3, 1, 0, 1, 0, 1}))}}, false),
          "y[4]");
  Bytes cut = zip({{"x.npy", ten_rows_x()}, {"y.npy", ten_rows_y()}}, true);
  cut.resize(cut.size() / 2);
  refused("cut.npz", cut, "not a readable .npz");
  // A deflated member that claims 8 GiB from a few hundred bytes is refused before anything is allocated.
  Bytes lying = zip({{"x.npy", ten_rows_x()}, {"y.npy", ten_rows_y()}}, true);
  const uint64_t huge = uint64_t{1} << 33;
  std::memcpy(lying.data() + 30 + 5 + 4, &huge, sizeof huge);  // the first member's zip64 size
  refused("lying.npz", lying, "claims 8589934592 bytes");
  Bytes bad_offsets;
  const std::string header = "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,400]}}";
  append<uint64_t>(bad_offsets, header.size());
  bad_offsets.insert(bad_offsets.end(), header.begin(), header.end());
  refused("offsets.safetensors", bad_offsets, "data_offsets");
  Bytes half;
  const std::string half_header = "{\"x\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}";
  append<uint64_t>(half, half_header.size());
  half.insert(half.end(), half_header.begin(), half_header.end());
  half.insert(half.end(), {0, 0});
  refused("half.safetensors", half, "F16");
}

}  // namespace
}  // namespace fedmesh::train::data
