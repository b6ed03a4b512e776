// tokens:FILE.bin shards and jsonl:FILE text (train/data/token_shards.h):
// windows read from the mapping equal the ids written and TextWindows' batches
// of the same ids, the train and held-out ranges split the file's tail off
// without overlap, every refusal names the file, and a 1 GiB shard is checked
// and sampled across its whole length without its pages piling up in memory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "train/data/text_corpus.h"
#include "train/data/token_shards.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

// A shard's header as a test writes it.
struct Header {
  int32_t magic = kTokenShardMagic;
  int32_t version = 1;
  std::optional<int64_t> count;  // none: the number of ids written
};

class TokenShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-token-shards-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A shard of `ids` (uint16 for version 1, else uint32), its header as
  // given, then `extra` bytes (negative: that many bytes cut off the end).
  std::string write_shard(const std::string& name, const std::vector<uint32_t>& ids, Header header = {},
                          int64_t extra = 0) {
    std::vector<int32_t> head(kTokenShardHeaderInts, 0);
    head[0] = header.magic;
    head[1] = header.version;
    head[2] = static_cast<int32_t>(header.count.value_or(static_cast<int64_t>(ids.size())));
    std::string bytes(reinterpret_cast<const char*>(head.data()), head.size() * 4);
    for (const uint32_t id : ids) {
      if (header.version == 1) {
        const uint16_t narrow = static_cast<uint16_t>(id);
        bytes.append(reinterpret_cast<const char*>(&narrow), 2);
      } else {
        bytes.append(reinterpret_cast<const char*>(&id), 4);
      }
    }
    if (extra > 0) bytes.append(static_cast<size_t>(extra), '\x07');
    if (extra < 0) bytes.resize(bytes.size() - static_cast<size_t>(-extra));
    return write_bytes(name, bytes);
  }

  std::string write_bytes(const std::string& name, const std::string& bytes) {
    const fs::path file = dir_ / name;
    std::ofstream out(file, std::ios::binary);
    out << bytes;
    return file.string();
  }

  fs::path dir_;
};

std::vector<uint32_t> pattern_ids(int64_t n, uint32_t vocabulary) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<uint32_t>((i * 7919 + i / 3) % vocabulary);
  return ids;
}

std::shared_ptr<TokenShard> opened(const std::string& path, int64_t vocabulary) {
  Result<TokenShard> shard = open_token_shard(path);
  EXPECT_TRUE(shard.is_ok()) << shard.status().to_string();
  auto shared = std::make_shared<TokenShard>(std::move(shard).value());
  const Status checked = shared->check_vocabulary(vocabulary);
  EXPECT_TRUE(checked.is_ok()) << checked.to_string();
  return shared;
}

// Every window of `windows` against the ids, and against TextWindows over
// the same ids (the form the transformer takes).
void expect_windows_match(const TokenWindows& windows, const std::vector<uint32_t>& ids) {
  const int64_t context = windows.context(), begin = windows.begin();
  std::vector<int32_t> range(ids.begin() + begin, ids.begin() + windows.end());
  const TextWindows text(range, context, context);
  ASSERT_EQ(windows.size(), text.size());
  ASSERT_GT(windows.size(), 0);
  std::vector<int64_t> indices(static_cast<size_t>(windows.size()));
  std::iota(indices.begin(), indices.end(), 0);
  std::reverse(indices.begin(), indices.end());  // any order
  Tensor inputs, text_inputs;
  std::vector<int32_t> targets, text_targets;
  windows.make_batch(indices, DType::kBF16, inputs, targets);
  text.make_batch(indices, DType::kBF16, text_inputs, text_targets);
  ASSERT_EQ(inputs.shape(), (Shape{windows.size(), context}));
  ASSERT_EQ(inputs.dtype(), DType::kF32);
  ASSERT_EQ(inputs.shape(), text_inputs.shape());
  ASSERT_EQ(inputs.dtype(), text_inputs.dtype());
  EXPECT_EQ(targets, text_targets);
  EXPECT_EQ(windows.targets_per_sample(), text.targets_per_sample());
  for (size_t b = 0; b < indices.size(); ++b) {
    const int64_t first = begin + indices[b] * context;
    for (int64_t t = 0; t < context; ++t) {
      const size_t at = b * static_cast<size_t>(context) + static_cast<size_t>(t);
      ASSERT_EQ(inputs.data<float>()[at], static_cast<float>(ids[static_cast<size_t>(first + t)])) << b << "," << t;
      ASSERT_EQ(inputs.data<float>()[at], text_inputs.data<float>()[at]);
      ASSERT_EQ(targets[at], static_cast<int32_t>(ids[static_cast<size_t>(first + t + 1)])) << b << "," << t;
    }
  }
}

