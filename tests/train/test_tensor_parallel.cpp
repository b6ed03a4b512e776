// Tensor parallelism with Gloo among real processes: a Linear(32, 64) ->
// ReLU -> Linear(64, 16) block split over 2 ranks (column- then
// row-parallel) gives, on a batch of 8, the output and input gradient of the
// whole block on one process, and each rank's parameter gradients are its
// slices of the whole block's, within 1e-5 (fp32 sums in another order).
// And a tiny transformer (2 blocks of 4 heads, width 16) with its blocks
// split over 2 ranks (2 heads and 32 MLP features each) gives the logits
// of one process and, after the backward pass of the mean next-token loss,
// the embeddings', layer norms' and each rank's slices of the projections'
// gradients, within 1e-5.
// And the layouts of a block's tensors over the ranks (replicated, rows in
// groups, columns, held by rank 0) cut and assemble back to the whole.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/loss.h"
#include "train/model.h"
#include "train/parallel/tensor_parallel.h"

namespace fedmesh::train {
namespace {

constexpr int64_t kBatch = 8, kIn = 32, kHidden = 64, kOut = 16;

struct Block {
  Linear first{"fc1", kIn, kHidden};
  Linear second{"fc2", kHidden, kOut};
  Block() {
    Rng rng(3);
    first.initialize(rng);
    second.initialize(rng);
  }
};

Tensor random_tensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::zeros(std::move(shape));
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
  return t;
}

std::vector<float> values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

void write(const std::string& path, const std::vector<std::vector<float>>& parts) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : parts) {
    const uint64_t n = p.size();
    out.write(reinterpret_cast<const char*>(&n), sizeof n);
    out.write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(n * sizeof(float)));
  }
}

std::vector<std::vector<float>> read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::vector<float>> parts;
  uint64_t n = 0;
  while (in.read(reinterpret_cast<char*>(&n), sizeof n)) {
    parts.emplace_back(n);
    in.read(reinterpret_cast<char*>(parts.back().data()), static_cast<std::streamsize>(n * sizeof(float)));
  }
  return parts;
}

// Output, input gradient, then fc1 weight/bias and fc2 weight/bias gradients.
std::vector<std::vector<float>> whole_block() {
  Block block;
  ReLU relu;
  const Tensor z = block.second.forward(relu.forward(block.first.forward(random_tensor({kBatch, kIn}, 11), true), true), true);
  const std::vector<float> output = values(z);
  const Tensor dx = block.first.backward(relu.backward(block.second.backward(random_tensor({kBatch, kOut}, 12), true), true), true);
  return {output, values(dx), values(block.first.weight().grad), values(block.first.bias().grad),
          values(block.second.weight().grad), values(block.second.bias().grad)};
}

int run_rank(const std::string& dir, int rank, int size) {
  RendezvousOptions options;
  options.directory = dir + "/rendezvous";
  options.rank = rank;
  options.size = size;
  Result<std::unique_ptr<Communicator>> communicator = make_gloo_communicator(options);
  if (!communicator.is_ok()) return 2;
  Block block;
  Result<std::unique_ptr<TensorParallelMlp>> shard = TensorParallelMlp::shard(block.first, block.second, **communicator);
  if (!shard.is_ok()) return 3;
  Result<Tensor> z = (*shard)->forward(random_tensor({kBatch, kIn}, 11));
  if (!z.is_ok()) return 4;
  Result<Tensor> dx = (*shard)->backward(random_tensor({kBatch, kOut}, 12));
  if (!dx.is_ok()) return 5;
  write(dir + "/rank-" + std::to_string(rank),
        {values(*z), values(*dx), values((*shard)->column().weight().grad), values((*shard)->column().bias().grad),
         values((*shard)->row().weight().grad), values((*shard)->row().bias().grad)});
  return 0;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  EXPECT_LT(worst, 1e-5) << what;
}

