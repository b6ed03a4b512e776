#include "train/data/fashion_mnist.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

void append_be32(Bytes& out, uint32_t value) {
  out.push_back(static_cast<uint8_t>(value >> 24));
  out.push_back(static_cast<uint8_t>(value >> 16));
  out.push_back(static_cast<uint8_t>(value >> 8));
  out.push_back(static_cast<uint8_t>(value));
}

Bytes images_file_bytes(uint32_t count, uint32_t rows, uint32_t cols, const Bytes& pixels,
                        uint32_t magic = kIdxImagesMagic) {
  Bytes out;
  append_be32(out, magic);
  append_be32(out, count);
  append_be32(out, rows);
  append_be32(out, cols);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

Bytes labels_file_bytes(uint32_t count, const Bytes& labels, uint32_t magic = kIdxLabelsMagic) {
  Bytes out;
  append_be32(out, magic);
  append_be32(out, count);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

// A small data set whose every byte is known: pixel j of image i is
// (7i + j) mod 256, labels cycle through the classes.
struct Synthetic {
  uint32_t count = 5, rows = 3, cols = 4;
  int num_classes = 3;
  Bytes pixels, labels;
  Synthetic(uint32_t count_in = 5, uint32_t rows_in = 3, uint32_t cols_in = 4)
      : count(count_in), rows(rows_in), cols(cols_in) {
    for (uint32_t i = 0; i < count; ++i) {
      for (uint32_t j = 0; j < rows * cols; ++j) pixels.push_back(static_cast<uint8_t>((7 * i + j) % 256));
      labels.push_back(static_cast<uint8_t>(i % num_classes));
    }
  }
  Bytes images_bytes() const { return images_file_bytes(count, rows, cols, pixels); }
  Bytes labels_bytes() const { return labels_file_bytes(count, labels); }
};

class FashionMnistTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    dir_ = fs::temp_directory_path() /
           ("fedmesh_test_fashion_mnist_" + std::to_string(::getpid()) + "_" + std::to_string(ticks));
    ASSERT_TRUE(fs::create_directory(dir_)) << dir_;
  }
  void TearDown() override {
    std::error_code error;
    fs::remove_all(dir_, error);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_plain(const std::string& name, const Bytes& bytes) const {
    std::string file_path = path(name);
    std::ofstream out(file_path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << file_path;
    return file_path;
  }

  std::string write_gzip(const std::string& name, const Bytes& bytes) const {
    std::string file_path = path(name);
    gzFile file = gzopen(file_path.c_str(), "wb");
    EXPECT_NE(file, nullptr) << file_path;
    if (file == nullptr) return file_path;
    if (!bytes.empty()) {
      EXPECT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    }
    EXPECT_EQ(gzclose(file), Z_OK);
    return file_path;
  }

  Bytes gzip_bytes(const Bytes& bytes) const {
    const std::string file_path = write_gzip("scratch.gz", bytes);
    std::ifstream in(file_path, std::ios::binary);
    Bytes out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fs::remove(file_path);
    return out;
  }

  // Loads the pair and expects kCorrupt with a message naming `file` and
  // containing `problem`.
  void expect_corrupt(const std::string& images, const std::string& labels, int num_classes,
                      const std::string& file, const std::string& problem) const {
    Result<ImageDataset> loaded = load_idx_pair(images, labels, num_classes);
    ASSERT_FALSE(loaded.is_ok()) << "expected '" << problem << "' in " << file;
    EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt) << loaded.status().to_string();
    EXPECT_NE(loaded.status().message().find(file), std::string::npos) << loaded.status().message();
    EXPECT_NE(loaded.status().message().find(problem), std::string::npos)
        << "missing '" << problem << "' in: " << loaded.status().message();
  }

  fs::path dir_;
};

void expect_same(const ImageDataset& loaded, const Synthetic& expected) {
  EXPECT_EQ(loaded.count, expected.count);
  EXPECT_EQ(loaded.rows, expected.rows);
  EXPECT_EQ(loaded.cols, expected.cols);
  EXPECT_EQ(loaded.num_classes, expected.num_classes);
  EXPECT_EQ(loaded.pixels_per_image(), int64_t{expected.rows} * expected.cols);
  EXPECT_EQ(loaded.pixels, expected.pixels);
  EXPECT_EQ(loaded.labels, expected.labels);
}

TEST_F(FashionMnistTest, ReadsGzippedPairExactly) {
  const Synthetic data;
  const std::string images = write_gzip("images.gz", data.images_bytes());
  const std::string labels = write_gzip("labels.gz", data.labels_bytes());
  Result<ImageDataset> loaded = load_idx_pair(images, labels, data.num_classes);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  expect_same(*loaded, data);
}

TEST_F(FashionMnistTest, ReadsPlainAndMixedPairsExactly) {
  const Synthetic data;
  const std::string images_plain = write_plain("images", data.images_bytes());
  const std::string labels_plain = write_plain("labels", data.labels_bytes());
  const std::string images_gzip = write_gzip("images.gz", data.images_bytes());
  const std::string labels_gzip = write_gzip("labels.gz", data.labels_bytes());
  for (const auto& [images, labels] : {std::pair{images_plain, labels_plain}, std::pair{images_gzip, labels_plain},
                                       std::pair{images_plain, labels_gzip}}) {
    Result<ImageDataset> loaded = load_idx_pair(images, labels, data.num_classes);
    ASSERT_TRUE(loaded.is_ok()) << images << " + " << labels << ": " << loaded.status().to_string();
    expect_same(*loaded, data);
  }
}

TEST_F(FashionMnistTest, ReadsPayloadsLargerThanOneReadChunk) {
  // 3000 images of 28x28 is 2.35 MB, more than the reader's 1 MiB slices.
  const Synthetic data(3000, 28, 28);
  const std::string images = write_gzip("images.gz", data.images_bytes());
  const std::string labels = write_plain("labels", data.labels_bytes());
  Result<ImageDataset> loaded = load_idx_pair(images, labels, data.num_classes);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  expect_same(*loaded, data);

  Bytes cut = data.images_bytes();
  cut.resize(cut.size() - 1000);
  const std::string truncated = write_gzip("cut.gz", cut);
  expect_corrupt(truncated, labels, data.num_classes, truncated,
                 "truncated: header declares 3000 images of 28x28 (2352000 bytes) but only 2351000 bytes follow");
}

TEST_F(FashionMnistTest, LoadsBothSplitsFromADirectory) {
  const Synthetic train(6, 28, 28);
  const Synthetic test(4, 28, 28);
  write_gzip("train-images-idx3-ubyte.gz", train.images_bytes());
  write_gzip("train-labels-idx1-ubyte.gz", train.labels_bytes());
  // The test split as plain files, as left by gunzip.
  write_plain("t10k-images-idx3-ubyte", test.images_bytes());
  write_plain("t10k-labels-idx1-ubyte", test.labels_bytes());

  Result<ImageDataset> loaded_train = load_fashion_mnist(dir_.string(), Split::kTrain);
  ASSERT_TRUE(loaded_train.is_ok()) << loaded_train.status().to_string();
  EXPECT_EQ(loaded_train->count, 6);
  EXPECT_EQ(loaded_train->num_classes, 10);
  EXPECT_EQ(loaded_train->pixels, train.pixels);
  EXPECT_EQ(loaded_train->labels, train.labels);

  Result<ImageDataset> loaded_test = load_fashion_mnist(dir_.string(), Split::kTest);
  ASSERT_TRUE(loaded_test.is_ok()) << loaded_test.status().to_string();
  EXPECT_EQ(loaded_test->count, 4);
  EXPECT_EQ(loaded_test->pixels, test.pixels);
  EXPECT_EQ(loaded_test->labels, test.labels);
}

TEST_F(FashionMnistTest, MissingFilesAreNotFoundWithTheFix) {
  Result<ImageDataset> loaded = load_fashion_mnist(dir_.string(), Split::kTest);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
  const std::string& message = loaded.status().message();
  EXPECT_NE(message.find(path("t10k-images-idx3-ubyte.gz")), std::string::npos) << message;
  // A directory of the user's: the message says how own data is named.
  EXPECT_NE(message.find("csv:FILE"), std::string::npos) << message;
  EXPECT_NE(message.find("images:DIR"), std::string::npos) << message;

  // Images present, labels missing: the labels path is named.
  const Synthetic data(2, 28, 28);
  write_gzip("t10k-images-idx3-ubyte.gz", data.images_bytes());
  loaded = load_fashion_mnist(dir_.string(), Split::kTest);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
  EXPECT_NE(loaded.status().message().find(path("t10k-labels-idx1-ubyte.gz")), std::string::npos)
      << loaded.status().message();

  const std::string images = write_plain("images", data.images_bytes());
  loaded = load_idx_pair(images, path("no-such-labels"), 10);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
  EXPECT_NE(loaded.status().message().find(path("no-such-labels")), std::string::npos) << loaded.status().message();
}

TEST_F(FashionMnistTest, RejectsWrongMagic) {
  const Synthetic data;
  const std::string labels = write_plain("labels", data.labels_bytes());
  const std::string images = write_plain("images", data.images_bytes());

  const std::string swapped = write_plain("swapped", data.labels_bytes());
  expect_corrupt(swapped, labels, 3, swapped, "bad magic 0x00000801, expected 0x00000803");
  expect_corrupt(swapped, labels, 3, swapped, "this is a labels file");

  const std::string images_as_labels = write_gzip("images-as-labels.gz", data.images_bytes());
  expect_corrupt(images, images_as_labels, 3, images_as_labels, "bad magic 0x00000803, expected 0x00000801");

  const std::string text = write_plain("text", Bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd', '!',
                                                     '1', '2', '3', '4', '5'});
  expect_corrupt(text, labels, 3, text, "not an IDX file");

  // IDX of 32-bit ints (type 0x0c) is a valid IDX file but not bytes.
  const std::string ints = write_plain("ints", images_file_bytes(5, 3, 4, data.pixels, 0x00000c03));
  expect_corrupt(ints, labels, 3, ints, "bad magic 0x00000c03");
}

