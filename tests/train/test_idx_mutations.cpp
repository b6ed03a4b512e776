// Deterministic mutation fuzzing of the IDX reader (train/data/fashion_mnist).
//
// A small valid image+label pair is mutated a few thousand times from a fixed
// seed (bit flips, interesting bytes, truncation, garbage, header fields set
// to zero/huge/negative-as-unsigned, swapped files, duplicated and deleted
// chunks; for gzip files the payload before compression or the compressed
// bytes). Every variant must come back from load_idx_pair, and the answer is
// compared with a reference reader kept deliberately plain: the whole file is
// decompressed into memory, then parsed in one pass.
//   - reference valid   => is_ok(), and the data equal the reference's;
//   - reference invalid => kCorrupt with a message naming the file at fault.
// Run under ASan/UBSan this also proves no variant touches memory it should
// not. A failure prints the variant index and its mutations, so that
// FEDMESH_IDX_SEED / FEDMESH_IDX_VARIANTS replay or widen a run.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/random.h"
#include "train/data/fashion_mnist.h"
#include "tests/support/idx_reference.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;
using Bytes = fedmesh::testing::IdxBytes;

constexpr uint64_t kDefaultSeed = 0x1d5eed;
constexpr int kDefaultVariants = 4000;
constexpr int kMaxReportedFailures = 10;
constexpr uint32_t kCount = 20, kRows = 4, kCols = 3;
constexpr int kNumClasses = 10;
constexpr size_t kImagesHeaderBytes = fedmesh::testing::kIdxImagesHeaderBytes;
constexpr size_t kLabelsHeaderBytes = fedmesh::testing::kIdxLabelsHeaderBytes;

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  return text != nullptr && *text != '\0' ? std::strtoull(text, nullptr, 0) : fallback;
}

void store_be32(Bytes& bytes, size_t at, uint32_t value) {
  if (bytes.size() < at + 4) bytes.resize(at + 4);
  for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<uint8_t>(value >> (24 - 8 * i));
}

Bytes images_bytes(uint32_t count, uint32_t rows = kRows, uint32_t cols = kCols, bool with_payload = true) {
  Bytes out(kImagesHeaderBytes);
  store_be32(out, 0, kIdxImagesMagic);
  store_be32(out, 4, count);
  store_be32(out, 8, rows);
  store_be32(out, 12, cols);
  const uint64_t pixel_bytes = with_payload ? uint64_t{count} * rows * cols : 0;
  for (uint64_t i = 0; i < pixel_bytes; ++i) out.push_back(static_cast<uint8_t>(31 * i + 7));
  return out;
}

Bytes labels_bytes(uint32_t count) {
  Bytes out(kLabelsHeaderBytes);
  store_be32(out, 0, kIdxLabelsMagic);
  store_be32(out, 4, count);
  for (uint32_t i = 0; i < count; ++i) out.push_back(static_cast<uint8_t>(i % kNumClasses));
  return out;
}

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  FEDMESH_CHECK(out.good(), "cannot write " + path);
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_gzip(const std::string& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  FEDMESH_CHECK(file != nullptr, "gzopen " + path);
  if (!bytes.empty()) {
    FEDMESH_CHECK(
        gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()),
        "gzwrite " + path);
  }
  FEDMESH_CHECK(gzclose(file) == Z_OK, "gzclose " + path);
}

// ---- the reference reader --------------------------------------------------

// The whole decompressed content, or nothing where zlib reports an error.
std::optional<Bytes> reference_decode(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) return std::nullopt;
  Bytes out;
  uint8_t buffer[4096];
  int got = 0;
  while ((got = gzread(file, buffer, sizeof buffer)) > 0) out.insert(out.end(), buffer, buffer + got);
  int code = Z_OK;
  gzerror(file, &code);
  gzclose_r(file);
  if (got < 0 || code != Z_OK) return std::nullopt;
  return out;
}

std::optional<ImageDataset> reference_load(const std::string& images_path, const std::string& labels_path,
                                           int num_classes) {
  const std::optional<Bytes> images = reference_decode(images_path);
  const std::optional<Bytes> labels = reference_decode(labels_path);
  if (!images || !labels) return std::nullopt;
  return fedmesh::testing::reference_parse_idx(*images, *labels, num_classes);
}

// A message with the file paths taken out and cut before its first number:
// "bad magic ", "header declares ", "FILE declares " (a count mismatch).
std::string rejection_kind(std::string message, const std::array<std::string, 2>& paths) {
  for (const std::string& path : paths) {
    for (size_t at = message.find(path); at != std::string::npos; at = message.find(path, at)) {
      message.replace(at, path.size(), "FILE");
    }
  }
  if (message.starts_with("FILE: ")) message.erase(0, 6);
  return message.substr(0, message.find_first_of("0123456789(,"));
}

