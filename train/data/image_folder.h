// A folder of images as a data set (`--data images:DIR`): one sub-folder per
// class, PNG and JPEG files told apart by their first bytes (never by the
// extension), each image center-cropped to a square and resized to
// image_size x image_size, gray or RGB.
//
// The files come from outside the program: every image is bounded before it
// is decoded, a decoder error never leaves the process (libjpeg's error
// manager longjmps back, libpng's simplified API catches its own), and every
// flaw is a Status naming the file: kCorrupt for bytes that do not decode
// (truncated, damaged, CMYK JPEG, over the size bounds), kInvalidArgument for
// a spec or a folder layout that cannot be used, kNotFound for a missing path.
//
// Cache file (ImageFolderSpec::cache), written atomically:
//   line 1   "fedmesh-image-cache v1"
//   line 2   one JSON object: "key" (BLAKE2b-256 hex of the spec and of both
//            folders' file lists with sizes and mtimes), "checksum" (BLAKE2b-256
//            hex of the payload), train/test counts, classes, channels, size,
//            skipped files, the source sizes text;
//   payload  train labels (u8 each), train pixels (count, channels, size, size),
//            test labels, test pixels.
// A cache whose key differs, or that fails its checksum, is rebuilt and
// replaced; the description says which happened.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

// Bounds checked on a file's header before its pixels are decoded.
inline constexpr int64_t kMaxImageSide = 16384;
inline constexpr int64_t kMaxImagePixels = int64_t{64} << 20;   // 64 MP
inline constexpr int64_t kMaxImageFileBytes = int64_t{256} << 20;
// A progressive JPEG may hold any number of scans, each a pass over the whole
// image: past this many it is refused (libjpeg-turbo's own fuzzers use 500).
inline constexpr int kMaxJpegScans = 1000;
// Bounds on a folder.
inline constexpr int64_t kMaxFolderImages = 10'000'000;
inline constexpr int64_t kMaxFolderClasses = 65535;
// ImageDataset labels are bytes: at most this many classes for now.
inline constexpr int64_t kMaxImageLabelClasses = 256;
inline constexpr int64_t kMaxImageOutputSize = 4096;  // image_size
// Decoded, resized pixels of train + test kept in memory (and in the cache).
inline constexpr int64_t kMaxImageFolderPixelBytes = int64_t{32} << 30;

struct ImageFolderSpec {
  std::string dir;             // one sub-folder per class; class ids in sorted folder-name order
  std::string test_dir;        // optional, same class folders (one missing is fine, an extra one is refused)
  double test_fraction = 0.2;  // without test_dir: a seeded, deterministic split per class, in [0, 1)
  uint64_t seed = 0;
  int64_t image_size = 28;     // center crop to a square, then area average (shrink) or bilinear (enlarge)
  int64_t channels = 1;        // 1: gray (ITU-R 601 luma), 3: RGB (gray replicated)
  // The class folder names in class-id order, so every site numbers classes
  // alike; a class may then be absent from a site's folders. Empty: the
  // sorted names of dir's sub-folders, each of which must hold an image.
  std::vector<std::string> classes;
  // Per-channel normalization of pixels scaled to [0, 1]; empty: computed
  // from the training images (and recorded in both data sets).
  std::vector<float> mean, std;
  std::string cache;  // optional cache file path (format above); "" no cache
  int64_t train_limit = 0, test_limit = 0;  // > 0: keep the first N of the (seeded, shuffled) order
};

// Reads the folders. train and test are ImageSets; both sets are in a seeded
// shuffled order (so a limit keeps a sample of every class). schema:
// sample_shape {channels, image_size, image_size}, classes, canonical text
// "images v1; classes=...; size=S; channels=C; normalize=computed|mean=..;std=..".
Result<LoadedData> load_image_folder(const ImageFolderSpec& spec);

// One decoded image, interleaved: (rows, cols, channels), channels 1 (gray)
// or 3 (RGB); alpha is composited on black, 16-bit samples scaled to 8 bits.
struct DecodedImage {
  int64_t channels = 0;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> pixels;
};

enum class ImageFormat { kUnknown, kPng, kJpeg };
// By the magic bytes: 89 'P' 'N' 'G' 0d 0a 1a 0a, or ff d8 ff.
ImageFormat sniff_image_format(std::span<const uint8_t> bytes);

// Decodes a PNG or JPEG held in memory; `name` (a path) starts every message.
// Never crashes or exits on any input: a flaw is kCorrupt.
Result<DecodedImage> decode_image(std::span<const uint8_t> bytes, const std::string& name);

// The center square of `image`, resized to size x size, as (channels, size,
// size) planes: gray from RGB by ITU-R 601 luma (0.299 R + 0.587 G + 0.114 B),
// RGB from gray by replication. channels 1 or 3, size >= 1.
std::vector<uint8_t> square_planes(const DecodedImage& image, int64_t channels, int64_t size);

}  // namespace fedmesh::train::data
