#include "train/data/tokenized_text.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace fedmesh::train::data {

TextSplit split_text(const TextCorpus& corpus, std::span<const size_t> documents, double holdout,
                     const BpeTokenizer* tokenizer) {
  return tokenizer ? split_documents(corpus, documents, holdout, *tokenizer)
                   : split_documents(corpus, documents, holdout);
}

Result<TextSplit> site_text(const TextCorpus& corpus, std::string_view partition, int sites, int index, double holdout,
                            const BpeTokenizer* tokenizer) {
  Result<TextCorpus> mine = site_corpus(corpus, partition, sites, index);
  if (!mine.is_ok()) return mine.status();
  std::vector<size_t> all(mine->documents.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = d;
  return split_text(*mine, all, holdout, tokenizer);
}

Result<SiteWindows> site_windows(const TextCorpus& corpus, std::string_view partition, int sites, int index,
                                 int64_t context, int64_t train_limit, const BpeTokenizer* tokenizer) {
  Result<TextSplit> text = site_text(corpus, partition, sites, index, kSiteHoldout, tokenizer);
  if (!text.is_ok()) return text.status();
  TextSplit& split = *text;
  if (train_limit > 0) {
    split.train.resize(std::min(split.train.size(), static_cast<size_t>(train_limit * context + 1)));
  }
  SiteWindows windows{TextWindows(std::move(split.train), context, context),
                      TextWindows(std::move(split.validation), context, context)};
  if (windows.train.size() == 0) {
    return invalid_argument("site " + std::to_string(index) + "'s text is shorter than one window of " +
                            std::to_string(context) + " tokens");
  }
  return windows;
}

Result<TextWindows> held_out_windows(const TextCorpus& corpus, int64_t context, int64_t limit,
                                     const BpeTokenizer* tokenizer) {
  std::vector<size_t> all(corpus.documents.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = d;
  return held_out_token_windows(split_text(corpus, all, kHeldOutText, tokenizer).validation, context, limit);
}

std::span<const int32_t> scored_targets(std::span<const int32_t> held_out, int64_t context) {
  const size_t n = held_out.size(), width = static_cast<size_t>(context);
  if (context < 1 || n <= width) return {};
  const size_t windows = (n - width - 1) / width + 1;
  return held_out.subspan(1, windows * width);
}

double tokens_per_byte(std::span<const int32_t> targets, const BpeTokenizer* tokenizer) {
  if (tokenizer == nullptr || targets.empty()) return 1.0;
  const int64_t bytes = tokenizer->byte_count(targets);
  return bytes > 0 ? static_cast<double>(targets.size()) / static_cast<double>(bytes) : 1.0;
}

double bits_per_byte(double loss_nats_per_token, double tokens_per_byte) {
  return loss_nats_per_token * tokens_per_byte / std::log(2.0);
}

HeldOutBaseline held_out_baseline(std::span<const int32_t> train, std::span<const int32_t> held_out, int64_t context,
                                  const BpeTokenizer* tokenizer) {
  HeldOutBaseline out;
  if (tokenizer == nullptr) {
    out.byte_unigram_loss = unigram_cross_entropy(train, held_out, kByteVocabulary);
    out.token_unigram_loss = out.byte_unigram_loss;
    return out;
  }
  const std::span<const int32_t> targets = scored_targets(held_out, context);
  if (targets.empty()) return out;
  // Both spans came from encode(): every id is in the vocabulary.
  const std::string train_text = tokenizer->decode(train).value();
  const std::string target_text = tokenizer->decode(targets).value();
  out.byte_unigram_loss = unigram_cross_entropy(byte_tokens(train_text), byte_tokens(target_text), kByteVocabulary);
  out.token_unigram_loss = unigram_cross_entropy(train, targets, tokenizer->vocabulary());
  out.tokens_per_byte = tokens_per_byte(targets, tokenizer);
  return out;
}

}  // namespace fedmesh::train::data
