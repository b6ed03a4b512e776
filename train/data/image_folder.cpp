#include "train/data/image_folder.h"

// jpeglib.h needs FILE and size_t declared before it.
#include <cstddef>
#include <cstdio>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "base/file_io.h"
#include "base/random.h"
#include "crypto/hash.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

constexpr uint8_t kPngMagic[8] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
constexpr uint8_t kJpegMagic[3] = {0xff, 0xd8, 0xff};
constexpr size_t kSniffBytes = 8;
// libjpeg's working memory (a progressive image keeps all its coefficients);
// past it libjpeg-turbo fails cleanly ("backing store not supported").
constexpr long kMaxJpegWorkingBytes = 1L << 30;
constexpr const char* kCacheMagicLine = "fedmesh-image-cache v1";
constexpr size_t kMaxCacheHeaderBytes = size_t{4} << 20;
constexpr mode_t kCacheFileMode = 0644;

// ---------------------------------------------------------------- decoding

Status check_dimensions(const std::string& name, const char* format, int64_t cols, int64_t rows) {
  if (cols < 1 || rows < 1) {
    return corrupt(name + ": " + format + " declares an empty image (" + std::to_string(cols) + "x" +
                   std::to_string(rows) + ")");
  }
  if (cols > kMaxImageSide || rows > kMaxImageSide) {
    return corrupt(name + ": " + format + " image of " + std::to_string(cols) + "x" + std::to_string(rows) +
                   " is over the limit of " + std::to_string(kMaxImageSide) + " pixels on a side");
  }
  if (cols * rows > kMaxImagePixels) {
    return corrupt(name + ": " + format + " image of " + std::to_string(cols) + "x" + std::to_string(rows) +
                   " has more than the limit of " + std::to_string(kMaxImagePixels) + " pixels");
  }
  return Status::ok();
}

Result<DecodedImage> decode_png(std::span<const uint8_t> bytes, const std::string& name) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  // The simplified API catches libpng's errors itself (its own setjmp) and
  // frees the png_image when it fails; png_image_free is safe to repeat.
  if (png_image_begin_read_from_memory(&image, bytes.data(), bytes.size()) == 0) {
    std::string message = image.message;
    png_image_free(&image);
    return corrupt(name + ": unreadable PNG: " + message);
  }
  Status bounds = check_dimensions(name, "PNG", image.width, image.height);
  if (!bounds.is_ok()) {
    png_image_free(&image);
    return bounds;
  }
  DecodedImage out;
  out.channels = (image.format & PNG_FORMAT_FLAG_COLOR) != 0 ? 3 : 1;
  out.rows = image.height;
  out.cols = image.width;
  image.format = out.channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  // A 16-bit file without gAMA/sRGB is sRGB-encoded like an 8-bit one (libpng
  // would otherwise take it as linear and gamma-encode it on the way to 8 bits).
  image.flags |= PNG_IMAGE_FLAG_16BIT_sRGB;
  out.pixels.resize(PNG_IMAGE_SIZE(image));
  const png_color black = {0, 0, 0};  // alpha is composited on black
  if (png_image_finish_read(&image, &black, out.pixels.data(), 0, nullptr) == 0) {
    std::string message = image.message;
    png_image_free(&image);
    return corrupt(name + ": unreadable PNG: " + message);
  }
  return out;
}

// libjpeg reports errors by calling error_exit, which must not return: it
// longjmps back to decode_jpeg_steps. No C++ object with a destructor lives in
// the frames it jumps over (only libjpeg's C frames), and libjpeg's own
// memory is released by jpeg_destroy_decompress after the jump.
struct JpegErrors {
  jpeg_error_mgr manager;  // first: libjpeg's err pointer is this struct's address
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 64];
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  JpegErrors* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

// Warnings that mean pixels are missing are errors here: libjpeg would
// otherwise pad a truncated file with gray and call it a success. Other
// warnings (extraneous bytes between markers) are tolerated.
void jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0) {
    const int code = cinfo->err->msg_code;
    if (code == JWRN_JPEG_EOF || code == JWRN_HIT_MARKER || code == JWRN_MUST_RESYNC) jpeg_fail(cinfo);
    return;
  }
  if (cinfo->is_decompressor) {
    const int scans = reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number;
    if (scans > kMaxJpegScans) {
      JpegErrors* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
      std::snprintf(errors->message, sizeof errors->message, "more than %d scans", kMaxJpegScans);
      std::longjmp(errors->jump, 1);
    }
  }
}

struct JpegJob {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
  std::string name;
  Status refusal;  // set (and the jump not taken) for refusals after the header
  DecodedImage* out = nullptr;
};

