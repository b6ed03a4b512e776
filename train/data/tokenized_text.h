// A language model's text under its tokenizer, one implementation for
// `fedmesh train`, the sites of a federation and the aggregator's evaluation:
// a BPE tokenizer (bpe_tokenizer.h), or, where the pointer is null, the byte
// tokenizer of text_corpus.h. Every split cuts each document at the same byte
// under either tokenizer, so runs with and without one hold out the same text.
//
// Bits per byte: a loss in nats per token times the tokens per byte of the
// text scored, over ln 2. The tokens scored are the targets of the held-out
// windows (windows of `context` at stride `context`: tokens 1 .. windows *
// context of the held-out stream), and their bytes are the bytes those
// tokens decode to; with the byte tokenizer that ratio is 1.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/text_corpus.h"

namespace fedmesh::train::data {

// split_documents (text_corpus.h) under `tokenizer`.
TextSplit split_text(const TextCorpus& corpus, std::span<const size_t> documents, double holdout,
                     const BpeTokenizer* tokenizer);

// The text site `index` of `sites` trains on and holds out under a text
// partition: site_corpus's documents (text_corpus.h), each cut into training
// text and the last `holdout` of it.
Result<TextSplit> site_text(const TextCorpus& corpus, std::string_view partition, int sites, int index, double holdout,
                            const BpeTokenizer* tokenizer = nullptr);

// What a site of a federation trains on and holds out for its local
// evaluation: site_text with the last kSiteHoldout of each of its
// documents held out, in windows of `context` at stride `context` (the
// first train_limit training windows when > 0). kInvalidArgument when the
// training text is shorter than one window.
inline constexpr double kSiteHoldout = 0.1;
struct SiteWindows {
  TextWindows train, holdout;
};
Result<SiteWindows> site_windows(const TextCorpus& corpus, std::string_view partition, int sites, int index,
                                 int64_t context, int64_t train_limit, const BpeTokenizer* tokenizer = nullptr);

// The text every site holds out from training: the last kHeldOutText of
// every document of the corpus, in windows of `context` tokens (the first
// `limit` windows; 0: all).
Result<TextWindows> held_out_windows(const TextCorpus& corpus, int64_t context, int64_t limit,
                                     const BpeTokenizer* tokenizer = nullptr);

// The targets an evaluation of `held_out` in windows of `context` at stride
// `context` scores: tokens 1 .. windows * context (empty when the text is
// shorter than one window).
std::span<const int32_t> scored_targets(std::span<const int32_t> held_out, int64_t context);

// Scored tokens per byte they stand for: 1 for the byte tokenizer, and for
// an empty span.
double tokens_per_byte(std::span<const int32_t> targets, const BpeTokenizer* tokenizer);

// A held-out loss in nats per token as bits per byte of the text it scored.
double bits_per_byte(double loss_nats_per_token, double tokens_per_byte);

// What a language model's held-out loss is compared with (`fedmesh train`):
// a unigram of the training text, which ignores context, on the held-out
// text. The byte unigram is the bar in bits per byte whatever the
// tokenizer, so that runs with and without one compare.
struct HeldOutBaseline {
  double tokens_per_byte = 1.0;     // scored held-out targets per byte
  double byte_unigram_loss = 0.0;   // nats per byte: the byte unigram of the training text
  double token_unigram_loss = 0.0;  // nats per token: the unigram of the training tokens (the byte
                                    // tokenizer: the byte unigram's)
};
// With the byte tokenizer every held-out token is measured; with a BPE
// tokenizer the scored targets (scored_targets), and nothing when the
// held-out text is shorter than one window (the caller refuses such text).
HeldOutBaseline held_out_baseline(std::span<const int32_t> train, std::span<const int32_t> held_out, int64_t context,
                                  const BpeTokenizer* tokenizer);

}  // namespace fedmesh::train::data
