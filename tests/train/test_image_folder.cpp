#include "train/data/image_folder.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include "support/image_files.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

using fedmesh::testing::Bytes;
using fedmesh::testing::jpeg_bytes;
using fedmesh::testing::kPngGray;
using fedmesh::testing::kPngGrayAlpha;
using fedmesh::testing::kPngPalette;
using fedmesh::testing::kPngRgb;
using fedmesh::testing::kPngRgba;
using fedmesh::testing::png_bytes;

Bytes gray_png(uint32_t width, uint32_t height, const Bytes& pixels) {
  return png_bytes(width, height, kPngGray, 8, pixels);
}

const ImageDataset& images_of(const std::unique_ptr<Dataset>& set) {
  const auto* image_set = dynamic_cast<const ImageSet*>(set.get());
  EXPECT_NE(image_set, nullptr);
  return image_set->images();
}

Result<DecodedImage> decode(const Bytes& bytes, const std::string& name = "mem.png") {
  return decode_image({bytes.data(), bytes.size()}, name);
}

class ImageFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    dir_ = fs::temp_directory_path() /
           ("fedmesh_test_image_folder_" + std::to_string(::getpid()) + "_" + std::to_string(ticks));
    ASSERT_TRUE(fs::create_directory(dir_)) << dir_;
  }
  void TearDown() override {
    std::error_code error;
    fs::remove_all(dir_, error);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write(const std::string& name, const Bytes& bytes) const {
    const fs::path file = dir_ / name;
    fs::create_directories(file.parent_path());
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << file;
    return file.string();
  }

  // `per_class` 4x4 gray PNGs in each of `classes` under `root`; image i of
  // class c has every pixel at value(c, i).
  void make_classes(const std::string& root, const std::vector<std::string>& classes, int per_class,
                    int (*value)(int, int)) const {
    for (size_t c = 0; c < classes.size(); ++c) {
      for (int i = 0; i < per_class; ++i) {
        write(root + "/" + classes[c] + "/" + std::to_string(i) + ".png",
              gray_png(4, 4, Bytes(16, static_cast<uint8_t>(value(static_cast<int>(c), i)))));
      }
    }
  }

  ImageFolderSpec spec_for(const std::string& root, int64_t size = 4) const {
    ImageFolderSpec spec;
    spec.dir = path(root);
    spec.image_size = size;
    return spec;
  }

  fs::path dir_;
};

int class_value(int c, int /*i*/) { return 10 + 90 * c; }
int image_value(int c, int i) { return c * 40 + i * 3; }