// Returns false with job.errors.message set, or with job.refusal set.
bool decode_jpeg_steps(const uint8_t* data, size_t size, JpegJob& job) {
  j_decompress_ptr cinfo = &job.cinfo;
  cinfo->err = jpeg_std_error(&job.errors.manager);
  job.errors.manager.error_exit = jpeg_fail;
  job.errors.manager.emit_message = jpeg_message;
  job.errors.message[0] = '\0';
  if (setjmp(job.errors.jump) != 0) {
    jpeg_destroy_decompress(cinfo);
    return false;
  }
  jpeg_create_decompress(cinfo);
  cinfo->mem->max_memory_to_use = kMaxJpegWorkingBytes;
  jpeg_mem_src(cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(cinfo, TRUE);
  Status bounds = check_dimensions(job.name, "JPEG", cinfo->image_width, cinfo->image_height);
  if (!bounds.is_ok()) {
    job.refusal = std::move(bounds);
    jpeg_destroy_decompress(cinfo);
    return false;
  }
  switch (cinfo->jpeg_color_space) {
    case JCS_GRAYSCALE: cinfo->out_color_space = JCS_GRAYSCALE; break;
    case JCS_YCbCr:
    case JCS_RGB: cinfo->out_color_space = JCS_RGB; break;
    case JCS_CMYK:
    case JCS_YCCK:
      job.refusal = corrupt(job.name + ": CMYK JPEG is not supported (convert it to RGB)");
      jpeg_destroy_decompress(cinfo);
      return false;
    default:
      job.refusal = corrupt(job.name + ": JPEG with " + std::to_string(cinfo->num_components) +
                            " components of an unknown color space is not supported");
      jpeg_destroy_decompress(cinfo);
      return false;
  }
  jpeg_start_decompress(cinfo);
  DecodedImage& out = *job.out;
  out.channels = cinfo->output_components;
  out.rows = cinfo->output_height;
  out.cols = cinfo->output_width;
  const size_t stride = static_cast<size_t>(out.cols * out.channels);
  out.pixels.resize(stride * static_cast<size_t>(out.rows));
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = out.pixels.data() + stride * cinfo->output_scanline;
    jpeg_read_scanlines(cinfo, &row, 1);
  }
  jpeg_finish_decompress(cinfo);
  jpeg_destroy_decompress(cinfo);
  return true;
}

Result<DecodedImage> decode_jpeg(std::span<const uint8_t> bytes, const std::string& name) {
  DecodedImage out;
  JpegJob job;
  job.name = name;
  job.out = &out;
  if (!decode_jpeg_steps(bytes.data(), bytes.size(), job)) {
    if (!job.refusal.is_ok()) return job.refusal;
    return corrupt(name + ": unreadable JPEG: " + job.errors.message);
  }
  if (out.channels != 1 && out.channels != 3) {
    return corrupt(name + ": JPEG decoded to " + std::to_string(out.channels) + " channels");
  }
  return out;
}

// ---------------------------------------------------------------- resizing

// How each output index of one axis mixes input indices.
struct AxisTaps {
  std::vector<int64_t> first;  // (out) first input index
  std::vector<int64_t> count;  // (out) number of taps
  std::vector<float> weights;  // (out, max_taps)
  int64_t max_taps = 0;
};

AxisTaps make_taps(int64_t in, int64_t out) {
  AxisTaps taps;
  taps.first.resize(static_cast<size_t>(out));
  taps.count.resize(static_cast<size_t>(out));
  if (in > out) {
    // Area average: output o covers [o*scale, (o+1)*scale) of the input.
    const double scale = static_cast<double>(in) / static_cast<double>(out);
    taps.max_taps = static_cast<int64_t>(std::ceil(scale)) + 1;
    taps.weights.assign(static_cast<size_t>(out * taps.max_taps), 0.0f);
    for (int64_t o = 0; o < out; ++o) {
      const double low = static_cast<double>(o) * scale, high = static_cast<double>(o + 1) * scale;
      const int64_t begin = static_cast<int64_t>(std::floor(low));
      const int64_t end = std::min(in, static_cast<int64_t>(std::ceil(high)));
      taps.first[o] = begin;
      taps.count[o] = end - begin;
      for (int64_t s = begin; s < end; ++s) {
        const double overlap = std::min(high, static_cast<double>(s + 1)) - std::max(low, static_cast<double>(s));
        taps.weights[static_cast<size_t>(o * taps.max_taps + (s - begin))] = static_cast<float>(overlap / scale);
      }
    }
  } else {
    // Bilinear with pixel centers at +0.5 (identity when in == out).
    taps.max_taps = 2;
    taps.weights.assign(static_cast<size_t>(out * 2), 0.0f);
    const double scale = static_cast<double>(in) / static_cast<double>(out);
    for (int64_t o = 0; o < out; ++o) {
      const double x = std::clamp((static_cast<double>(o) + 0.5) * scale - 0.5, 0.0, static_cast<double>(in - 1));
      const int64_t s0 = static_cast<int64_t>(std::floor(x));
      const int64_t s1 = std::min(s0 + 1, in - 1);
      const double f = x - static_cast<double>(s0);
      taps.first[o] = s0;
      taps.count[o] = s1 > s0 ? 2 : 1;
      taps.weights[static_cast<size_t>(o * 2)] = static_cast<float>(s1 > s0 ? 1.0 - f : 1.0);
      if (s1 > s0) taps.weights[static_cast<size_t>(o * 2 + 1)] = static_cast<float>(f);
    }
  }
  return taps;
}

