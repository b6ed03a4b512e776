// libFuzzer target for tokens:FILE.bin shards and jsonl:FILE text
// (train/data/token_shards.h): open_token_shard, check_vocabulary(256),
// TokenWindows::make_batch and load_token_data on what they accept, and
// parse_jsonl_documents through read_jsonl_documents. How to build and run
// it: tests/fuzz/README.md.
//
// Input layout (every byte string is a valid input):
//   byte 0   bit 0: the rest is a jsonl file (else a shard)
//            bit 1: shard: the target writes a valid header before the rest
//                   (so that the fuzzer spends its time on the tokens);
//                   jsonl: the field is "body" (else "text")
//            bit 2: with bit 1, version 2 (uint32 tokens; else 1, uint16)
//            bit 3: with bit 1, the header's count one more than the rest holds
//            bits 4-7: context - 1 (1 .. 16)
//   rest     the file (after a written header, its tokens)
// The file is a memfd read through /proc/self/fd/N: nothing touches the disk.
// For every input the result must be
//   - a shard accepted by open_token_shard: its size and ids equal what a
//     plain reader of the bytes makes of them; check_vocabulary(256) passes
//     exactly when every id is below 256, else names the first bad one; on
//     a pass, every window's inputs and targets are those ids, one apart,
//     and load_token_data splits without overlap or refuses with
//     kInvalidArgument;
//   - jsonl accepted: each document is the field of the line's object as
//     nlohmann's DOM parser reads it, one per non-blank line;
//   - any refusal: a message that begins with the file's path and holds no
//     control character.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/data/token_shards.h"

