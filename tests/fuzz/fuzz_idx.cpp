// libFuzzer target for the IDX reader, fedmesh::train::data::load_idx_pair. How to
// build and run it: tests/fuzz/README.md.
//
// Input layout (every byte string is a valid input):
//   byte 0     flags: bit 0 gzip the images part, bit 1 gzip the labels part,
//              bit 2 pass the images file as both arguments
//   byte 1     num_classes - 1 (so 1..256)
//   bytes 2-3  split point, big-endian u16, clamped to what follows
//   rest       images file = rest[0, split), labels file = rest[split, end)
// A part that is not gzipped here is written as it is, so a part that itself
// begins with 1f 8b reaches zlib's gzip decoder with fuzzed compressed bytes.
//
// The files are memfds read through /proc/self/fd/N: nothing touches the
// disk and nothing is left behind. For every input the result must be
//   - is_ok() with consistent data equal to what a plain reference reader
//     (decompress the whole file, then parse it in one pass) makes of the
//     files, or
//   - kCorrupt with a message naming one of the files, where the reference
//     rejects them too.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "train/data/fashion_mnist.h"
#include "tests/support/idx_reference.h"

namespace {

using fedmesh::Result;
using fedmesh::StatusCode;
using fedmesh::train::data::ImageDataset;
using Bytes = fedmesh::testing::IdxBytes;

constexpr size_t kInputHeaderBytes = 4;
constexpr uint8_t kGzipImagesFlag = 1, kGzipLabelsFlag = 2, kSamePathFlag = 4;
// The reference decodes whole files; past this (a gzip bomb from an input
// made large with -max_len) it gives up and only the invariants are checked.
constexpr size_t kReferenceLimitBytes = size_t{256} << 20;

struct MemFile {
  int fd = -1;
  std::string path;
};

MemFile g_images, g_labels;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_idx: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

MemFile make_memfile(const char* name) {
  MemFile file;
  file.fd = memfd_create(name, MFD_CLOEXEC);
  if (file.fd < 0) {
    std::perror("fuzz_idx: memfd_create");
    std::abort();
  }
  file.path = "/proc/self/fd/" + std::to_string(file.fd);
  return file;
}

void fill(const MemFile& file, const uint8_t* data, size_t size) {
  if (ftruncate(file.fd, 0) != 0) violated("ftruncate failed");
  size_t done = 0;
  while (done < size) {
    const ssize_t wrote = pwrite(file.fd, data + done, size - done, static_cast<off_t>(done));
    if (wrote <= 0) violated("pwrite to a memfd failed");
    done += static_cast<size_t>(wrote);
  }
}

Bytes gzip(const uint8_t* data, size_t size) {
  z_stream stream{};
  constexpr int kGzipWindowBits = 15 + 16;  // +16: a gzip header and trailer
  if (deflateInit2(&stream, Z_BEST_SPEED, Z_DEFLATED, kGzipWindowBits, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    violated("deflateInit2 failed");
  }
  Bytes out(deflateBound(&stream, size));
  stream.next_in = const_cast<uint8_t*>(data);
  stream.avail_in = static_cast<uInt>(size);
  stream.next_out = out.data();
  stream.avail_out = static_cast<uInt>(out.size());
  if (deflate(&stream, Z_FINISH) != Z_STREAM_END) violated("deflate did not finish");
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

enum class Decoded { kOk, kError, kTooLarge };

Decoded reference_decode(const std::string& path, Bytes& out) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) return Decoded::kError;
  uint8_t buffer[1 << 16];
  int got = 0;
  while ((got = gzread(file, buffer, sizeof buffer)) > 0) {
    if (out.size() + static_cast<size_t>(got) > kReferenceLimitBytes) {
      gzclose_r(file);
      return Decoded::kTooLarge;
    }
    out.insert(out.end(), buffer, buffer + got);
  }
  int code = Z_OK;
  gzerror(file, &code);
  gzclose_r(file);
  return got < 0 || code != Z_OK ? Decoded::kError : Decoded::kOk;
}

// The data set the files hold, nullopt where they are not a valid pair, or
// `unknown` set where the reference gave up.
std::optional<ImageDataset> reference_load(const std::string& images_path, const std::string& labels_path,
                                           int num_classes, bool& unknown) {
  Bytes images, labels;
  const Decoded images_state = reference_decode(images_path, images);
  const Decoded labels_state = reference_decode(labels_path, labels);
  unknown = images_state == Decoded::kTooLarge || labels_state == Decoded::kTooLarge;
  if (images_state != Decoded::kOk || labels_state != Decoded::kOk) return std::nullopt;
  return fedmesh::testing::reference_parse_idx(images, labels, num_classes);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  g_images = make_memfile("fuzz_idx_images");
  g_labels = make_memfile("fuzz_idx_labels");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kInputHeaderBytes) return -1;  // not added to the corpus
  const uint8_t flags = data[0];
  const int num_classes = 1 + data[1];
  const size_t rest = size - kInputHeaderBytes;
  const size_t split = std::min<size_t>((size_t{data[2]} << 8) | data[3], rest);
  const uint8_t* images = data + kInputHeaderBytes;
  const uint8_t* labels = images + split;
  const size_t labels_size = rest - split;

  if (flags & kGzipImagesFlag) {
    const Bytes packed = gzip(images, split);
    fill(g_images, packed.data(), packed.size());
  } else {
    fill(g_images, images, split);
  }
  if (flags & kGzipLabelsFlag) {
    const Bytes packed = gzip(labels, labels_size);
    fill(g_labels, packed.data(), packed.size());
  } else {
    fill(g_labels, labels, labels_size);
  }
  const std::string& images_path = g_images.path;
  const std::string& labels_path = (flags & kSamePathFlag) ? g_images.path : g_labels.path;

  Result<ImageDataset> got = fedmesh::train::data::load_idx_pair(images_path, labels_path, num_classes);
  bool unknown = false;
  const std::optional<ImageDataset> want = reference_load(images_path, labels_path, num_classes, unknown);

  if (got.is_ok()) {
    const ImageDataset& dataset = got.value();
    if (dataset.count < 1 || dataset.rows < 1 || dataset.cols < 1 ||
        static_cast<int64_t>(dataset.pixels.size()) != dataset.count * dataset.rows * dataset.cols ||
        static_cast<int64_t>(dataset.labels.size()) != dataset.count || dataset.num_classes != num_classes) {
      violated("accepted with inconsistent sizes");
    }
    for (uint8_t label : dataset.labels) {
      if (label >= num_classes) violated("accepted a label not below num_classes");
    }
    if (unknown) return 0;
    if (!want) violated("accepted files the reference rejects");
    if (dataset.count != want->count || dataset.rows != want->rows || dataset.cols != want->cols ||
        dataset.pixels != want->pixels || dataset.labels != want->labels) {
      violated("accepted with data that differ from the files' content");
    }
    return 0;
  }
  const std::string& message = got.status().message();
  if (got.status().code() != StatusCode::kCorrupt) {
    violated("rejected with a code other than corrupt: " + message);
  }
  if (message.find(images_path) == std::string::npos && message.find(labels_path) == std::string::npos) {
    violated("message names neither file: '" + message + "'");
  }
  if (want) violated("rejected valid files: " + message);
  return 0;
}
