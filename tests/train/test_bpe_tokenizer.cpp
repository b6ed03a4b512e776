// The byte-level BPE tokenizer (train/data/bpe_tokenizer.h):
// - the classic example "aaabdaaabac" learns aa, ab, then (aa)(ab) and stops
//   when no pair occurs twice; ties go to the smallest pair of ids;
// - pre-tokenization cuts words as GPT-2 does and partitions the text;
// - on the King James Bible, 768 merges (vocabulary 1024) encode at more
//   than 2.9 bytes per token (measured 3.05) and every book decodes back
//   exactly, as do random bytes; training twice gives the same merges;
// - the file round-trips, and hostile files (truncated, wrong version,
//   merges naming later ids, duplicates, a vocabulary over the limit, a bad
//   checksum, seeded mutations) are refused with kCorrupt and a message
//   naming what is wrong, never a crash;
// - a language model takes the tokenizer's vocabulary;
// - GPT-2's regex (the "gpt2" pretokenizer) on its quirks, and GPT-2's
//   vocab.json + merges.txt imported (byte order, special tokens, a version
//   2 file that round-trips), each flaw of the files refused by name.
//   tests/train/check_gpt2_tokenizer.py checks the encoding against GPT-2's
//   own algorithm.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/random.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/gpt2_tokenizer.h"
#include "train/model.h"

namespace fedmesh::train::data {
namespace {

namespace fs = std::filesystem;
using Merge = BpeTokenizer::Merge;

TextCorpus corpus_of(std::vector<std::string> texts) {
  TextCorpus corpus;
  for (size_t i = 0; i < texts.size(); ++i) corpus.documents.push_back({"d" + std::to_string(i), std::move(texts[i])});
  return corpus;
}

BpeTokenizer trained(const TextCorpus& corpus, int vocabulary) {
  BpeTrainOptions options;
  options.vocabulary = vocabulary;
  Result<BpeTokenizer> tokenizer = train_bpe(corpus, options);
  EXPECT_TRUE(tokenizer.is_ok()) << tokenizer.status().to_string();
  return std::move(tokenizer).value();
}

TEST(BpeTokenizer, TheClassicExampleLearnsTheClassicMerges) {
  // Wikipedia's example: aa -> Z, then Za and ab tie at 2 and ab (97, 98)
  // has the smaller ids -> Y, then ZY -> X; "XdXac" has no pair twice.
  const BpeTokenizer tokenizer = trained(corpus_of({"aaabdaaabac"}), 300);
  const std::vector<Merge> expected = {{'a', 'a'}, {'a', 'b'}, {256, 257}};
  EXPECT_EQ(tokenizer.merges(), expected);
  EXPECT_EQ(tokenizer.vocabulary(), 259) << "stops when no pair occurs twice";
  const std::vector<int32_t> tokens = tokenizer.encode("aaabdaaabac");
  EXPECT_EQ(tokens, (std::vector<int32_t>{258, 'd', 258, 'a', 'c'}));
  EXPECT_EQ(tokenizer.token_bytes(258), "aaab");
  EXPECT_EQ(tokenizer.decode(tokens).value(), "aaabdaaabac");
  EXPECT_EQ(tokenizer.byte_count(tokens), 11);
}

TEST(BpeTokenizer, PairsNeverCrossDocumentsOrWords) {
  // Joined, "xa" + "bxa" + "b" would hold "ab" twice (and (97, 98) would win
  // the tie with "xa"); apart, only "xa" occurs twice.
  const BpeTokenizer tokenizer = trained(corpus_of({"xa", "bxa", "b"}), 300);
  EXPECT_EQ(tokenizer.merges(), (std::vector<Merge>{{'x', 'a'}}));
  // Across words: "a b" three times gives " b" (a space joins the word after it), never "a ".
  const BpeTokenizer words = trained(corpus_of({"a b a b a b"}), 300);
  ASSERT_FALSE(words.merges().empty());
  EXPECT_EQ(words.merges()[0], (Merge{' ', 'b'}));
  for (const Merge& m : words.merges()) EXPECT_NE(m, (Merge{'a', ' '}));
}

TEST(BpeTokenizer, PretokenizationCutsWordsAsGpt2Does) {
  const std::string text = "Hello world  foo\n\nbar 42!\n caf\xc3\xa9";
  std::vector<std::string> pieces;
  for (const std::string_view p : pretokenize(text, 128)) pieces.emplace_back(p);
  const std::vector<std::string> expected = {"Hello", " world", " ", " foo", "\n\n", "bar", " 42", "!", "\n", " caf\xc3\xa9"};
  EXPECT_EQ(pieces, expected);
  std::string long_word(300, 'a');
  const std::vector<std::string_view> cut = pretokenize(long_word, 128);
  ASSERT_EQ(cut.size(), 3u);
  EXPECT_EQ(cut[0].size(), 128u);
  EXPECT_EQ(cut[2].size(), 44u);
  EXPECT_TRUE(pretokenize("", 128).empty());
}

class BibleTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<TextCorpus> loaded = load_text_corpus(kBibleCorpus);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    bible_ = new TextCorpus(std::move(*loaded));
    tokenizer_ = new BpeTokenizer(trained(*bible_, 1024));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete bible_;
  }
  static TextCorpus* bible_;
  static BpeTokenizer* tokenizer_;
};
TextCorpus* BibleTokenizer::bible_ = nullptr;
BpeTokenizer* BibleTokenizer::tokenizer_ = nullptr;