TEST_F(ImageFolderTest, ClassesAreNumberedInSortedFolderOrder) {
  make_classes("set", {"b_cat", "a_dog", "c_eel"}, 3, class_value);  // a_dog 100, b_cat 10, c_eel 190
  write("set/notes.txt", {'h', 'i'});
  write("set/a_dog/.DS_Store", {0, 1, 2});
  write("set/a_dog/readme.md", {'#'});
  ImageFolderSpec spec = spec_for("set");
  spec.test_fraction = 0.0;
  Result<LoadedData> data = load_image_folder(spec);
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  const ImageDataset& train = images_of(data->train);
  ASSERT_EQ(train.count, 9);
  EXPECT_EQ(images_of(data->test).count, 0);
  EXPECT_EQ(train.num_classes, 3);
  const uint8_t expected[3] = {100, 10, 190};  // a_dog, b_cat, c_eel
  for (int64_t i = 0; i < train.count; ++i) {
    EXPECT_EQ(train.pixels[static_cast<size_t>(i * 16)], expected[train.labels[static_cast<size_t>(i)]]);
  }
  EXPECT_EQ(data->schema.classes, 3);
  EXPECT_EQ(data->schema.sample_shape, (Shape{1, 4, 4}));
  EXPECT_EQ(data->schema.canonical, "images v1; classes=a_dog,b_cat,c_eel; size=4; channels=1; normalize=computed");
  EXPECT_EQ(data->description.find("9 images of 3 classes in " + spec.dir + " (0 test), 4x4 -> 4x4 gray"), 0u)
      << data->description;
  EXPECT_NE(data->description.find("3 other files skipped"), std::string::npos) << data->description;

  // The spec's class list decides the numbering; a listed class may be absent.
  spec.classes = {"c_eel", "zebra", "a_dog", "b_cat"};
  spec.mean = {0.5f};
  spec.std = {0.25f};
  data = load_image_folder(spec);
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  const ImageDataset& named = images_of(data->train);
  const uint8_t by_list[4] = {190, 0, 100, 10};
  for (int64_t i = 0; i < named.count; ++i) {
    ASSERT_NE(named.labels[static_cast<size_t>(i)], 1);
    EXPECT_EQ(named.pixels[static_cast<size_t>(i * 16)], by_list[named.labels[static_cast<size_t>(i)]]);
  }
  EXPECT_EQ(data->schema.classes, 4);
  EXPECT_EQ(named.mean, std::vector<float>{0.5f});
  EXPECT_EQ(data->schema.canonical,
            "images v1; classes=c_eel,zebra,a_dog,b_cat; size=4; channels=1; normalize=mean=0.5;std=0.25");

  // A folder that is not a listed class is refused, naming it.
  spec.classes = {"a_dog", "b_cat"};
  data = load_image_folder(spec);
  ASSERT_FALSE(data.is_ok());
  EXPECT_EQ(data.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(data.status().message().find(path("set/c_eel")), std::string::npos) << data.status().message();
}

TEST_F(ImageFolderTest, GrayAndRgbOutputs) {
  Bytes red;
  for (int i = 0; i < 16; ++i) red.insert(red.end(), {255, 0, 0});
  write("set/red/0.png", png_bytes(4, 4, kPngRgb, 8, red));
  write("set/gray/0.png", gray_png(4, 4, Bytes(16, 50)));
  ImageFolderSpec spec = spec_for("set");
  spec.test_fraction = 0.0;
  Result<LoadedData> gray = load_image_folder(spec);
  ASSERT_TRUE(gray.is_ok()) << gray.status().to_string();
  const ImageDataset& g = images_of(gray->train);
  ASSERT_EQ(g.count, 2);
  for (int64_t i = 0; i < 2; ++i) {
    // classes: gray 0, red 1; red's luma is 0.299 * 255 = 76.2
    const uint8_t want = g.labels[static_cast<size_t>(i)] == 0 ? 50 : 76;
    for (int j = 0; j < 16; ++j) EXPECT_EQ(g.pixels[static_cast<size_t>(i * 16 + j)], want);
  }
  // The computed normalization is that of the training pixels.
  EXPECT_NEAR(g.mean[0], (50 + 76) / 2.0 / 255.0, 1e-5);
  EXPECT_NEAR(g.std[0], 13 / 255.0, 1e-5);

  spec.channels = 3;
  Result<LoadedData> rgb = load_image_folder(spec);
  ASSERT_TRUE(rgb.is_ok()) << rgb.status().to_string();
  const ImageDataset& c = images_of(rgb->train);
  EXPECT_EQ(rgb->schema.sample_shape, (Shape{3, 4, 4}));
  EXPECT_EQ(c.mean.size(), 3u);
  for (int64_t i = 0; i < 2; ++i) {
    const bool is_red = c.labels[static_cast<size_t>(i)] == 1;
    for (int k = 0; k < 3; ++k) {
      const uint8_t want = is_red ? (k == 0 ? 255 : 0) : 50;  // gray replicated
      for (int j = 0; j < 16; ++j) EXPECT_EQ(c.pixels[static_cast<size_t>((i * 3 + k) * 16 + j)], want);
    }
  }
  EXPECT_NE(rgb->description.find("4x4 -> 4x4 RGB"), std::string::npos) << rgb->description;
}

TEST_F(ImageFolderTest, CenterCropThenResizeKeepsTheLayout) {
  // 10 rows x 20 columns, the left half white: the center square is
  // columns 5..14, its left half white.
  DecodedImage wide{1, 10, 20, Bytes(200, 0)};
  for (int r = 0; r < 10; ++r) {
    for (int c = 0; c < 10; ++c) wide.pixels[static_cast<size_t>(r * 20 + c)] = 255;
  }
  const Bytes shrunk = square_planes(wide, 1, 4);  // area average 10 -> 4
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 4; ++c) EXPECT_EQ(shrunk[static_cast<size_t>(r * 4 + c)], c < 2 ? 255 : 0) << r << "," << c;
  }
  const Bytes grown = square_planes(wide, 1, 20);  // bilinear 10 -> 20
  for (int r = 0; r < 20; ++r) {
    for (int c = 0; c < 9; ++c) EXPECT_EQ(grown[static_cast<size_t>(r * 20 + c)], 255) << r << "," << c;
    for (int c = 11; c < 20; ++c) EXPECT_EQ(grown[static_cast<size_t>(r * 20 + c)], 0) << r << "," << c;
    EXPECT_GT(grown[static_cast<size_t>(r * 20 + 9)], grown[static_cast<size_t>(r * 20 + 10)]);
  }
  // 3 -> 2 (a non-integer ratio): each output is the area-weighted mean.
  DecodedImage small{1, 3, 3, {0, 90, 180, 0, 90, 180, 0, 90, 180}};
  const Bytes two = square_planes(small, 1, 2);
  EXPECT_EQ(two[0], 30);   // (0 * 1 + 90 * 0.5) / 1.5
  EXPECT_EQ(two[1], 150);  // (90 * 0.5 + 180 * 1) / 1.5

  // Through a file: a tall image, the top half white, stays top-half white.
  Bytes tall(20 * 10, 0);
  for (int r = 0; r < 10; ++r) {
    for (int c = 0; c < 10; ++c) tall[static_cast<size_t>(r * 10 + c)] = 255;
  }
  write("set/only/tall.png", gray_png(10, 20, tall));
  ImageFolderSpec spec = spec_for("set", 4);
  spec.test_fraction = 0.0;
  Result<LoadedData> data = load_image_folder(spec);
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  const ImageDataset& train = images_of(data->train);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 4; ++c) EXPECT_EQ(train.pixels[static_cast<size_t>(r * 4 + c)], r < 2 ? 255 : 0);
  }
  EXPECT_NE(data->description.find("10x20 -> 4x4 gray"), std::string::npos) << data->description;
}