TEST(TensorParallel, TwoRanksEqualOneOnTheWholeBlock) {
  const int size = 2;
  const std::string dir = ::testing::TempDir() + "fedmesh-tp-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // Every run in a child: the kernels' worker threads do not survive a fork.
  std::vector<pid_t> children;
  for (int rank = -1; rank < size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (rank < 0) {
        write(dir + "/whole", whole_block());
        ::_exit(0);
      }
      ::_exit(run_rank(dir, rank, size));
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a run failed with " << WEXITSTATUS(status);
  }
  const std::vector<std::vector<float>> whole = read(dir + "/whole");
  ASSERT_EQ(whole.size(), 6u);
  const int64_t slice = kHidden / size;
  for (int rank = 0; rank < size; ++rank) {
    const std::vector<std::vector<float>> mine = read(dir + "/rank-" + std::to_string(rank));
    ASSERT_EQ(mine.size(), 6u);
    const std::string who = "rank " + std::to_string(rank) + ": ";
    expect_near(mine[0], whole[0], who + "output");
    expect_near(mine[1], whole[1], who + "input gradient");
    const int64_t begin = rank * slice;
    // fc1: rows [begin, begin + slice) of the weight, the same slice of the bias.
    expect_near(mine[2], std::vector<float>(whole[2].begin() + begin * kIn, whole[2].begin() + (begin + slice) * kIn),
                who + "fc1.weight gradient");
    expect_near(mine[3], std::vector<float>(whole[3].begin() + begin, whole[3].begin() + begin + slice), who + "fc1.bias gradient");
    // fc2: columns [begin, begin + slice) of the weight; the bias on rank 0.
    std::vector<float> columns;
    for (int64_t o = 0; o < kOut; ++o) {
      columns.insert(columns.end(), whole[4].begin() + o * kHidden + begin, whole[4].begin() + o * kHidden + begin + slice);
    }
    expect_near(mine[4], columns, who + "fc2.weight gradient");
    expect_near(mine[5], rank == 0 ? whole[5] : std::vector<float>(kOut, 0.0f), who + "fc2.bias gradient");
  }
  std::filesystem::remove_all(dir);
}

// ---- a tiny transformer ------------------------------------------------------------

TransformerConfig tiny_transformer() {
  TransformerConfig c;
  c.vocabulary = 13;
  c.context = 8;
  c.width = 16;
  c.heads = 4;
  c.layers = 2;
  return c;
}

constexpr int64_t kTextBatch = 3;

// The batch and targets both runs see.
void text_batch(Tensor& x, std::vector<int32_t>& targets) {
  const TransformerConfig c = tiny_transformer();
  Rng rng(31);
  x = Tensor::empty({kTextBatch, c.context});
  targets.clear();
  for (int64_t i = 0; i < x.numel(); ++i) {
    x.data<float>()[i] = static_cast<float>(rng.below(static_cast<uint64_t>(c.vocabulary)));
    targets.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocabulary))));
  }
}

// Forward, mean cross-entropy, backward; returns the logits, then every
// parameter's gradient in the model's order.
std::vector<std::vector<float>> forward_backward(Sequential& model) {
  Tensor x;
  std::vector<int32_t> targets;
  text_batch(x, targets);
  model.zero_grad();
  const Tensor logits = model.forward(x, true);
  std::vector<std::vector<float>> out = {values(logits)};
  Tensor dlogits = Tensor::empty(logits.shape());
  softmax_cross_entropy(logits, targets, &dlogits, 1.0f, static_cast<float>(targets.size()));
  model.backward(dlogits);
  for (Parameter* p : model.parameters()) out.push_back(values(p->grad));
  return out;
}

// The whole model's weights, with every block replaced by this rank's shard.
Result<std::unique_ptr<Sequential>> sharded_transformer(Sequential& whole, Communicator& communicator,
                                                        std::vector<TransformerBlock*>& shards) {
  const TransformerConfig c = tiny_transformer();
  auto model = std::make_unique<Sequential>("tp", Shape{c.context});
  auto embedding = std::make_unique<TokenEmbedding>(c.vocabulary, c.context, c.width);
  auto& source = dynamic_cast<TokenEmbedding&>(whole.layer(0));
  for (size_t i = 0; i < 2; ++i) embedding->parameters()[i]->value = source.parameters()[i]->value.clone();
  for (Parameter* p : embedding->parameters()) p->set_compute_dtype(DType::kF32);
  TokenEmbedding& tied = *embedding;
  model->add(std::move(embedding));
  for (int64_t b = 0; b < c.layers; ++b) {
    Result<std::unique_ptr<TransformerBlock>> shard =
        shard_transformer_block(dynamic_cast<TransformerBlock&>(whole.layer(static_cast<size_t>(1 + b))), communicator);
    if (!shard.is_ok()) return shard.status();
    shards.push_back(shard->get());
    model->add(std::move(*shard));
  }
  auto final_norm = std::make_unique<LayerNorm>("ln_f", c.width);
  auto& source_norm = dynamic_cast<LayerNorm&>(whole.layer(static_cast<size_t>(1 + c.layers)));
  for (size_t i = 0; i < 2; ++i) final_norm->parameters()[i]->value = source_norm.parameters()[i]->value.clone();
  for (Parameter* p : final_norm->parameters()) p->set_compute_dtype(DType::kF32);
  model->add(std::move(final_norm));
  model->add(std::make_unique<TiedProjection>(tied, c.vocabulary, c.width));
  return model;
}