TEST_F(FashionMnistTest, RejectsZeroAndAbsurdDimensions) {
  const Synthetic data;
  const std::string labels = write_plain("labels", data.labels_bytes());
  struct Case {
    uint32_t count, rows, cols;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {0, 3, 4, "header declares 0 images"},
      {5, 0, 4, "header declares 0 rows"},
      {5, 3, 0, "header declares 0 columns"},
      {10'000'001, 3, 4, "header declares 10000001 images, more than the limit of 10000000"},
      {4'000'000'000u, 3, 4, "header declares 4000000000 images"},
      {5, 4097, 4, "header declares 4097 rows, more than the limit of 4096"},
      {5, 3, 0xffffffffu, "header declares 4294967295 columns, more than the limit of 4096"},
      // Each dimension within bounds, the product is not: the tiny file must
      // be rejected before anything is allocated for it.
      {10'000'000, 4096, 4096, "(167772160000000 bytes), more than the limit of 4294967296 bytes"},
  };
  for (const Case& c : cases) {
    const std::string images = write_gzip("images.gz", images_file_bytes(c.count, c.rows, c.cols, data.pixels));
    expect_corrupt(images, labels, 3, images, c.problem);
  }

  const std::string images = write_plain("images", data.images_bytes());
  const std::string zero_labels = write_plain("zero-labels", labels_file_bytes(0, {}));
  expect_corrupt(images, zero_labels, 3, zero_labels, "header declares 0 labels");
  const std::string many_labels = write_plain("many-labels", labels_file_bytes(20'000'000, data.labels));
  expect_corrupt(images, many_labels, 3, many_labels, "header declares 20000000 labels, more than the limit");
}

TEST_F(FashionMnistTest, RejectsTruncatedHeadersAndPayloads) {
  const Synthetic data;
  const std::string labels = write_plain("labels", data.labels_bytes());
  const std::string images = write_plain("images", data.images_bytes());

  const std::string empty = write_plain("empty", {});
  expect_corrupt(empty, labels, 3, empty, "file is empty");
  const std::string empty_gzip = write_gzip("empty.gz", {});
  expect_corrupt(images, empty_gzip, 3, empty_gzip, "file is empty");

  Bytes short_header = data.images_bytes();
  short_header.resize(10);
  const std::string header_cut = write_plain("header-cut", short_header);
  expect_corrupt(header_cut, labels, 3, header_cut, "file ends after 10 bytes, inside the 16-byte IDX header");

  Bytes short_pixels = data.images_bytes();
  short_pixels.pop_back();
  for (const std::string& cut : {write_plain("pixels-cut", short_pixels), write_gzip("pixels-cut.gz", short_pixels)}) {
    expect_corrupt(cut, labels, 3, cut,
                   "truncated: header declares 5 images of 3x4 (60 bytes) but only 59 bytes follow");
  }

  Bytes short_labels = data.labels_bytes();
  short_labels.resize(short_labels.size() - 2);
  const std::string labels_cut = write_gzip("labels-cut.gz", short_labels);
  expect_corrupt(images, labels_cut, 3, labels_cut,
                 "truncated: header declares 5 labels (5 bytes) but only 3 bytes follow");
}

TEST_F(FashionMnistTest, RejectsTrailingGarbage) {
  const Synthetic data;
  const std::string labels = write_plain("labels", data.labels_bytes());
  const std::string images = write_plain("images", data.images_bytes());

  Bytes long_images = data.images_bytes();
  long_images.insert(long_images.end(), {1, 2, 3});
  for (const std::string& file : {write_plain("long", long_images), write_gzip("long.gz", long_images)}) {
    expect_corrupt(file, labels, 3, file, "trailing garbage: 3 bytes after the 5 images of 3x4 the header declares");
  }

  Bytes long_labels = data.labels_bytes();
  long_labels.resize(long_labels.size() + 10000, 0);
  const std::string file = write_gzip("long-labels.gz", long_labels);
  expect_corrupt(images, file, 3, file, "trailing garbage: at least 4096 bytes after the 5 labels");
}

TEST_F(FashionMnistTest, RejectsCorruptGzipStreams) {
  const Synthetic data(200, 28, 28);
  const std::string labels = write_plain("labels", data.labels_bytes());
  const Bytes good = gzip_bytes(data.images_bytes());
  ASSERT_GT(good.size(), 100u);
  ASSERT_EQ(good[0], 0x1f);
  ASSERT_EQ(good[1], 0x8b);

  // Damaged deflate data in the middle of the stream.
  Bytes damaged = good;
  for (size_t i = good.size() / 2; i < good.size() / 2 + 16; ++i) damaged[i] ^= 0xa5;
  const std::string damaged_path = write_plain("damaged.gz", damaged);
  expect_corrupt(damaged_path, labels, data.num_classes, damaged_path, "corrupt gzip stream");

  // A wrong CRC-32 in the gzip trailer (its first 4 of the last 8 bytes).
  Bytes bad_crc = good;
  bad_crc[bad_crc.size() - 8] ^= 0xff;
  const std::string bad_crc_path = write_plain("bad-crc.gz", bad_crc);
  expect_corrupt(bad_crc_path, labels, data.num_classes, bad_crc_path, "corrupt gzip stream (incorrect data check)");

  // The compressed file cut short: zlib reports an unexpected end of file.
  Bytes cut = good;
  cut.resize(good.size() / 2);
  const std::string cut_path = write_plain("cut.gz", cut);
  expect_corrupt(cut_path, labels, data.num_classes, cut_path, "gzip stream is truncated");
  // Even a stream cut inside its 8-byte trailer, after all the data.
  Bytes no_trailer = good;
  no_trailer.resize(good.size() - 3);
  const std::string no_trailer_path = write_plain("no-trailer.gz", no_trailer);
  expect_corrupt(no_trailer_path, labels, data.num_classes, no_trailer_path, "gzip stream is truncated");

  // A gzip magic followed by a broken header.
  const std::string bad_header = write_plain("bad-header.gz", Bytes{0x1f, 0x8b, 0x99, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3});
  expect_corrupt(bad_header, labels, data.num_classes, bad_header, "corrupt gzip stream");
}

TEST_F(FashionMnistTest, RejectsCountMismatch) {
  const Synthetic data;
  const std::string images = write_plain("images", data.images_bytes());
  const Bytes four_labels(data.labels.begin(), data.labels.begin() + 4);
  const std::string labels = write_gzip("labels.gz", labels_file_bytes(4, four_labels));
  Result<ImageDataset> loaded = load_idx_pair(images, labels, 3);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(loaded.status().message(), images + " declares 5 images but " + labels + " declares 4 labels");
}

TEST_F(FashionMnistTest, RejectsLabelsOutsideTheClasses) {
  const Synthetic data(8, 3, 4);
  const std::string images = write_plain("images", data.images_bytes());
  Bytes labels = data.labels;
  labels[5] = 12;
  const std::string labels_path = write_gzip("t10k-labels-idx1-ubyte.gz", labels_file_bytes(8, labels));
  Result<ImageDataset> loaded = load_idx_pair(images, labels_path, 10);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(loaded.status().message(), labels_path + ": label 12 at index 5 is not below 10 classes");

  // The same file is fine for a 13-class reader.
  loaded = load_idx_pair(images, labels_path, 13);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->labels[5], 12);
}