TEST_F(TokenShardTest, Uint16WindowsAreTheIdsWritten) {
  const std::vector<uint32_t> ids = pattern_ids(1000, 50257);
  const std::string path = write_shard("v1.bin", ids);
  const auto shard = opened(path, 50257);
  EXPECT_EQ(shard->version(), 1);
  EXPECT_EQ(shard->size(), 1000);
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(shard->token(i), ids[static_cast<size_t>(i)]);
  const TokenWindows windows(shard, 0, 1000, 16, 50257);
  EXPECT_EQ(windows.size(), (1000 - 17) / 16 + 1);
  expect_windows_match(windows, ids);
  expect_windows_match(TokenWindows(shard, 37, 611, 5, 60000), ids);  // an inner range, a larger vocabulary
  expect_windows_match(TokenWindows(shard, 0, 2, 1, 50257), ids);     // one window of one token
  EXPECT_EQ(TokenWindows(shard, 0, 1, 1, 50257).size(), 0);
}

TEST_F(TokenShardTest, Uint32WindowsAreTheIdsWritten) {
  std::vector<uint32_t> ids = pattern_ids(777, 100000);
  ids[5] = 99999;  // above uint16
  const std::string path = write_shard("v2.bin", ids, {.version = 2});
  const auto shard = opened(path, 100000);
  EXPECT_EQ(shard->version(), 2);
  EXPECT_EQ(shard->width_bytes(), 4);
  EXPECT_EQ(shard->token(5), 99999);
  expect_windows_match(TokenWindows(shard, 0, 777, 8, 100000), ids);
  expect_windows_match(TokenWindows(shard, 3, 777, 31, 100000), ids);
}

TEST_F(TokenShardTest, HeldOutTailNeitherOverlapsNorLeavesAGap) {
  const std::vector<uint32_t> ids = pattern_ids(2000, 300);
  TokenSpec spec;
  spec.path = write_shard("split.bin", ids);
  spec.context = 8;
  spec.vocabulary = 300;
  Result<LoadedTokens> loaded = load_token_data(spec);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  const TokenWindows& train = loaded->train;
  const TokenWindows& test = loaded->test;
  // One mapping for both.
  EXPECT_EQ(&train.shard(), &test.shard());
  EXPECT_EQ(train.shared_shard().use_count(), 2);
  // The last 5 %: tokens [1900, 2000).
  EXPECT_EQ(train.begin(), 0);
  EXPECT_EQ(train.end(), 1900);
  EXPECT_EQ(test.begin(), 1900);
  EXPECT_EQ(test.end(), 2000);
  // The last token any training window reads (its last target) is before
  // the first held-out token; the held-out windows reach the last context
  // tokens of the file.
  const int64_t last_train_read = train.begin() + (train.size() - 1) * 8 + 8;
  EXPECT_LT(last_train_read, test.begin());
  const int64_t last_test_read = test.begin() + (test.size() - 1) * 8 + 8;
  EXPECT_LT(last_test_read, 2000);
  EXPECT_GT(last_test_read, 2000 - 1 - 8);
  expect_windows_match(train, ids);
  expect_windows_match(test, ids);
  EXPECT_NE(loaded->description.find("2,000 uint16 tokens"), std::string::npos) << loaded->description;

  spec.train_limit = 3;
  spec.test_limit = 2;
  Result<LoadedTokens> limited = load_token_data(spec);
  ASSERT_TRUE(limited.is_ok()) << limited.status().to_string();
  EXPECT_EQ(limited->train.size(), 3);
  EXPECT_EQ(limited->test.size(), 2);
  EXPECT_EQ(limited->test.begin(), 1900);

  // A second shard holds out all of itself; the first trains on all of itself.
  const std::vector<uint32_t> test_ids = pattern_ids(100, 300);
  spec.test_path = write_shard("test.bin", test_ids, {.version = 2});
  spec.train_limit = spec.test_limit = 0;
  Result<LoadedTokens> two = load_token_data(spec);
  ASSERT_TRUE(two.is_ok()) << two.status().to_string();
  EXPECT_EQ(two->train.end(), 2000);
  EXPECT_EQ(two->test.begin(), 0);
  EXPECT_EQ(two->test.shard().path(), spec.test_path);
  expect_windows_match(two->test, test_ids);

  // Too short to hold out one window.
  TokenSpec small = spec;
  small.test_path.clear();
  small.context = 200;  // the tail is 100 tokens
  Result<LoadedTokens> refused = load_token_data(small);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(refused.status().message().starts_with(small.path + ": ")) << refused.status().message();
  EXPECT_NE(refused.status().message().find("100 held-out tokens"), std::string::npos) << refused.status().message();
}