uint8_t luma(uint8_t r, uint8_t g, uint8_t b) {
  return static_cast<uint8_t>(std::lround(0.299 * r + 0.587 * g + 0.114 * b));
}

}  // namespace

ImageFormat sniff_image_format(std::span<const uint8_t> bytes) {
  if (bytes.size() >= sizeof kPngMagic && std::memcmp(bytes.data(), kPngMagic, sizeof kPngMagic) == 0) {
    return ImageFormat::kPng;
  }
  if (bytes.size() >= sizeof kJpegMagic && std::memcmp(bytes.data(), kJpegMagic, sizeof kJpegMagic) == 0) {
    return ImageFormat::kJpeg;
  }
  return ImageFormat::kUnknown;
}

Result<DecodedImage> decode_image(std::span<const uint8_t> bytes, const std::string& name) {
  switch (sniff_image_format(bytes)) {
    case ImageFormat::kPng: return decode_png(bytes, name);
    case ImageFormat::kJpeg: return decode_jpeg(bytes, name);
    case ImageFormat::kUnknown: break;
  }
  return corrupt(name + ": neither a PNG nor a JPEG (by its first bytes)");
}

std::vector<uint8_t> square_planes(const DecodedImage& image, int64_t channels, int64_t size) {
  FEDMESH_CHECK(channels == 1 || channels == 3, "channels must be 1 or 3");
  FEDMESH_CHECK(size >= 1, "size must be positive");
  FEDMESH_CHECK(image.channels == 1 || image.channels == 3, "a decoded image has 1 or 3 channels");
  FEDMESH_CHECK(static_cast<int64_t>(image.pixels.size()) == image.rows * image.cols * image.channels,
                "decoded pixels match their dimensions");
  const int64_t side = std::min(image.rows, image.cols);
  const int64_t row0 = (image.rows - side) / 2, col0 = (image.cols - side) / 2;
  // The center square in the output's channels, as planes: (channels, side, side).
  const size_t plane = static_cast<size_t>(side * side);
  std::vector<uint8_t> square(static_cast<size_t>(channels) * plane);
  for (int64_t r = 0; r < side; ++r) {
    const uint8_t* src = image.pixels.data() + ((row0 + r) * image.cols + col0) * image.channels;
    const size_t at = static_cast<size_t>(r * side);
    for (int64_t c = 0; c < side; ++c) {
      const uint8_t* p = src + c * image.channels;
      if (channels == 1) {
        square[at + c] = image.channels == 1 ? p[0] : luma(p[0], p[1], p[2]);
      } else {
        for (int64_t k = 0; k < 3; ++k) square[k * plane + at + c] = image.channels == 1 ? p[0] : p[k];
      }
    }
  }
  if (side == size) return square;

  const AxisTaps taps = make_taps(side, size);
  std::vector<uint8_t> out(static_cast<size_t>(channels * size * size));
  std::vector<float> across(static_cast<size_t>(side * size));  // (side rows, size cols) of one channel
  for (int64_t k = 0; k < channels; ++k) {
    const uint8_t* in = square.data() + k * plane;
    for (int64_t r = 0; r < side; ++r) {
      for (int64_t o = 0; o < size; ++o) {
        float sum = 0.0f;
        const float* w = taps.weights.data() + o * taps.max_taps;
        const uint8_t* p = in + r * side + taps.first[o];
        for (int64_t t = 0; t < taps.count[o]; ++t) sum += w[t] * static_cast<float>(p[t]);
        across[static_cast<size_t>(r * size + o)] = sum;
      }
    }
    uint8_t* dst = out.data() + k * size * size;
    for (int64_t o = 0; o < size; ++o) {
      const float* w = taps.weights.data() + o * taps.max_taps;
      for (int64_t c = 0; c < size; ++c) {
        float sum = 0.0f;
        for (int64_t t = 0; t < taps.count[o]; ++t) sum += w[t] * across[static_cast<size_t>((taps.first[o] + t) * size + c)];
        dst[o * size + c] = static_cast<uint8_t>(std::clamp(std::lround(sum), 0L, 255L));
      }
    }
  }
  return out;
}

