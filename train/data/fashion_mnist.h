// Fashion-MNIST and other IDX image/label pairs, read from gzipped or plain
// files. The files come from outside the program, so every header field is
// checked against named bounds before it decides an allocation, and every
// flaw is a kCorrupt Status naming the file and what was wrong.
//
// IDX format (big-endian), as used by MNIST and Fashion-MNIST:
//   images: u32 magic 0x00000803 (0x08 = unsigned byte, 3 dimensions),
//           u32 count, u32 rows, u32 cols, then count*rows*cols bytes;
//   labels: u32 magic 0x00000801 (unsigned byte, 1 dimension),
//           u32 count, then count bytes.
// Nothing may follow the payload. (Bytes after the end of a gzip stream that
// are not another gzip member are ignored by zlib, as by gzip(1): they are
// never decompressed, so they cannot reach the data.)
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace fedmesh::train::data {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;
// Bounds on what a header may declare; far above any IDX set in use
// (Fashion-MNIST: 60000 images of 28x28, 47 MB).
inline constexpr int64_t kMaxIdxImages = 10'000'000;
inline constexpr int64_t kMaxIdxSide = 4096;
inline constexpr int64_t kMaxIdxPixelBytes = int64_t{4} << 30;  // count*rows*cols
// Labels are bytes, so at most 256 classes can be told apart.
inline constexpr int kMaxIdxClasses = 256;

// Mean and standard deviation of Fashion-MNIST training pixels scaled to [0, 1].
inline constexpr float kFashionMnistPixelMean = 0.2860f;
inline constexpr float kFashionMnistPixelStd = 0.3530f;

struct ImageDataset {
  int64_t count = 0;            // number of images
  int64_t channels = 1;         // 1 (gray) or 3 (RGB)
  int64_t rows = 0, cols = 0;   // 28, 28 for Fashion-MNIST
  int num_classes = 10;
  std::vector<uint8_t> pixels;  // (count, channels, rows, cols), row-major, raw 0..255
  std::vector<uint8_t> labels;  // (count)
  // A pixel v becomes (v / 255 - mean[c]) / std[c] in a batch; one entry
  // per channel.
  std::vector<float> mean = {kFashionMnistPixelMean}, std = {kFashionMnistPixelStd};

  int64_t pixels_per_image() const { return channels * rows * cols; }
  // Copies the chosen images in that order; every index must be in [0, count).
  ImageDataset subset(std::span<const int64_t> indices) const;
  // The first min(n, count) images; n >= 0.
  ImageDataset head(int64_t n) const;
};

enum class Split { kTrain, kTest };

inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Reads DIR/train-images-idx3-ubyte(.gz) + train-labels-idx1-ubyte(.gz), or
// the t10k-* pair; the .gz file is taken when both forms are present. A
// missing file is kNotFound with the path and how to get the data.
Result<ImageDataset> load_fashion_mnist(const std::string& dir, Split split);

// The train and test splits for a --data flag ("fashion-mnist" is the
// installed data set, anything else a directory), each cut to its first
// N images when a limit > 0 is given.
struct FashionMnistSplits {
  ImageDataset train, test;
};
Result<FashionMnistSplits> load_fashion_mnist_splits(const std::string& data, int64_t train_limit, int64_t test_limit);

// General IDX pair reader. Each file may be gzipped or plain: zlib tells them
// apart by the gzip magic bytes 1f 8b. num_classes in [1, kMaxIdxClasses];
// every label must be below it.
Result<ImageDataset> load_idx_pair(const std::string& images_path, const std::string& labels_path,
                                   int num_classes);

}  // namespace fedmesh::train::data
