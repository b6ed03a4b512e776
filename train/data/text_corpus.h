// Plain text for the language models: a corpus of documents, a byte-level
// tokenizer (256 symbols: a byte is a token, nothing to download or train),
// a held-out split, and windows of tokens as a trainer Dataset.
//
// Sources:
// - "bible-kjv": the King James Bible from Debian's bible-kjv package
//   (`bible -f Gen1:1-Rev22:21`, 4.4 MB), one document per book (66: Ge ..
//   Rev, the Old Testament the first 39), verse references dropped, one
//   verse per line; the environment variable FEDMESH_BIBLE names another
//   `bible` program to run (default /usr/bin/bible);
// - "bible-kjv:old", "bible-kjv:new": its Old Testament (39 books) or New
//   Testament (27 books) alone;
// - a directory: every regular file in it (not recursive), sorted by name,
//   is a document, its bytes taken as they are.
// Both are input from outside: sizes are bounded and a source with no text
// is refused by name.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

inline constexpr const char* kBibleCorpus = "bible-kjv";
inline constexpr const char* kOldTestament = "bible-kjv:old";
inline constexpr const char* kNewTestament = "bible-kjv:new";
inline constexpr const char* kBibleProgramVariable = "FEDMESH_BIBLE";
inline constexpr int kBibleBooks = 66, kOldTestamentBooks = 39;
inline constexpr int64_t kMaxCorpusBytes = int64_t{2} << 30;
inline constexpr int kByteVocabulary = 256;

struct TextDocument {
  std::string name;  // the book's abbreviation ("Ge"), or the file name
  std::string text;
};

struct TextCorpus {
  std::vector<TextDocument> documents;
  int64_t bytes() const;
};

Result<TextCorpus> load_text_corpus(const std::string& source);

// Byte-level tokenizer.
std::vector<int32_t> byte_tokens(std::string_view text);
// Bytes of the tokens; ids outside [0, 256) are refused.
Result<std::string> byte_text(std::span<const int32_t> tokens);

// Every chosen document cut in two: its first (1 - holdout) for training,
// the rest held out for validation (so every document is in both), each
// part's tokens concatenated in document order.
struct TextSplit {
  std::vector<int32_t> train, validation;
};
TextSplit split_documents(const TextCorpus& corpus, std::span<const size_t> documents, double holdout);

// The documents site `index` of `sites` holds under a text partition:
//   "iid"        every document: the site holds its index-th of `sites`
//                equal parts of each (site_text, tokenized_text.h);
//   "books"      documents index, index + sites, index + 2 sites, ...;
//   "contiguous" a contiguous run of about documents/sites (non-IID: for the
//                Bible, early sites hold the law and the prophets, late ones
//                the gospels and letters);
//   "testament"  the Bible only, 2 sites: the Old Testament, then the New.
// kInvalidArgument names a partition that does not apply.
Status check_text_partition(std::string_view partition);
Result<std::vector<size_t>> documents_for_site(const TextCorpus& corpus, std::string_view partition, int sites,
                                               int index);

// The text site `index` of `sites` holds under a text partition, as a
// corpus of its own: its documents (or, for "iid", its part of every one).
Result<TextCorpus> site_corpus(const TextCorpus& corpus, std::string_view partition, int sites, int index);

// Windows of `context` tokens; sample i starts at token i * stride and its
// targets are the `context` tokens after each of its positions.
class TextWindows final : public Dataset {
 public:
  TextWindows(std::vector<int32_t> tokens, int64_t context, int64_t stride);
  int64_t size() const override;
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;
  int64_t targets_per_sample() const override { return context_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  std::vector<int32_t> tokens_;
  int64_t context_, stride_;
};

// The text a language model trains on when a flag or key names the
// image data set's default ("fashion-mnist"): the Bible; else `source`.
std::string text_source(const std::string& source);

// The share of every document held out from training, as the aggregator
// and `fedmesh train` evaluate on it (held_out_windows, tokenized_text.h).
inline constexpr double kHeldOutText = 0.05;
// The held-out tokens of a split in windows of `context` (the first `limit`;
// 0: all); text shorter than one window is refused.
Result<TextWindows> held_out_token_windows(std::vector<int32_t> held_out, int64_t context, int64_t limit);

// Entropy of the unigram distribution of `train`'s tokens measured on
// `evaluated` (cross-entropy in nats per token, add-one smoothed): the loss
// of the best model that ignores context, the bar a language model must
// pass to have learned anything from context.
double unigram_cross_entropy(std::span<const int32_t> train, std::span<const int32_t> evaluated, int vocabulary);

}  // namespace fedmesh::train::data
