// The BPE tokenizer end to end with real `fedmesh` processes:
// - `fedmesh tokenizer train` on the King James Bible (vocabulary 512)
//   reports progress, then a summary; the file it writes is what it reports;
// - `fedmesh train --model gpt-nano --tokenizer FILE` takes the tokenizer's
//   vocabulary and, after 300 steps, its held-out bits per byte (nats over
//   the bytes the held-out tokens stand for) are 1.5 below the byte
//   unigram's and 0.5 below the token unigram's bits per byte (measured
//   2.22 against 4.34 and 3.17; bytes per token 2.38);
// - `fedmesh generate` decodes with the tokenizer kept in the store, without
//   being told;
// - resuming that run with another tokenizer, or with none, is refused, as
//   are a hostile tokenizer file and a tokenizer for an image model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/fedmesh_run.h"

namespace {

namespace fs = std::filesystem;

using Output = fedmesh::testing::FedmeshOutput;

Output run(std::vector<std::string> args) { return fedmesh::testing::run_fedmesh(std::move(args)); }

std::vector<std::string> train(const fs::path& tokenizer, const fs::path& db, int64_t steps) {
  std::vector<std::string> args = {"train", "--model", "gpt-nano", "--steps", std::to_string(steps), "--batch-size", "16",
                                   "--lr", "3e-3", "--schedule", "constant", "--test-limit", "100", "--threads", "1",
                                   "--seed", "2", "--log-every", "1000", "--json", "--db", db.string()};
  if (!tokenizer.empty()) {
    args.push_back("--tokenizer");
    args.push_back(tokenizer.string());
  }
  return args;
}

class Tokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-tokenizer-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(Tokenizer, TrainsOnTheBibleAndAModelLearnsWithItBeyondUnigrams) {
  const fs::path file = dir_ / "bible-512.json";
  const Output trained = run({"tokenizer", "train", "--data", "bible-kjv", "--vocab-size", "512", "--out", file.string(),
                              "--json"});
  ASSERT_EQ(trained.exit_code, 0) << trained.text;
  const nlohmann::json& summary = trained.last;
  EXPECT_EQ(summary["event"], "summary");
  EXPECT_EQ(summary["vocab_size"], 512);
  EXPECT_EQ(summary["merges"], 256);
  int progress = 0;
  for (const nlohmann::json& e : trained.events) progress += e["event"] == "progress";
  EXPECT_GE(progress, 3) << "merges 100, 200 and the last";
  const double bytes_per_token = summary["bytes_per_token"].get<double>();
  EXPECT_GT(bytes_per_token, 2.2) << "256 merges of English words (measured 2.38)";
  std::printf("tokenizer, vocabulary 512: %.3f bytes per token on the Bible\n", bytes_per_token);
  ASSERT_TRUE(fs::exists(file));
  std::ifstream in(file);
  const nlohmann::json saved = nlohmann::json::parse(in);
  EXPECT_EQ(saved["vocab_size"], 512);
  EXPECT_EQ(saved["checksum"], summary["checksum"]);

  const fs::path db = dir_ / "lm.db";
  const Output lm = run(train(file, db, 300));
  ASSERT_EQ(lm.exit_code, 0) << lm.text;
  const double bits = lm.last["val_bits_per_byte"].get<double>();
  const double unigram = lm.last["unigram_bits_per_byte"].get<double>();
  const double token_unigram = lm.last["token_unigram_bits_per_byte"].get<double>();
  EXPECT_EQ(lm.last["vocab_size"], 512);
  EXPECT_EQ(lm.last["tokenizer"], summary["checksum"]);
  EXPECT_GT(lm.last["held_out_bytes_per_token"].get<double>(), 2.2);
  EXPECT_GT(unigram, 4.0) << "the byte unigram, as without a tokenizer";
  EXPECT_LT(bits, unigram - 1.5) << "well below what any model of bytes without context reaches";
  EXPECT_LT(bits, token_unigram - 0.5) << "and below what these tokens give without context";
  std::printf("gpt-nano + BPE 512, 300 steps: %.3f bits/byte held out; byte unigram %.3f, token unigram %.3f\n", bits,
              unigram, token_unigram);

