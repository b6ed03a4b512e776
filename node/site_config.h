// What one institution's node is: its identity in the federation, its model,
// its data (a shard of Fashion-MNIST standing in for the institution's own),
// how it trains and compresses, and (aggregator mode) where the aggregator
// is. `fedmesh node` reads it from TOML for both modes: the aggregator site
// (site_runtime.h) and the gossip peer (node/gossip_runtime.h), which
// adds its own [gossip] and [swim] keys.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/toml_input.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/data_source.h"
#include "train/data/dataset.h"
#include "train/data/fashion_mnist.h"
#include "train/initial_weights.h"
#include "train/model.h"
#include "train/trainer.h"

namespace fedmesh::node {

struct SiteConfig {
  std::string federation;
  std::string name;                       // our roster name
  std::string aggregator = "tcp://127.0.0.1:7400";
  std::string aggregator_name = "aggregator";
  std::string keys, roster, admin_public;
  std::string store;                      // default: NAME.db
  int64_t keep_last = 3;                  // rounds the store keeps (each holds the model and its state)
  std::string metrics;                    // HOST:PORT ("" = off)
  std::string model = "mlp";
  uint64_t seed = 1;                      // the federation's model seed (version 0)
  train::InitialWeights init;             // init, init_format: version 0 from this file (the aggregator's own)
  // This site's data. The institution's own (data.source = "csv:FILE" or
  // "images:DIR", train/data/data_source.h): all of it, never split, its
  // test part held out for local evaluation. The demo sets (Fashion-MNIST,
  // the text corpora): shard `index` of `sites` split by `partition` with
  // `data_seed`, a tenth of it held out.
  train::data::DataSource data;
  std::string partition = "dirichlet:0.5";  // read_site_config: "iid" for language models when unset
  int sites = 1;
  int index = 0;
  uint64_t data_seed = 1;
  int64_t train_limit = 0;
  // data.tokenizer: language models, a BPE tokenizer file (`fedmesh
  // tokenizer train`) to read the text with instead of bytes; the model's
  // vocabulary becomes the tokenizer's. It must be the aggregator's
  // `tokenizer` (the site refuses to take part otherwise). Aggregator mode
  // only: gossip peers have no way to agree on one yet. "" = bytes.
  std::string tokenizer;
  train::TrainOptions local;                     // max_steps comes from the aggregator's announcement
  int threads = 1;
  // training.device / `fedmesh node --device`: "cpu" or "cuda" (the model
  // trained on the GPU: train/trainer.h's train::training_device says when it can).
  std::string device = "cpu";
  int ranks = 1;                          // `fedmesh node --ranks N`: data-parallel ranks (site_ranks.h)
  // training.tensor_parallel / `--tensor-parallel N`: a GPT's blocks split
  // over N CPU ranks, times `ranks` data-parallel groups (site_ranks.h).
  int tensor_parallel = 1;
  bool zero_one = false;                  // `--zero-1`: their optimizer state sharded
  double poll_seconds = 0.2;
  double step_delay_seconds = 0.0;        // experiments: make this site slower
  double give_up_seconds = 0.0;           // > 0: exit when the aggregator is silent this long
  // How updates are compressed ([compression]: default, overrides, dense_below;
  // specs as in protocol/compression_spec.h), with error feedback: the
  // residual is checkpointed with the rest (role "residual").
  std::string compress = "identity";
  std::vector<std::string> compress_overrides;
  uint64_t dense_below = 0;
  std::string compress_device = "cpu";   // cpu, cuda or auto
  std::string faults;                     // transport.faults: experiments only (protocol/fault_injection.h)
  // privacy.mode: "trusted" (the aggregator sees each signed update) or
  // "private" (secure aggregation: the update leaves only masked, and the
  // aggregator learns the sum of the round's survivors). Must match the
  // aggregator's: a private site never sends an update in the clear.
  std::string privacy_mode = "trusted";
  SiteConfig();
  Status validate() const;
};

// Reads the keys every node has; the aggregator's address and polling
// settings only when `with_aggregator`.
void read_site_keys(ConfigReader& reader, SiteConfig& config, bool with_aggregator);
Result<SiteConfig> read_site_config(const std::string& path);
// The config's `mode` key: "aggregator" (the default) or "gossip".
Result<std::string> read_node_mode(const std::string& path);

// This node's training shard and the tenth of it held out for local
// evaluation, from data.* (the same split on every node of the federation),
// and with test_limit >= 0 the test set (its first test_limit samples; 0:
// all of them; null without). Image models: Fashion-MNIST images, the
// shard cut by the image partition. Language models: windows of text
// (train/data/text_corpus.h): the node's documents under a text partition
// (books, contiguous, testament), the first 90% of each to train on and
// the rest held out; the test set is every document's last 5%, which no
// node trains on. With data.tokenizer the text is read with it (loaded
// here; a file that is not a valid tokenizer is refused by name) and the
// model is made with its vocabulary (train::make_model(model, seed, vocabulary)).
struct SiteData {
  std::unique_ptr<train::data::Dataset> shard, holdout, test;
  train::data::DataSchema schema;  // image and table models: what the model is built for
  std::optional<train::data::BpeTokenizer> tokenizer;
  int64_t vocabulary = 0;  // the tokenizer's; 0: the model's own
  // "fnv1a64:..." of data.tokenizer, "" for bytes (and the image models).
  std::string tokenizer_fingerprint() const { return tokenizer ? tokenizer->fingerprint() : std::string(); }
  train::ModelInput model_input() const { return {vocabulary, schema.sample_shape, schema.classes, schema.regression}; }
};
Result<SiteData> load_site_data(const SiteConfig& config, int64_t test_limit = -1);

}  // namespace fedmesh::node
