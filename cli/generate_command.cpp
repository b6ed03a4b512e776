#include "cli/generate_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "base/random.h"
#include "cli/output.h"
#include "kernels/parallel.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/text_corpus.h"
#include "train/model.h"
#include "train/training_checkpoint.h"
#include "store/checkpoint_store.h"

namespace fedmesh::cli {

namespace {

struct GenerateFlags {
  std::string checkpoint;
  std::string model;  // "": the model the checkpoint's run names
  int64_t round = -1;
  std::string prompt = "\n";
  int64_t tokens = 200;
  double temperature = 0.8;
  int top_k = 40;
  uint64_t seed = 0;
  int threads = 0;
  bool json = false;
};

int fail(const GenerateFlags& flags, const Status& status, int exit_code = 2) {
  return report_failure("generate", flags.json, status, exit_code);
}

// The model a store's run trained: `fedmesh train` and the aggregator
// record it in their meta.
Result<std::string> stored_model_name(store::CheckpointStore& store) {
  for (const char* key : {"train_config", "aggregator_config"}) {
    Result<std::optional<std::string>> meta = store.meta(key);
    if (!meta.is_ok()) return meta.status();
    if (!meta->has_value()) continue;
    const nlohmann::json config = nlohmann::json::parse(**meta, nullptr, false);
    if (config.is_object() && config.contains("model") && config["model"].is_string()) return config["model"].get<std::string>();
  }
  return not_found("the checkpoint does not say which model it holds: give --model");
}

// The BPE tokenizer a store's run trained with (`fedmesh train --tokenizer`
// keeps the file in meta "tokenizer"); nullopt for the byte tokenizer. The
// store is checked like the file was: a damaged copy is refused by name, as
// is one that is not the tokenizer the run's flags name.
Result<std::optional<train::data::BpeTokenizer>> stored_tokenizer(store::CheckpointStore& store) {
  Result<std::optional<std::string>> text = store.meta("tokenizer");
  if (!text.is_ok()) return text.status();
  if (!text->has_value() || (*text)->empty()) return std::optional<train::data::BpeTokenizer>();
  Result<train::data::BpeTokenizer> tokenizer = train::data::BpeTokenizer::parse(**text);
  if (!tokenizer.is_ok()) {
    return Status(tokenizer.status().code(), "the tokenizer kept in the store: " + tokenizer.status().message());
  }
  Result<std::optional<std::string>> config = store.meta("train_config");
  if (config.is_ok() && config->has_value()) {
    const nlohmann::json flags = nlohmann::json::parse(**config, nullptr, false);
    if (flags.is_object() && flags.contains("tokenizer") && flags["tokenizer"] != tokenizer->fingerprint()) {
      return corrupt("the tokenizer kept in the store (" + tokenizer->fingerprint() +
                     ") is not the one its run recorded training with");
    }
  }
  return std::optional<train::data::BpeTokenizer>(std::move(*tokenizer));
}

// Samples the next token from the last row of `logits`: temperature, then
// the top_k most likely (0: all), then a draw.
int32_t sample(const float* logits, int64_t vocabulary, double temperature, int top_k, Rng& rng) {
  std::vector<int32_t> order(static_cast<size_t>(vocabulary));
  std::iota(order.begin(), order.end(), 0);
  if (temperature <= 0.0) {
    return *std::max_element(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] < logits[b]; });
  }
  const size_t keep = top_k > 0 ? std::min<size_t>(static_cast<size_t>(top_k), order.size()) : order.size();
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  std::vector<double> weights(keep);
  const double top = logits[order[0]];
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += weights[i] = std::exp((logits[order[i]] - top) / temperature);
  double draw = rng.uniform() * total;
  for (size_t i = 0; i < keep; ++i) {
    draw -= weights[i];
    if (draw <= 0.0) return order[i];
  }
  return order[keep - 1];
}

