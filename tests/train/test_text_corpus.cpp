// Text for the language models (train/data/text_corpus.h): the King James
// Bible from Debian's bible-kjv as 66 books, a directory of files as
// documents, the byte tokenizer, the held-out split, the site partitions,
// windows of tokens as a Dataset, and the unigram baseline.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train/data/text_corpus.h"
#include "train/data/tokenized_text.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;

TEST(TextCorpus, TheBibleIsSixtySixBooksWithoutVerseReferences) {
  Result<TextCorpus> bible = load_text_corpus(kBibleCorpus);
  ASSERT_TRUE(bible.is_ok()) << bible.status().to_string();
  ASSERT_EQ(bible->documents.size(), 66u);
  EXPECT_EQ(bible->documents.front().name, "Ge");
  EXPECT_EQ(bible->documents[38].name, "Mal") << "the Old Testament ends with Malachi, book 39";
  EXPECT_EQ(bible->documents.back().name, "Rev");
  EXPECT_EQ(bible->documents.front().text.rfind("In the beginning God created the heaven and the earth.\n", 0), 0u);
  EXPECT_EQ(bible->documents.front().text.find("Ge1:"), std::string::npos) << "verse references are dropped";
  EXPECT_GT(bible->bytes(), 3'900'000);
  EXPECT_LT(bible->bytes(), 4'400'000);
}

// FEDMESH_BIBLE names the program to run: one under a path with a space and
// a quote runs (it hands over to Debian's), a missing one is refused naming
// the variable, and one that prints too few books is refused by name.
TEST(TextCorpus, FedmeshBibleNamesTheProgramToRun) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("fedmesh bible's " + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto script = [&](const std::string& name, const std::string& body) {
    const fs::path path = dir / name;
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    fs::permissions(path, fs::perms::owner_all);
    return path.string();
  };
  const std::string forward = script("bible", "exec /usr/bin/bible \"$@\"");
  const std::string two_books = script("two", "echo 'Ge1:1 In the beginning'; echo 'Ex1:1 Now these'");

  ASSERT_EQ(::setenv(kBibleProgramVariable, forward.c_str(), 1), 0);
  Result<TextCorpus> bible = load_text_corpus(kBibleCorpus);
  ASSERT_TRUE(bible.is_ok()) << bible.status().to_string();
  EXPECT_EQ(bible->documents.size(), 66u);

  ASSERT_EQ(::setenv(kBibleProgramVariable, two_books.c_str(), 1), 0);
  Result<TextCorpus> short_bible = load_text_corpus(kBibleCorpus);
  EXPECT_EQ(short_bible.status().code(), StatusCode::kCorrupt) << short_bible.status().to_string();
  EXPECT_NE(short_bible.status().message().find(two_books + " printed 2 books"), std::string::npos)
      << short_bible.status().message();

  const std::string missing = (dir / "absent").string();
  ASSERT_EQ(::setenv(kBibleProgramVariable, missing.c_str(), 1), 0);
  Result<TextCorpus> none = load_text_corpus(kBibleCorpus);
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find(missing + " is missing"), std::string::npos) << none.status().message();
  EXPECT_NE(none.status().message().find("FEDMESH_BIBLE"), std::string::npos) << none.status().message();

  ::unsetenv(kBibleProgramVariable);
  fs::remove_all(dir);
}

TEST(TextCorpus, ADirectoryIsItsFilesInNameOrder) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("fedmesh-text-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "b.txt") << "second";
  std::ofstream(dir / "a.txt") << "first";
  std::ofstream(dir / "c.txt");  // empty: skipped
  fs::create_directories(dir / "sub");
  Result<TextCorpus> corpus = load_text_corpus(dir.string());
  ASSERT_TRUE(corpus.is_ok()) << corpus.status().to_string();
  ASSERT_EQ(corpus->documents.size(), 2u);
  EXPECT_EQ(corpus->documents[0].name, "a.txt");
  EXPECT_EQ(corpus->documents[1].text, "second");
  fs::remove(dir / "a.txt");
  fs::remove(dir / "b.txt");
  Result<TextCorpus> empty = load_text_corpus(dir.string());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("no non-empty file"), std::string::npos);
  fs::remove_all(dir);
  Result<TextCorpus> missing = load_text_corpus(dir.string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("bible-kjv"), std::string::npos) << missing.status().message();
}

TEST(TextCorpus, BytesAreTokens) {
  const std::string text = "Let there be light\n\xff\x01";
  const std::vector<int32_t> tokens = byte_tokens(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], 'L');
  EXPECT_EQ(tokens[text.size() - 2], 255);
  EXPECT_EQ(byte_text(tokens).value(), text);
  const std::vector<int32_t> bad = {65, 300};
  EXPECT_NE(byte_text(bad).status().message().find("token 300"), std::string::npos);
}

