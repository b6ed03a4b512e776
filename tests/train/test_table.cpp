// csv:FILE tables (train/data/table.h): parsing, encoding, the split, the
// schema two sites compare, every refusal naming file, row and column, and
// a generated separable table that the trainer learns.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "base/file_io.h"
#include "base/random.h"
#include "train/data/table.h"
#include "train/layers/layers.h"
#include "train/trainer.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

class TableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-table-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const fs::path file = dir_ / name;
    std::ofstream out(file, std::ios::binary);
    out << text;
    return file.string();
  }

  TableSpec spec(const std::string& name, const std::string& text) {
    TableSpec s;
    s.path = write(name, text);
    s.label = "y";
    return s;
  }

  fs::path dir_;
};

const TableSet& set_of(const std::unique_ptr<Dataset>& dataset) { return static_cast<const TableSet&>(*dataset); }

// Every sample of a split, as floats (rows, features).
std::vector<float> all_values(const Dataset& dataset, std::vector<int32_t>& targets) {
  std::vector<int64_t> indices(static_cast<size_t>(dataset.size()));
  std::iota(indices.begin(), indices.end(), 0);
  Tensor inputs;
  dataset.make_batch(indices, DType::kF32, inputs, targets);
  return {inputs.data<float>(), inputs.data<float>() + inputs.numel()};
}

// A status refused with `code` whose message holds every one of `parts`.
void expect_refused(const Result<LoadedData>& got, StatusCode code, const std::vector<std::string>& parts) {
  ASSERT_FALSE(got.is_ok()) << "accepted, expected a refusal naming " << parts[0];
  EXPECT_EQ(got.status().code(), code) << got.status().to_string();
  for (const std::string& part : parts) {
    EXPECT_NE(got.status().message().find(part), std::string::npos)
        << "'" << got.status().message() << "' does not name " << part;
  }
}