namespace {

// ---------------------------------------------------------------- folders

struct ListedFile {
  int32_t label = 0;
  std::string path;      // as opened and as named in messages
  std::string relative;  // class/.../name, for the cache key and the order
  uint64_t size_bytes = 0;
  int64_t mtime_ns = 0;
};

struct Listing {
  std::vector<ListedFile> files;  // by label, then relative path
  int64_t skipped = 0;            // hidden files and files outside class folders
};

bool hidden(const std::string& name) { return !name.empty() && name[0] == '.'; }

Status stat_file(ListedFile& file) {
  struct stat info {};
  if (::stat(file.path.c_str(), &info) != 0) {
    return io_error(file.path + ": cannot stat: " + errno_text(errno));
  }
  file.size_bytes = static_cast<uint64_t>(info.st_size);
  file.mtime_ns = static_cast<int64_t>(info.st_mtim.tv_sec) * 1'000'000'000 + info.st_mtim.tv_nsec;
  return Status::ok();
}

// The class sub-folders of `dir`, sorted by name.
Result<std::vector<std::string>> class_folders(const std::string& dir, int64_t& skipped) {
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (!fs::exists(status)) return not_found(dir + ": no such folder");
  if (!fs::is_directory(status)) return invalid_argument(dir + ": not a folder (images:DIR wants one sub-folder per class)");
  std::vector<std::string> names;
  fs::directory_iterator it(dir, error);
  if (error) return io_error(dir + ": cannot list: " + error.message());
  for (; it != fs::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (hidden(name)) {
      ++skipped;
      continue;
    }
    std::error_code type_error;
    if (it->is_directory(type_error)) {
      names.push_back(name);
      if (static_cast<int64_t>(names.size()) > kMaxFolderClasses) {
        return invalid_argument(dir + ": more than " + std::to_string(kMaxFolderClasses) + " class folders");
      }
    } else {
      ++skipped;
    }
  }
  if (error) return io_error(dir + ": cannot list: " + error.message());
  std::sort(names.begin(), names.end());
  return names;
}

// Every file under class folder `label` (recursively, hidden ones skipped),
// appended to `listing` sorted by relative path.
Status list_class(const std::string& dir, const std::string& class_name, int32_t label, Listing& listing) {
  const fs::path root = fs::path(dir) / class_name;
  std::vector<ListedFile> found;
  std::error_code error;
  fs::recursive_directory_iterator it(root, error);
  if (error) return io_error(root.string() + ": cannot list: " + error.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    std::error_code type_error;
    if (hidden(name)) {
      if (it->is_directory(type_error)) it.disable_recursion_pending();
      ++listing.skipped;
      continue;
    }
    if (it->is_directory(type_error)) continue;
    if (!it->is_regular_file(type_error)) {
      ++listing.skipped;
      continue;
    }
    ListedFile file;
    file.label = label;
    file.path = it->path().string();
    file.relative = class_name + "/" + it->path().lexically_relative(root).generic_string();
    FEDMESH_RETURN_IF_ERROR(stat_file(file));
    found.push_back(std::move(file));
    if (static_cast<int64_t>(listing.files.size() + found.size()) > kMaxFolderImages) {
      return invalid_argument(dir + ": more than " + std::to_string(kMaxFolderImages) + " files in class folders");
    }
  }
  if (error) return io_error(root.string() + ": cannot list: " + error.message());
  std::sort(found.begin(), found.end(),
            [](const ListedFile& a, const ListedFile& b) { return a.relative < b.relative; });
  for (ListedFile& file : found) listing.files.push_back(std::move(file));
  return Status::ok();
}

// Runs fn(i) for i in [0, count) on every hardware thread. The Status
// returned is that of the smallest failing i, whatever the timing (indexes
// past a known failure are skipped).
template <class Fn>
Status parallel_for(size_t count, Fn&& fn) {
  const size_t threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), count);
  std::atomic<size_t> next{0};
  std::atomic<size_t> first_failure{SIZE_MAX};
  std::mutex mutex;
  Status failure;
  auto work = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= count) return;
      if (i > first_failure.load()) continue;
      Status status;
      try {
        status = fn(i);
      } catch (const std::bad_alloc&) {
        status = io_error("out of memory at item " + std::to_string(i));
      }
      if (!status.is_ok()) {
        std::lock_guard<std::mutex> lock(mutex);
        if (i < first_failure.load()) {
          first_failure.store(i);
          failure = std::move(status);
        }
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  return failure;
}

Result<ImageFormat> sniff_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error(path + ": cannot open: " + errno_text(errno));
  uint8_t head[kSniffBytes] = {};
  in.read(reinterpret_cast<char*>(head), sizeof head);
  return sniff_image_format({head, static_cast<size_t>(in.gcount())});
}

// ---------------------------------------------------------------- text

std::string escaped(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c <= 0x20 || c >= 0x7f || c == ',' || c == ';' || c == '%' || c == '=') {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string float_list(const std::vector<float>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) {
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", static_cast<double>(values[i]));
    if (i > 0) out += ',';
    out += text;
  }
  return out;
}

std::string hex(const crypto::Hash& hash) {
  std::string out;
  for (uint8_t byte : hash) {
    char text[3];
    std::snprintf(text, sizeof text, "%02x", byte);
    out += text;
  }
  return out;
}

// ---------------------------------------------------------------- spec