TEST_F(BibleTokenizer, EncodesTheBibleInFewerTokensAndDecodesItExactly) {
  ASSERT_EQ(tokenizer_->vocabulary(), 1024);
  int64_t bytes = 0, tokens = 0;
  for (const TextDocument& book : bible_->documents) {
    const std::vector<int32_t> encoded = tokenizer_->encode(book.text);
    for (const int32_t t : encoded) ASSERT_TRUE(t >= 0 && t < 1024);
    ASSERT_EQ(tokenizer_->decode(encoded).value(), book.text) << book.name;
    EXPECT_EQ(tokenizer_->byte_count(encoded), static_cast<int64_t>(book.text.size()));
    bytes += static_cast<int64_t>(book.text.size());
    tokens += static_cast<int64_t>(encoded.size());
  }
  const double bytes_per_token = static_cast<double>(bytes) / static_cast<double>(tokens);
  std::printf("King James Bible, 768 merges: %lld bytes in %lld tokens, %.3f bytes per token\n",
              static_cast<long long>(bytes), static_cast<long long>(tokens), bytes_per_token);
  EXPECT_GT(bytes_per_token, 2.9);
  // The merges are English: " the" and " and" are single tokens.
  EXPECT_EQ(tokenizer_->encode(" the").size(), 1u);
  EXPECT_EQ(tokenizer_->encode(" and").size(), 1u);
}

TEST_F(BibleTokenizer, RandomBytesRoundTrip) {
  Rng rng(11);
  for (const size_t size : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}, size_t{1} << 20}) {
    std::string bytes(size, '\0');
    for (char& c : bytes) c = static_cast<char>(rng.below(256));
    ASSERT_EQ(tokenizer_->decode(tokenizer_->encode(bytes)).value(), bytes) << size << " random bytes";
  }
  std::string all(256, '\0');
  for (int b = 0; b < 256; ++b) all[static_cast<size_t>(b)] = static_cast<char>(b);
  EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(all + all + "  the\r\n\t")).value(), all + all + "  the\r\n\t");
}

TEST_F(BibleTokenizer, TrainingIsDeterministic) {
  // The first ten books, twice: the same merges, the same fingerprint, the
  // same bytes on disk.
  TextCorpus part;
  part.documents.assign(bible_->documents.begin(), bible_->documents.begin() + 10);
  const BpeTokenizer first = trained(part, 600), second = trained(part, 600);
  EXPECT_EQ(first.merges(), second.merges());
  EXPECT_EQ(first.fingerprint(), second.fingerprint());
  EXPECT_EQ(first.to_json(), second.to_json());
  // Another corpus, other merges: the fingerprint tells them apart.
  EXPECT_NE(first.fingerprint(), tokenizer_->fingerprint());
}