TEST_F(TableTest, ParsesQuotesCrlfAndBom) {
  // Quoted separators, "" escapes, a quoted line end, CRLF, a BOM, an empty
  // line, spaces around unquoted fields. Test rows are all of b.csv.
  TableSpec s = spec("a.csv",
                     "\xEF\xBB\xBF" "y,\"x, one\",note,c\r\n"
                     "\"p\",1.5,\"say \"\"hi\"\"\",u\r\n"
                     "\r\n"
                     "q , -2 ,\"two\r\nlines\",v\r\n");
  s.test_path = write("b.csv", "y,\"x, one\",note,c\nq,+3e0,x,u");  // no final line end
  s.drop = {"note"};
  s.categories = {{"c", {"u", "v"}}};
  s.normalize = "none";
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const LoadedData& data = got.value();
  EXPECT_EQ(data.schema.sample_shape, (Shape{3}));
  EXPECT_EQ(data.schema.classes, 2);
  std::vector<int32_t> targets;
  EXPECT_EQ(all_values(*data.train, targets), (std::vector<float>{1.5f, 1, 0, -2.0f, 0, 1}));
  EXPECT_EQ(targets, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(all_values(*data.test, targets), (std::vector<float>{3.0f, 1, 0}));
  EXPECT_EQ(targets, (std::vector<int32_t>{1}));
  EXPECT_NE(data.schema.canonical.find("\"x, one\":num"), std::string::npos) << data.schema.canonical;
  EXPECT_EQ(data.description, "2 rows of a.csv (1 test rows of b.csv), 3 features, 2 classes");

  // Row numbers are lines: after a quoted line end in row 3 the next record
  // begins on line 5.
  TableSpec bad = spec("c.csv", "y,x,n\r\n0,1,a\r\n1,2,\"a\r\nb\"\r\n1,oops,c\r\n");
  bad.drop = {"n"};
  expect_refused(load_table(bad), StatusCode::kCorrupt, {bad.path, "row 5", "'x'", "'oops'", "not a finite number"});
}

TEST_F(TableTest, OneHotBlocksStandInHeaderOrder) {
  TableSpec s = spec("t.csv",
                     "id,color,a,y,size,b\n"
                     "1,red,1,0,S,10\n"
                     "2,blue,2,1,L,20\n"
                     "3,green,3,0,M,30\n"
                     "4,red,4,1,S,40\n");
  s.drop = {"id"};
  s.categories = {{"color", {"red", "green", "blue"}}, {"size", {"S", "M", "L"}}};
  s.normalize = "none";
  s.test_fraction = 0.25;
  Result<LoadedData> got = parse_table(read_file_bounded(s.path, 1 << 20).value(), s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const LoadedData& data = got.value();
  ASSERT_EQ(data.schema.sample_shape, (Shape{8}));
  EXPECT_EQ(data.schema.canonical,
            "table v1 features=[\"color\":cat[\"red\",\"green\",\"blue\"],\"a\":num,\"size\":cat[\"S\",\"M\",\"L\"],"
            "\"b\":num] label=\"y\" classes=[\"0\",\"1\"] normalize=none missing=refuse");
  // Every row, wherever the split put it, encodes as color(3) a size(3) b.
  const std::vector<std::vector<float>> expected = {
      {1, 0, 0, 1, 1, 0, 0, 10}, {0, 0, 1, 2, 0, 0, 1, 20}, {0, 1, 0, 3, 0, 1, 0, 30}, {1, 0, 0, 4, 1, 0, 0, 40}};
  for (const auto* split : {&data.train, &data.test}) {
    const TableSet& set = set_of(*split);
    for (int64_t i = 0; i < set.size(); ++i) {
      const std::vector<float> row(set.values().begin() + i * 8, set.values().begin() + (i + 1) * 8);
      const int a = static_cast<int>(row[3]);
      ASSERT_GE(a, 1);
      ASSERT_LE(a, 4);
      EXPECT_EQ(row, expected[static_cast<size_t>(a - 1)]);
      EXPECT_EQ(set.targets()[static_cast<size_t>(i)], (a - 1) % 2);
    }
  }
}

TEST_F(TableTest, StandardizesWithTheTrainingRows) {
  std::string text = "y,a,b,k,c\n";
  Rng rng(3);
  for (int i = 0; i < 200; ++i) {
    text += std::to_string(i % 3) + "," + std::to_string(rng.uniform() * 100.0 - 7.0) + "," +
            std::to_string(rng.normal() * 0.01 + 5.0) + ",42," + (i % 2 ? "on" : "off") + "\n";
  }
  TableSpec s = spec("s.csv", text);
  s.categories = {{"c", {"off", "on"}}};
  s.seed = 9;
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const TableSet& train = set_of(got.value().train);
  ASSERT_EQ(train.features(), 5);
  ASSERT_EQ(train.size(), 160);
  ASSERT_EQ(got.value().test->size(), 40);
  for (int64_t f = 0; f < 3; ++f) {
    double sum = 0, squares = 0;
    for (int64_t i = 0; i < train.size(); ++i) sum += train.values()[static_cast<size_t>(i * 5 + f)];
    const double mean = sum / 160.0;
    for (int64_t i = 0; i < train.size(); ++i) {
      const double d = train.values()[static_cast<size_t>(i * 5 + f)] - mean;
      squares += d * d;
    }
    EXPECT_NEAR(mean, 0.0, 1e-5) << "feature " << f;
    // The constant column k (std 0) is divided by 1: all zeros.
    EXPECT_NEAR(std::sqrt(squares / 160.0), f == 2 ? 0.0 : 1.0, 1e-4) << "feature " << f;
  }
  // One-hot features stay 0 or 1.
  for (int64_t i = 0; i < train.size(); ++i) {
    EXPECT_EQ(train.values()[static_cast<size_t>(i * 5 + 3)] + train.values()[static_cast<size_t>(i * 5 + 4)], 1.0f);
  }
  EXPECT_EQ(train.stats().names, (std::vector<std::string>{"a", "b", "k"}));
  EXPECT_EQ(train.stats().count, (std::vector<int64_t>{160, 160, 160}));
  EXPECT_NEAR(train.stats().mean[1], 5.0, 0.01);
  EXPECT_EQ(train.stats().mean[2], 42.0);
  EXPECT_EQ(train.stats().std[2], 0.0);
  // The stats are not in the schema.
  EXPECT_EQ(got.value().schema.canonical.find("42"), std::string::npos);
  Result<TableStats> stats = table_statistics(s);
  ASSERT_TRUE(stats.is_ok());
  EXPECT_EQ(stats.value().mean, train.stats().mean);

  // bf16 batches hold the same values, rounded.
  Tensor inputs;
  std::vector<int32_t> targets;
  const std::vector<int64_t> indices = {5, 0};
  train.make_batch(indices, DType::kBF16, inputs, targets);
  EXPECT_EQ(inputs.shape(), (Shape{2, 5}));
  EXPECT_EQ(inputs.dtype(), DType::kBF16);
  EXPECT_NEAR(to_float(inputs.data<bf16>()[1]), train.values()[5 * 5 + 1], 0.02);
  EXPECT_EQ(targets, (std::vector<int32_t>{train.targets()[5], train.targets()[0]}));
}

TEST_F(TableTest, MissingValuesRefusedOrFilled) {
  const std::string text = "y,a,c\n0,1,x\n1,NA,x\n0,3,\n1,,x\n";
  TableSpec s = spec("m.csv", text);
  s.categories = {{"c", {"x"}}};
  s.normalize = "none";
  expect_refused(load_table(s), StatusCode::kCorrupt, {s.path, "row 3", "'a'", "missing"});
  s.test_path = write("m_test.csv", "y,a,c\n1,,\n");
  s.missing = "mean";
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  std::vector<int32_t> targets;
  EXPECT_EQ(all_values(*got.value().train, targets), (std::vector<float>{1, 1, 2, 1, 3, 0, 2, 1}));
  EXPECT_EQ(set_of(got.value().train).stats().count, (std::vector<int64_t>{2}));
  EXPECT_EQ(all_values(*got.value().test, targets), (std::vector<float>{2, 0}));
  s.missing = "zero";
  got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(all_values(*got.value().train, targets), (std::vector<float>{1, 1, 0, 1, 3, 0, 0, 1}));
}

TEST_F(TableTest, ClassesSortNumericallyOrFollowTheSpec) {
  TableSpec s = spec("c.csv", "x,y\n1,10\n2,9\n3,-1\n4,9\n5,10\n");
  s.normalize = "none";
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_NE(got.value().schema.canonical.find("classes=[\"-1\",\"9\",\"10\"]"), std::string::npos);
  s.classes = {"10", "9", "-1"};
  got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(got.value().schema.classes, 3);
  for (const auto* split : {&got.value().train, &got.value().test}) {
    const TableSet& set = set_of(*split);
    for (int64_t i = 0; i < set.size(); ++i) {
      // x 1..5 -> labels 10 9 -1 9 10 -> class ids 0 1 2 1 0.
      const int x = static_cast<int>(set.values()[static_cast<size_t>(i)]);
      const int32_t want[] = {0, 1, 2, 1, 0};
      EXPECT_EQ(set.targets()[static_cast<size_t>(i)], want[x - 1]) << "x " << x;
    }
  }
  TableSpec words = spec("w.csv", "x,y\n1,dog\n2,cat\n3,ant\n");
  got = load_table(words);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_NE(got.value().schema.canonical.find("classes=[\"ant\",\"cat\",\"dog\"]"), std::string::npos);
}

TEST_F(TableTest, SplitSizesAndSeeds) {
  std::string text = "y,x\n";
  for (int i = 0; i < 569; ++i) text += std::to_string(i % 2) + "," + std::to_string(i) + "\n";
  TableSpec s = spec("breast_cancer.csv", text);
  s.normalize = "none";
  const auto rows_of = [](const Dataset& d) {
    std::vector<int32_t> targets;
    return all_values(d, targets);
  };
  Result<LoadedData> a = load_table(s);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a.value().train->size(), 455);
  EXPECT_EQ(a.value().test->size(), 114);
  EXPECT_EQ(a.value().description, "455 rows of breast_cancer.csv (114 test), 1 features, 2 classes");
  std::vector<float> train = rows_of(*a.value().train), test = rows_of(*a.value().test);
  std::vector<float> all = train;
  all.insert(all.end(), test.begin(), test.end());
  std::sort(all.begin(), all.end());
  for (int i = 0; i < 569; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], static_cast<float>(i)) << "rows lost or doubled";
  EXPECT_TRUE(std::is_sorted(train.begin(), train.end())) << "file order kept";

  Result<LoadedData> same = load_table(s);
  EXPECT_EQ(rows_of(*same.value().test), test);
  s.seed = 1;
  Result<LoadedData> other = load_table(s);
  EXPECT_EQ(other.value().test->size(), 114);
  EXPECT_NE(rows_of(*other.value().test), test);
  EXPECT_EQ(other.value().schema.fingerprint(), a.value().schema.fingerprint()) << "the seed is not in the schema";

  s.train_limit = 100;
  s.test_limit = 7;
  s.test_fraction = 0.5;
  Result<LoadedData> limited = load_table(s);
  EXPECT_EQ(limited.value().train->size(), 100);
  EXPECT_EQ(limited.value().test->size(), 7);
}

