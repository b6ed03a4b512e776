#include "cli/tokenizer_command.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/output.h"
#include "base/file_io.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/gpt2_tokenizer.h"
#include "train/data/text_corpus.h"

namespace fedmesh::cli {

namespace {

struct TokenizerTrainFlags {
  std::string data = train::data::kBibleCorpus;
  int vocab_size = 1024;
  int max_piece_bytes = train::data::kDefaultMaxPieceBytes;
  std::string out;
  uint64_t seed = 0;  // accepted as every command's is; training draws nothing at random
  bool json = false;
};

int fail(const TokenizerTrainFlags& flags, const Status& status, int exit_code = 2) {
  return report_failure("tokenizer train", flags.json, status, exit_code);
}

int run_tokenizer_train(const TokenizerTrainFlags& flags) {
  const auto start = std::chrono::steady_clock::now();
  const auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  if (flags.vocab_size < 257 || flags.vocab_size > train::data::kMaxTokenizerVocabulary) {
    return fail(flags, invalid_argument("--vocab-size must be in [257, " + std::to_string(train::data::kMaxTokenizerVocabulary) +
                                        "]: the 256 bytes and at least one merge"));
  }
  if (flags.max_piece_bytes < 2 || flags.max_piece_bytes > train::data::kMaxPieceBytesLimit) {
    return fail(flags, invalid_argument("--max-piece-bytes must be in [2, " + std::to_string(train::data::kMaxPieceBytesLimit) + "]"));
  }
  const std::string source = flags.data == "kjv" ? train::data::kBibleCorpus : train::data::text_source(flags.data);
  Result<train::data::TextCorpus> corpus = train::data::load_text_corpus(source);
  if (!corpus.is_ok()) return fail(flags, corpus.status());
  const int64_t corpus_bytes = corpus->bytes();
  if (!flags.json) {
    std::fprintf(stderr, "training a BPE tokenizer of %d symbols on %s (%zu documents, %s)\n", flags.vocab_size,
                 source.c_str(), corpus->documents.size(), format_bytes(corpus_bytes).c_str());
  }

  ProgressLine line;
  train::data::BpeTrainOptions options;
  options.vocabulary = flags.vocab_size;
  options.max_piece_bytes = flags.max_piece_bytes;
  options.progress_every = 100;
  const auto train_start = std::chrono::steady_clock::now();
  options.on_progress = [&](int done, int wanted) {
    if (flags.json) {
      emit_json({{"event", "progress"}, {"merges", done}, {"wanted_merges", wanted}, {"seconds", seconds_since(train_start)}});
      return;
    }
    char text[128];
    std::snprintf(text, sizeof text, "merges %d/%d  %.1fs", done, wanted, seconds_since(train_start));
    line.update(text, done == wanted);
  };
  Result<train::data::BpeTokenizer> tokenizer = train::data::train_bpe(*corpus, options);
  line.finish();
  if (!tokenizer.is_ok()) return fail(flags, tokenizer.status());
  const double train_seconds = seconds_since(train_start);
  if (Status s = tokenizer->save(flags.out); !s.is_ok()) return fail(flags, s, 1);

  // How well it compresses the corpus it was trained on.
  int64_t tokens = 0;
  for (const train::data::TextDocument& document : corpus->documents) tokens += static_cast<int64_t>(tokenizer->encode(document.text).size());
  const double bytes_per_token = tokens > 0 ? static_cast<double>(corpus_bytes) / static_cast<double>(tokens) : 0.0;
  const int merges = static_cast<int>(tokenizer->merges().size());
  const double wall_seconds = seconds_since(start);
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "tokenizer train"},
               {"data", source},
               {"out", flags.out},
               {"vocab_size", tokenizer->vocabulary()},
               {"requested_vocab_size", flags.vocab_size},
               {"merges", merges},
               {"checksum", tokenizer->fingerprint()},
               {"documents", corpus->documents.size()},
               {"corpus_bytes", corpus_bytes},
               {"corpus_tokens", tokens},
               {"bytes_per_token", bytes_per_token},
               {"train_seconds", train_seconds},
               {"rounds", 0},
               {"bytes_sent", 0},
               {"bytes_received", 0},
               {"wall_seconds", wall_seconds}});
    return 0;
  }
  if (tokenizer->vocabulary() < flags.vocab_size) {
    std::fprintf(stderr, "stopped at %d symbols: no pair of symbols occurs twice in the corpus any more\n",
                 tokenizer->vocabulary());
  }
  std::printf("wrote %s: %d symbols (%d merges), %.3f bytes per token on %s (%lld tokens for %lld bytes), "
              "trained in %s, %s in all\n", flags.out.c_str(), tokenizer->vocabulary(), merges, bytes_per_token,
              source.c_str(), static_cast<long long>(tokens), static_cast<long long>(corpus_bytes),
              format_duration(train_seconds).c_str(), format_duration(wall_seconds).c_str());
  return 0;
}

struct TokenizerImportFlags {
  std::string vocab, merges, out;
  bool json = false;
};

int run_tokenizer_import(const TokenizerImportFlags& flags) {
  Result<train::data::BpeTokenizer> tokenizer = train::data::import_gpt2_tokenizer_files(flags.vocab, flags.merges);
  if (!tokenizer.is_ok()) {
    return report_failure("tokenizer import", flags.json, tokenizer.status(),
                          tokenizer.status().code() == StatusCode::kIoError ? 1 : 2);
  }
  if (Status s = tokenizer->save(flags.out); !s.is_ok()) return report_failure("tokenizer import", flags.json, s, 1);
  const int64_t specials = static_cast<int64_t>(tokenizer->layout().specials.size());
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "tokenizer import"}, {"out", flags.out},
               {"vocab_size", tokenizer->vocabulary()}, {"merges", tokenizer->merges().size()},
               {"specials", tokenizer->layout().specials}, {"checksum", tokenizer->fingerprint()}});
    return 0;
  }
  std::printf("wrote %s: %d tokens (256 bytes, %zu merges, %lld special), GPT-2's pretokenizer, %s\n", flags.out.c_str(),
              tokenizer->vocabulary(), tokenizer->merges().size(), static_cast<long long>(specials),
              tokenizer->fingerprint().c_str());
  return 0;
}