// The refusal of `path`, which must begin with the path and hold `words`.
void expect_refused(const Status& status, const std::string& path, StatusCode code,
                    const std::vector<std::string>& words) {
  ASSERT_FALSE(status.is_ok()) << path;
  EXPECT_EQ(status.code(), code) << status.to_string();
  EXPECT_TRUE(status.message().starts_with(path + ": ")) << status.message();
  for (const std::string& word : words)
    EXPECT_NE(status.message().find(word), std::string::npos) << status.message() << " lacks " << word;
}

TEST_F(TokenShardTest, RefusalsNameTheFile) {
  const std::vector<uint32_t> ids = pattern_ids(100, 256);
  // Without the magic: a raw array of ids.
  std::string raw(200, '\x01');
  std::string path = write_bytes("raw.bin", raw);
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt,
                 {"not a token shard", "20240520", "version"});
  path = write_shard("magic.bin", ids, {.magic = 20240521});
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"found int32 20240521", "20240520"});
  path = write_bytes("empty.bin", "");
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"not a token shard", "0 bytes"});
  // The magic, then less than a header.
  std::string magic_only(104, '\0');
  std::memcpy(magic_only.data(), &kTokenShardMagic, 4);
  path = write_bytes("short-header.bin", magic_only);
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"truncated", "104 bytes", "1024"});
  // Sizes that disagree with the count: both numbers named.
  path = write_shard("long.bin", ids, {}, 3);
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt,
                 {"1227 bytes", "100 uint16", "1224 bytes"});
  path = write_shard("truncated.bin", ids, {}, -10);
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt,
                 {"1214 bytes", "1224 bytes", "truncated"});
  path = write_shard("v2-as-v1.bin", ids, {.version = 2, .count = 200});
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt,
                 {"1424 bytes", "200 uint32", "1824 bytes"});
  path = write_shard("one.bin", {5}, {});
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"1 tokens", "at least 2"});
  path = write_shard("negative.bin", ids, {.count = -4});
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"-4 tokens"});
  path = write_shard("v3.bin", ids, {.version = 3});
  expect_refused(open_token_shard(path).status(), path, StatusCode::kCorrupt, {"version 3", "1: uint16", "2: uint32"});
  path = (dir_ / "missing.bin").string();
  expect_refused(open_token_shard(path).status(), path, StatusCode::kNotFound, {"no such file"});
  path = dir_.string();
  expect_refused(open_token_shard(path).status(), path, StatusCode::kInvalidArgument, {"not a regular file"});

  // An id at or above the vocabulary: position and value named.
  std::vector<uint32_t> bad = pattern_ids(3000, 256);
  bad[2345] = 256;
  bad[2900] = 9999;  // only the first is named
  path = write_shard("bad-id.bin", bad);
  Result<TokenShard> shard = open_token_shard(path);
  ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
  expect_refused(shard->check_vocabulary(256), path, StatusCode::kCorrupt,
                 {"token 2345 ", "id 256", "vocabulary of 256"});
  EXPECT_EQ(shard->checked_vocabulary(), 0);
  EXPECT_TRUE(shard->check_vocabulary(10000).is_ok());
  EXPECT_EQ(shard->checked_vocabulary(), 10000);
  expect_refused(shard->check_vocabulary(0), path, StatusCode::kInvalidArgument, {"vocabulary 0"});
  // ... and through load_token_data, whatever the split.
  TokenSpec spec;
  spec.path = path;
  spec.context = 4;
  spec.vocabulary = 256;
  expect_refused(load_token_data(spec).status(), path, StatusCode::kCorrupt, {"token 2345 ", "id 256"});
  spec.path = write_shard("good.bin", ids);
  spec.test_path = path;
  expect_refused(load_token_data(spec).status(), path, StatusCode::kCorrupt, {"token 2345 "});
  // uint32 ids past the float-exact range are refused by the vocabulary bound.
  path = write_shard("huge-id.bin", {1, 1u << 30, 2}, {.version = 2});
  Result<TokenShard> huge = open_token_shard(path);
  ASSERT_TRUE(huge.is_ok());
  expect_refused(huge->check_vocabulary(kMaxTokenVocabulary), path, StatusCode::kCorrupt,
                 {"token 1 ", "id 1073741824"});
  expect_refused(huge->check_vocabulary(kMaxTokenVocabulary + 1), path, StatusCode::kInvalidArgument, {"outside"});
}