TEST_F(FashionMnistTest, RejectsBadClassCountAndUnreadablePaths) {
  const Synthetic data;
  const std::string images = write_plain("images", data.images_bytes());
  const std::string labels = write_plain("labels", data.labels_bytes());
  for (const int num_classes : {0, -1, 257}) {
    Result<ImageDataset> loaded = load_idx_pair(images, labels, num_classes);
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument) << num_classes;
  }
  // A directory opens but cannot be read.
  Result<ImageDataset> loaded = load_idx_pair(dir_.string(), labels, 3);
  ASSERT_FALSE(loaded.is_ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kIoError) << loaded.status().to_string();
  EXPECT_NE(loaded.status().message().find(dir_.string()), std::string::npos);
}

TEST(ImageDatasetTest, SubsetAndHeadCopyTheChosenImages) {
  const Synthetic data(6, 2, 2);
  ImageDataset dataset;
  dataset.count = 6;
  dataset.rows = 2;
  dataset.cols = 2;
  dataset.num_classes = 3;
  dataset.pixels = data.pixels;
  dataset.labels = data.labels;

  const std::array<int64_t, 3> chosen = {4, 0, 4};
  const ImageDataset picked = dataset.subset(chosen);
  EXPECT_EQ(picked.count, 3);
  EXPECT_EQ(picked.rows, 2);
  EXPECT_EQ(picked.cols, 2);
  EXPECT_EQ(picked.num_classes, 3);
  const Bytes expected_pixels = {28, 29, 30, 31, 0, 1, 2, 3, 28, 29, 30, 31};
  EXPECT_EQ(picked.pixels, expected_pixels);
  EXPECT_EQ(picked.labels, (Bytes{1, 0, 1}));

  const ImageDataset none = dataset.subset({});
  EXPECT_EQ(none.count, 0);
  EXPECT_TRUE(none.pixels.empty());

  const ImageDataset first_two = dataset.head(2);
  EXPECT_EQ(first_two.count, 2);
  EXPECT_EQ(first_two.pixels, (Bytes{0, 1, 2, 3, 7, 8, 9, 10}));
  EXPECT_EQ(first_two.labels, (Bytes{0, 1}));
  const ImageDataset all = dataset.head(100);
  EXPECT_EQ(all.count, 6);
  EXPECT_EQ(all.pixels, dataset.pixels);
  EXPECT_EQ(dataset.head(0).count, 0);
}

