// Byte-level BPE: a tokenizer trained on a text corpus (`fedmesh tokenizer
// train`), the optional alternative to the byte tokenizer of text_corpus.h.
//
// Symbols 0..255 are the bytes; merge i joins two earlier symbols into symbol
// 256 + i. Every token is a string of bytes, so any input encodes (no
// unknown token) and decoding concatenates the tokens' bytes:
// decode(encode(x)) == x for every byte string x.
//
// Pre-tokenization (kPretokenizer, "gpt2-ascii"): before merging, text is cut
// into pieces as GPT-2's regex cuts it, with ASCII classes, and merges never
// cross a piece (nor a document: pieces lie inside one document). A piece is
//   - an optional single space and a run of letters (A-Z, a-z and every byte
//     >= 0x80, so UTF-8 letters stay in their word), or of digits, or of
//     other non-space bytes (punctuation);
//   - a run of whitespace (' ', \t, \n, \v, \f, \r), less its last space
//     when a non-space follows (that space starts the next word);
// and a piece longer than max_piece_bytes is cut into pieces of that many
// bytes (a bound on the work one piece costs, in training and encoding).
// GPT-2's contractions ('s, 't, ...) are not special: "'" is punctuation.
//
// Training (train_bpe): count the pieces of the corpus as word types with
// counts, count adjacent symbol pairs over them (weighted by the counts),
// and repeatedly merge the most frequent pair (ties: the smallest first id,
// then the smallest second id) into a new symbol, updating the counts of the
// words that held the pair only, until the vocabulary is full or no pair
// occurs twice. Encoding applies the merges to each piece by rank (lowest
// first, leftmost first among equal ranks), as training applied them.
//
// The file (save/parse), JSON, one object:
//   {"format": "fedmesh-bpe", "version": 1, "pretokenizer": "gpt2-ascii",
//    (version 2 adds "byte_ids": [256 ids] and "specials": [strings], and
//    may say "pretokenizer": "gpt2": BpeLayout below)
//    "max_piece_bytes": 128, "vocab_size": 256 + M,
//    "merges": [[a0, b0], [a1, b1], ...],          // M pairs of symbol ids
//    "checksum": "fnv1a64:<16 hex digits>"}        // fingerprint(), below
// A tokenizer file is untrusted input: parse refuses (kCorrupt or
// kInvalidArgument, the message naming what is wrong) a file over
// kMaxTokenizerFileBytes, text that is not JSON, a missing or unknown key,
// another format or version, a vocabulary over kMaxTokenizerVocabulary or
// that is not 256 + merges, a merge that is not two ids, that names an id not
// yet created (negative, or >= 256 + its own index), that repeats an earlier
// merge, or that makes a token longer than max_piece_bytes, and a checksum
// that does not match.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "train/data/text_corpus.h"

namespace fedmesh::train::data {

inline constexpr const char* kBpeFormat = "fedmesh-bpe";
inline constexpr int kBpeFormatVersion = 1;
inline constexpr int kBpeFormatVersion2 = 2;  // an imported tokenizer's layout (BpeLayout)
inline constexpr const char* kPretokenizer = "gpt2-ascii";
inline constexpr int kMaxTokenizerVocabulary = 65536;
inline constexpr int kDefaultMaxPieceBytes = 128;
inline constexpr int kMaxPieceBytesLimit = 4096;
inline constexpr size_t kMaxTokenizerFileBytes = size_t{16} << 20;

// The pieces of `text` under kPretokenizer, in order; they partition it.
std::vector<std::string_view> pretokenize(std::string_view text, int max_piece_bytes);

// Appends text[begin, end) to a pretokenizer's pieces, cut into pieces of at
// most max_piece_bytes (what both pretokenizers do with a long piece).
class PieceCutter {
 public:
  PieceCutter(std::string_view text, int max_piece_bytes, std::vector<std::string_view>& pieces);
  void operator()(size_t begin, size_t end) const;