namespace {

using fedmesh::Result;
using fedmesh::Status;
using fedmesh::StatusCode;
using namespace fedmesh::train::data;

constexpr int64_t kVocabulary = 256;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_token_shard: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

struct MemFile {
  int fd = -1;
  std::string path;
};

MemFile& memfile() {
  static MemFile file = [] {
    MemFile made;
    made.fd = memfd_create("fuzz_token_shard", MFD_CLOEXEC);
    if (made.fd < 0) {
      std::perror("fuzz_token_shard: memfd_create");
      std::abort();
    }
    made.path = "/proc/self/fd/" + std::to_string(made.fd);
    return made;
  }();
  return file;
}

void fill(const MemFile& file, const std::string& bytes) {
  if (ftruncate(file.fd, 0) != 0) violated("ftruncate failed");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = pwrite(file.fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (wrote <= 0) violated("pwrite to a memfd failed");
    done += static_cast<size_t>(wrote);
  }
}

void check_refusal(const Status& status, const std::string& path, const char* what) {
  const std::string& message = status.message();
  if (status.is_ok()) violated(std::string(what) + ": refusal expected");
  if (!message.starts_with(path + ": "))
    violated(std::string(what) + ": message does not name the file: '" + message + "'");
  for (const char c : message) {
    if (static_cast<unsigned char>(c) < 0x20) violated(std::string(what) + ": message holds a control character");
  }
}

int32_t header_int(const std::string& bytes, size_t i) {
  int32_t value = 0;
  if (bytes.size() >= (i + 1) * 4) std::memcpy(&value, bytes.data() + i * 4, 4);
  return value;
}

void check_windows(const TokenWindows& windows, const std::vector<int64_t>& ids) {
  if (windows.size() == 0) return;
  std::vector<int64_t> indices(static_cast<size_t>(windows.size()));
  std::iota(indices.begin(), indices.end(), 0);
  fedmesh::Tensor inputs;
  std::vector<int32_t> targets;
  windows.make_batch(indices, fedmesh::DType::kBF16, inputs, targets);
  const int64_t context = windows.context();
  if (inputs.shape() != fedmesh::Shape{windows.size(), context} || inputs.dtype() != fedmesh::DType::kF32) {
    violated("batch shape or dtype");
  }
  if (static_cast<int64_t>(targets.size()) != windows.size() * context) violated("target count");
  for (int64_t w = 0; w < windows.size(); ++w) {
    const int64_t first = windows.begin() + w * context;
    if (first + context >= windows.end()) violated("a window reads past its range");
    for (int64_t t = 0; t < context; ++t) {
      if (inputs.data<float>()[w * context + t] != static_cast<float>(ids[static_cast<size_t>(first + t)])) {
        violated("an input is not the id of the file");
      }
      if (targets[static_cast<size_t>(w * context + t)] != ids[static_cast<size_t>(first + t + 1)]) {
        violated("a target is not the next id of the file");
      }
    }
  }
}

void fuzz_shard(const std::string& bytes, int64_t context) {
  const MemFile& file = memfile();
  fill(file, bytes);
  Result<TokenShard> opened = open_token_shard(file.path);
  // The plain reader: header, then the exact size.
  const int32_t magic = header_int(bytes, 0), version = header_int(bytes, 1), count = header_int(bytes, 2);
  const int64_t width = version == 1 ? 2 : 4;
  const bool valid = bytes.size() >= static_cast<size_t>(kTokenShardHeaderBytes) && magic == kTokenShardMagic &&
                     (version == 1 || version == 2) && count >= 2 &&
                     static_cast<int64_t>(bytes.size()) == kTokenShardHeaderBytes + count * width;
  if (!opened.is_ok()) {
    if (valid) violated("a valid shard refused: " + opened.status().to_string());
    if (opened.status().code() != StatusCode::kCorrupt) violated("refused with another code than kCorrupt");
    check_refusal(opened.status(), file.path, "open");
    return;
  }
  if (!valid) violated("an invalid shard accepted");
  auto shard = std::make_shared<TokenShard>(std::move(opened).value());
  if (shard->size() != count || shard->version() != version) violated("size or version differs from the header");
  std::vector<int64_t> ids(static_cast<size_t>(count));
  int64_t first_bad = -1;
  for (int64_t i = 0; i < count; ++i) {
    const char* at = bytes.data() + kTokenShardHeaderBytes + i * width;
    uint32_t id = 0;
    if (width == 2) {
      uint16_t narrow;
      std::memcpy(&narrow, at, 2);
      id = narrow;
    } else {
      std::memcpy(&id, at, 4);
    }
    ids[static_cast<size_t>(i)] = id;
    if (shard->token(i) != id) violated("an id read from the mapping differs from the file");
    if (first_bad < 0 && id >= kVocabulary) first_bad = i;
  }
  const Status checked = shard->check_vocabulary(kVocabulary);
  if (first_bad >= 0) {
    check_refusal(checked, file.path, "check_vocabulary");
    if (checked.code() != StatusCode::kCorrupt) violated("a bad id refused with another code than kCorrupt");
    if (checked.message().find("token " + std::to_string(first_bad) + " ") == std::string::npos) {
      violated("the refusal does not name the first bad id: " + checked.message());
    }
    return;
  }
  if (!checked.is_ok()) violated("ids below the vocabulary refused: " + checked.to_string());
  check_windows(TokenWindows(shard, 0, count, context, kVocabulary), ids);

  TokenSpec spec;
  spec.path = file.path;
  spec.context = context;
  spec.vocabulary = kVocabulary;
  spec.test_fraction = 0.25;
  Result<LoadedTokens> loaded = load_token_data(spec);
  if (!loaded.is_ok()) {
    if (loaded.status().code() != StatusCode::kInvalidArgument)
      violated("split refused: " + loaded.status().to_string());
    check_refusal(loaded.status(), file.path, "load_token_data");
    return;
  }
  const TokenWindows& train = loaded->train;
  const TokenWindows& test = loaded->test;
  if (train.size() < 1 || test.size() < 1) violated("an empty split accepted");
  if (train.begin() != 0 || train.end() > test.begin() || test.end() != count)
    violated("the splits overlap or miss the tail");
  check_windows(train, ids);
  check_windows(test, ids);
}

void fuzz_jsonl(const std::string& bytes, const std::string& field) {
  const MemFile& file = memfile();
  fill(file, bytes);
  Result<std::vector<std::string>> got = read_jsonl_documents(file.path, field);
  if (!got.is_ok()) {
    if (got.status().code() != StatusCode::kCorrupt) violated("jsonl refused with another code than kCorrupt");
    check_refusal(got.status(), file.path, "jsonl");
    return;
  }
  // The reference: nlohmann's DOM, line by line.
  std::string_view text = bytes;
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  size_t document = 0;
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const nlohmann::json value = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (value.is_discarded() || !value.is_object()) violated("a line accepted that is not a JSON object");
    const auto found = value.find(field);
    if (found == value.end() || !found->is_string()) violated("a line accepted without the field as a string");
    if (document >= got->size() || (*got)[document] != found->get<std::string>()) violated("a document differs");
    ++document;
  }
  if (document != got->size() || document == 0) violated("document count differs");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return -1;  // not added to the corpus
  const uint8_t flags = data[0];
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const int64_t context = 1 + (flags >> 4);
  if (flags & 1) {
    fuzz_jsonl(rest, (flags & 2) ? "body" : "text");
    return 0;
  }
  if (!(flags & 2)) {
    fuzz_shard(rest, context);
    return 0;
  }
  const int32_t version = (flags & 4) ? 2 : 1;
  const int64_t count = static_cast<int64_t>(rest.size()) / (version == 1 ? 2 : 4) + ((flags & 8) ? 1 : 0);
  std::vector<int32_t> header(kTokenShardHeaderInts, 0);
  header[0] = kTokenShardMagic;
  header[1] = version;
  header[2] = static_cast<int32_t>(count);
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  fuzz_shard(bytes + rest, context);
  return 0;
}