TEST_F(ImageFolderTest, PngPaletteSixteenBitAndAlpha) {
  // A palette of black and green, in a checkerboard.
  const Bytes palette = {0, 0, 0, 0, 255, 0};
  Bytes indexes(16);
  for (int i = 0; i < 16; ++i) indexes[static_cast<size_t>(i)] = static_cast<uint8_t>((i / 4 + i % 4) % 2);
  Result<DecodedImage> paletted = decode(png_bytes(4, 4, kPngPalette, 8, indexes, palette));
  ASSERT_TRUE(paletted.is_ok()) << paletted.status().to_string();
  ASSERT_EQ(paletted->channels, 3);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(paletted->pixels[static_cast<size_t>(i * 3 + 0)], 0);
    EXPECT_EQ(paletted->pixels[static_cast<size_t>(i * 3 + 1)], indexes[static_cast<size_t>(i)] * 255);
    EXPECT_EQ(paletted->pixels[static_cast<size_t>(i * 3 + 2)], 0);
  }
  // 16-bit gray without gAMA: sRGB samples, scaled to 8 bits (not gamma-encoded).
  const Bytes deep = {0x00, 0x00, 0x80, 0x80, 0xff, 0xff, 0x40, 0x40};
  Result<DecodedImage> sixteen = decode(png_bytes(4, 1, kPngGray, 16, deep));
  ASSERT_TRUE(sixteen.is_ok()) << sixteen.status().to_string();
  EXPECT_EQ(sixteen->channels, 1);
  EXPECT_EQ(sixteen->pixels, (Bytes{0, 128, 255, 64}));
  // 16-bit RGB.
  const Bytes deep_rgb = {0xff, 0xff, 0x00, 0x00, 0x80, 0x80};
  Result<DecodedImage> sixteen_rgb = decode(png_bytes(1, 1, kPngRgb, 16, deep_rgb));
  ASSERT_TRUE(sixteen_rgb.is_ok()) << sixteen_rgb.status().to_string();
  EXPECT_EQ(sixteen_rgb->pixels, (Bytes{255, 0, 128}));
  // Alpha is composited on black: opaque stays, transparent becomes 0.
  Result<DecodedImage> gray_alpha = decode(png_bytes(2, 1, kPngGrayAlpha, 8, {200, 255, 200, 0}));
  ASSERT_TRUE(gray_alpha.is_ok()) << gray_alpha.status().to_string();
  EXPECT_EQ(gray_alpha->channels, 1);
  EXPECT_EQ(gray_alpha->pixels, (Bytes{200, 0}));
  Result<DecodedImage> rgba = decode(png_bytes(2, 1, kPngRgba, 8, {10, 20, 30, 255, 10, 20, 30, 0}));
  ASSERT_TRUE(rgba.is_ok()) << rgba.status().to_string();
  EXPECT_EQ(rgba->pixels, (Bytes{10, 20, 30, 0, 0, 0}));
}

