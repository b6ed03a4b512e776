#include "train/data/fashion_mnist.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

namespace fedmesh::train::data {
namespace {

// gzread takes an unsigned length; reading in slices this size keeps every
// call far from that limit and lets a short file stop the loop early.
constexpr size_t kReadChunkBytes = size_t{1} << 20;
constexpr unsigned kGzipBufferBytes = 128u << 10;
// A header that passed the bounds may still lie about the length of a tiny
// file, so at most this much is reserved up front; beyond it the buffer grows
// only as bytes actually arrive.
constexpr int64_t kMaxUpfrontReserveBytes = int64_t{64} << 20;
// How many bytes past the payload are read to report trailing garbage.
constexpr size_t kTrailingProbeBytes = 4096;
constexpr size_t kImagesHeaderBytes = 16;
constexpr size_t kLabelsHeaderBytes = 8;

std::string hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", value);
  return text;
}

uint32_t read_be32(const uint8_t* bytes) {
  return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
         uint32_t{bytes[3]};
}

// One IDX file opened through zlib, which reads gzip and plain files alike.
class IdxFile {
 public:
  static Result<IdxFile> open(const std::string& path) {
    errno = 0;
    gzFile file = gzopen(path.c_str(), "rb");
    if (file == nullptr) {
      const int error = errno;
      if (error == ENOENT) return not_found(path + ": no such file");
      return io_error(path + ": cannot open: " +
                      (error != 0 ? std::strerror(error) : "zlib could not allocate its state"));
    }
    gzbuffer(file, kGzipBufferBytes);
    return IdxFile(file, path);
  }

  IdxFile(IdxFile&& other) noexcept
      : file_(std::exchange(other.file_, nullptr)),
        path_(std::move(other.path_)),
        offset_bytes_(other.offset_bytes_) {}
  IdxFile& operator=(IdxFile&&) = delete;
  IdxFile(const IdxFile&) = delete;
  IdxFile& operator=(const IdxFile&) = delete;
  ~IdxFile() {
    if (file_ != nullptr) gzclose_r(file_);
  }

  const std::string& path() const { return path_; }

  // Reads up to `size` bytes into `out`; fewer only at the end of the data.
  // A gzip stream that is damaged or cut short is an error here, so a short
  // count always means a well-formed end of file.
  Result<size_t> read(uint8_t* out, size_t size) {
    size_t total = 0;
    while (total < size) {
      const size_t want = std::min(size - total, kReadChunkBytes);
      const int got = gzread(file_, out + total, static_cast<unsigned>(want));
      if (got > 0) {
        total += static_cast<size_t>(got);
        offset_bytes_ += got;
      }
      if (got < 0 || static_cast<size_t>(got) < want) {
        FEDMESH_RETURN_IF_ERROR(stream_error());
        if (got < 0) return corrupt(path_ + ": read failed after " + std::to_string(offset_bytes_) + " bytes");
        break;
      }
    }
    return total;
  }

 private:
  IdxFile(gzFile file, std::string path) : file_(file), path_(std::move(path)) {}

  // zlib keeps the first error on the handle; Z_BUF_ERROR is how it says a
  // gzip stream ended before its end marker.
  Status stream_error() {
    int code = Z_OK;
    std::string what = gzerror(file_, &code);
    // zlib prefixes its message with the path, which ours already carries.
    if (what.starts_with(path_ + ": ")) what.erase(0, path_.size() + 2);
    const std::string where = " after " + std::to_string(offset_bytes_) + " decompressed bytes";
    switch (code) {
      case Z_OK: return Status::ok();
      case Z_BUF_ERROR: return corrupt(path_ + ": gzip stream is truncated (" + what + ")" + where);
      case Z_ERRNO: return io_error(path_ + ": read failed: " + std::strerror(errno));
      case Z_MEM_ERROR: return io_error(path_ + ": zlib is out of memory");
      default: return corrupt(path_ + ": corrupt gzip stream (" + what + ")" + where);
    }
  }