TEST_F(TableTest, SitesWithTheSameColumnsShareTheFingerprint) {
  TableSpec a = spec("site_a.csv", "id,y,x,c\n1,0,0.5,r\n2,1,7,g\n3,0,1,r\n");
  TableSpec b = spec("site_b.csv", "id,y,x,c\n10,1,-3,g\n11,0,100,g\n12,1,4,r\n13,1,2,g\n");
  for (TableSpec* s : {&a, &b}) {
    s->drop = {"id"};
    s->classes = {"0", "1"};
    s->categories = {{"c", {"r", "g"}}};
  }
  Result<LoadedData> ga = load_table(a), gb = load_table(b);
  ASSERT_TRUE(ga.is_ok() && gb.is_ok());
  EXPECT_EQ(ga.value().schema.canonical, gb.value().schema.canonical);
  EXPECT_EQ(ga.value().schema.fingerprint(), gb.value().schema.fingerprint());
  EXPECT_EQ(ga.value().schema.fingerprint().rfind("fnv1a64:", 0), 0u);

  b.categories = {{"c", {"g", "r"}}};  // same values, another order: another encoding
  gb = load_table(b);
  ASSERT_TRUE(gb.is_ok());
  EXPECT_NE(ga.value().schema.fingerprint(), gb.value().schema.fingerprint());
  b.categories = {{"c", {"r", "g", "b"}}};
  gb = load_table(b);
  EXPECT_NE(ga.value().schema.fingerprint(), gb.value().schema.fingerprint());
  b.categories = {{"c", {"r", "g"}}};
  b.missing = "mean";
  gb = load_table(b);
  EXPECT_NE(ga.value().schema.fingerprint(), gb.value().schema.fingerprint());
  b.missing = "refuse";
  b.normalize = "none";
  gb = load_table(b);
  EXPECT_NE(ga.value().schema.fingerprint(), gb.value().schema.fingerprint());
}