TEST_F(BibleTokenizer, SplitsDocumentsWhereTheByteTokenizerDoes) {
  std::vector<size_t> books = {0, 1, 65};
  const TextSplit bytes = split_documents(*bible_, books, kHeldOutText);
  const TextSplit bpe = split_documents(*bible_, books, kHeldOutText, *tokenizer_);
  EXPECT_EQ(byte_tokens(tokenizer_->decode(bpe.train).value()), bytes.train);
  EXPECT_EQ(byte_tokens(tokenizer_->decode(bpe.validation).value()), bytes.validation);
  EXPECT_LT(bpe.train.size() * 3, bytes.train.size());
}

TEST_F(BibleTokenizer, TheFileRoundTrips) {
  const std::string text = tokenizer_->to_json();
  Result<BpeTokenizer> parsed = BpeTokenizer::parse(text);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->merges(), tokenizer_->merges());
  EXPECT_EQ(parsed->fingerprint(), tokenizer_->fingerprint());
  EXPECT_EQ(parsed->to_json(), text);
  const fs::path file = fs::path(::testing::TempDir()) / ("fedmesh-bpe-" + std::to_string(::getpid()) + ".json");
  ASSERT_TRUE(tokenizer_->save(file.string()).is_ok());
  Result<BpeTokenizer> loaded = BpeTokenizer::load(file.string());
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->encode(bible_->documents[0].text), tokenizer_->encode(bible_->documents[0].text));
  fs::remove(file);
  Result<BpeTokenizer> missing = BpeTokenizer::load(file.string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(file.string()), std::string::npos) << missing.status().message();
}

// A valid file of `merges`, as to_json writes it but with `edit` applied to
// its parts (keys as they are written; "checksum" recomputed unless given).
std::string file_with(const std::vector<std::vector<int64_t>>& merges, const std::string& extra = "",
                      std::optional<std::string> checksum = std::nullopt, int64_t vocab = -1, std::string version = "1",
                      std::string format = "\"fedmesh-bpe\"") {
  std::vector<Merge> valid;
  bool representable = true;
  for (const auto& m : merges) {
    if (m.size() != 2) representable = false;
    else valid.emplace_back(static_cast<int32_t>(m[0]), static_cast<int32_t>(m[1]));
  }
  std::string list;
  for (const auto& m : merges) {
    list += list.empty() ? "[" : ", [";
    for (size_t i = 0; i < m.size(); ++i) list += (i ? ", " : "") + std::to_string(m[i]);
    list += "]";
  }
  if (!checksum) {
    // The fingerprint of what the merges would be, were they valid: only the
    // check under test fails.
    uint64_t hash = 0xcbf29ce484222325ULL;
    const auto mix = [&](const void* data, size_t size) {
      for (size_t i = 0; i < size; ++i) {
        hash ^= static_cast<const unsigned char*>(data)[i];
        hash *= 0x100000001b3ULL;
      }
    };
    const auto mix_u32 = [&](uint32_t v) {
      const unsigned char le[4] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8),
                                   static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 24)};
      mix(le, 4);
    };
    mix("gpt2-ascii", 11);
    mix_u32(128);
    if (representable) {
      for (const Merge& m : valid) {
        mix_u32(static_cast<uint32_t>(m.first));
        mix_u32(static_cast<uint32_t>(m.second));
      }
    }
    char text[32];
    std::snprintf(text, sizeof text, "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
    checksum = text;
  }
  if (vocab < 0) vocab = 256 + static_cast<int64_t>(merges.size());
  return "{\"format\": " + format + ", \"version\": " + version +
         ", \"pretokenizer\": \"gpt2-ascii\", \"max_piece_bytes\": 128, \"vocab_size\": " + std::to_string(vocab) +
         ", \"checksum\": \"" + *checksum + "\", \"merges\": [" + list + "]" + extra + "}";
}