  gzFile file_;
  std::string path_;
  int64_t offset_bytes_ = 0;  // decompressed bytes read so far
};

Status check_magic(const IdxFile& file, uint32_t magic, uint32_t expected) {
  if (magic == expected) return Status::ok();
  const bool want_images = expected == kIdxImagesMagic;
  std::string message = file.path() + ": bad magic " + hex32(magic) + ", expected " + hex32(expected) +
                        (want_images ? " (IDX images: unsigned bytes, 3 dimensions)"
                                     : " (IDX labels: unsigned bytes, 1 dimension)");
  if (magic == (want_images ? kIdxLabelsMagic : kIdxImagesMagic)) {
    message += want_images ? "; this is a labels file" : "; this is an images file";
  } else if ((magic >> 16) != 0) {
    message += "; not an IDX file";
  }
  return corrupt(std::move(message));
}

// Reads the `size_bytes` header and checks its magic number. The magic is
// judged as soon as its 4 bytes are in, so that a labels file passed as
// images (8-byte header, maybe shorter than 16 bytes) is named as such.
Status read_header(IdxFile& file, uint8_t* header, size_t size_bytes, uint32_t expected_magic) {
  Result<size_t> got = file.read(header, size_bytes);
  if (!got.is_ok()) return got.status();
  if (*got == 0) return corrupt(file.path() + ": file is empty, expected an IDX header");
  if (*got >= 4) {
    FEDMESH_RETURN_IF_ERROR(check_magic(file, read_be32(header), expected_magic));
  }
  if (*got < size_bytes) {
    return corrupt(file.path() + ": file ends after " + std::to_string(*got) + " bytes, inside the " +
                   std::to_string(size_bytes) + "-byte IDX header");
  }
  return Status::ok();
}

Status check_dimension(const IdxFile& file, const char* name, int64_t value, int64_t limit) {
  if (value == 0) return corrupt(file.path() + ": header declares 0 " + name);
  if (value > limit) {
    return corrupt(file.path() + ": header declares " + std::to_string(value) + " " + name +
                   ", more than the limit of " + std::to_string(limit));
  }
  return Status::ok();
}

// Reads the `size_bytes` payload the header declared (already bounded), then
// makes sure nothing follows it. `what` describes the payload for messages.
Result<std::vector<uint8_t>> read_payload(IdxFile& file, int64_t size_bytes, const std::string& what) {
  std::vector<uint8_t> payload;
  payload.reserve(static_cast<size_t>(std::min(size_bytes, kMaxUpfrontReserveBytes)));
  const size_t expected = static_cast<size_t>(size_bytes);
  while (payload.size() < expected) {
    const size_t old_size = payload.size();
    const size_t want = std::min(expected - old_size, kReadChunkBytes);
    payload.resize(old_size + want);
    Result<size_t> got = file.read(payload.data() + old_size, want);
    if (!got.is_ok()) return got.status();
    payload.resize(old_size + *got);
    if (*got < want) {
      return corrupt(file.path() + ": truncated: header declares " + what + " (" +
                     std::to_string(size_bytes) + " bytes) but only " + std::to_string(payload.size()) +
                     " bytes follow");
    }
  }
  // The probe also makes zlib read the gzip trailer, where a wrong CRC or a
  // missing trailer shows up.
  uint8_t probe[kTrailingProbeBytes];
  Result<size_t> extra = file.read(probe, sizeof probe);
  if (!extra.is_ok()) return extra.status();
  if (*extra > 0) {
    return corrupt(file.path() + ": trailing garbage: " +
                   (*extra == sizeof probe ? "at least " : "") + std::to_string(*extra) +
                   " bytes after the " + what + " the header declares");
  }
  return payload;
}

struct ImagesHeader {
  int64_t count = 0, rows = 0, cols = 0;
};

Result<ImagesHeader> read_images_header(IdxFile& file) {
  uint8_t header[kImagesHeaderBytes];
  FEDMESH_RETURN_IF_ERROR(read_header(file, header, sizeof header, kIdxImagesMagic));
  ImagesHeader dims{read_be32(header + 4), read_be32(header + 8), read_be32(header + 12)};
  FEDMESH_RETURN_IF_ERROR(check_dimension(file, "images", dims.count, kMaxIdxImages));
  FEDMESH_RETURN_IF_ERROR(check_dimension(file, "rows", dims.rows, kMaxIdxSide));
  FEDMESH_RETURN_IF_ERROR(check_dimension(file, "columns", dims.cols, kMaxIdxSide));
  // Each factor is bounded above, so the product fits in int64.
  const int64_t pixel_bytes = dims.count * dims.rows * dims.cols;
  if (pixel_bytes > kMaxIdxPixelBytes) {
    return corrupt(file.path() + ": header declares " + std::to_string(dims.count) + " images of " +
                   std::to_string(dims.rows) + "x" + std::to_string(dims.cols) + " (" +
                   std::to_string(pixel_bytes) + " bytes), more than the limit of " +
                   std::to_string(kMaxIdxPixelBytes) + " bytes");
  }
  return dims;
}

Result<int64_t> read_labels_header(IdxFile& file) {
  uint8_t header[kLabelsHeaderBytes];
  FEDMESH_RETURN_IF_ERROR(read_header(file, header, sizeof header, kIdxLabelsMagic));
  const int64_t count = read_be32(header + 4);
  FEDMESH_RETURN_IF_ERROR(check_dimension(file, "labels", count, kMaxIdxImages));
  return count;
}

const char* kFashionMnistFix =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) "
    "or pass --data DIR holding the IDX files";