struct TokenizerEncodeFlags {
  std::string tokenizer, text;
  bool json = false;
};

// The ids of a text file's bytes, as one JSON line {"ids": [...]}.
int run_tokenizer_encode(const TokenizerEncodeFlags& flags) {
  const auto failed = [&](const Status& s) {
    return report_failure("tokenizer encode", flags.json, s, s.code() == StatusCode::kIoError ? 1 : 2);
  };
  Result<train::data::BpeTokenizer> tokenizer = train::data::BpeTokenizer::load(flags.tokenizer);
  if (!tokenizer.is_ok()) return failed(tokenizer.status());
  Result<std::string> text = read_file_bounded(flags.text, train::data::kMaxCorpusBytes);
  if (!text.is_ok()) return failed(Status(text.status().code(), "--text " + flags.text + ": " + text.status().message()));
  const std::vector<int32_t> ids = tokenizer->encode(*text);
  emit_json({{"event", "summary"}, {"command", "tokenizer encode"}, {"bytes", text->size()}, {"tokens", ids.size()},
             {"ids", ids}});
  return 0;
}

}  // namespace

void add_tokenizer_command(CLI::App& app, int& exit_code) {
  CLI::App* tokenizer = app.add_subcommand(
      "tokenizer", "Tokenizers for the language models: the byte tokenizer needs nothing; a BPE tokenizer is trained "
                   "here or imported from GPT-2's files");
  tokenizer->require_subcommand(1);
  auto flags = std::make_shared<TokenizerTrainFlags>();
  CLI::App* train = tokenizer->add_subcommand(
      "train",
      "Train a byte-level BPE tokenizer on a text corpus and write it to --out (a small JSON file with a checksum). "
      "It starts from the 256 bytes and merges the most frequent adjacent pair of symbols until --vocab-size "
      "symbols (or until no pair occurs twice); text is first cut into words as GPT-2 cuts it (a leading space "
      "joins the word after it), and merges never cross a word or a document. Any bytes encode, and decoding gives "
      "them back exactly. Use it with `fedmesh train --model gpt-* --tokenizer FILE`.");
  train->add_option("--data", flags->data,
                    "bible-kjv (or kjv: Debian's King James Bible, one document per book) or a directory of text "
                    "files (one document each)")
      ->capture_default_str();
  train->add_option("--vocab-size", flags->vocab_size,
                    "Symbols in the vocabulary: 256 bytes plus this minus 256 merges, at most " +
                        std::to_string(train::data::kMaxTokenizerVocabulary))
      ->capture_default_str();
  train->add_option("--out", flags->out, "The tokenizer file to write (replaced atomically)")->required();
  train->add_option("--max-piece-bytes", flags->max_piece_bytes,
                    "Words longer than this are cut into pieces of this many bytes (bounds a token's length)")
      ->capture_default_str();
  train->add_option("--seed", flags->seed, "Accepted for symmetry: training is deterministic and draws nothing at random")
      ->capture_default_str();
  train->add_flag("--json", flags->json,
                  "Print JSON lines: {\"event\":\"progress\",\"merges\",...} every 100 merges, then "
                  "{\"event\":\"summary\",\"vocab_size\",\"merges\",\"bytes_per_token\",\"wall_seconds\",...}");
  train->callback([flags, &exit_code] { exit_code = run_tokenizer_train(*flags); });

  auto import_flags = std::make_shared<TokenizerImportFlags>();
  CLI::App* imported = tokenizer->add_subcommand(
      "import",
      "Turn GPT-2's tokenizer files (Hugging Face's vocab.json and merges.txt; OpenAI's encoder.json and vocab.bpe "
      "are the same) into a fedmesh tokenizer file, so that fine-tuning GPT-2's weights (train --init-format "
      "hf-gpt2) reads text as GPT-2 was trained to: its byte order, merges, <|endoftext|> and its own regex "
      "(Unicode letters and numbers, contractions). Use the result as --tokenizer / data.tokenizer.");
  imported->add_option("--vocab", import_flags->vocab, "vocab.json (encoder.json): token -> id")->required();
  imported->add_option("--merges", import_flags->merges, "merges.txt (vocab.bpe): one merge per line")->required();
  imported->add_option("--out", import_flags->out, "The tokenizer file to write (replaced atomically)")->required();
  imported->add_flag("--json", import_flags->json, "Print one JSON summary line");
  imported->callback([import_flags, &exit_code] { exit_code = run_tokenizer_import(*import_flags); });

  auto encode_flags = std::make_shared<TokenizerEncodeFlags>();
  CLI::App* encode = tokenizer->add_subcommand(
      "encode", "Print the token ids of a text file's bytes under a tokenizer file, as one JSON line {\"ids\": [...]}");
  encode->add_option("--tokenizer", encode_flags->tokenizer, "The tokenizer file (tokenizer train or import)")->required();
  encode->add_option("--text", encode_flags->text, "The text file")->required();
  encode->add_flag("--json", encode_flags->json, "Errors as JSON too (the ids are JSON always)");
  encode->callback([encode_flags, &exit_code] { exit_code = run_tokenizer_encode(*encode_flags); });
}

}  // namespace fedmesh::cli