void expect_refused(std::string_view text, const std::string& named) {
  Result<BpeTokenizer> parsed = BpeTokenizer::parse(text);
  ASSERT_FALSE(parsed.is_ok()) << "accepted: " << text.substr(0, 200);
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorrupt) << parsed.status().to_string();
  EXPECT_NE(parsed.status().message().find(named), std::string::npos)
      << "expected \"" << named << "\" in: " << parsed.status().message();
}

TEST(BpeTokenizerFile, TheHelperWritesValidFiles) {
  Result<BpeTokenizer> ok = BpeTokenizer::parse(file_with({{'t', 'h'}, {256, 'e'}}));
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->token_bytes(257), "the");
  EXPECT_EQ(ok->fingerprint(), BpeTokenizer::from_merges({{'t', 'h'}, {256, 'e'}}).value().fingerprint());
}

TEST(BpeTokenizerFile, HostileFilesAreRefusedByName) {
  const std::string good = file_with({{'t', 'h'}, {256, 'e'}});
  expect_refused(good.substr(0, good.size() / 2), "not JSON");
  expect_refused("", "not JSON");
  expect_refused("[1, 2]", "not a JSON object");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, -1, "3"), "version 3 is not supported");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, -1, "2"), "no \"byte_ids\"");
  std::string gpt2_in_version_1 = file_with({{'t', 'h'}});
  gpt2_in_version_1.replace(gpt2_in_version_1.find("gpt2-ascii"), 10, "gpt2");
  expect_refused(gpt2_in_version_1, "pretokenizer \"gpt2\" is unknown");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, -1, "\"1\""), "version \"1\" is not supported");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, -1, "1", "\"sentencepiece\""), "format \"sentencepiece\"");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, 70000), "vocab_size 70000 is not an integer in [256, 65536]");
  expect_refused(file_with({{'t', 'h'}}, "", std::nullopt, 258), "vocab_size 258 needs 2 merges, the file has 1");
  expect_refused(file_with({{'t', 'h'}, {257, 'e'}}), "merge 1 names id 257, which is created later (merge 1)");
  expect_refused(file_with({{300, 'h'}, {'a', 'b'}}), "merge 0 names id 300, which is created later (merge 44)");
  expect_refused(file_with({{'t', -1}}), "merge 0 names id -1, which is negative");
  expect_refused(file_with({{'t', 'h'}, {'a', 'b'}, {'t', 'h'}}), "merge 2 repeats merge 0 (116, 104)");
  expect_refused(file_with({{'t', 'h', 'e'}}), "merge 0 is not a pair of token ids");
  expect_refused(file_with({{'t', 'h'}}, "", std::string("fnv1a64:0000000000000000")), "checksum");
  expect_refused(file_with({{'t', 'h'}}, ", \"comment\": 1"), "unknown key \"comment\"");
  expect_refused("{\"format\": \"fedmesh-bpe\"}", "no \"version\"");
  expect_refused(file_with({{'t', 'h'}, {99999999999, 'e'}}), "merge 1 is not a pair of token ids");
  // A file over the limit is refused before it is parsed.
  expect_refused(std::string(kMaxTokenizerFileBytes + 1, ' '), "over the limit");
  // Deeply nested JSON: refused, no stack overflow.
  expect_refused(std::string(100000, '[') + std::string(100000, ']'), "not a JSON object");
  // Tokens that double each merge would outgrow memory: bounded by max_piece_bytes.
  std::vector<Merge> doubling = {{'a', 'a'}};
  for (int32_t i = 0; i < 10; ++i) doubling.emplace_back(256 + i, 256 + i);
  Result<BpeTokenizer> huge = BpeTokenizer::from_merges(doubling);
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("merge 7 makes a token of 256 bytes, longer than max_piece_bytes 128"),
            std::string::npos) << huge.status().message();
}