// Picks DIR/STEM.gz, or DIR/STEM when only the plain file is there.
Result<std::string> resolve_idx_file(const std::string& dir, const std::string& stem) {
  const std::filesystem::path plain = std::filesystem::path(dir) / stem;
  std::filesystem::path gzipped = plain;
  gzipped += ".gz";
  std::error_code error;
  if (std::filesystem::exists(gzipped, error)) return gzipped.string();
  if (std::filesystem::exists(plain, error)) return plain.string();
  if (dir != kDefaultFashionMnistDir) {
    return not_found(gzipped.string() + " (or " + plain.string() + ") is missing: a directory given as data holds "
                     "IDX files (train-images-idx3-ubyte, ...); for your own data name its format: csv:FILE for a "
                     "table, images:DIR for one folder of images per class (docs/data.md)");
  }
  return not_found(gzipped.string() + " (or " + plain.string() + ") is missing: " + kFashionMnistFix);
}

}  // namespace

ImageDataset ImageDataset::subset(std::span<const int64_t> indices) const {
  const int64_t image_bytes = pixels_per_image();
  ImageDataset out;
  out.count = static_cast<int64_t>(indices.size());
  out.channels = channels;
  out.rows = rows;
  out.cols = cols;
  out.num_classes = num_classes;
  out.mean = mean;
  out.std = std;
  out.pixels.resize(static_cast<size_t>(out.count * image_bytes));
  out.labels.resize(indices.size());
  for (size_t i = 0; i < indices.size(); ++i) {
    const int64_t index = indices[i];
    FEDMESH_CHECK(index >= 0 && index < count,
                  "subset index " + std::to_string(index) + " outside [0, " + std::to_string(count) + ")");
    std::copy_n(pixels.begin() + index * image_bytes, image_bytes,
                out.pixels.begin() + static_cast<int64_t>(i) * image_bytes);
    out.labels[i] = labels[static_cast<size_t>(index)];
  }
  return out;
}