Status check_spec(const ImageFolderSpec& spec) {
  if (spec.dir.empty()) return invalid_argument("images: no folder given (images:DIR)");
  if (spec.channels != 1 && spec.channels != 3) {
    return invalid_argument("images:" + spec.dir + ": channels must be 1 (gray) or 3 (RGB), not " +
                            std::to_string(spec.channels));
  }
  if (spec.image_size < 1 || spec.image_size > kMaxImageOutputSize) {
    return invalid_argument("images:" + spec.dir + ": image size " + std::to_string(spec.image_size) +
                            " outside [1, " + std::to_string(kMaxImageOutputSize) + "]");
  }
  if (!(spec.test_fraction >= 0.0 && spec.test_fraction < 1.0)) {
    return invalid_argument("images:" + spec.dir + ": test fraction " + std::to_string(spec.test_fraction) +
                            " outside [0, 1)");
  }
  if (spec.train_limit < 0 || spec.test_limit < 0) {
    return invalid_argument("images:" + spec.dir + ": limits must be >= 0");
  }
  if (spec.mean.empty() != spec.std.empty()) {
    return invalid_argument("images:" + spec.dir + ": give both mean and std, or neither");
  }
  if (!spec.mean.empty()) {
    if (spec.mean.size() != static_cast<size_t>(spec.channels) || spec.std.size() != static_cast<size_t>(spec.channels)) {
      return invalid_argument("images:" + spec.dir + ": mean and std need one value per channel (" +
                              std::to_string(spec.channels) + ")");
    }
    for (size_t c = 0; c < spec.mean.size(); ++c) {
      if (!std::isfinite(spec.mean[c]) || !std::isfinite(spec.std[c]) || !(spec.std[c] > 0.0f)) {
        return invalid_argument("images:" + spec.dir + ": mean must be finite and std finite and positive");
      }
    }
  }
  if (static_cast<int64_t>(spec.classes.size()) > kMaxFolderClasses) {
    return invalid_argument("images:" + spec.dir + ": more than " + std::to_string(kMaxFolderClasses) + " classes");
  }
  std::vector<std::string> sorted = spec.classes;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const std::string& name = sorted[i];
    if (name.empty() || name == "." || name == ".." || hidden(name) || name.find('/') != std::string::npos) {
      return invalid_argument("images:" + spec.dir + ": class name '" + name + "' is not a folder name");
    }
    if (i > 0 && sorted[i - 1] == name) {
      return invalid_argument("images:" + spec.dir + ": class '" + name + "' named twice");
    }
  }
  return Status::ok();
}

Status check_class_count(const std::string& dir, size_t classes) {
  if (static_cast<int64_t>(classes) > kMaxImageLabelClasses) {
    return invalid_argument(dir + ": " + std::to_string(classes) + " classes, but image labels are bytes: at most " +
                            std::to_string(kMaxImageLabelClasses) + " classes for now");
  }
  return Status::ok();
}

// Lists `dir` against the class names (extra folders refused).
Status list_against(const std::string& dir, const std::vector<std::string>& classes, Listing& listing) {
  Result<std::vector<std::string>> folders = class_folders(dir, listing.skipped);
  if (!folders.is_ok()) return folders.status();
  for (const std::string& folder : *folders) {
    const auto at = std::find(classes.begin(), classes.end(), folder);
    if (at == classes.end()) {
      return invalid_argument((fs::path(dir) / folder).string() + ": a class folder that is not one of the " +
                              std::to_string(classes.size()) + " classes");
    }
    FEDMESH_RETURN_IF_ERROR(list_class(dir, folder, static_cast<int32_t>(at - classes.begin()), listing));
  }
  std::stable_sort(listing.files.begin(), listing.files.end(),
                   [](const ListedFile& a, const ListedFile& b) { return a.label < b.label; });
  return Status::ok();
}

crypto::Hash cache_key(const ImageFolderSpec& spec, const std::vector<std::string>& classes, const Listing& train,
                       const Listing& test) {
  crypto::Hasher hasher;
  hasher.update_text(kCacheMagicLine);
  hasher.update_text(spec.dir);
  hasher.update_text(spec.test_dir);
  char fraction[32];
  std::snprintf(fraction, sizeof fraction, "%.17g", spec.test_fraction);
  hasher.update_text(fraction);
  hasher.update_u64(spec.seed);
  hasher.update_u64(static_cast<uint64_t>(spec.image_size));
  hasher.update_u64(static_cast<uint64_t>(spec.channels));
  hasher.update_u64(static_cast<uint64_t>(spec.train_limit));
  hasher.update_u64(static_cast<uint64_t>(spec.test_limit));
  hasher.update_u64(classes.size());
  for (const std::string& name : classes) hasher.update_text(name);
  for (const Listing* listing : {&train, &test}) {
    hasher.update_u64(listing->files.size());
    for (const ListedFile& file : listing->files) {
      hasher.update_u64(static_cast<uint64_t>(file.label));
      hasher.update_text(file.relative);
      hasher.update_u64(file.size_bytes);
      hasher.update_u64(static_cast<uint64_t>(file.mtime_ns));
    }
  }
  return hasher.finish();
}

// ---------------------------------------------------------------- loading

struct Decoded {
  ImageDataset train, test;
  int64_t skipped = 0;
  std::string source;  // "8x8", or "mixed sizes, 6x8 to 640x480"
};

crypto::Hash payload_checksum(const ImageDataset& train, const ImageDataset& test) {
  crypto::Hasher hasher;
  hasher.update(train.labels);
  hasher.update(train.pixels);
  hasher.update(test.labels);
  hasher.update(test.pixels);
  return hasher.finish();
}

ImageDataset empty_set(const ImageFolderSpec& spec, int num_classes) {
  ImageDataset set;
  set.channels = spec.channels;
  set.rows = set.cols = spec.image_size;
  set.num_classes = num_classes;
  return set;
}

