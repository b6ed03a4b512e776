#include "node/site_config.h"

#include "train/data/partition.h"
#include "train/data/text_corpus.h"
#include "train/data/token_shards.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "protocol/compression_spec.h"
#include "protocol/fault_injection.h"

namespace fedmesh::node {

SiteConfig::SiteConfig() {
  local.batch_size = 32;
  local.optimizer = "sgd";
  local.lr = 0.05f;
  local.weight_decay = 0.0f;
}

Status SiteConfig::validate() const {
  if (federation.empty() || name.empty()) return invalid_argument("federation and name are required");
  if (keys.empty() || roster.empty() || admin_public.empty()) {
    return invalid_argument("keys, roster and admin_public are required");
  }
  if (ranks < 1 || ranks > 64) return invalid_argument("--ranks must be in [1, 64], not " + std::to_string(ranks));
  if (tensor_parallel != 1) {
    if (tensor_parallel < 1 || ranks * tensor_parallel > 64) {
      return invalid_argument("training.tensor_parallel " + std::to_string(tensor_parallel) + " with --ranks " +
                              std::to_string(ranks) + ": at least 1, and at most 64 processes in all");
    }
    if (Status fits = train::check_tensor_parallel_model(model, tensor_parallel); !fits.is_ok()) {
      return invalid_argument("training.tensor_parallel: " + fits.message());
    }
    if (zero_one) return invalid_argument("training.tensor_parallel with --zero-1 is not supported yet");
    if (init.lora.enabled()) return invalid_argument("training.tensor_parallel with training.lora is not supported yet");
  }
  FEDMESH_RETURN_IF_ERROR(init.lora.validate());
  if (sites < 1 || index < 0 || index >= sites) {
    return invalid_argument("data.index " + std::to_string(index) + " is not a shard of data.sites " +
                            std::to_string(sites));
  }
  if (train_limit < 0) return invalid_argument("data.train_limit must be >= 0");
  FEDMESH_RETURN_IF_ERROR(data.validate());
  if (data.own() && (sites != 1 || index != 0)) {
    return invalid_argument("data.sites and data.index cut the demo data sets into shards; data.source = \"" +
                            data.source + "\" is this institution's own data, which is used whole: remove data.sites "
                            "and data.index");
  }
  if (train::data::is_token_shard(data.source)) {
    if (!train::language_model_config(model)) {
      return invalid_argument("data.source = \"" + data.source + "\": token shards are for the language models "
                              "(gpt-*), not model '" + model + "'");
    }
    if (sites != 1 || index != 0) {
      return invalid_argument("data.sites and data.index cut the demo data sets into shards; data.source = \"" +
                              data.source + "\" is this site's own token shard, which is used whole: remove "
                              "data.sites and data.index");
    }
  }
  if (data.own() && train::language_model_config(model)) {
    return invalid_argument("data.source = \"" + data.source + "\": the language models read text, not " +
                            data.format() + " data");
  }
  if (threads < 0 || threads > 1024) return invalid_argument("training.threads must be in 0..1024");
  if (device != "cpu" && device != "cuda") return invalid_argument("training.device must be cpu or cuda, not '" + device + "'");
  if (!(poll_seconds > 0.0) || poll_seconds > 60.0) return invalid_argument("poll_seconds must be in (0, 60]");
  if (!(step_delay_seconds >= 0.0)) return invalid_argument("step_delay_seconds must be >= 0");
  if (!(give_up_seconds >= 0.0)) return invalid_argument("give_up_seconds must be >= 0");
  if (train::language_model_config(model)) {
    // A token shard is used whole: no partition applies to it.
    if (!train::data::is_token_shard(data.source)) FEDMESH_RETURN_IF_ERROR(train::data::check_text_partition(partition));
  } else if (!tokenizer.empty()) {
    return invalid_argument("data.tokenizer applies to the language models (gpt-*), not to model '" + model + "'");
  } else {
    FEDMESH_RETURN_IF_ERROR(train::data::PartitionSpec::parse(partition).status());
  }
  Result<protocol::CompressionPlan> plan = protocol::make_compression_plan(compress, compress_overrides, dense_below);
  if (!plan.is_ok()) return plan.status();
  FEDMESH_RETURN_IF_ERROR(protocol::parse_fault_plan(faults).status());
  if (compress_device != "cpu" && compress_device != "cuda" && compress_device != "auto") {
    return invalid_argument("compression.device must be cpu, cuda or auto, not '" + compress_device + "'");
  }
  if (privacy_mode != "trusted" && privacy_mode != "private") {
    return invalid_argument("privacy.mode must be trusted or private, not '" + privacy_mode + "'");
  }
  if (privacy_mode == "private" && (compress != "identity" || !compress_overrides.empty())) {
    return invalid_argument(
        "privacy.mode = \"private\" sends the update as 32-bit fixed point under secure aggregation's masks, which is "
        "its compression: leave compression.default at identity with no overrides. Top-k and the sparse encodings "
        "send different coordinates per site and int8/int4/dct-sign scale each site's values differently, so masked "
        "sums of them do not decode");
  }
  if (plan->uses_powersgd()) {
    return invalid_argument("compression: powersgd needs a P shared by the round's sites, an exchange the networked "
                            "aggregator protocol does not carry yet (fedmesh sim runs it); use topk, int8/int4, "
                            "dct-sign or a cast");
  }
  train::TrainOptions check = local;
  check.max_steps = 1;
  return check.validate();
}

void read_site_keys(ConfigReader& r, SiteConfig& c, bool with_aggregator) {
  r.require("federation", c.federation);
  r.require("name", c.name);
  if (with_aggregator) {
    r.require("aggregator", c.aggregator);
    r.read("aggregator_name", c.aggregator_name);
    r.read("poll_seconds", c.poll_seconds);
    r.read("give_up_seconds", c.give_up_seconds);
  }
  r.require("keys", c.keys);
  r.require("roster", c.roster);
  r.require("admin_public", c.admin_public);
  r.read("store", c.store);
  r.read("keep_last", c.keep_last);
  r.read("metrics", c.metrics);
  r.read("model", c.model);
  r.read("seed", c.seed);
  r.read("init", c.init.path);
  r.read("init_format", c.init.format);
  r.read("init_partial", c.init.partial);
  train::read_lora_keys(r, c.init.lora);
  train::data::read_data_source(r, c.data);
  // Unset, the partition follows the model: images by label (Dirichlet),
  // text iid (a Dirichlet over labels means nothing for text).
  std::string partition;
  r.read("data.partition", partition);
  if (!partition.empty()) {
    c.partition = partition;
  } else if (train::language_model_config(c.model)) {
    c.partition = "iid";
  }
  r.read("data.sites", c.sites);
  r.read("data.index", c.index);
  r.read("data.seed", c.data_seed);
  r.read("data.train_limit", c.train_limit);
  r.read("data.tokenizer", c.tokenizer);
  r.read("training.batch_size", c.local.batch_size);
  r.read("training.optimizer", c.local.optimizer);
  r.read("training.lr", c.local.lr);
  r.read("training.momentum", c.local.momentum);
  r.read("training.weight_decay", c.local.weight_decay);
  r.read("training.threads", c.threads);
  r.read("training.device", c.device);
  r.read("training.tensor_parallel", c.tensor_parallel);
  r.read("training.step_delay_seconds", c.step_delay_seconds);
  r.read("compression.default", c.compress);
  r.read("compression.overrides", c.compress_overrides);
  r.read("compression.dense_below", c.dense_below);
  r.read("compression.device", c.compress_device);
  r.read("transport.faults", c.faults);
}

Result<SiteConfig> read_site_config(const std::string& path) {
  Result<toml::table> table = read_toml_file(path);
  if (!table.is_ok()) return table.status();
  SiteConfig c;
  ConfigReader r(*table, path);
  std::string mode = "aggregator";
  r.read("mode", mode);
  if (mode != "aggregator") {
    return invalid_argument(path + ": mode is '" + mode + "': this is not an aggregator site's config (fedmesh node --mode " + mode + ")");
  }
  read_site_keys(r, c, /*with_aggregator=*/true);
  r.read("privacy.mode", c.privacy_mode);
  FEDMESH_RETURN_IF_ERROR(r.finish());
  if (c.store.empty()) c.store = c.name + ".db";
  if (Status s = c.validate(); !s.is_ok()) return invalid_argument(path + ": " + s.message());
  return c;
}

Result<std::string> read_node_mode(const std::string& path) {
  Result<toml::table> table = read_toml_file(path);
  if (!table.is_ok()) return table.status();
  const toml::node* mode = table->get("mode");
  if (mode == nullptr) return std::string("aggregator");
  const std::optional<std::string> text = mode->value<std::string>();
  if (!text || (*text != "aggregator" && *text != "gossip")) {
    return invalid_argument(path + ": mode must be \"aggregator\" or \"gossip\"");
  }
  return *text;
}

namespace {

Result<SiteData> load_site_text(const SiteConfig& config, const train::TransformerConfig& model, int64_t test_limit) {
  SiteData out;
  if (!config.tokenizer.empty()) {
    Result<train::data::BpeTokenizer> tokenizer = train::data::BpeTokenizer::load(config.tokenizer);
    if (!tokenizer.is_ok()) {
      return Status(tokenizer.status().code(), "data.tokenizer: " + tokenizer.status().message());
    }
    out.tokenizer.emplace(std::move(*tokenizer));
    out.vocabulary = out.tokenizer->vocabulary();
  }
  if (train::data::is_token_shard(config.data.source)) {
    // This site's own ids, read in place: the model's vocabulary (or the
    // tokenizer's) bounds every id; the held-out part is the shard's tail
    // (data.test_fraction) or data.test.
    train::data::TokenSpec tokens;
    tokens.path = config.data.path();
    tokens.test_path = config.data.test.empty() ? "" : train::data::DataSource{config.data.test}.path();
    tokens.test_fraction = config.data.test_fraction;
    tokens.context = model.context;
    tokens.vocabulary = out.vocabulary > 0 ? out.vocabulary : model.vocabulary;
    tokens.train_limit = config.train_limit;
    tokens.test_limit = std::max<int64_t>(0, test_limit);
    Result<train::data::LoadedTokens> loaded = train::data::load_token_data(tokens);
    if (!loaded.is_ok()) return loaded.status();
    out.shard = std::make_unique<train::data::TokenWindows>(std::move(loaded->train));
    out.holdout = std::make_unique<train::data::TokenWindows>(std::move(loaded->test));
    if (test_limit >= 0) out.test = std::make_unique<train::data::DatasetView>(*out.holdout);
    return out;
  }
  const train::data::BpeTokenizer* tokenizer = out.tokenizer ? &*out.tokenizer : nullptr;
  Result<train::data::TextCorpus> corpus = train::data::load_text_corpus(train::data::text_source(config.data.source));
  if (!corpus.is_ok()) return corpus.status();
  Result<train::data::SiteWindows> windows = train::data::site_windows(*corpus, config.partition, config.sites, config.index,
                                                          model.context, config.train_limit, tokenizer);
  if (!windows.is_ok()) {
    return invalid_argument("data.partition: " + windows.status().message() + " (language models split text)");
  }
  out.shard = std::make_unique<train::data::TextWindows>(std::move(windows->train));
  out.holdout = std::make_unique<train::data::TextWindows>(std::move(windows->holdout));
  if (test_limit >= 0) {
    Result<train::data::TextWindows> test = train::data::held_out_windows(*corpus, model.context, test_limit, tokenizer);
    if (!test.is_ok()) return test.status();
    out.test = std::make_unique<train::data::TextWindows>(std::move(*test));
  }
  return out;
}

}  // namespace

Result<SiteData> load_site_data(const SiteConfig& config, int64_t test_limit) {
  if (const std::optional<train::TransformerConfig> language = train::language_model_config(config.model)) {
    return load_site_text(config, *language, test_limit);
  }
  if (config.data.own()) {
    // All of it: the train part to train on, the test part held out (and,
    // when a test set is asked for, the same part seen as one). Image
    // folders are decoded once, into a cache beside the store.
    train::data::DataSource source = config.data;
    if (source.format() == "images" && source.cache.empty() && !config.store.empty()) {
      source.cache = config.store + ".images";
    }
    Result<train::data::LoadedData> loaded =
        train::data::load_own_data(source, config.train_limit, std::max<int64_t>(0, test_limit));
    if (!loaded.is_ok()) return loaded.status();
    SiteData out;
    out.shard = std::move(loaded->train);
    out.holdout = std::move(loaded->test);
    if (test_limit >= 0) out.test = std::make_unique<train::data::DatasetView>(*out.holdout);
    out.schema = std::move(loaded->schema);
    return out;
  }
  Result<train::data::FashionMnistSplits> splits =
      train::data::load_fashion_mnist_splits(config.data.source, config.train_limit, test_limit < 0 ? 1 : test_limit);
  if (!splits.is_ok()) return splits.status();
  Result<train::data::PartitionSpec> spec = train::data::PartitionSpec::parse(config.partition);
  if (!spec.is_ok()) return spec.status();
  Result<std::vector<std::vector<int64_t>>> parts = train::data::partition_indices(
      splits->train.labels, splits->train.num_classes, config.sites, *spec, config.data_seed);
  if (!parts.is_ok()) return parts.status();
  const std::vector<int64_t>& mine = (*parts)[static_cast<size_t>(config.index)];
  std::vector<int64_t> train_idx, holdout_idx;
  for (size_t i = 0; i < mine.size(); ++i) (i % 10 == 9 ? holdout_idx : train_idx).push_back(mine[i]);
  if (train_idx.empty()) return invalid_argument("shard " + std::to_string(config.index) + " holds no training images");
  SiteData out;
  out.schema = train::data::idx_schema(splits->train);
  out.shard = std::make_unique<train::data::ImageSet>(splits->train.subset(train_idx));
  out.holdout = std::make_unique<train::data::ImageSet>(splits->train.subset(holdout_idx));
  if (test_limit >= 0) out.test = std::make_unique<train::data::ImageSet>(std::move(splits->test));
  return out;
}

}  // namespace fedmesh::node