TEST_F(TableTest, RefusalsNameFileRowAndColumn) {
  const auto refused = [&](const std::string& text, StatusCode code, std::vector<std::string> parts,
                           const std::function<void(TableSpec&)>& adjust = {}) {
    TableSpec s = spec("bad.csv", text);
    s.categories = {{"c", {"r", "g"}}};
    if (adjust) adjust(s);
    parts.insert(parts.begin(), s.path);
    SCOPED_TRACE(text);
    expect_refused(load_table(s), code, parts);
  };
  const std::string header = "y,x,c\n";
  refused(header + "0,1,r\n1,2\n", StatusCode::kCorrupt, {"row 3", "2 fields", "header has 3"});
  refused(header + "0,1,r\n1,2,r,9\n", StatusCode::kCorrupt, {"row 3", "4 fields"});
  refused(header + "0,1,r\n1,abc,g\n", StatusCode::kCorrupt, {"row 3", "'x'", "'abc'", "data.categories"});
  refused(header + "0,1,r\n1,1e999,g\n", StatusCode::kCorrupt, {"row 3", "'x'", "'1e999'"});
  refused(header + "0,1,r\n1,3,blue\n", StatusCode::kCorrupt, {"row 3", "'c'", "'blue'", "'r', 'g'"});
  refused(header + "0,1,\n", StatusCode::kCorrupt, {"row 2", "'c'", "missing"});
  refused(header, StatusCode::kCorrupt, {"no data rows"});
  refused("", StatusCode::kCorrupt, {"empty"});
  refused("\xEF\xBB\xBF\r\n\r\n", StatusCode::kCorrupt, {"empty"});
  refused(header + "0,1,r\n1,\"2,g\n", StatusCode::kCorrupt, {"row 3", "column 'x'", "not closed"});
  refused(header + "0,\"1\"x,r\n", StatusCode::kCorrupt, {"row 2", "column 'x'", "after the closing quote"});
  refused(header + "0,1,r\n,1,r\n", StatusCode::kCorrupt, {"row 3", "'y'", "label is empty"});
  refused(header + "0,1,r\n7,1,r\n", StatusCode::kCorrupt, {"row 3", "'7'", "not one of the classes"},
          [](TableSpec& s) { s.classes = {"0", "1"}; });
  refused("a,b,c,d\n1,2,r,4\n", StatusCode::kInvalidArgument, {"label column 'y'", "'a', 'b', 'c', 'd'"});
  refused(header + "0,1,r\n", StatusCode::kInvalidArgument, {"'nope'", "not in the header"},
          [](TableSpec& s) { s.drop = {"nope"}; });
  refused(header + "0,1,r\n", StatusCode::kInvalidArgument, {"'z'", "not in the header"},
          [](TableSpec& s) { s.categories["z"] = {"1"}; });
  refused(header + "0,1,r\n", StatusCode::kInvalidArgument, {"data.label"}, [](TableSpec& s) { s.label = ""; });
  refused(header + "0,1,r\n", StatusCode::kInvalidArgument, {"data.missing"}, [](TableSpec& s) { s.missing = "drop"; });
  refused(header + "0,1,r\n", StatusCode::kInvalidArgument, {"test_fraction"},
          [](TableSpec& s) { s.test_fraction = 1.0; });
  refused(header + "0,1,r\n", StatusCode::kCorrupt, {"too few"});
  refused("y,x,x\n0,1,2\n", StatusCode::kCorrupt, {"'x' twice", "columns 2 and 3"},
          [](TableSpec& s) { s.categories.clear(); });
  refused(",y,x\n0,1,2\n", StatusCode::kCorrupt, {"column 1", "no name", "index=False"},
          [](TableSpec& s) { s.categories.clear(); });
  refused("y,c\n0,r\n", StatusCode::kInvalidArgument, {"no feature columns"},
          [](TableSpec& s) { s.drop = {"c"}; s.categories.clear(); });

  // The label column missing from a wide header: the list is cut.
  std::string wide;
  for (int i = 0; i < 50; ++i) wide += (i ? ",f" : "f") + std::to_string(i);
  refused(wide + "\n", StatusCode::kInvalidArgument, {"'f0', 'f1'", "(50 in all)"},
          [](TableSpec& s) { s.categories.clear(); });

  // Too many columns.
  std::string huge = "y";
  for (int64_t i = 0; i < kMaxTableColumns; ++i) huge += ",x" + std::to_string(i);
  refused(huge + "\n", StatusCode::kCorrupt, {"row 1", "more than 100000 fields"},
          [](TableSpec& s) { s.categories.clear(); });

  // The test file: its own name in the messages.
  TableSpec s = spec("train.csv", header + "0,1,r\n1,2,g\n");
  s.categories = {{"c", {"r", "g"}}};
  s.test_path = write("test.csv", "y,c,x\n0,r,1\n");
  expect_refused(load_table(s), StatusCode::kCorrupt, {s.test_path, "column 2 is 'c'", "header differs"});
  s.test_path = write("test.csv", header + "0,1,r\n2,1,r\n");
  expect_refused(load_table(s), StatusCode::kCorrupt, {s.test_path, "row 3", "'2'", "not one of the classes"});
  s.test_path = (dir_ / "absent.csv").string();
  expect_refused(load_table(s), StatusCode::kNotFound, {s.test_path});
}

