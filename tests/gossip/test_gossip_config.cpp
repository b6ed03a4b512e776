// A gossip peer's config file (node/gossip_config.h): what it compresses
// with when the file does not say. Replicas after SGD send top-k 1.5 % with
// int8 values (5 % for a language model), after AdamW dense int4
// (gossip/replicas.h says why); push-sum
// and pairwise send model states, dense; a spec the file names wins. The
// chunk size is bounded.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "node/gossip_config.h"

namespace fedmesh::node {
namespace {

Result<GossipConfig> read(const std::string& extra) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "gossip_config";
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "node.toml";
  // The keys every node file needs; read_gossip_config names the files, it does not open them.
  std::ofstream(file) << "federation = \"fed\"\nkeys = \"k.key\"\nroster = \"r.toml\"\nadmin_public = \"00\"\n"
                      << "name = \"s\"\nmode = \"gossip\"\n"
                      << extra;
  return read_gossip_config(file.string());
}

TEST(GossipConfig, CompressionFollowsTheMergeRuleAndTheLocalOptimizer) {
  const struct {
    const char* extra;
    const char* compress;
  } cases[] = {
      {"", "topk:0.015+int8"},
      {"training.optimizer = \"sgd\"\n", "topk:0.015+int8"},
      {"training.optimizer = \"adamw\"\n", "int4"},
      {"model = \"gpt-nano\"\n", "topk:0.05+int8"},
      {"model = \"gpt-nano\"\ntraining.optimizer = \"adamw\"\n", "int4"},
      {"gossip.merge = \"push-sum\"\n", "identity"},
      {"gossip.merge = \"pairwise\"\ntraining.optimizer = \"adamw\"\n", "identity"},
      {"training.optimizer = \"adamw\"\ncompression.default = \"topk:0.05+int8\"\n", "topk:0.05+int8"},
  };
  for (const auto& c : cases) {
    Result<GossipConfig> config = read(c.extra);
    ASSERT_TRUE(config.is_ok()) << c.extra << config.status().message();
    EXPECT_EQ(config->site.compress, c.compress) << c.extra;
  }
}

TEST(GossipConfig, ChunkBytesAreBounded) {
  Result<GossipConfig> config = read("gossip.chunk_bytes = 65536\n");
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_EQ(config->chunk_bytes, 65536u);
  for (const char* bad : {"gossip.chunk_bytes = 100\n", "gossip.chunk_bytes = 8388608\n"}) {
    Result<GossipConfig> refused = read(bad);
    ASSERT_FALSE(refused.is_ok()) << bad;
    EXPECT_NE(refused.status().message().find("gossip.chunk_bytes must be in 4096..4194304"), std::string::npos)
        << refused.status().message();
  }
}

TEST(GossipConfig, ADenseMergeRefusesASparseSpecByName) {
  Result<GossipConfig> config = read("gossip.merge = \"push-sum\"\ncompression.default = \"topk:0.01\"\n");
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("topk:0.01"), std::string::npos) << config.status().message();
}

}  // namespace
}  // namespace fedmesh::node