TEST(BpeTokenizerFile, SeededMutationsAreRefusedOrParseToAValidTokenizer) {
  const BpeTokenizer base = trained(corpus_of({"the theme of the thesis: then there they thew these"}), 300);
  const std::string good = base.to_json();
  Rng rng(5);
  int refused = 0, accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string text = good;
    const int edits = 1 + static_cast<int>(rng.below(3));
    for (int e = 0; e < edits && !text.empty(); ++e) {
      const size_t at = rng.below(text.size());
      switch (rng.below(4)) {
        case 0: text[at] = static_cast<char>(rng.below(256)); break;
        case 1: text.erase(at, 1 + rng.below(8)); break;
        case 2: text.insert(at, 1, "0123456789[],-\""[rng.below(15)]); break;
        default: text.resize(at); break;
      }
    }
    Result<BpeTokenizer> parsed = BpeTokenizer::parse(text);
    if (parsed.is_ok()) {
      ++accepted;
      // Only an edit the checksum cannot see (white space) is accepted: the same merges.
      ASSERT_EQ(parsed->merges(), base.merges()) << text;
      ASSERT_EQ(parsed->decode(parsed->encode(text)).value(), text);
    } else {
      ++refused;
      ASSERT_EQ(parsed.status().code(), StatusCode::kCorrupt);
      ASSERT_FALSE(parsed.status().message().empty());
    }
  }
  EXPECT_GT(refused, 1000) << accepted << " accepted";
}

TEST(BpeTokenizer, DecodeRefusesIdsOutsideTheVocabulary) {
  const BpeTokenizer tokenizer = BpeTokenizer::from_merges({{'a', 'b'}}).value();
  const std::vector<int32_t> bad = {'a', 257};
  Result<std::string> decoded = tokenizer.decode(bad);
  ASSERT_FALSE(decoded.is_ok());
  EXPECT_NE(decoded.status().message().find("token 257 is outside the tokenizer's vocabulary of 257"), std::string::npos);
  const std::vector<int32_t> negative = {-1};
  EXPECT_FALSE(tokenizer.decode(negative).is_ok());
}

TEST(BpeTokenizer, TrainingRefusesAVocabularyOutsideItsBounds) {
  BpeTrainOptions options;
  options.vocabulary = 256;
  EXPECT_EQ(train_bpe(corpus_of({"abab"}), options).status().code(), StatusCode::kInvalidArgument);
  options.vocabulary = kMaxTokenizerVocabulary + 1;
  EXPECT_EQ(train_bpe(corpus_of({"abab"}), options).status().code(), StatusCode::kInvalidArgument);
}

TEST(BpeTokenizer, ALanguageModelTakesTheTokenizersVocabulary) {
  const int64_t bytes = train::make_model("gpt-nano", 1).value()->parameter_count();
  const int64_t bpe = train::make_model("gpt-nano", 1, 512).value()->parameter_count();
  EXPECT_EQ(bpe - bytes, 256 * 64) << "256 more rows of the width-64 token embedding (tied to the output)";
  Result<std::unique_ptr<train::Sequential>> image = train::make_model("mlp", 1, 512);
  ASSERT_FALSE(image.is_ok());
  EXPECT_NE(image.status().message().find("not a language model"), std::string::npos);
}

}  // namespace
}  // namespace fedmesh::train::data