TEST_F(TableTest, OversizedFileIsRefusedBeforeReading) {
  const std::string path = (dir_ / "big.csv").string();
  {
    std::ofstream out(path, std::ios::binary);
    out << "y,x\n";
  }
  fs::resize_file(path, static_cast<uintmax_t>(kMaxTableBytes) + 1);  // sparse: no disk used
  TableSpec s;
  s.path = path;
  s.label = "y";
  expect_refused(load_table(s), StatusCode::kCorrupt, {path, "limit"});
}

TEST_F(TableTest, LinearlySeparableTableTrains) {
  // Two classes split by a hyperplane in 4 numeric features (one with a huge
  // scale: standardization matters) and a categorical column that shifts it.
  Rng rng(11);
  const auto table = [&](int rows) {
    std::string text = "id,f0,f1,f2,f3,group,label\n";
    for (int i = 0; i < rows; ++i) {
      double f[4];
      for (double& v : f) v = rng.uniform() * 2.0 - 1.0;
      const bool group = rng.below(2) == 1;
      const double score = 1.5 * f[0] - 2.0 * f[1] + 0.5 * f[2] + (group ? 0.4 : -0.4);
      text += std::to_string(i) + "," + std::to_string(f[0]) + "," + std::to_string(f[1] * 1000.0) + "," +
              std::to_string(f[2]) + "," + std::to_string(f[3]) + "," + (group ? "b" : "a") + "," +
              (score > 0 ? "yes" : "no") + "\n";
    }
    return text;
  };
  TableSpec s;
  s.path = write("train.csv", table(1200));
  s.test_path = write("test.csv", table(400));
  s.label = "label";
  s.drop = {"id"};
  s.categories = {{"group", {"a", "b"}}};
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const LoadedData& data = got.value();
  ASSERT_EQ(data.schema.sample_shape, (Shape{6}));
  ASSERT_EQ(data.schema.classes, 2);

  Sequential model("table-linear", data.schema.sample_shape);
  auto linear = std::make_unique<Linear>("fc", 6, 2);
  Rng init(5);
  linear->initialize(init);
  model.add(std::move(linear));
  TrainOptions options;
  options.epochs = 15;
  options.batch_size = 32;
  options.lr = 0.02f;
  options.seed = 3;
  Trainer trainer(model, options);
  const TrainSummary summary = trainer.fit(*data.train, data.test.get(), {});
  EXPECT_EQ(summary.test.count, 400);
  EXPECT_GE(summary.test.accuracy, 0.95);
}