// Reads the cache when its key matches; nullopt (with `why`) when it must be rebuilt.
std::optional<Decoded> read_cache(const ImageFolderSpec& spec, const std::string& key, int num_classes,
                                  std::string& why) {
  std::ifstream in(spec.cache, std::ios::binary);
  if (!in) {
    why = "written";
    return std::nullopt;
  }
  std::string head(kMaxCacheHeaderBytes, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  const size_t line1 = head.find('\n');
  const size_t line2 = line1 == std::string::npos ? line1 : head.find('\n', line1 + 1);
  if (line2 == std::string::npos || head.compare(0, line1, kCacheMagicLine) != 0) {
    why = "rebuilt (not a cache file of this version)";
    return std::nullopt;
  }
  const nlohmann::json header = nlohmann::json::parse(head.substr(line1 + 1, line2 - line1 - 1), nullptr, false);
  auto integer = [&](const char* name, int64_t low, int64_t high) -> std::optional<int64_t> {
    if (!header.is_object() || !header.contains(name) || !header[name].is_number_integer()) return std::nullopt;
    const int64_t value = header[name].get<int64_t>();
    if (value < low || value > high) return std::nullopt;
    return value;
  };
  const auto train_count = integer("train", 0, kMaxFolderImages), test_count = integer("test", 0, kMaxFolderImages),
             skipped = integer("skipped", 0, INT64_MAX);
  if (!train_count || !test_count || !skipped || !header.contains("key") || !header["key"].is_string() ||
      !header.contains("checksum") || !header["checksum"].is_string() || !header.contains("source") ||
      !header["source"].is_string()) {
    why = "rebuilt (malformed header)";
    return std::nullopt;
  }
  if (header["key"].get<std::string>() != key) {
    why = "rebuilt (the spec or the folders changed)";
    return std::nullopt;
  }
  Decoded decoded{empty_set(spec, num_classes), empty_set(spec, num_classes), *skipped,
                  header["source"].get<std::string>()};
  const int64_t per_image = spec.channels * spec.image_size * spec.image_size;
  const uint64_t payload = static_cast<uint64_t>((*train_count + *test_count) * (1 + per_image));
  std::error_code error;
  const uint64_t file_bytes = fs::file_size(spec.cache, error);
  if (error || file_bytes != line2 + 1 + payload) {
    why = "rebuilt (wrong length)";
    return std::nullopt;
  }
  in.clear();
  in.seekg(static_cast<std::streamoff>(line2 + 1));
  for (ImageDataset* set : {&decoded.train, &decoded.test}) {
    set->count = set == &decoded.train ? *train_count : *test_count;
    set->labels.resize(static_cast<size_t>(set->count));
    set->pixels.resize(static_cast<size_t>(set->count * per_image));
    in.read(reinterpret_cast<char*>(set->labels.data()), static_cast<std::streamsize>(set->labels.size()));
    in.read(reinterpret_cast<char*>(set->pixels.data()), static_cast<std::streamsize>(set->pixels.size()));
  }
  if (!in || hex(payload_checksum(decoded.train, decoded.test)) != header["checksum"].get<std::string>()) {
    why = "rebuilt (checksum mismatch)";
    return std::nullopt;
  }
  for (const ImageDataset* set : {&decoded.train, &decoded.test}) {
    for (uint8_t label : set->labels) {
      if (label >= num_classes) {
        why = "rebuilt (a label out of range)";
        return std::nullopt;
      }
    }
  }
  return decoded;
}

Status write_cache(const ImageFolderSpec& spec, const std::string& key, const Decoded& decoded) {
  nlohmann::json header = {
      {"key", key},
      {"checksum", hex(payload_checksum(decoded.train, decoded.test))},
      {"train", decoded.train.count},
      {"test", decoded.test.count},
      {"channels", spec.channels},
      {"size", spec.image_size},
      {"skipped", decoded.skipped},
      {"source", decoded.source},
  };
  std::string bytes = std::string(kCacheMagicLine) + "\n" + header.dump() + "\n";
  bytes.reserve(bytes.size() + decoded.train.labels.size() + decoded.train.pixels.size() +
                decoded.test.labels.size() + decoded.test.pixels.size());
  for (const ImageDataset* set : {&decoded.train, &decoded.test}) {
    bytes.append(reinterpret_cast<const char*>(set->labels.data()), set->labels.size());
    bytes.append(reinterpret_cast<const char*>(set->pixels.data()), set->pixels.size());
  }
  return write_file_atomically(spec.cache, bytes, kCacheFileMode);
}

void shuffle(std::vector<size_t>& order, Rng& rng) {
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
}

// Sniffs, splits, decodes and resizes.
Result<Decoded> decode_folders(const ImageFolderSpec& spec, const std::vector<std::string>& classes,
                               const Listing& train_listing, const Listing& test_listing) {
  const int num_classes = static_cast<int>(classes.size());
  // Which files are images, by their first bytes.
  std::vector<const ListedFile*> all;
  for (const Listing* listing : {&train_listing, &test_listing}) {
    for (const ListedFile& file : listing->files) all.push_back(&file);
  }
  std::vector<uint8_t> is_image(all.size(), 0);
  FEDMESH_RETURN_IF_ERROR(parallel_for(all.size(), [&](size_t i) -> Status {
    Result<ImageFormat> format = sniff_file(all[i]->path);
    if (!format.is_ok()) return format.status();
    is_image[i] = *format != ImageFormat::kUnknown;
    return Status::ok();
  }));
  Decoded decoded{empty_set(spec, num_classes), empty_set(spec, num_classes),
                  train_listing.skipped + test_listing.skipped, ""};
  // Images of each class in each folder, as indexes into `all`.
  std::vector<std::vector<size_t>> train_by_class(classes.size()), test_by_class(classes.size());
  for (size_t i = 0; i < all.size(); ++i) {
    if (!is_image[i]) {
      ++decoded.skipped;
      continue;
    }
    const bool from_test = i >= train_listing.files.size();
    (from_test ? test_by_class : train_by_class)[static_cast<size_t>(all[i]->label)].push_back(i);
  }
  if (spec.classes.empty()) {
    for (size_t c = 0; c < classes.size(); ++c) {
      if (train_by_class[c].empty()) {
        return invalid_argument((fs::path(spec.dir) / classes[c]).string() + ": no PNG or JPEG images in this class folder");
      }
    }
  }
  Rng rng(spec.seed);
  std::vector<size_t> train_order, test_order;
  for (size_t c = 0; c < classes.size(); ++c) {
    std::vector<size_t>& mine = train_by_class[c];
    if (spec.test_dir.empty()) {
      shuffle(mine, rng);
      int64_t test = std::llround(spec.test_fraction * static_cast<double>(mine.size()));
      test = std::min<int64_t>(test, std::max<int64_t>(0, static_cast<int64_t>(mine.size()) - 1));
      test_order.insert(test_order.end(), mine.begin(), mine.begin() + test);
      train_order.insert(train_order.end(), mine.begin() + test, mine.end());
    } else {
      train_order.insert(train_order.end(), mine.begin(), mine.end());
      test_order.insert(test_order.end(), test_by_class[c].begin(), test_by_class[c].end());
    }
  }
  if (train_order.empty()) return invalid_argument(spec.dir + ": no PNG or JPEG images in its class folders");
  shuffle(train_order, rng);
  shuffle(test_order, rng);
  if (spec.train_limit > 0 && static_cast<int64_t>(train_order.size()) > spec.train_limit) {
    train_order.resize(static_cast<size_t>(spec.train_limit));
  }
  if (spec.test_limit > 0 && static_cast<int64_t>(test_order.size()) > spec.test_limit) {
    test_order.resize(static_cast<size_t>(spec.test_limit));
  }
  const int64_t per_image = spec.channels * spec.image_size * spec.image_size;
  const int64_t total = static_cast<int64_t>(train_order.size() + test_order.size());
  if (total > kMaxImageFolderPixelBytes / per_image) {
    return invalid_argument(spec.dir + ": " + std::to_string(total) + " images of " + std::to_string(per_image) +
                            " bytes are over the limit of " + std::to_string(kMaxImageFolderPixelBytes) +
                            " bytes in memory; use a smaller size or a limit");
  }

  std::vector<size_t> order = train_order;
  order.insert(order.end(), test_order.begin(), test_order.end());
  std::vector<std::vector<uint8_t>> planes(order.size());
  std::vector<std::pair<int64_t, int64_t>> dims(order.size());  // (cols, rows)
  FEDMESH_RETURN_IF_ERROR(parallel_for(order.size(), [&](size_t i) -> Status {
    const ListedFile& file = *all[order[i]];
    Result<std::string> bytes = read_file_bounded(file.path, static_cast<size_t>(kMaxImageFileBytes));
    if (!bytes.is_ok()) return bytes.status();
    Result<DecodedImage> image = decode_image(
        {reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()}, file.path);
    if (!image.is_ok()) return image.status();
    dims[i] = {image->cols, image->rows};
    planes[i] = square_planes(*image, spec.channels, spec.image_size);
    return Status::ok();
  }));

  for (ImageDataset* set : {&decoded.train, &decoded.test}) {
    const bool is_train = set == &decoded.train;
    const size_t begin = is_train ? 0 : train_order.size();
    const size_t end = is_train ? train_order.size() : order.size();
    set->count = static_cast<int64_t>(end - begin);
    set->pixels.reserve(static_cast<size_t>(set->count * per_image));
    for (size_t i = begin; i < end; ++i) {
      set->pixels.insert(set->pixels.end(), planes[i].begin(), planes[i].end());
      std::vector<uint8_t>().swap(planes[i]);
      set->labels.push_back(static_cast<uint8_t>(all[order[i]]->label));
    }
  }
  const auto [smallest, largest] = std::minmax_element(dims.begin(), dims.end(), [](const auto& a, const auto& b) {
    return a.first * a.second < b.first * b.second || (a.first * a.second == b.first * b.second && a < b);
  });
  auto size_text = [](const std::pair<int64_t, int64_t>& d) {
    return std::to_string(d.first) + "x" + std::to_string(d.second);
  };
  const bool uniform = std::all_of(dims.begin(), dims.end(), [&](const auto& d) { return d == dims.front(); });
  decoded.source = uniform ? size_text(dims.front())
                           : "mixed sizes, " + size_text(*smallest) + " to " + size_text(*largest);
  return decoded;
}

// Per-channel mean and std of the training pixels scaled to [0, 1].
void computed_normalization(const ImageDataset& train, std::vector<float>& mean, std::vector<float>& std_dev) {
  const int64_t plane = train.rows * train.cols;
  mean.assign(static_cast<size_t>(train.channels), 0.0f);
  std_dev.assign(static_cast<size_t>(train.channels), 1.0f);
  for (int64_t c = 0; c < train.channels; ++c) {
    uint64_t histogram[256] = {};
    for (int64_t i = 0; i < train.count; ++i) {
      const uint8_t* p = train.pixels.data() + (i * train.channels + c) * plane;
      for (int64_t j = 0; j < plane; ++j) ++histogram[p[j]];
    }
    double n = 0, sum = 0, squares = 0;
    for (int v = 0; v < 256; ++v) {
      const double x = v / 255.0, k = static_cast<double>(histogram[v]);
      n += k;
      sum += k * x;
      squares += k * x * x;
    }
    if (n == 0) continue;
    const double m = sum / n;
    const double s = std::sqrt(std::max(0.0, squares / n - m * m));
    mean[static_cast<size_t>(c)] = static_cast<float>(m);
    // A constant channel would divide by zero: leave it unscaled.
    std_dev[static_cast<size_t>(c)] = s > 1e-6 ? static_cast<float>(s) : 1.0f;
  }
}

}  // namespace