TEST(ImageDatasetDeathTest, SubsetIndexOutOfRangeIsAProgrammingError) {
  ImageDataset dataset;
  dataset.count = 1;
  dataset.rows = 1;
  dataset.cols = 1;
  dataset.pixels = {9};
  dataset.labels = {0};
  const std::array<int64_t, 1> outside = {1};
  EXPECT_DEATH(dataset.subset(outside), "subset index 1 outside");
}

TEST(RealFashionMnistTest, LoadsBothSplitsWithBalancedClasses) {
  if (!fs::is_directory(kDefaultFashionMnistDir)) {
    GTEST_SKIP() << kDefaultFashionMnistDir
                 << " is absent; install the Debian package dataset-fashion-mnist to run this test";
  }
  struct Expected {
    Split split;
    int64_t count;
  };
  for (const Expected& expected : {Expected{Split::kTrain, 60000}, Expected{Split::kTest, 10000}}) {
    Result<ImageDataset> loaded = load_fashion_mnist(kDefaultFashionMnistDir, expected.split);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->count, expected.count);
    EXPECT_EQ(loaded->rows, 28);
    EXPECT_EQ(loaded->cols, 28);
    EXPECT_EQ(loaded->num_classes, 10);
    ASSERT_EQ(loaded->pixels.size(), static_cast<size_t>(expected.count * 28 * 28));
    ASSERT_EQ(loaded->labels.size(), static_cast<size_t>(expected.count));

    std::array<int64_t, 10> per_class{};
    for (const uint8_t label : loaded->labels) ++per_class[label];
    for (int label = 0; label < 10; ++label) {
      EXPECT_GT(per_class[label], expected.count / 10 * 9 / 10) << "class " << label;
      EXPECT_LT(per_class[label], expected.count / 10 * 11 / 10) << "class " << label;
    }
    // Real images, not zeros: Fashion-MNIST's mean pixel is about 73 of 255.
    double sum = 0.0;
    for (const uint8_t pixel : loaded->pixels) sum += pixel;
    const double mean = sum / static_cast<double>(loaded->pixels.size());
    EXPECT_GT(mean, 50.0);
    EXPECT_LT(mean, 100.0);
  }
}

}  // namespace
}  // namespace fedmesh::train::data