// ---- the mutator -----------------------------------------------------------

constexpr std::array<uint8_t, 6> kInterestingBytes = {0x00, 0xff, 0x7f, 0x80, kNumClasses - 1, kNumClasses};
// clang-format off
constexpr std::array<uint32_t, 22> kInterestingU32 = {
    0, 1, 2, kCount - 1, kCount + 1, kRows, kCols,                      // zero, small, off by one
    4096, 4097, 65535, 0x7fffffff, 0x80000000, 0xfffffffe, 0xffffffff,  // limits, negative as unsigned
    uint32_t{kMaxIdxImages}, uint32_t{kMaxIdxImages + 1},               // the count limit
    kIdxImagesMagic, kIdxLabelsMagic, 0x03080000, 0x08000000, 0x00000804, 0x1f8b0800};  // magics
// clang-format on

// One mutation of a byte string; `log` collects what was done.
void mutate(Bytes& bytes, Rng& rng, bool is_images, std::string& log) {
  auto pos = [&](size_t extra = 0) { return static_cast<size_t>(rng.below(bytes.size() + extra)); };
  switch (rng.below(bytes.empty() ? 2 : 9)) {
    case 0: {  // extend with garbage, sometimes past the reader's 4096-byte probe
      const size_t n = rng.below(8) == 0 ? 4090 + rng.below(16) : 1 + rng.below(64);
      for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<uint8_t>(rng.next_u64()));
      log += " extend(" + std::to_string(n) + ")";
      return;
    }
    case 1: {  // set a header field (the magic, or a dimension) to a telling value
      const size_t fields = is_images ? 4 : 2;
      const size_t at = 4 * rng.below(fields);
      const uint32_t value = kInterestingU32[rng.below(kInterestingU32.size())];
      store_be32(bytes, at, value);
      log += " field@" + std::to_string(at) + "=" + std::to_string(value);
      return;
    }
    case 2: {  // bit flips
      const int n = 1 + static_cast<int>(rng.below(4));
      for (int i = 0; i < n; ++i) {
        const size_t at = pos();
        bytes[at] ^= static_cast<uint8_t>(1u << rng.below(8));
        log += " flip@" + std::to_string(at);
      }
      return;
    }
    case 3: {  // interesting byte values
      const int n = 1 + static_cast<int>(rng.below(4));
      for (int i = 0; i < n; ++i) {
        const size_t at = pos();
        bytes[at] = kInterestingBytes[rng.below(kInterestingBytes.size())];
        log += " byte@" + std::to_string(at) + "=" + std::to_string(bytes[at]);
      }
      return;
    }
    case 4: {  // truncate, most often inside the header
      const size_t at = rng.below(2) == 0 ? rng.below(std::min<size_t>(bytes.size(), 20)) : pos();
      bytes.resize(at);
      log += " truncate(" + std::to_string(at) + ")";
      return;
    }
    case 5: {  // duplicate a chunk somewhere
      const size_t from = pos();
      const size_t length = 1 + rng.below(std::min<size_t>(bytes.size() - from, 64));
      const size_t to = pos(1);
      const Bytes chunk(bytes.begin() + from, bytes.begin() + from + length);
      bytes.insert(bytes.begin() + to, chunk.begin(), chunk.end());
      log += " dup(" + std::to_string(from) + "+" + std::to_string(length) + "->" + std::to_string(to) + ")";
      return;
    }
    case 6: {  // delete a chunk
      const size_t from = pos();
      const size_t length = 1 + rng.below(std::min<size_t>(bytes.size() - from, 16));
      bytes.erase(bytes.begin() + from, bytes.begin() + from + length);
      log += " del(" + std::to_string(from) + "+" + std::to_string(length) + ")";
      return;
    }
    case 7: {  // the whole file twice (for gzip: a second member)
      const Bytes copy = bytes;
      bytes.insert(bytes.end(), copy.begin(), copy.end());
      log += " double";
      return;
    }
    default: {  // overwrite a random u32 anywhere with a telling value
      const size_t at = pos();
      store_be32(bytes, at, kInterestingU32[rng.below(kInterestingU32.size())]);
      log += " u32@" + std::to_string(at);
      return;
    }
  }
}

// How a file is written: plain, gzip of the (maybe mutated) payload, or the
// gzip bytes of the valid payload mutated after compression.
enum class Form { kPlain, kGzipPayload, kGzipBytes };

struct Variant {
  Bytes images, labels;
  Form images_form = Form::kPlain, labels_form = Form::kPlain;
  bool images_mutated = false, labels_mutated = false;
  bool same_path = false;  // both arguments name the images file
  std::string log;
};

class IdxMutationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    dir_ = fs::temp_directory_path() /
           ("fedmesh_test_idx_mutations_" + std::to_string(::getpid()) + "_" + std::to_string(ticks));
    ASSERT_TRUE(fs::create_directory(dir_)) << dir_;
    images_path_ = (dir_ / "images-idx3-ubyte").string();
    labels_path_ = (dir_ / "labels-idx1-ubyte").string();
    // The valid files compressed once; kGzipBytes mutates copies of these.
    const std::string scratch = (dir_ / "scratch.gz").string();
    write_gzip(scratch, images_bytes(kCount));
    images_gz_ = read_file(scratch);
    write_gzip(scratch, labels_bytes(kCount));
    labels_gz_ = read_file(scratch);
    fs::remove(scratch);
  }
  void TearDown() override {
    std::error_code error;
    fs::remove_all(dir_, error);
  }

  Variant make_variant(Rng& rng) const {
    Variant v;
    v.images = images_bytes(kCount);
    v.labels = labels_bytes(kCount);
    auto pick_form = [&] { return static_cast<Form>(rng.below(3)); };
    v.images_form = pick_form();
    v.labels_form = pick_form();
    const uint64_t kind = rng.below(16);
    if (kind == 0) {  // a consistent count, often valid, sometimes far too large
      const std::array<uint32_t, 8> counts = {1, 2, kCount - 1, kCount + 3, 200, 10'000'000, 10'000'001, 0};
      const uint32_t count = counts[rng.below(counts.size())];
      if (count <= 200) {
        v.images = images_bytes(count);
        v.labels = labels_bytes(count);
      } else {
        store_be32(v.images, 4, count);
        store_be32(v.labels, 4, count);
      }
      v.images_mutated = v.labels_mutated = true;
      v.log += " count=" + std::to_string(count);
    } else if (kind == 1) {  // consistent shapes: zero, one, odd, at the side limit
      const std::array<uint32_t, 6> sides = {0, 1, 2, 5, 4096, 4097};
      const uint32_t rows = sides[rng.below(sides.size())], cols = sides[rng.below(sides.size())];
      const uint32_t count = 1 + static_cast<uint32_t>(rng.below(3));
      // Past a megabyte only the header is written: the payload is then short.
      constexpr uint64_t kMaxWrittenPixelBytes = 1 << 20;
      v.images = images_bytes(count, rows, cols, uint64_t{count} * rows * cols <= kMaxWrittenPixelBytes);
      v.labels = labels_bytes(count);
      v.images_mutated = v.labels_mutated = true;
      v.log += " shape=" + std::to_string(count) + "x" + std::to_string(rows) + "x" + std::to_string(cols);
    } else if (kind == 2) {
      std::swap(v.images, v.labels);
      v.images_mutated = v.labels_mutated = true;
      v.log += " swap";
    } else if (kind == 3) {
      v.same_path = true;
      v.images_mutated = v.labels_mutated = true;
      v.log += " same-path";
    }
    // Then 1-3 stacked mutations of one file or both; after a change above,
    // sometimes none, so that the change is judged alone.
    const uint64_t target = rng.below(kind <= 3 ? 6 : 5);  // 0-2 images, 3 labels, 4 both, 5 none
    const bool hit_images = target <= 2 || target == 4;
    const bool hit_labels = target == 3 || target == 4;
    auto mutate_file = [&](Bytes& bytes, Form& form, bool is_images, const char* name) {
      const int rounds = 1 + static_cast<int>(rng.below(3));
      if (form == Form::kGzipBytes) {
        // Valid content only: a swapped or recounted file keeps its own form.
        if (bytes == images_bytes(kCount)) {
          bytes = images_gz_;
        } else if (bytes == labels_bytes(kCount)) {
          bytes = labels_gz_;
        } else {
          form = Form::kGzipPayload;
        }
      }
      v.log += std::string(" ") + name +
               (form == Form::kPlain         ? "[plain]:"
                : form == Form::kGzipPayload ? "[gz payload]:"
                                             : "[gz bytes]:");
      for (int i = 0; i < rounds; ++i) mutate(bytes, rng, is_images, v.log);
    };
    if (hit_images) {
      mutate_file(v.images, v.images_form, true, "images");
      v.images_mutated = true;
    }
    if (hit_labels) {
      mutate_file(v.labels, v.labels_form, false, "labels");
      v.labels_mutated = true;
    }
    // An untouched kGzipBytes file is written as gzip of its payload.
    if (!hit_images && v.images_form == Form::kGzipBytes) v.images_form = Form::kGzipPayload;
    if (!hit_labels && v.labels_form == Form::kGzipBytes) v.labels_form = Form::kGzipPayload;
    return v;
  }

  void write(const std::string& path, const Bytes& bytes, Form form) const {
    // A fresh file each time: ext4 flushes a file truncated and rewritten in
    // place when it is closed, which made the test ten times slower.
    fs::remove(path);
    if (form == Form::kGzipPayload) {
      write_gzip(path, bytes);
    } else {
      write_file(path, bytes);
    }
  }

  fs::path dir_;
  std::string images_path_, labels_path_;
  Bytes images_gz_, labels_gz_;
};