// Regression: the label column is a real-valued target, standardized by the
// training rows' mean and std (its statistics after the features'), refused
// naming row and column when it is not a number, and given no classes.
TEST_F(TableTest, ARegressionTargetIsStandardizedAndItsStatisticsComeLast) {
  TableSpec s = spec("r.csv", "a,y\n1,10\n2,20\n3,30\n4,40\n");
  s.test_path = write("r-test.csv", "a,y\n5,50\n");
  s.regression = true;
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const LoadedData& data = got.value();
  EXPECT_TRUE(data.schema.regression);
  EXPECT_EQ(data.schema.classes, 1);
  EXPECT_NE(data.schema.canonical.find("task=regression"), std::string::npos) << data.schema.canonical;
  EXPECT_NE(data.description.find("regression on 'y'"), std::string::npos) << data.description;
  const TableSet& train = set_of(data.train);
  ASSERT_TRUE(train.regression());
  ASSERT_EQ(train.stats().names, (std::vector<std::string>{"a", "y"}));
  EXPECT_DOUBLE_EQ(train.stats().mean[1], 25.0);
  const double sd = std::sqrt(125.0);  // population std of 10, 20, 30, 40
  EXPECT_NEAR(train.stats().std[1], sd, 1e-12);
  EXPECT_NEAR(train.target_scale(), sd, 1e-12);
  std::vector<float> values;
  const std::vector<int64_t> indices = {0, 3};
  train.batch_values(indices, values);
  ASSERT_EQ(values.size(), 2u);
  EXPECT_NEAR(values[0], (10.0 - 25.0) / sd, 1e-6);
  EXPECT_NEAR(values[1], (40.0 - 25.0) / sd, 1e-6);
  std::vector<int32_t> targets = {7};
  all_values(train, targets);
  EXPECT_TRUE(targets.empty()) << "a regression batch has no class ids";
  std::vector<float> test_values;
  const std::vector<int64_t> first = {0};
  data.test->batch_values(first, test_values);
  EXPECT_NEAR(test_values[0], (50.0 - 25.0) / sd, 1e-6) << "the test rows use the training rows' statistics";

  // Unstandardized: the values as written, unit 1.
  s.normalize = "none";
  Result<LoadedData> raw = load_table(s);
  ASSERT_TRUE(raw.is_ok());
  raw.value().train->batch_values(indices, values);
  EXPECT_EQ(values, (std::vector<float>{10.0f, 40.0f}));
  EXPECT_EQ(raw.value().train->target_scale(), 1.0);

  TableSpec word = spec("w.csv", "a,y\n1,10\n2,high\n");
  word.regression = true;
  expect_refused(parse_table(read_file_bounded(word.path, 1 << 20).value(), word), StatusCode::kCorrupt,
                 {"w.csv", "row 3", "'y'", "'high'", "not a finite number"});
  TableSpec empty = spec("e.csv", "a,y\n1,10\n2,\n");
  empty.regression = true;
  expect_refused(parse_table(read_file_bounded(empty.path, 1 << 20).value(), empty), StatusCode::kCorrupt,
                 {"e.csv", "row 3", "the target is missing"});
  TableSpec classes = spec("c.csv", "a,y\n1,10\n2,20\n");
  classes.regression = true;
  classes.classes = {"10", "20"};
  expect_refused(parse_table(read_file_bounded(classes.path, 1 << 20).value(), classes), StatusCode::kInvalidArgument,
                 {"data.classes", "regression"});
}

