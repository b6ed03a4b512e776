// What a local training run (`fedmesh train`) trains and evaluates on:
// Fashion-MNIST images for the image models; windows of a text corpus for
// the language models (95% of every document to train on, the rest held
// out), in bytes or in the tokens of a BPE tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "base/status.h"
#include "train/data/data_source.h"
#include "train/data/dataset.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/fashion_mnist.h"

namespace fedmesh::train {

struct TrainingDataSpec {
  std::string model;            // decides images or text
  data::DataSource data;        // --data and the flags of own data
  std::string tokenizer;        // language models: a BPE tokenizer file; "": bytes
  int64_t train_limit = 0;      // images, or windows of text (0: all)
  int64_t test_limit = 0;
};

struct TrainingData {
  std::unique_ptr<data::FashionMnistSplits> images;
  std::unique_ptr<data::Dataset> train, test;
  data::DataSchema schema;    // image and table models: what the model is built for
  double load_seconds = 0.0;  // reading, decoding and splitting, before training
  bool language = false;
  bool pretokenized = false;  // tokens:FILE.bin: ids with no bytes behind them (no bits per byte)
  std::string description;    // "60000 Fashion-MNIST images (10000 test)"
  double unigram_loss = 0.0;  // language models: the byte unigram's nats per byte on the held-out text
  // A BPE tokenizer: it, the model's vocabulary (0: the model's own),
  // held-out target tokens per byte they stand for, and the token unigram's
  // nats per token on them.
  std::optional<data::BpeTokenizer> tokenizer;
  int64_t vocabulary = 0;
  double tokens_per_byte = 1.0;
  double token_unigram_loss = 0.0;
};

// kInvalidArgument for a tokenizer given to an image model, own data given to
// a language model, or a text too short for one window; the loaders' errors
// otherwise.
Result<TrainingData> load_training_data(const TrainingDataSpec& spec);

}  // namespace fedmesh::train