TEST_F(ImageFolderTest, JpegDecodesCloseToItsSource) {
  Bytes rgb(16 * 16 * 3);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) {
      uint8_t* p = rgb.data() + (r * 16 + c) * 3;
      p[0] = static_cast<uint8_t>(r * 16);
      p[1] = static_cast<uint8_t>(c * 16);
      p[2] = 128;
    }
  }
  Result<DecodedImage> color = decode(jpeg_bytes(16, 16, 3, JCS_RGB, rgb), "mem.jpg");
  ASSERT_TRUE(color.is_ok()) << color.status().to_string();
  ASSERT_EQ(color->channels, 3);
  ASSERT_EQ(color->pixels.size(), rgb.size());
  double error = 0;
  for (size_t i = 0; i < rgb.size(); ++i) error += std::abs(int{color->pixels[i]} - int{rgb[i]});
  EXPECT_LT(error / static_cast<double>(rgb.size()), 4.0);

  Bytes gray(8 * 8);
  for (int i = 0; i < 64; ++i) gray[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 4);
  Result<DecodedImage> g = decode(jpeg_bytes(8, 8, 1, JCS_GRAYSCALE, gray), "mem.jpg");
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  ASSERT_EQ(g->channels, 1);
  error = 0;
  for (size_t i = 0; i < gray.size(); ++i) error += std::abs(int{g->pixels[i]} - int{gray[i]});
  EXPECT_LT(error / static_cast<double>(gray.size()), 4.0);

  // By content, not by name: a JPEG called .png loads from a folder.
  write("set/x/looks_like.png", jpeg_bytes(8, 8, 1, JCS_GRAYSCALE, gray));
  ImageFolderSpec spec = spec_for("set", 8);
  spec.test_fraction = 0.0;
  Result<LoadedData> data = load_image_folder(spec);
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  EXPECT_EQ(images_of(data->train).pixels, g->pixels);
}

TEST_F(ImageFolderTest, TestSplitIsSeededAndDeterministic) {
  make_classes("set", {"a", "b", "c", "d", "e"}, 10, image_value);  // every image a distinct value
  ImageFolderSpec spec = spec_for("set");
  spec.seed = 7;
  Result<LoadedData> first = load_image_folder(spec);
  Result<LoadedData> again = load_image_folder(spec);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE(again.is_ok());
  const ImageDataset& train = images_of(first->train);
  const ImageDataset& test = images_of(first->test);
  EXPECT_EQ(train.count, 40);
  EXPECT_EQ(test.count, 10);
  EXPECT_EQ(train.pixels, images_of(again->train).pixels);
  EXPECT_EQ(train.labels, images_of(again->train).labels);
  EXPECT_EQ(test.pixels, images_of(again->test).pixels);
  // Two per class in the test set, and train and test together are every image once.
  std::vector<int> per_class(5, 0);
  std::set<uint8_t> seen;
  for (int64_t i = 0; i < test.count; ++i) {
    ++per_class[test.labels[static_cast<size_t>(i)]];
    seen.insert(test.pixels[static_cast<size_t>(i * 16)]);
  }
  for (int64_t i = 0; i < train.count; ++i) seen.insert(train.pixels[static_cast<size_t>(i * 16)]);
  EXPECT_EQ(per_class, std::vector<int>(5, 2));
  EXPECT_EQ(seen.size(), 50u);

  spec.seed = 8;
  Result<LoadedData> other = load_image_folder(spec);
  ASSERT_TRUE(other.is_ok());
  EXPECT_NE(images_of(other->test).pixels, test.pixels);

  // Limits keep the first N of the shuffled order: a sample of the classes.
  spec.seed = 7;
  spec.train_limit = 12;
  spec.test_limit = 3;
  Result<LoadedData> limited = load_image_folder(spec);
  ASSERT_TRUE(limited.is_ok());
  EXPECT_EQ(images_of(limited->train).count, 12);
  EXPECT_EQ(images_of(limited->test).count, 3);
  const std::set<uint8_t> classes(images_of(limited->train).labels.begin(), images_of(limited->train).labels.end());
  EXPECT_GT(classes.size(), 1u);

  // With a test folder, the fraction is not used; a missing class there is fine.
  make_classes("held_out", {"b", "d"}, 2, image_value);
  spec = spec_for("set");
  spec.test_dir = path("held_out");
  Result<LoadedData> folders = load_image_folder(spec);
  ASSERT_TRUE(folders.is_ok()) << folders.status().to_string();
  EXPECT_EQ(images_of(folders->train).count, 50);
  EXPECT_EQ(images_of(folders->test).count, 4);
  for (uint8_t label : images_of(folders->test).labels) EXPECT_TRUE(label == 1 || label == 3);
}