int run_transformer_rank(const std::string& dir, int rank, int size) {
  RendezvousOptions options;
  options.directory = dir + "/rendezvous";
  options.rank = rank;
  options.size = size;
  Result<std::unique_ptr<Communicator>> communicator = make_gloo_communicator(options);
  if (!communicator.is_ok()) return 2;
  std::unique_ptr<Sequential> whole = make_transformer("tiny", tiny_transformer(), 17);
  std::vector<TransformerBlock*> shards;
  Result<std::unique_ptr<Sequential>> model = sharded_transformer(*whole, **communicator, shards);
  if (!model.is_ok()) return 3;
  const std::vector<std::vector<float>> out = forward_backward(**model);
  for (TransformerBlock* shard : shards) {
    if (!shard->reduction_status().is_ok()) return 4;
  }
  write(dir + "/rank-" + std::to_string(rank), out);
  return 0;
}

std::vector<float> rows_of(const std::vector<float>& m, int64_t columns, int64_t begin, int64_t count) {
  return {m.begin() + begin * columns, m.begin() + (begin + count) * columns};
}

std::vector<float> columns_of(const std::vector<float>& m, int64_t columns, int64_t begin, int64_t count) {
  std::vector<float> out;
  for (size_t r = 0; r < m.size() / static_cast<size_t>(columns); ++r) {
    out.insert(out.end(), m.begin() + static_cast<int64_t>(r) * columns + begin,
               m.begin() + static_cast<int64_t>(r) * columns + begin + count);
  }
  return out;
}