namespace fedmesh::train::data {
namespace {

std::vector<std::string> gpt2_pieces(std::string_view text) {
  std::vector<std::string> pieces;
  for (const std::string_view p : pretokenize_gpt2(text, kMaxPieceBytesLimit)) pieces.emplace_back(p);
  return pieces;
}

TEST(Gpt2Pretokenizer, CutsAsGpt2sRegexDoes) {
  using V = std::vector<std::string>;
  EXPECT_EQ(gpt2_pieces("Hello world"), (V{"Hello", " world"}));
  // A run of white space keeps its last character for what follows: a space
  // joins the word, anything else stands alone.
  EXPECT_EQ(gpt2_pieces("Hello\n\nWorld"), (V{"Hello", "\n", "\n", "World"}));
  EXPECT_EQ(gpt2_pieces("a  b"), (V{"a", " ", " b"}));
  EXPECT_EQ(gpt2_pieces("end   "), (V{"end", "   "}));
  EXPECT_EQ(gpt2_pieces("x\t\ty"), (V{"x", "\t", "\t", "y"}));
  // Contractions, lowercase only, and only at a piece's start.
  EXPECT_EQ(gpt2_pieces("I'm it's we'll"), (V{"I", "'m", " it", "'s", " we", "'ll"}));
  EXPECT_EQ(gpt2_pieces("I'M 'sup"), (V{"I", "'", "M", " '", "sup"}));
  // Numbers, punctuation runs with their space.
  EXPECT_EQ(gpt2_pieces("pi 3.14!?"), (V{"pi", " 3", ".", "14", "!?"}));
  EXPECT_EQ(gpt2_pieces("a ...b"), (V{"a", " ...", "b"}));
  // Unicode classes: letters of any script, other numbers, an em dash is punctuation.
  EXPECT_EQ(gpt2_pieces("caf\xc3\xa9\xe2\x80\x94na\xc3\xafve"), (V{"caf\xc3\xa9", "\xe2\x80\x94", "na\xc3\xafve"}));
  EXPECT_EQ(gpt2_pieces("\xe6\x97\xa5\xe6\x9c\xac \xc2\xbd"), (V{"\xe6\x97\xa5\xe6\x9c\xac", " \xc2\xbd"}));
  // U+3000 is white space; U+00A0 too.
  EXPECT_EQ(gpt2_pieces("a\xe3\x80\x80\xe3\x80\x80" "b"), (V{"a", "\xe3\x80\x80", "\xe3\x80\x80", "b"}));
  // Bytes that are not UTF-8 are characters of their own, neither letter nor space.
  EXPECT_EQ(gpt2_pieces("ab\xff\xfe" "cd"), (V{"ab", "\xff\xfe", "cd"}));
  EXPECT_EQ(gpt2_pieces("a\xc3"), (V{"a", "\xc3"}));
  // The pieces always partition the text.
  Rng rng(3);
  for (int round = 0; round < 200; ++round) {
    std::string text(static_cast<size_t>(rng.below(40)), ' ');
    for (char& c : text) c = static_cast<char>(rng.below(256));
    std::string joined;
    for (const std::string_view p : pretokenize_gpt2(text, 7)) {
      EXPECT_FALSE(p.empty());
      EXPECT_LE(p.size(), 7u);
      joined += p;
    }
    EXPECT_EQ(joined, text);
  }
}

// GPT-2's byte alphabet written as UTF-8.
std::string written(std::string_view bytes) {
  std::string out;
  for (const unsigned char b : bytes) {
    const char32_t c = gpt2_byte_char(b);
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }
  return out;
}

// vocab.json and merges.txt as GPT-2's are, for these merges (token bytes).
std::pair<std::string, std::string> gpt2_files(const std::vector<std::pair<std::string, std::string>>& merges,
                                               bool with_end_of_text = true) {
  nlohmann::json vocab = nlohmann::json::object();
  int id = 0;
  for (int b = 33; b < 256; ++b) {  // GPT-2's order: the printable bytes first...
    if (written(std::string(1, static_cast<char>(b))).size() == (b < 128 ? 1u : 2u) &&
        ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE))) {
      vocab[written(std::string(1, static_cast<char>(b)))] = id++;
    }
  }
  for (int b = 0; b < 256; ++b) {  // ...then the others
    const std::string w = written(std::string(1, static_cast<char>(b)));
    if (!vocab.contains(w)) vocab[w] = id++;
  }
  std::string text = "#version: 0.2\n";
  for (const auto& [a, b] : merges) {
    text += written(a) + " " + written(b) + "\n";
    vocab[written(a + b)] = id++;
  }
  if (with_end_of_text) vocab["<|endoftext|>"] = id;
  return {vocab.dump(), text};
}