int run_generate(const GenerateFlags& flags) {
  if (flags.tokens < 0 || flags.tokens > 1'000'000) return fail(flags, invalid_argument("--tokens must be in [0, 1000000]"));
  if (!(flags.temperature >= 0.0) || !std::isfinite(flags.temperature)) {
    return fail(flags, invalid_argument("--temperature must be >= 0 (0: always the most likely token)"));
  }
  if (flags.top_k < 0) return fail(flags, invalid_argument("--top-k must be >= 0 (0: no cut)"));
  if (flags.prompt.empty()) return fail(flags, invalid_argument("--prompt must not be empty"));
  set_cpu_threads(flags.threads);
  Result<store::CheckpointStore> store = store::CheckpointStore::open_existing(flags.checkpoint);
  if (!store.is_ok()) return fail(flags, store.status());
  Result<std::string> name = flags.model.empty() ? stored_model_name(*store) : Result<std::string>(flags.model);
  if (!name.is_ok()) return fail(flags, name.status());
  const std::optional<train::TransformerConfig> config = train::language_model_config(*name);
  if (!config) return fail(flags, invalid_argument("model '" + *name + "' is not a language model"));
  Result<std::optional<train::data::BpeTokenizer>> tokenizer = stored_tokenizer(*store);
  if (!tokenizer.is_ok()) return fail(flags, tokenizer.status(), 1);
  const int64_t vocabulary = tokenizer->has_value() ? (*tokenizer)->vocabulary() : config->vocabulary;
  Result<store::LoadedCheckpoint> loaded = flags.round >= 0 ? store->load_round(flags.round) : store->load_latest();
  if (!loaded.is_ok()) return fail(flags, loaded.status(), 1);
  Result<std::unique_ptr<train::Sequential>> model =
      train::make_model(*name, 0, tokenizer->has_value() ? vocabulary : 0);
  if (!model.is_ok()) return fail(flags, model.status());
  if (Status s = train::load_model_weights(*loaded, **model); !s.is_ok()) return fail(flags, s, 1);

  std::vector<int32_t> tokens = tokenizer->has_value() ? (*tokenizer)->encode(flags.prompt) : train::data::byte_tokens(flags.prompt);
  for (const int32_t t : tokens) {
    if (t >= vocabulary) return fail(flags, invalid_argument("the prompt has a byte outside the model's vocabulary"));
  }
  Rng rng(flags.seed);
  const size_t prompt_tokens = tokens.size();
  if (!flags.json) std::fputs(flags.prompt.c_str(), stdout);
  for (int64_t i = 0; i < flags.tokens; ++i) {
    // The last `context` tokens, the model's window.
    const size_t begin = tokens.size() > static_cast<size_t>(config->context) ? tokens.size() - static_cast<size_t>(config->context) : 0;
    const int64_t length = static_cast<int64_t>(tokens.size() - begin);
    Tensor x = Tensor::empty({1, length});
    for (int64_t t = 0; t < length; ++t) x.data<float>()[t] = static_cast<float>(tokens[begin + static_cast<size_t>(t)]);
    const Tensor logits = (*model)->forward(x, /*training=*/false);
    const int32_t next = sample(logits.data<float>() + (length - 1) * vocabulary, vocabulary,
                                flags.temperature, flags.top_k, rng);
    tokens.push_back(next);
    if (!flags.json) {
      if (tokenizer->has_value()) {
        const std::string_view bytes = (*tokenizer)->token_bytes(next);
        std::fwrite(bytes.data(), 1, bytes.size(), stdout);
      } else {
        std::fputc(static_cast<char>(next), stdout);
      }
      std::fflush(stdout);
    }
  }
  const std::span<const int32_t> generated = std::span<const int32_t>(tokens).subspan(prompt_tokens);
  const std::string text =
      tokenizer->has_value() ? (*tokenizer)->decode(generated).value() : train::data::byte_text(generated).value();
  if (flags.json) {
    nlohmann::json summary = {{"event", "summary"}, {"command", "generate"}, {"model", *name}, {"round", loaded->round.round},
                              {"prompt", flags.prompt}, {"text", text}, {"tokens", flags.tokens}};
    if (tokenizer->has_value()) {
      summary["tokenizer"] = (*tokenizer)->fingerprint();
      summary["vocab_size"] = vocabulary;
    }
    emit_json(summary);
  } else {
    std::fputc('\n', stdout);
  }
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Sample text from a language model's checkpoint (fedmesh train --db, or an aggregator's store): the "
                  "prompt, then --tokens tokens drawn one at a time with --temperature and --top-k. Tokens are bytes, "
                  "or, for a run trained with `fedmesh train --tokenizer FILE`, that BPE tokenizer's tokens: the "
                  "store keeps the tokenizer, so nothing needs to be given.");
  cmd->add_option("--checkpoint", flags->checkpoint, "The store (SQLite) holding the model")->required();
  cmd->add_option("--model", flags->model, "The model's name (default: the one the store's run recorded)");
  cmd->add_option("--round", flags->round, "Which checkpoint (default: the newest)");
  cmd->add_option("--prompt", flags->prompt, "Text to continue")->capture_default_str();
  cmd->add_option("--tokens", flags->tokens, "Tokens to generate (bytes with the byte tokenizer)")->capture_default_str();
  cmd->add_option("--temperature", flags->temperature, "Softmax temperature (0: the most likely byte every time)")
      ->capture_default_str();
  cmd->add_option("--top-k", flags->top_k, "Draw from the k most likely bytes only (0: all)")->capture_default_str();
  cmd->add_option("--seed", flags->seed, "Seed of the draws")->capture_default_str();
  cmd->add_option("--threads", flags->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--json", flags->json, "Print one JSON line: {\"event\":\"summary\",\"text\":...}");
  cmd->callback([flags, &exit_code] { exit_code = run_generate(*flags); });
}

}  // namespace fedmesh::cli