TEST(TensorParallel, TwoRanksEqualOneOnATinyTransformer) {
  const int size = 2;
  const std::string dir = ::testing::TempDir() + "fedmesh-tp-gpt-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<pid_t> children;
  for (int rank = -1; rank < size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (rank < 0) {
        std::unique_ptr<Sequential> whole = make_transformer("tiny", tiny_transformer(), 17);
        write(dir + "/whole", forward_backward(*whole));
        ::_exit(0);
      }
      ::_exit(run_transformer_rank(dir, rank, size));
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a run failed with " << WEXITSTATUS(status);
  }
  const TransformerConfig c = tiny_transformer();
  const std::vector<std::vector<float>> whole = read(dir + "/whole");
  // logits, wte, wpe, 12 per block, ln_f (2)
  ASSERT_EQ(whole.size(), static_cast<size_t>(1 + 2 + 12 * c.layers + 2));
  const int64_t width = c.width, attention = width / size, hidden = 4 * width / size;
  for (int rank = 0; rank < size; ++rank) {
    const std::vector<std::vector<float>> mine = read(dir + "/rank-" + std::to_string(rank));
    ASSERT_EQ(mine.size(), whole.size());
    const std::string who = "rank " + std::to_string(rank) + ": ";
    expect_near(mine[0], whole[0], who + "logits");
    expect_near(mine[1], whole[1], who + "wte gradient");
    expect_near(mine[2], whole[2], who + "wpe gradient");
    for (int64_t b = 0; b < c.layers; ++b) {
      const size_t at = static_cast<size_t>(3 + 12 * b);
      const std::string block = who + "h" + std::to_string(b) + ".";
      // ln_1 weight/bias, c_attn weight/bias, attn.c_proj weight/bias, ln_2, c_fc, mlp.c_proj.
      expect_near(mine[at], whole[at], block + "ln_1.weight");
      expect_near(mine[at + 1], whole[at + 1], block + "ln_1.bias");
      std::vector<float> qkv_rows, qkv_bias;
      for (int64_t part = 0; part < 3; ++part) {
        const std::vector<float> r = rows_of(whole[at + 2], width, part * width + rank * attention, attention);
        qkv_rows.insert(qkv_rows.end(), r.begin(), r.end());
        const std::vector<float> bias = rows_of(whole[at + 3], 1, part * width + rank * attention, attention);
        qkv_bias.insert(qkv_bias.end(), bias.begin(), bias.end());
      }
      expect_near(mine[at + 2], qkv_rows, block + "attn.c_attn.weight (this rank's heads of q, k, v)");
      expect_near(mine[at + 3], qkv_bias, block + "attn.c_attn.bias");
      expect_near(mine[at + 4], columns_of(whole[at + 4], width, rank * attention, attention), block + "attn.c_proj.weight");
      expect_near(mine[at + 5], rank == 0 ? whole[at + 5] : std::vector<float>(static_cast<size_t>(width), 0.0f),
                  block + "attn.c_proj.bias");
      expect_near(mine[at + 6], whole[at + 6], block + "ln_2.weight");
      expect_near(mine[at + 7], whole[at + 7], block + "ln_2.bias");
      expect_near(mine[at + 8], rows_of(whole[at + 8], width, rank * hidden, hidden), block + "mlp.c_fc.weight");
      expect_near(mine[at + 9], rows_of(whole[at + 9], 1, rank * hidden, hidden), block + "mlp.c_fc.bias");
      expect_near(mine[at + 10], columns_of(whole[at + 10], 4 * width, rank * hidden, hidden), block + "mlp.c_proj.weight");
      expect_near(mine[at + 11], rank == 0 ? whole[at + 11] : std::vector<float>(static_cast<size_t>(width), 0.0f),
                  block + "mlp.c_proj.bias");
    }
    expect_near(mine[mine.size() - 2], whole[whole.size() - 2], who + "ln_f.weight");
    expect_near(mine[mine.size() - 1], whole[whole.size() - 1], who + "ln_f.bias");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fedmesh::train

// ---- the split layouts ------------------------------------------------------------

namespace fedmesh::train {
namespace {

// Every layout's slices, gathered in rank order, assemble to the whole
// tensor again, and each slice is the rank's part as its comment says.
TEST(TensorParallelSplits, SlicesAssembleToTheWhole) {
  const Tensor matrix = random_tensor({12, 6}, 41), vector = random_tensor({12}, 42);
  const std::vector<std::pair<Split, const Tensor*>> cases = {
      {{Split::kReplicated}, &matrix}, {{Split::kOwner}, &vector},    {{Split::kRows, 3}, &matrix},
      {{Split::kRows, 3}, &vector},    {{Split::kRows, 1}, &matrix},  {{Split::kColumns}, &matrix}};
  for (const int ranks : {1, 2}) {
    for (const auto& [split, whole] : cases) {
      const std::string what = "split " + std::to_string(split.kind) + " parts " + std::to_string(split.parts) +
                               " over " + std::to_string(ranks) + ", " + shape_to_string(whole->shape());
      Result<Shape> shape = split_shape(whole->shape(), split, ranks);
      ASSERT_TRUE(shape.is_ok()) << what;
      std::vector<float> gathered;
      for (int rank = 0; rank < ranks; ++rank) {
        Tensor slice = Tensor::zeros(*shape);
        slice_for_rank(*whole, split, rank, ranks, slice);
        const std::vector<float> v = values(slice);
        gathered.insert(gathered.end(), v.begin(), v.end());
        if (split.kind == Split::kOwner && rank > 0) EXPECT_EQ(v, std::vector<float>(v.size(), 0.0f)) << what;
      }
      Tensor assembled = Tensor::zeros(whole->shape());
      assemble_slices(gathered, split, ranks, assembled);
      EXPECT_EQ(values(assembled), values(*whole)) << what;
    }
  }
  // c_attn's rows: rank 1 of 2 holds rows 2-3 of q, of k and of v (each 4 rows).
  Tensor slice = Tensor::zeros({6, 6});
  slice_for_rank(matrix, {Split::kRows, 3}, 1, 2, slice);
  for (const int64_t part : {0, 1, 2}) {
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t c = 0; c < 6; ++c) {
        EXPECT_EQ(slice.data<float>()[(part * 2 + r) * 6 + c], matrix.data<float>()[(part * 4 + 2 + r) * 6 + c]);
      }
    }
  }
  // Shapes that do not divide are refused.
  EXPECT_FALSE(split_shape({12, 6}, {Split::kRows, 3}, 8).is_ok());
  EXPECT_FALSE(split_shape({12, 5}, {Split::kColumns}, 2).is_ok());
  EXPECT_FALSE(split_shape({12}, {Split::kColumns}, 2).is_ok());
}

}  // namespace
}  // namespace fedmesh::train