TEST(TokenWindowsDeathTest, WindowsOverUncheckedIdsStopTheProgram) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const fs::path file = fs::path(::testing::TempDir()) / ("fedmesh-unchecked-" + std::to_string(::getpid()) + ".bin");
  {
    std::vector<int32_t> head(kTokenShardHeaderInts, 0);
    head[0] = kTokenShardMagic;
    head[1] = 1;
    head[2] = 4;
    const uint16_t tokens[4] = {1, 2, 3, 4};
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size() * 4));
    out.write(reinterpret_cast<const char*>(tokens), sizeof tokens);
  }
  Result<TokenShard> shard = open_token_shard(file.string());
  // The mapping outlives the name; the death tests' children (which run
  // this test again up to their statement) remove theirs too.
  fs::remove(file);
  ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
  auto shared = std::make_shared<TokenShard>(std::move(shard).value());
  EXPECT_DEATH(TokenWindows(shared, 0, 4, 2, 256), "check_vocabulary first");
  ASSERT_TRUE(shared->check_vocabulary(100).is_ok());
  EXPECT_DEATH(TokenWindows(shared, 0, 4, 2, 50), "check_vocabulary first");  // checked against more than 50
  TokenWindows ok(shared, 0, 4, 2, 100);
  EXPECT_EQ(ok.size(), 1);
}

// --- memory: a 1 GiB shard ---

// A /proc/self/status field in kB (VmHWM: peak resident set; VmRSS: now).
int64_t status_kb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.starts_with(prefix)) return std::stoll(line.substr(prefix.size()));
  }
  return -1;
}

// Resets VmHWM to the current resident set (Linux >= 4.0); false where the
// kernel refuses.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint16_t big_pattern(int64_t i) { return static_cast<uint16_t>((static_cast<uint64_t>(i) * 2654435761ull) % 256); }

// Drops `file`'s pages from the page cache (written back first), as for a
// shard that is not in memory when a run starts: the usual state of a shard
// of many GiB. Only pages nobody maps can go.
void evict_from_page_cache(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fsync(fd), 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
}

// The three numbers a memory measure needs, in kB.
struct Memory {
  int64_t peak = status_kb("VmHWM"), anonymous = status_kb("RssAnon"), file = status_kb("RssFile");
};