TEST(Gpt2Tokenizer, ImportsGpt2sFilesWithTheirByteOrderAndSpecialToken) {
  const auto [vocab, merges] = gpt2_files({{" ", "t"}, {"h", "e"}, {" t", "he"}});
  Result<BpeTokenizer> tokenizer = import_gpt2_tokenizer(vocab, merges);
  ASSERT_TRUE(tokenizer.is_ok()) << tokenizer.status().to_string();
  EXPECT_EQ(tokenizer->vocabulary(), 256 + 3 + 1);
  EXPECT_EQ(tokenizer->encode("!"), (std::vector<int32_t>{0})) << "GPT-2 numbers '!' 0";
  EXPECT_EQ(tokenizer->encode("A"), (std::vector<int32_t>{32}));
  EXPECT_EQ(tokenizer->encode(" the"), (std::vector<int32_t>{258})) << "merge 2 is id 258";
  EXPECT_EQ(tokenizer->encode("the the"), (std::vector<int32_t>{static_cast<int32_t>('t' - 33), 257, 258}));
  EXPECT_EQ(tokenizer->token_bytes(259), "<|endoftext|>");
  EXPECT_EQ(tokenizer->decode(std::vector<int32_t>{258, 259}).value(), " the<|endoftext|>");
  // Every byte string round-trips through the permuted ids.
  Rng rng(5);
  for (int round = 0; round < 50; ++round) {
    std::string text(static_cast<size_t>(rng.below(64)), ' ');
    for (char& c : text) c = static_cast<char>(rng.below(256));
    EXPECT_EQ(tokenizer->decode(tokenizer->encode(text)).value(), text);
  }
  // Its file is version 2 and reads back to the same tokenizer.
  const std::string file = tokenizer->to_json();
  EXPECT_NE(file.find("\"version\": 2"), std::string::npos);
  EXPECT_NE(file.find("\"pretokenizer\": \"gpt2\""), std::string::npos);
  Result<BpeTokenizer> back = BpeTokenizer::parse(file);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->fingerprint(), tokenizer->fingerprint());
  EXPECT_EQ(back->encode("the the!"), tokenizer->encode("the the!"));
  EXPECT_NE(tokenizer->fingerprint(), BpeTokenizer::from_merges({{' ', 't'}, {'h', 'e'}, {256, 257}}).value().fingerprint());
}

TEST(Gpt2Tokenizer, RefusesFlawedFilesByName) {
  const auto refused = [](const std::string& vocab, const std::string& merges, const std::string& says) {
    Result<BpeTokenizer> r = import_gpt2_tokenizer(vocab, merges);
    ASSERT_FALSE(r.is_ok()) << says;
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().to_string();
  };
  const auto [vocab, merges] = gpt2_files({{" ", "t"}, {"h", "e"}});
  refused(vocab, "#version: 0.2\nh e x\n", "merges.txt line 2 is not two tokens");
  refused(vocab, "#version: 0.2\nhe e\n", "line 2: token 'he' is made by no earlier merge");
  refused(vocab, "#version: 0.2\n\xc3\xbf\xc3 e\n", "line 2: token");
  refused(vocab, "#version: 0.2\nh e\nh e\n", "line 3 makes a token an earlier merge made");
  refused("[1]", merges, "vocab.json is not a JSON object");
  refused("{\"a\": -1}", merges, "the id -1");
  nlohmann::json v = nlohmann::json::parse(vocab);
  v.erase(written(" "));
  refused(v.dump(), merges, "vocab.json has no token with the id");
  v = nlohmann::json::parse(vocab);
  std::swap(v[written("he")], v[written(" t")]);
  refused(v.dump(), merges, "merges.txt makes it as merge");
  v = nlohmann::json::parse(vocab);
  v["extra"] = 5000;
  refused(v.dump(), merges, "vocab.json skips ids before 5000");
  v = nlohmann::json::parse(vocab);
  v[written("t")] = 3;
  refused(v.dump(), merges, "the id 3 to");
}

}  // namespace
}  // namespace fedmesh::train::data
