// Pre-tokenized text as a data set (`tokens:FILE.bin`), and text as JSON
// lines (`jsonl:FILE`).
//
// Token shards are llm.c's and nanoGPT's `.bin` files, memory-mapped and
// never copied: the windows of a training run read their ids straight from
// the mapping, so the memory a run holds is the pages it touched, which the
// OS may drop again (they are clean file pages). Resident-set figures count
// them by the page cache's folio: where the file is cached in large folios
// (after a sequential read of it, on Linux 6.18 up to 2 MiB), one touched
// window maps its whole folio (docs/data.md has the measured numbers).
//
// Format (all integers little-endian):
//   bytes 0 .. 1023   header: 256 int32
//                       [0] magic 20240520
//                       [1] version: 1 = uint16 tokens, 2 = uint32 tokens
//                       [2] token count C
//                       [3 .. 255] unused (llm.c writes zeros; not checked)
//   bytes 1024 ..     C tokens of 2 (version 1) or 4 (version 2) bytes
// The file is exactly 1024 + C × width bytes and C >= 2 (one window needs
// an input and a target). A file without the magic (a raw array of ids,
// say) is refused rather than guessed at.
//
// Ids must be below the model's vocabulary (an id at or above it would index
// past the embedding). make_batch cannot return a Status, so the whole shard
// is checked once, before any window is built: check_vocabulary reads the
// file in one sequential pass of kTokenCheckChunkBytes reads (through the
// page cache, not the mapping, so it adds nothing to the process's resident
// memory) and names the first bad id and its position. The pass costs about
// what reading the file once costs, far less than one epoch of training.
//
// Every flaw of a file is a Status whose message begins with the file's
// path: kNotFound for a missing file, kCorrupt for its contents,
// kInvalidArgument for a spec that does not fit it, kIoError when the OS
// refuses.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int64_t kTokenShardHeaderInts = 256;
inline constexpr int64_t kTokenShardHeaderBytes = kTokenShardHeaderInts * 4;
// Ids travel to the model as floats, exact below 2^24.
inline constexpr int64_t kMaxTokenVocabulary = int64_t{1} << 24;
// The size of one read of check_vocabulary's pass.
inline constexpr int64_t kTokenCheckChunkBytes = int64_t{1} << 20;

// One mapped shard (read-only, MAP_PRIVATE). Move-only; unmaps on
// destruction. Share it between data sets through a std::shared_ptr.
class TokenShard {
 public:
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  int version() const { return version_; }
  int width_bytes() const { return version_ == 1 ? 2 : 4; }
  int64_t size() const { return count_; }  // tokens
  // Token i in [0, size()), as read from the mapping.
  int64_t token(int64_t i) const;

  // One sequential pass over the file: every id below `vocabulary` (in
  // [1, kMaxTokenVocabulary]; else kInvalidArgument). The first id that is
  // not is kCorrupt, naming its position (0-based, in tokens) and value; a
  // file that changed size since it was opened is kIoError. On success the
  // shard remembers the smallest vocabulary it passed (checked_vocabulary).
  Status check_vocabulary(int64_t vocabulary);
  int64_t checked_vocabulary() const { return checked_vocabulary_; }  // 0: never checked

 private:
  friend Result<TokenShard> open_token_shard(const std::string& path);
  TokenShard() = default;
  void release();

  std::string path_;
  int fd_ = -1;  // kept for check_vocabulary's reads
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int version_ = 0;
  int64_t count_ = 0;
  int64_t checked_vocabulary_ = 0;
};

// Opens and maps `path`, checking the header and the file's size (not the
// ids: check_vocabulary).
Result<TokenShard> open_token_shard(const std::string& path);

// Windows of `context` tokens at stride `context` over the tokens
// [begin, end) of a shard: window i's inputs are tokens begin + i·context
// .. + context − 1 and its targets the tokens one further, so a window reads
// context + 1 tokens and none reads past `end`. make_batch gives the same
// tensors as TextWindows::make_batch: inputs (batch, context) ids as fp32
// whatever the dtype asked, targets batch × context ids.
// The shard must have passed check_vocabulary with a vocabulary no larger
// than `vocabulary`; make_batch checks every id again (a compare per token)
// and stops the process, naming the file, when one is out of range, which
// only a file rewritten under the mapping can cause. (A file truncated under
// the mapping raises SIGBUS on the next read of a lost page; nothing here
// guards against that.)
class TokenWindows final : public Dataset {
 public:
  TokenWindows(std::shared_ptr<const TokenShard> shard, int64_t begin, int64_t end, int64_t context,
               int64_t vocabulary);
  int64_t size() const override;  // windows
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;
  int64_t targets_per_sample() const override { return context_; }

  const TokenShard& shard() const { return *shard_; }
  const std::shared_ptr<const TokenShard>& shared_shard() const { return shard_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  int64_t context() const { return context_; }
  int64_t vocabulary() const { return vocabulary_; }

 private:
  std::shared_ptr<const TokenShard> shard_;
  int64_t begin_, end_, context_, vocabulary_;
};

struct TokenSpec {
  std::string path;                         // the training shard
  std::string test_path;                    // optional held-out shard; else the last test_fraction of path
  double test_fraction = 0.05;              // in (0, 1), used without test_path
  int64_t context = 0;                      // tokens per window, >= 1
  int64_t vocabulary = 0;                   // the model's, in [1, kMaxTokenVocabulary]; every id is checked against it
  int64_t train_limit = 0, test_limit = 0;  // windows: > 0: the first N of the split; 0: all
};

struct LoadedTokens {
  TokenWindows train, test;  // without test_path both share one mapping
  std::string description;   // one line for the start of a run
};

// Opens the shard(s), checks every id against spec.vocabulary, and splits:
// without test_path, training reads tokens [0, cut) and the held-out set
// [cut, size) with cut = size − ceil(size × test_fraction), so no token is
// in both. A split shorter than one window (context + 1 tokens) is
// kInvalidArgument naming the file and the numbers.
Result<LoadedTokens> load_token_data(const TokenSpec& spec);

// --- jsonl:FILE ---
// One JSON object per line, each a document: its `field` (default "text")
// must be a string. Lines end with "\n" or "\r\n"; blank lines are skipped;
// a UTF-8 BOM before line 1 is skipped. Refusals (kCorrupt) name the file
// and the line (1-based): not JSON (with the byte of the line where parsing
// failed), not an object, nested deeper than kMaxJsonlDepth, no such field,
// the field not a string (naming its type); a file with no document, or
// over kMaxJsonlBytes. Other fields are skipped unread (never kept in
// memory); a field given twice counts the last time. The documents are
// returned in file order, empty strings included.
inline constexpr size_t kMaxJsonlBytes = size_t{1} << 30;
inline constexpr int kMaxJsonlDepth = 64;
inline constexpr const char* kDefaultJsonlField = "text";
Result<std::vector<std::string>> read_jsonl_documents(const std::string& path,
                                                      const std::string& field = kDefaultJsonlField);
// The same on bytes already read (`path` only names them in messages).
Result<std::vector<std::string>> parse_jsonl_documents(std::string_view text, const std::string& path,
                                                       const std::string& field = kDefaultJsonlField);

}  // namespace fedmesh::train::data