TEST(TextCorpus, EveryDocumentIsSplitIntoTrainingAndHeldOutText) {
  TextCorpus corpus;
  corpus.documents = {{"one", std::string(100, 'a')}, {"two", std::string(200, 'b')}};
  const std::vector<size_t> both = {0, 1};
  const TextSplit split = split_documents(corpus, both, 0.1);
  ASSERT_EQ(split.train.size(), 90u + 180u);
  ASSERT_EQ(split.validation.size(), 10u + 20u);
  EXPECT_EQ(split.train[89], 'a');
  EXPECT_EQ(split.train[90], 'b');
  EXPECT_EQ(split.validation[9], 'a');
  EXPECT_EQ(split.validation[10], 'b');
}

TEST(TextCorpus, SitesGetDocumentsByPartition) {
  TextCorpus corpus;
  for (int i = 0; i < 66; ++i) corpus.documents.push_back({std::to_string(i), "x"});
  EXPECT_EQ(documents_for_site(corpus, "books", 4, 1).value(), (std::vector<size_t>{1, 5, 9, 13, 17, 21, 25, 29, 33, 37,
                                                                                     41, 45, 49, 53, 57, 61, 65}));
  const std::vector<size_t> first = documents_for_site(corpus, "contiguous", 3, 0).value();
  EXPECT_EQ(first.size(), 22u);
  EXPECT_EQ(first.back(), 21u);
  EXPECT_EQ(documents_for_site(corpus, "testament", 2, 0).value().size(), 39u);
  EXPECT_EQ(documents_for_site(corpus, "testament", 2, 1).value().front(), 39u);
  EXPECT_NE(documents_for_site(corpus, "testament", 3, 0).status().message().find("exactly 2 sites"), std::string::npos);
  EXPECT_NE(documents_for_site(corpus, "dirichlet:0.5", 2, 0).status().message().find("unknown text partition"),
            std::string::npos);
  EXPECT_NE(documents_for_site(corpus, "books", 67, 0).status().message().find("only 66 documents"), std::string::npos);
}

TEST(TextCorpus, IidGivesEverySitePartOfEveryDocument) {
  TextCorpus corpus;
  corpus.documents = {{"one", "aaaaaaaaaaaaaaaaaaaa"}, {"two", "bbbbbbbbbbcccccccccc"}};
  const TextSplit first = site_text(corpus, "iid", 2, 0, 0.1).value();
  const TextSplit second = site_text(corpus, "iid", 2, 1, 0.1).value();
  // Each site: 10 bytes of each document, 9 to train on and 1 held out.
  EXPECT_EQ(first.train.size(), 18u);
  EXPECT_EQ(first.validation.size(), 2u);
  EXPECT_EQ(first.train[9], 'b');
  EXPECT_EQ(second.train[9], 'c');
  EXPECT_EQ(site_text(corpus, "books", 2, 1, 0.1).value().train.size(), 18u);
  EXPECT_NE(site_text(corpus, "dirichlet:0.5", 2, 0, 0.1).status().message().find("expected iid, books"), std::string::npos);
}

TEST(TextCorpus, WindowsPredictTheNextToken) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 20; ++i) tokens.push_back(i);
  const TextWindows windows(tokens, 4, 4);
  EXPECT_EQ(windows.size(), 4) << "windows at 0, 4, 8, 12 (the last needs a token after it)";
  EXPECT_EQ(windows.targets_per_sample(), 4);
  Tensor inputs;
  std::vector<int32_t> targets;
  const std::vector<int64_t> indices = {2, 0};
  windows.make_batch(indices, DType::kBF16, inputs, targets);
  ASSERT_EQ(inputs.shape(), (Shape{2, 4}));
  EXPECT_EQ(inputs.dtype(), DType::kF32) << "token ids stay exact";
  EXPECT_EQ(inputs.data<float>()[0], 8.0f);
  EXPECT_EQ(targets, (std::vector<int32_t>{9, 10, 11, 12, 1, 2, 3, 4}));
  EXPECT_EQ(TextWindows(std::vector<int32_t>(4, 1), 4, 4).size(), 0);
}

TEST(TextCorpus, TheUnigramBaselineIsTheEntropyOfTheTokenCounts) {
  // Two symbols equally often: log 2 nats (add-one smoothing over 256
  // symbols moves it by about 256/100000).
  std::vector<int32_t> tokens;
  for (int i = 0; i < 100000; ++i) tokens.push_back(i % 2);
  EXPECT_NEAR(unigram_cross_entropy(tokens, tokens, 256), std::log(2.0), 3e-3);
}

}  // namespace
}  // namespace fedmesh::train::data