ImageDataset ImageDataset::head(int64_t n) const {
  FEDMESH_CHECK(n >= 0, "head of a negative count " + std::to_string(n));
  const int64_t kept = std::min(n, count);
  ImageDataset out;
  out.count = kept;
  out.channels = channels;
  out.rows = rows;
  out.cols = cols;
  out.num_classes = num_classes;
  out.mean = mean;
  out.std = std;
  out.pixels.assign(pixels.begin(), pixels.begin() + kept * pixels_per_image());
  out.labels.assign(labels.begin(), labels.begin() + kept);
  return out;
}

Result<ImageDataset> load_idx_pair(const std::string& images_path, const std::string& labels_path,
                                   int num_classes) {
  if (num_classes < 1 || num_classes > kMaxIdxClasses) {
    return invalid_argument("num_classes " + std::to_string(num_classes) + " is outside [1, " +
                            std::to_string(kMaxIdxClasses) + "]");
  }
  Result<IdxFile> images_file = IdxFile::open(images_path);
  if (!images_file.is_ok()) return images_file.status();
  Result<ImagesHeader> dims = read_images_header(*images_file);
  if (!dims.is_ok()) return dims.status();

  Result<IdxFile> labels_file = IdxFile::open(labels_path);
  if (!labels_file.is_ok()) return labels_file.status();
  Result<int64_t> label_count = read_labels_header(*labels_file);
  if (!label_count.is_ok()) return label_count.status();

  if (*label_count != dims->count) {
    return corrupt(images_path + " declares " + std::to_string(dims->count) + " images but " + labels_path +
                   " declares " + std::to_string(*label_count) + " labels");
  }

  Result<std::vector<uint8_t>> labels =
      read_payload(*labels_file, *label_count, std::to_string(*label_count) + " labels");
  if (!labels.is_ok()) return labels.status();
  for (size_t i = 0; i < labels->size(); ++i) {
    const int label = (*labels)[i];
    if (label >= num_classes) {
      return corrupt(labels_path + ": label " + std::to_string(label) + " at index " + std::to_string(i) +
                     " is not below " + std::to_string(num_classes) + " classes");
    }
  }

  const int64_t pixel_bytes = dims->count * dims->rows * dims->cols;
  Result<std::vector<uint8_t>> pixels = read_payload(
      *images_file, pixel_bytes,
      std::to_string(dims->count) + " images of " + std::to_string(dims->rows) + "x" + std::to_string(dims->cols));
  if (!pixels.is_ok()) return pixels.status();

  ImageDataset dataset;
  dataset.count = dims->count;
  dataset.rows = dims->rows;
  dataset.cols = dims->cols;
  dataset.num_classes = num_classes;
  dataset.pixels = std::move(*pixels);
  dataset.labels = std::move(*labels);
  return dataset;
}

Result<ImageDataset> load_fashion_mnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  Result<std::string> images_path = resolve_idx_file(dir, prefix + "-images-idx3-ubyte");
  if (!images_path.is_ok()) return images_path.status();
  Result<std::string> labels_path = resolve_idx_file(dir, prefix + "-labels-idx1-ubyte");
  if (!labels_path.is_ok()) return labels_path.status();
  constexpr int kFashionMnistClasses = 10;
  return load_idx_pair(*images_path, *labels_path, kFashionMnistClasses);
}

Result<FashionMnistSplits> load_fashion_mnist_splits(const std::string& data, int64_t train_limit,
                                                     int64_t test_limit) {
  if (train_limit < 0 || test_limit < 0) return invalid_argument("limits must be >= 0");
  const std::string directory = data == "fashion-mnist" ? std::string(kDefaultFashionMnistDir) : data;
  Result<ImageDataset> train = load_fashion_mnist(directory, Split::kTrain);
  if (!train.is_ok()) return train.status();
  Result<ImageDataset> test = load_fashion_mnist(directory, Split::kTest);
  if (!test.is_ok()) return test.status();
  FashionMnistSplits splits{std::move(*train), std::move(*test)};
  if (train_limit > 0) splits.train = splits.train.head(train_limit);
  if (test_limit > 0) splits.test = splits.test.head(test_limit);
  return splits;
}

}  // namespace fedmesh::train::data