  const std::vector<std::string> greedy = {"generate", "--checkpoint", db.string(), "--prompt", "And God said",
                                           "--tokens", "40", "--temperature", "0", "--json"};
  const Output first = run(greedy), second = run(greedy);
  ASSERT_EQ(first.exit_code, 0) << first.text;
  EXPECT_EQ(first.last["tokenizer"], summary["checksum"]) << "the tokenizer comes from the store";
  EXPECT_EQ(first.last["vocab_size"], 512);
  const std::string text = first.last["text"].get<std::string>();
  EXPECT_GT(text.size(), 40u) << "40 tokens of several bytes each: " << text;
  EXPECT_EQ(second.last["text"], first.last["text"]) << "greedy decoding is deterministic";
  size_t plain = 0;
  for (const char c : text) plain += std::isalpha(static_cast<unsigned char>(c)) || std::string(" ,.;:'\n").find(c) != std::string::npos;
  EXPECT_GE(plain * 10, text.size() * 9) << "mostly letters and punctuation: " << text;
  std::printf("greedy continuation of \"And God said\": %s\n", text.c_str());

  // The run resumes only with its own tokenizer.
  const fs::path other = dir_ / "bible-300.json";
  ASSERT_EQ(run({"tokenizer", "train", "--vocab-size", "300", "--out", other.string(), "--json"}).exit_code, 0);
  const Output wrong = run(train(other, db, 300));
  EXPECT_EQ(wrong.exit_code, 2) << wrong.text;
  const std::string message = wrong.last.value("message", "");
  EXPECT_NE(message.find("trained with the BPE tokenizer " + summary["checksum"].get<std::string>()), std::string::npos)
      << message;
  const Output none = run(train({}, db, 300));
  EXPECT_EQ(none.exit_code, 2) << none.text;
  EXPECT_NE(none.last.value("message", "").find("not the byte tokenizer"), std::string::npos) << none.text;
  const Output same = run(train(file, db, 300));
  EXPECT_EQ(same.exit_code, 0) << same.text;
  EXPECT_EQ(same.last["already_complete"], true) << "the same tokenizer is the same run";
}

TEST_F(Tokenizer, RefusesWhatItCannotUse) {
  const Output help = run({"tokenizer", "train", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  const Output small = run({"tokenizer", "train", "--vocab-size", "100", "--out", (dir_ / "t.json").string(), "--json"});
  EXPECT_EQ(small.exit_code, 2);
  EXPECT_NE(small.last.value("message", "").find("--vocab-size"), std::string::npos) << small.text;
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));

  const fs::path hostile = dir_ / "hostile.json";
  std::ofstream(hostile) << R"({"format": "fedmesh-bpe", "version": 1, "pretokenizer": "gpt2-ascii",
    "max_piece_bytes": 128, "vocab_size": 258, "checksum": "fnv1a64:0000000000000000", "merges": [[97, 98], [300, 97]]})";
  const Output refused = run(train(hostile, dir_ / "h.db", 5));
  EXPECT_EQ(refused.exit_code, 2);
  const std::string message = refused.last.value("message", "");
  EXPECT_NE(message.find("hostile.json"), std::string::npos) << message;
  EXPECT_NE(message.find("merge 1 names id 300, which is created later"), std::string::npos) << message;

  const Output missing = run(train(dir_ / "none.json", dir_ / "m.db", 5));
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.last.value("message", "").find("none.json"), std::string::npos) << missing.text;

  const Output image = run({"train", "--model", "mlp", "--steps", "1", "--tokenizer", hostile.string(), "--json"});
  EXPECT_EQ(image.exit_code, 2);
  EXPECT_NE(image.last.value("message", "").find("language models"), std::string::npos) << image.text;
}

}  // namespace