TEST_F(ImageFolderTest, CacheIsReusedAndInvalidatedByATouchedFile) {
  make_classes("set", {"a", "b"}, 5, image_value);
  ImageFolderSpec spec = spec_for("set", 6);
  spec.cache = path("set.cache");
  Result<LoadedData> written = load_image_folder(spec);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  EXPECT_TRUE(fs::exists(spec.cache));
  EXPECT_NE(written->description.find("cache written"), std::string::npos) << written->description;

  Result<LoadedData> reused = load_image_folder(spec);
  ASSERT_TRUE(reused.is_ok()) << reused.status().to_string();
  EXPECT_NE(reused->description.find("cache reused"), std::string::npos) << reused->description;
  EXPECT_EQ(images_of(reused->train).pixels, images_of(written->train).pixels);
  EXPECT_EQ(images_of(reused->train).labels, images_of(written->train).labels);
  EXPECT_EQ(images_of(reused->test).pixels, images_of(written->test).pixels);
  EXPECT_EQ(images_of(reused->test).labels, images_of(written->test).labels);
  EXPECT_EQ(images_of(reused->train).mean, images_of(written->train).mean);
  EXPECT_EQ(reused->schema.canonical, written->schema.canonical);

  // A touched file (new mtime) invalidates it.
  const fs::path touched = path("set/a/0.png");
  fs::last_write_time(touched, fs::last_write_time(touched) + std::chrono::seconds(5));
  Result<LoadedData> rebuilt = load_image_folder(spec);
  ASSERT_TRUE(rebuilt.is_ok());
  EXPECT_NE(rebuilt->description.find("cache rebuilt"), std::string::npos) << rebuilt->description;
  EXPECT_EQ(images_of(rebuilt->train).pixels, images_of(written->train).pixels);
  Result<LoadedData> after = load_image_folder(spec);
  ASSERT_TRUE(after.is_ok());
  EXPECT_NE(after->description.find("cache reused"), std::string::npos) << after->description;

  // So does another spec (size).
  spec.image_size = 5;
  Result<LoadedData> resized = load_image_folder(spec);
  ASSERT_TRUE(resized.is_ok());
  EXPECT_NE(resized->description.find("cache rebuilt"), std::string::npos) << resized->description;
  EXPECT_EQ(images_of(resized->train).rows, 5);

  // A damaged payload fails its checksum and is rebuilt, not trusted.
  {
    std::fstream file(spec.cache, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-1, std::ios::end);
    file.put('\x7f');
  }
  Result<LoadedData> checked = load_image_folder(spec);
  ASSERT_TRUE(checked.is_ok());
  EXPECT_NE(checked->description.find("cache rebuilt (checksum mismatch)"), std::string::npos) << checked->description;
  EXPECT_EQ(images_of(checked->train).pixels, images_of(resized->train).pixels);
}