// What the peak resident set, the anonymous memory (where a copy of the
// shard would land) and the file pages mapped grew by since `before`.
std::string growth_text(const Memory& before, const Memory& after) {
  return "VmHWM +" + std::to_string(after.peak - before.peak) + " kB (RssAnon +" +
         std::to_string(after.anonymous - before.anonymous) + " kB, RssFile +" +
         std::to_string(after.file - before.file) + " kB)";
}

// The memory test of the format: a 1 GiB shard (512 Mi uint16 ids, written
// in ~2 s here) is checked and sampled over its whole length without a copy.
// Asserted, and why:
//   - check_vocabulary's pass reads through the page cache, not the mapping:
//     the peak resident set (VmHWM) grows by less than 400 MB (~1 MB: its
//     buffer);
//   - 100 batches of 8 windows of 1024 spread over the whole file, the file
//     not in the page cache: the peak grows by less than 400 MB (~5 MB: the
//     pages of the windows);
//   - the same batches right after the check's pass, as a run meets the
//     file: the peak grows by less than 400 MB as well. The pass drops what
//     it read from the page cache as it goes (POSIX_FADV_DONTNEED): left
//     there in large folios, the file would be mapped a folio (up to 2 MiB)
//     per window's fault, ~1 GB for 800 windows on Linux 6.18.
//   Everywhere: no anonymous memory appears (RssAnon, where a copy would
//   land, grows < 400 MB).
TEST_F(TokenShardTest, OneGibShardIsCheckedAndSampledWithoutACopy) {
  constexpr int64_t kTokens = int64_t{512} << 20;  // 512 Mi uint16: 1 GiB
  constexpr int64_t kChunk = int64_t{4} << 20;
  constexpr int64_t kContext = 1024, kBatch = 8, kBatches = 100;
  constexpr int64_t kMaxGrowthKb = 400 * 1000;  // 400 MB
  const fs::path file = dir_ / "big.bin";
  auto start = std::chrono::steady_clock::now();
  {
    std::FILE* out = std::fopen(file.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    std::vector<int32_t> head(kTokenShardHeaderInts, 0);
    head[0] = kTokenShardMagic;
    head[1] = 1;
    head[2] = static_cast<int32_t>(kTokens);
    ASSERT_EQ(std::fwrite(head.data(), 4, head.size(), out), head.size());
    std::vector<uint16_t> chunk(static_cast<size_t>(kChunk));
    for (int64_t first = 0; first < kTokens; first += kChunk) {
      for (int64_t i = 0; i < kChunk; ++i) chunk[static_cast<size_t>(i)] = big_pattern(first + i);
      ASSERT_EQ(std::fwrite(chunk.data(), 2, chunk.size(), out), chunk.size());
    }
    ASSERT_EQ(std::fclose(out), 0);
  }
  const double write_seconds = seconds_since(start);
  ASSERT_EQ(static_cast<int64_t>(fs::file_size(file)), kTokenShardHeaderBytes + kTokens * 2);
  evict_from_page_cache(file);

  // Opened and checked as load_token_data does, the file not in the page
  // cache before (as a shard of many GiB would not be).
  const auto open_checked = [&]() {
    Result<TokenShard> opened_shard = open_token_shard(file.string());
    EXPECT_TRUE(opened_shard.is_ok()) << opened_shard.status().to_string();
    auto shard = std::make_shared<TokenShard>(std::move(opened_shard).value());
    const Status checked = shard->check_vocabulary(256);
    EXPECT_TRUE(checked.is_ok()) << checked.to_string();
    return shard;
  };
  // 100 batches spread evenly over the whole file, the last window
  // included; `shift` moves every window by a fraction of the spacing.
  const auto sample = [&](const TokenWindows& windows, int64_t shift) {
    ASSERT_EQ(windows.size(), (kTokens - kContext - 1) / kContext + 1);
    Tensor inputs;
    std::vector<int32_t> targets;
    for (int64_t b = 0; b < kBatches; ++b) {
      std::vector<int64_t> indices(kBatch);
      for (int64_t j = 0; j < kBatch; ++j) {
        const int64_t spread = (b * kBatch + j) * (windows.size() - 1) / (kBatches * kBatch - 1);
        indices[static_cast<size_t>(j)] = std::min(windows.size() - 1, spread + shift);
      }
      windows.make_batch(indices, DType::kF32, inputs, targets);
      for (int64_t j = 0; j < kBatch; ++j) {
        const int64_t first = indices[static_cast<size_t>(j)] * kContext;
        ASSERT_EQ(inputs.data<float>()[j * kContext], big_pattern(first));
        ASSERT_EQ(inputs.data<float>()[j * kContext + kContext - 1], big_pattern(first + kContext - 1));
        ASSERT_EQ(targets[static_cast<size_t>(j * kContext + kContext - 1)], big_pattern(first + kContext));
      }
    }
  };

  // 1. The check's pass.
  const bool reset = reset_peak_rss();
  const Memory before_check;
  ASSERT_GT(before_check.peak, 0);
  start = std::chrono::steady_clock::now();
  std::shared_ptr<TokenShard> shard = open_checked();
  ASSERT_NE(shard, nullptr);
  const double check_seconds = seconds_since(start);
  const Memory after_check;

  // 2. Batches right after it, as a run meets the file: the page cache holds
  // it in the folios the pass's read-ahead made.
  (void)reset_peak_rss();
  const Memory before_run;
  start = std::chrono::steady_clock::now();
  sample(TokenWindows(shard, 0, kTokens, kContext, 256), 0);
  const double run_seconds = seconds_since(start);
  const Memory after_run;

  // 3. Batches over a file not in the page cache: a fresh mapping, the
  // cache dropped after the check.
  shard.reset();
  evict_from_page_cache(file);
  shard = open_checked();
  ASSERT_NE(shard, nullptr);
  evict_from_page_cache(file);
  (void)reset_peak_rss();
  const Memory before_cold;
  start = std::chrono::steady_clock::now();
  sample(TokenWindows(shard, 0, kTokens, kContext, 256), 0);
  const double cold_seconds = seconds_since(start);
  const Memory after_cold;

  std::printf(
      "[ token shard memory ] 1 GiB shard written in %.2f s; open + check_vocabulary(256) %.2f s; "
      "VmHWM %s\n",
      write_seconds, check_seconds, reset ? "reset before each step" : "NOT resettable here: whole-process peak");
  std::printf("[ token shard memory ] check_vocabulary: %s\n", growth_text(before_check, after_check).c_str());
  std::printf(
      "[ token shard memory ] %lld batches of %lld x %lld right after the check, as in a run (%.3f s): %s\n",
      static_cast<long long>(kBatches), static_cast<long long>(kBatch), static_cast<long long>(kContext), run_seconds,
      growth_text(before_run, after_run).c_str());
  std::printf("[ token shard memory ] the same, the shard not in the page cache (%.3f s): %s\n", cold_seconds,
              growth_text(before_cold, after_cold).c_str());
  EXPECT_LT(after_check.peak - before_check.peak, kMaxGrowthKb);
  EXPECT_LT(after_cold.peak - before_cold.peak, kMaxGrowthKb);
  EXPECT_LT(after_run.peak - before_run.peak, kMaxGrowthKb) << "after the check, as a run meets the file";
  EXPECT_LT(after_check.anonymous - before_check.anonymous, kMaxGrowthKb);
  EXPECT_LT(after_run.anonymous - before_run.anonymous, kMaxGrowthKb);
  EXPECT_LT(after_cold.anonymous - before_cold.anonymous, kMaxGrowthKb);

  shard.reset();
  fs::remove(file);
  EXPECT_FALSE(fs::exists(file));
}

// --- jsonl:FILE ---

TEST_F(TokenShardTest, JsonLinesAreDocuments) {
  const std::string path = write_bytes(
      "docs.jsonl",
      "\xEF\xBB\xBF{\"id\": 1, \"text\": \"In the beginning\", \"meta\": {\"text\": 5, \"x\": [1, [2, {}]]}}\n"
      "\n"
      "   \r\n"
      "{\"text\": \"caf\\u00e9 \\\"quoted\\\"\\nnewline\"}\r\n"
      "{\"text\": \"\", \"other\": null}\n"
      "{\"text\": 3, \"text\": \"last wins\"}");  // no newline at the end
  Result<std::vector<std::string>> documents = read_jsonl_documents(path, "text");
  ASSERT_TRUE(documents.is_ok()) << documents.status().to_string();
  EXPECT_EQ(*documents,
            (std::vector<std::string>{"In the beginning", "caf\xC3\xA9 \"quoted\"\nnewline", "", "last wins"}));

  const std::string other = write_bytes("body.jsonl", "{\"body\": \"a\", \"text\": 1}\n{\"body\": \"b\"}\n");
  Result<std::vector<std::string>> bodies = read_jsonl_documents(other, "body");
  ASSERT_TRUE(bodies.is_ok()) << bodies.status().to_string();
  EXPECT_EQ(*bodies, (std::vector<std::string>{"a", "b"}));
}

TEST_F(TokenShardTest, JsonLinesRefusalsNameTheLine) {
  struct Case {
    const char* name;
    std::string text;
    std::vector<std::string> words;
  };
  const std::string ok = "{\"text\": \"fine\"}\n";
  const std::vector<Case> cases = {
      {"not-json.jsonl", ok + ok + "{\"text\": \"unterminated}\n", {"line 3: ", "not JSON", "byte"}},
      {"trailing.jsonl", ok + "{\"text\": \"a\"} {\"text\": \"b\"}\n", {"line 2: ", "not JSON"}},
      {"plain-text.jsonl", "In the beginning\n", {"line 1: ", "not JSON"}},
      {"no-field.jsonl",
       ok + "{\"body\": \"x\", \"meta\": {\"text\": \"nested\"}}\n",
       {"line 2: ", "no field \"text\""}},
      {"number.jsonl", ok + ok + ok + "{\"text\": 42}\n", {"line 4: ", "field \"text\" is a number, not a string"}},
      {"object.jsonl", "{\"text\": {\"inner\": \"x\"}}\n", {"line 1: ", "is an object, not a string"}},
      {"null.jsonl", "{\"text\": null}\n", {"line 1: ", "is null, not a string"}},
      {"array.jsonl", ok + "[\"text\"]\n", {"line 2: ", "not an object but an array"}},
      {"string.jsonl", "\"text\"\n", {"line 1: ", "not an object but a string"}},
      {"deep.jsonl",
       "{\"text\": \"x\", \"d\": " + std::string(100, '[') + std::string(100, ']') + "}\n",
       {"line 1: ", "nested deeper than 64"}},
      {"bad-utf8.jsonl", "{\"text\": \"\xFF\"}\n", {"line 1: ", "not JSON"}},
      {"empty.jsonl", "\n\n", {"holds no document"}},
  };
  for (const Case& c : cases) {
    const std::string path = write_bytes(c.name, c.text);
    Result<std::vector<std::string>> got = read_jsonl_documents(path, "text");
    expect_refused(got.status(), path, StatusCode::kCorrupt, c.words);
    for (const char ch : got.status().message()) EXPECT_GE(static_cast<unsigned char>(ch), 0x20) << c.name;
  }
  expect_refused(read_jsonl_documents((dir_ / "none.jsonl").string(), "text").status(), (dir_ / "none.jsonl").string(),
                 StatusCode::kNotFound, {"no such file"});
  const std::string path = write_bytes("field.jsonl", ok);
  expect_refused(read_jsonl_documents(path, "").status(), path, StatusCode::kInvalidArgument, {"field"});
  expect_refused(parse_jsonl_documents(std::string_view(ok.data(), 1), "x.jsonl", "text").status(), "x.jsonl",
                 StatusCode::kCorrupt, {"line 1: ", "not JSON"});
}

}  // namespace
}  // namespace fedmesh::train::data
