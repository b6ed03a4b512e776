// Statistics computed together: each node's sums over its training part,
// merged by adding, give exactly the mean and std of all the nodes' rows;
// read back as data.normalize = "stats:FILE" they normalize every node the
// same way and join the schema; a damaged or mismatched file is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "train/data/data_stats.h"
#include "train/data/table.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

class DataStatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-data-stats-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  DataSource table(const std::string& file, const std::string& normalize = "standard") {
    DataSource d;
    d.source = "csv:" + file;
    d.label = "y";
    d.classes = {"a", "b"};
    d.test_fraction = 0.25;
    d.normalize = normalize;
    return d;
  }
  fs::path dir_;
};

TEST_F(DataStatsTest, MergedSumsGiveTheMeanAndStdOfAllRows) {
  // Two sites whose values lie far apart: their own standardizations differ.
  const std::string a = write("a.csv", "x,z,y\n1,10,a\n2,20,b\n3,30,a\n4,40,b\n");
  const std::string b = write("b.csv", "x,z,y\n100,-5,a\n200,-6,b\n300,-7,a\n400,-8,b\n");
  Result<DataStats> sa = compute_data_stats(table(a)), sb = compute_data_stats(table(b));
  ASSERT_TRUE(sa.is_ok()) << sa.status().to_string();
  ASSERT_TRUE(sb.is_ok()) << sb.status().to_string();
  EXPECT_EQ(sa->kind, "table");
  ASSERT_EQ(sa->features.size(), 2u);
  EXPECT_EQ(sa->features[0].name, "x");
  EXPECT_EQ(sa->features[0].count, 3) << "the training part only (a quarter is held out)";
  Result<DataStats> merged = merge_data_stats({*sa, *sb});
  ASSERT_TRUE(merged.is_ok()) << merged.status().to_string();
  EXPECT_EQ(merged->parts, 2);
  // The same rows in one table: the training parts of both, as the loader splits them.
  const auto training_rows = [&](const std::string& file) {
    DataSource d = table(file, "none");
    Result<LoadedData> loaded = load_own_data(d, 0, 0);
    EXPECT_TRUE(loaded.is_ok());
    return static_cast<const TableSet&>(*loaded->train).values();
  };
  std::vector<float> all = training_rows(a);
  for (float v : training_rows(b)) all.push_back(v);
  for (size_t j = 0; j < 2; ++j) {
    double sum = 0, squares = 0;
    size_t n = 0;
    for (size_t i = j; i < all.size(); i += 2, ++n) {
      sum += all[i];
      squares += static_cast<double>(all[i]) * all[i];
    }
    const double mean = sum / static_cast<double>(n);
    EXPECT_NEAR(merged->mean()[j], mean, 1e-9);
    EXPECT_NEAR(merged->std()[j], std::sqrt(squares / static_cast<double>(n) - mean * mean), 1e-9);
  }

  // Read back by every node: the same normalization and the same schema.
  const std::string shared = (dir_ / "federation.json").string();
  ASSERT_TRUE(write_data_stats(*merged, shared).is_ok());
  Result<DataStats> reread = read_data_stats(shared);
  ASSERT_TRUE(reread.is_ok()) << reread.status().to_string();
  EXPECT_EQ(reread->digest(), merged->digest()) << "the file keeps the sums exactly";
  Result<LoadedData> la = load_own_data(table(a, "stats:" + shared), 0, 0);
  Result<LoadedData> lb = load_own_data(table(b, "stats:" + shared), 0, 0);
  ASSERT_TRUE(la.is_ok()) << la.status().to_string();
  ASSERT_TRUE(lb.is_ok()) << lb.status().to_string();
  EXPECT_EQ(la->schema.fingerprint(), lb->schema.fingerprint());
  EXPECT_NE(la->schema.canonical.find(merged->digest()), std::string::npos) << la->schema.canonical;
  const std::vector<float>& va = static_cast<const TableSet&>(*la->train).values();
  EXPECT_NEAR(va[0], (1.0 - merged->mean()[0]) / merged->std()[0], 1e-5) << "x = 1 with the shared mean and std";
  // Another statistics file is another schema.
  Result<DataStats> only_a = merge_data_stats({*sa});
  const std::string other = (dir_ / "other.json").string();
  ASSERT_TRUE(write_data_stats(*only_a, other).is_ok());
  Result<LoadedData> lo = load_own_data(table(a, "stats:" + other), 0, 0);
  ASSERT_TRUE(lo.is_ok());
  EXPECT_NE(lo->schema.fingerprint(), la->schema.fingerprint());
}

TEST_F(DataStatsTest, MismatchesAndDamagedFilesAreRefusedByName) {
  const std::string a = write("a.csv", "x,z,y\n1,10,a\n2,20,b\n3,30,a\n4,40,b\n");
  const std::string c = write("c.csv", "x,w,y\n1,10,a\n2,20,b\n3,30,a\n4,40,b\n");
  Result<DataStats> sa = compute_data_stats(table(a)), sc = compute_data_stats(table(c));
  ASSERT_TRUE(sa.is_ok() && sc.is_ok());
  Result<DataStats> merged = merge_data_stats({*sa, *sc});
  ASSERT_FALSE(merged.is_ok());
  EXPECT_NE(merged.status().message().find("'w'"), std::string::npos) << merged.status().message();
  // Statistics of other columns given to a table: refused naming both lists.
  const std::string wrong = (dir_ / "wrong.json").string();
  ASSERT_TRUE(write_data_stats(*sc, wrong).is_ok());
  Result<LoadedData> loaded = load_own_data(table(a, "stats:" + wrong), 0, 0);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_NE(loaded.status().message().find("'w'"), std::string::npos) << loaded.status().message();
  for (const std::string& text :
       {std::string("not json"), std::string("{\"format\":\"other\"}"),
        std::string("{\"format\":\"fedmesh-stats v1\",\"kind\":\"table\",\"parts\":1,\"features\":[{\"name\":\"x\","
                    "\"count\":0,\"sum\":1,\"sum_squares\":1}]}"),
        std::string("{\"format\":\"fedmesh-stats v1\",\"kind\":\"table\",\"parts\":1,\"features\":[{\"name\":\"x\"}]}")}) {
    const std::string bad = write("bad.json", text);
    Result<DataStats> read = read_data_stats(bad);
    ASSERT_FALSE(read.is_ok()) << text;
    EXPECT_NE(read.status().message().find("bad.json"), std::string::npos) << read.status().message();
    Result<LoadedData> refused = load_own_data(table(a, "stats:" + bad), 0, 0);
    EXPECT_FALSE(refused.is_ok()) << text;
  }
}

}  // namespace
}  // namespace fedmesh::train::data