void expect_refused(const Result<LoadedData>& data, StatusCode code, const std::string& names) {
  ASSERT_FALSE(data.is_ok());
  EXPECT_EQ(data.status().code(), code) << data.status().to_string();
  EXPECT_NE(data.status().message().find(names), std::string::npos) << data.status().message();
}

TEST_F(ImageFolderTest, FlawsAreRefusedNamingTheFile) {
  const Bytes good_png = gray_png(8, 8, Bytes(64, 9));
  Bytes gray(64, 100);
  const Bytes good_jpeg = jpeg_bytes(8, 8, 1, JCS_GRAYSCALE, gray);

  write("png/a/ok.png", good_png);
  const std::string cut_png = write("png/a/cut.png", Bytes(good_png.begin(), good_png.begin() + good_png.size() - 20));
  ImageFolderSpec spec = spec_for("png");
  expect_refused(load_image_folder(spec), StatusCode::kCorrupt, cut_png);

  write("jpeg/a/ok.jpg", good_jpeg);
  const std::string cut_jpeg = write("jpeg/a/cut.jpg", Bytes(good_jpeg.begin(), good_jpeg.begin() + good_jpeg.size() / 2));
  expect_refused(load_image_folder(spec_for("jpeg")), StatusCode::kCorrupt, cut_jpeg);

  Bytes cmyk(8 * 8 * 4, 50);
  const std::string cmyk_path = write("cmyk/a/ink.jpg", jpeg_bytes(8, 8, 4, JCS_CMYK, cmyk));
  const Result<LoadedData> ink = load_image_folder(spec_for("cmyk"));
  expect_refused(ink, StatusCode::kCorrupt, cmyk_path);
  EXPECT_NE(ink.status().message().find("CMYK"), std::string::npos);

  // Over the bounds, judged on the header alone (the IDAT is far too short).
  const std::string huge = write("huge/a/wide.png", png_bytes(20000, 1, kPngGray, 8, Bytes(20000, 0)));
  const Result<LoadedData> wide = load_image_folder(spec_for("huge"));
  expect_refused(wide, StatusCode::kCorrupt, huge);
  EXPECT_NE(wide.status().message().find("16384"), std::string::npos) << wide.status().message();

  // A folder without images, or without class folders.
  fs::create_directories(path("empty/a"));
  write("empty/a/notes.txt", {'x'});
  write("empty/b/ok.png", good_png);
  expect_refused(load_image_folder(spec_for("empty")), StatusCode::kInvalidArgument, path("empty/a"));
  fs::create_directories(path("bare"));
  expect_refused(load_image_folder(spec_for("bare")), StatusCode::kInvalidArgument, path("bare"));
  expect_refused(load_image_folder(spec_for("absent")), StatusCode::kNotFound, path("absent"));

  // A test folder with a class the training folder lacks.
  write("train/a/ok.png", good_png);
  write("test/a/ok.png", good_png);
  write("test/zz/ok.png", good_png);
  spec = spec_for("train");
  spec.test_dir = path("test");
  expect_refused(load_image_folder(spec), StatusCode::kInvalidArgument, path("test/zz"));

  // More classes than byte labels can tell apart.
  for (int c = 0; c < 257; ++c) fs::create_directories(path("many/" + std::to_string(1000 + c)));
  const Result<LoadedData> many = load_image_folder(spec_for("many"));
  expect_refused(many, StatusCode::kInvalidArgument, "257 classes");
  EXPECT_NE(many.status().message().find("at most 256"), std::string::npos);

  // Bad specs.
  spec = spec_for("train");
  spec.channels = 2;
  expect_refused(load_image_folder(spec), StatusCode::kInvalidArgument, "channels");
  spec = spec_for("train");
  spec.mean = {0.5f, 0.5f};
  spec.std = {0.1f, 0.1f};
  expect_refused(load_image_folder(spec), StatusCode::kInvalidArgument, "one value per channel");

  // The decoder on its own: garbage and nothing.
  EXPECT_EQ(decode({1, 2, 3}).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode({}).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode({0xff, 0xd8, 0xff}, "x.jpg").status().code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace fedmesh::train::data