Result<LoadedData> load_image_folder(const ImageFolderSpec& spec) {
  FEDMESH_RETURN_IF_ERROR(check_spec(spec));
  int64_t top_level_entries = 0;  // counted again by list_against
  std::vector<std::string> classes = spec.classes;
  if (classes.empty()) {
    Result<std::vector<std::string>> found = class_folders(spec.dir, top_level_entries);
    if (!found.is_ok()) return found.status();
    if (found->empty()) return invalid_argument(spec.dir + ": no class folders (images:DIR wants one sub-folder per class)");
    classes = std::move(*found);
  }
  FEDMESH_RETURN_IF_ERROR(check_class_count(spec.dir, classes.size()));
  const int num_classes = static_cast<int>(classes.size());

  Listing train_listing, test_listing;
  FEDMESH_RETURN_IF_ERROR(list_against(spec.dir, classes, train_listing));
  if (!spec.test_dir.empty()) FEDMESH_RETURN_IF_ERROR(list_against(spec.test_dir, classes, test_listing));

  std::string cache_state;
  std::optional<Decoded> decoded;
  std::string key;
  if (!spec.cache.empty()) {
    key = hex(cache_key(spec, classes, train_listing, test_listing));
    decoded = read_cache(spec, key, num_classes, cache_state);
    if (decoded) cache_state = "reused";
  }
  if (!decoded) {
    Result<Decoded> fresh = decode_folders(spec, classes, train_listing, test_listing);
    if (!fresh.is_ok()) return fresh.status();
    decoded = std::move(*fresh);
    if (!spec.cache.empty()) {
      Status written = write_cache(spec, key, *decoded);
      if (!written.is_ok()) cache_state = "not written: " + written.message();
    }
  }

  std::vector<float> mean = spec.mean, std_dev = spec.std;
  if (mean.empty()) computed_normalization(decoded->train, mean, std_dev);
  for (ImageDataset* set : {&decoded->train, &decoded->test}) {
    set->mean = mean;
    set->std = std_dev;
  }

  LoadedData data;
  data.schema.sample_shape = {spec.channels, spec.image_size, spec.image_size};
  data.schema.classes = num_classes;
  std::string class_list;
  for (size_t c = 0; c < classes.size(); ++c) {
    if (c > 0) class_list += ',';
    class_list += escaped(classes[c]);
  }
  data.schema.canonical = "images v1; classes=" + class_list + "; size=" + std::to_string(spec.image_size) +
                          "; channels=" + std::to_string(spec.channels) + "; normalize=" +
                          (spec.mean.empty() ? std::string("computed")
                                             : "mean=" + float_list(spec.mean) + ";std=" + float_list(spec.std));
  const std::string size_text = std::to_string(spec.image_size) + "x" + std::to_string(spec.image_size);
  data.description = std::to_string(decoded->train.count) + " images of " + std::to_string(num_classes) +
                     " classes in " + spec.dir + " (" + std::to_string(decoded->test.count) + " test" +
                     (spec.test_dir.empty() ? "" : " in " + spec.test_dir) + "), " + decoded->source + " -> " +
                     size_text + (spec.channels == 1 ? " gray" : " RGB");
  // (Top-level files outside class folders are counted by list_against.)
  const int64_t skipped = decoded->skipped;
  if (skipped > 0) data.description += ", " + std::to_string(skipped) + " other files skipped";
  if (!cache_state.empty()) data.description += ", cache " + cache_state;
  data.train = std::make_unique<ImageSet>(std::move(decoded->train));
  data.test = std::make_unique<ImageSet>(std::move(decoded->test));
  return data;
}

}  // namespace fedmesh::train::data