// A linear target y = 3 f0 - 2 f1 + 40 f2 + 7 + noise, with f2 on a scale
// of 1000: a linear model learns it, and evaluate()'s MAE, RMSE and R² are
// what the predictions (read back through the model, unstandardized) give.
TEST_F(TableTest, ALinearTargetIsLearnedAndItsMetricsAreInItsUnits) {
  Rng rng(17);
  const auto table = [&](int rows) {
    std::string text = "f0,f1,f2,y\n";
    for (int i = 0; i < rows; ++i) {
      const double f0 = rng.uniform() * 2 - 1, f1 = rng.uniform() * 2 - 1, f2 = (rng.uniform() * 2 - 1) * 1000;
      const double y = 3 * f0 - 2 * f1 + 0.04 * f2 + 7 + 0.1 * (rng.uniform() * 2 - 1);
      text += std::to_string(f0) + "," + std::to_string(f1) + "," + std::to_string(f2) + "," + std::to_string(y) + "\n";
    }
    return text;
  };
  TableSpec s;
  s.path = write("lin.csv", table(800));
  s.test_path = write("lin-test.csv", table(200));
  s.label = "y";
  s.regression = true;
  Result<LoadedData> got = load_table(s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const LoadedData& data = got.value();
  Sequential model("table-regression", data.schema.sample_shape);
  auto linear = std::make_unique<Linear>("fc", 3, 1);
  Rng init(5);
  linear->initialize(init);
  model.add(std::move(linear));
  TrainOptions options;
  options.epochs = 20;
  options.batch_size = 32;
  options.lr = 0.02f;
  options.weight_decay = 0.0f;
  options.seed = 3;
  Trainer trainer(model, options);
  const TrainSummary summary = trainer.fit(*data.train, data.test.get(), {});
  ASSERT_TRUE(summary.test.regression);
  EXPECT_EQ(summary.test.accuracy, 0.0);
  EXPECT_GE(summary.test.r2, 0.99);

  // The metrics by hand, from the model's predictions in the target's units.
  const TableSet& test = set_of(data.test);
  const double mean = test.stats().mean.back(), scale = test.target_scale();
  std::vector<int64_t> indices(static_cast<size_t>(test.size()));
  std::iota(indices.begin(), indices.end(), 0);
  Tensor inputs;
  std::vector<int32_t> targets;
  std::vector<float> values;
  test.make_batch(indices, DType::kF32, inputs, targets);
  test.batch_values(indices, values);
  const Tensor predictions = model.forward(inputs, /*training=*/false);
  double abs_sum = 0.0, squares = 0.0, y_sum = 0.0;
  std::vector<double> y(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    y[i] = values[i] * scale + mean;
    const double predicted = predictions.data<float>()[i] * scale + mean;
    abs_sum += std::fabs(predicted - y[i]);
    squares += (predicted - y[i]) * (predicted - y[i]);
    y_sum += y[i];
  }
  const double n = static_cast<double>(values.size()), y_mean = y_sum / n;
  double total = 0.0;
  for (const double v : y) total += (v - y_mean) * (v - y_mean);
  const EvalResult eval = trainer.evaluate(test);
  EXPECT_NEAR(eval.mae, abs_sum / n, 1e-4 * (abs_sum / n));
  EXPECT_NEAR(eval.rmse, std::sqrt(squares / n), 1e-4 * std::sqrt(squares / n));
  EXPECT_NEAR(eval.r2, 1.0 - squares / total, 1e-5);
  EXPECT_LT(eval.mae, 0.5) << "noise of at most 0.1 on a target spanning about +-50";
}

}  // namespace
}  // namespace fedmesh::train::data