TEST_F(IdxMutationTest, EveryVariantIsReadOrRejectedWithTheFileNamed) {
  const uint64_t seed = env_or("FEDMESH_IDX_SEED", kDefaultSeed);
  const int variants = static_cast<int>(env_or("FEDMESH_IDX_VARIANTS", kDefaultVariants));
  Rng rng(seed);
  int failures = 0, accepted = 0;
  std::map<std::string, int> rejections;  // by the first words after the path
  for (int index = 0; index < variants && failures < kMaxReportedFailures; ++index) {
    const Variant v = make_variant(rng);
    write(images_path_, v.images, v.images_form);
    write(labels_path_, v.labels, v.labels_form);
    const std::string& labels_arg = v.same_path ? images_path_ : labels_path_;

    Result<ImageDataset> got = load_idx_pair(images_path_, labels_arg, kNumClasses);
    const std::optional<ImageDataset> want = reference_load(images_path_, labels_arg, kNumClasses);

    const std::string where =
        "variant " + std::to_string(index) + " (seed " + std::to_string(seed) + "):" + v.log;
    auto fail = [&](const std::string& what) {
      ADD_FAILURE() << where << "\n  " << what;
      ++failures;
    };
    if (got.is_ok()) {
      ++accepted;
      const ImageDataset& data = got.value();
      if (data.count < 1 || data.rows < 1 || data.cols < 1 ||
          static_cast<int64_t>(data.pixels.size()) != data.count * data.rows * data.cols ||
          static_cast<int64_t>(data.labels.size()) != data.count || data.num_classes != kNumClasses ||
          std::any_of(data.labels.begin(), data.labels.end(), [](uint8_t l) { return l >= kNumClasses; })) {
        fail("accepted with inconsistent data: count " + std::to_string(data.count) + ", " +
             std::to_string(data.rows) + "x" + std::to_string(data.cols) + ", " +
             std::to_string(data.pixels.size()) + " pixel bytes, " + std::to_string(data.labels.size()) +
             " labels");
      } else if (!want) {
        fail("accepted, but the reference reader rejects these files");
      } else if (data.count != want->count || data.rows != want->rows || data.cols != want->cols ||
                 data.pixels != want->pixels || data.labels != want->labels) {
        fail("accepted with data that differ from the files' content");
      }
      continue;
    }
    const Status& status = got.status();
    const std::string& message = status.message();
    const bool names_images = message.find(images_path_) != std::string::npos;
    const bool names_labels = message.find(labels_arg) != std::string::npos;
    if (want) {
      fail("rejected valid files: " + status.to_string());
    } else if (status.code() != StatusCode::kCorrupt) {
      fail("rejected with code " + std::string(status_code_name(status.code())) +
           ", expected corrupt: " + message);
    } else if (message.empty() || (!names_images && !names_labels)) {
      fail("message names neither file: '" + message + "'");
    } else if (!v.same_path && v.images_mutated != v.labels_mutated &&
               !(v.images_mutated ? names_images : names_labels)) {
      fail("only the " + std::string(v.images_mutated ? "images" : "labels") +
           " file was changed, but the message blames the other: " + message);
    } else {
      ++rejections[rejection_kind(message, {images_path_, labels_path_})];
    }
  }
  EXPECT_LT(failures, kMaxReportedFailures) << "stopped after " << kMaxReportedFailures << " failures";

  // The mutator must reach deep into the reader: valid variants, and the
  // rejections each check makes, must all have occurred.
  std::string seen;
  for (const auto& [kind, n] : rejections) seen += "\n  " + std::to_string(n) + "  " + kind;
  std::printf("%d variants: %d accepted, rejections:%s\n", variants, accepted, seen.c_str());
  EXPECT_GT(accepted, variants / 50);
  for (const char* expected :
       {"bad magic", "file is empty", "file ends after", "header declares ", "truncated:", "trailing garbage",
        "label ", "corrupt gzip stream", "gzip stream is truncated"}) {
    EXPECT_TRUE(std::any_of(rejections.begin(), rejections.end(),
                            [&](const auto& entry) { return entry.first.starts_with(expected); }))
        << "no variant was rejected with '" << expected << "'" << seen;
  }
}

}  // namespace
}  // namespace fedmesh::train::data