 private:
  std::string_view text_;
  size_t limit_;
  std::vector<std::string_view>& pieces_;
};

// How a tokenizer cuts text before merging: "gpt2-ascii" (above, what
// `fedmesh tokenizer train` writes), or "gpt2", GPT-2's own regex with
// Unicode classes and contractions (gpt2_tokenizer.h), for tokenizers
// imported from GPT-2's vocab.json and merges.txt.
enum class Pretokenizer { kGpt2Ascii, kGpt2 };
inline constexpr const char* kGpt2Pretokenizer = "gpt2";
inline constexpr size_t kMaxSpecialTokens = 64;
inline constexpr size_t kMaxSpecialTokenBytes = 256;

// What an imported tokenizer adds to the merges (file version 2; a
// tokenizer with the defaults is written as version 1, as before):
// the pretokenizer, the id of each byte's token (GPT-2 numbers its 256
// byte tokens in its own order; merged tokens are 256 + their merge's index
// in both), and special tokens after the merged ones (GPT-2's
// <|endoftext|>, 50256), which encode never produces and decode writes out
// as their text.
struct BpeLayout {
  Pretokenizer pretokenizer = Pretokenizer::kGpt2Ascii;
  std::vector<int32_t> byte_ids;      // empty: byte b is id b; else a permutation of 0..255
  std::vector<std::string> specials;  // at most kMaxSpecialTokens, each 1..kMaxSpecialTokenBytes bytes
  bool is_default() const { return pretokenizer == Pretokenizer::kGpt2Ascii && byte_ids.empty() && specials.empty(); }
};

class BpeTokenizer {
 public:
  using Merge = std::pair<int32_t, int32_t>;

  // A tokenizer from its merges (pairs of byte values 0..255 and merged ids
  // 256 + i, whatever the layout's byte ids), checked as a file's are.
  static Result<BpeTokenizer> from_merges(std::vector<Merge> merges, int max_piece_bytes = kDefaultMaxPieceBytes,
                                          BpeLayout layout = {});
  // The file's text (see above); a refusal names what is wrong.
  static Result<BpeTokenizer> parse(std::string_view text);
  static Result<BpeTokenizer> load(const std::string& path);

  // The file's text, canonical: equal tokenizers give equal bytes.
  std::string to_json() const;
  // Written atomically (a crash leaves the old file or the new one).
  Status save(const std::string& path) const;
  // FNV-1a (64 bits) over the pretokenizer, max_piece_bytes and the merges:
  // "fnv1a64:" and 16 hex digits. Two tokenizers with the same fingerprint
  // encode alike; a run records it and refuses to resume with another.
  std::string fingerprint() const;

  int vocabulary() const { return 256 + static_cast<int>(merges_.size() + layout_.specials.size()); }
  int max_piece_bytes() const { return max_piece_bytes_; }
  const std::vector<Merge>& merges() const { return merges_; }
  const BpeLayout& layout() const { return layout_; }
  // The bytes of a token; id in [0, vocabulary()).
  std::string_view token_bytes(int32_t id) const;

  std::vector<int32_t> encode(std::string_view text) const;
  // Ids outside [0, vocabulary()) are refused by value.
  Result<std::string> decode(std::span<const int32_t> tokens) const;
  // Bytes the tokens stand for (their decoded length); ids must be valid.
  int64_t byte_count(std::span<const int32_t> tokens) const;

 private:
  BpeTokenizer() = default;
  // Applies the merges to one piece's bytes, appending its tokens.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<Merge> merges_;
  int max_piece_bytes_ = kDefaultMaxPieceBytes;
  BpeLayout layout_;
  std::array<int32_t, 256> byte_id_{}, byte_of_id_{};  // byte -> its token id, and back
  std::vector<std::string> token_bytes_;                  // by id
  std::unordered_map<uint64_t, int32_t> merge_rank_;  // (first << 32 | second) -> merge index
};

struct BpeTrainOptions {
  int vocabulary = 1024;  // 256 bytes + merges, in [257, kMaxTokenizerVocabulary]
  int max_piece_bytes = kDefaultMaxPieceBytes;
  // Called every `progress_every` merges and after the last one with the
  // merges done and the merges asked for.
  std::function<void(int done, int wanted)> on_progress;
  int progress_every = 100;
};

// Trains on every document of `corpus` (see above). Stops early, with fewer
// merges, when no pair occurs twice.
Result<BpeTokenizer> train_bpe(const TextCorpus& corpus, const BpeTrainOptions& options);

// split_documents (text_corpus.h) with this tokenizer: each document cut at
// the same byte as the byte tokenizer cuts it, each part encoded on its own.
TextSplit split_documents(const TextCorpus& corpus, std::span<const size_t> documents, double holdout,
                          const BpeTokenizer& tokenizer);

}  // namespace fedmesh::train::data
