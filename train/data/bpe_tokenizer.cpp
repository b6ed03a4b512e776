#include "train/data/bpe_tokenizer.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <queue>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "train/data/gpt2_tokenizer.h"

namespace fedmesh::train::data {

namespace {

constexpr size_t kMaxEncodeCacheEntries = size_t{1} << 20;

uint64_t pair_key(int32_t first, int32_t second) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(first)) << 32) | static_cast<uint32_t>(second);
}

enum class ByteClass { kLetter, kDigit, kSpace, kOther };

ByteClass byte_class(unsigned char c) {
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c >= 0x80) return ByteClass::kLetter;
  if (c >= '0' && c <= '9') return ByteClass::kDigit;
  if (c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r') return ByteClass::kSpace;
  return ByteClass::kOther;
}

void fnv1a(uint64_t& hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ULL;
  }
}

void fnv1a_u32(uint64_t& hash, uint32_t value) {
  const unsigned char le[4] = {static_cast<unsigned char>(value), static_cast<unsigned char>(value >> 8),
                               static_cast<unsigned char>(value >> 16), static_cast<unsigned char>(value >> 24)};
  fnv1a(hash, le, sizeof le);
}

// An integer JSON value within [low, high], or false.
bool integer_in(const nlohmann::json& value, int64_t low, int64_t high, int64_t& out) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(high)) return false;
    out = static_cast<int64_t>(u);
  } else if (value.is_number_integer()) {
    out = value.get<int64_t>();
  } else {
    return false;
  }
  return out >= low && out <= high;
}

// A JSON value as a message may quote it: ASCII only (nothing a JSON error
// line cannot carry), and short.
std::string shown(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', /*ensure_ascii=*/true);
  if (text.size() > 60) text = text.substr(0, 60) + "...";
  return text;
}

// Replaces every non-overlapping (first, second), left to right, by `merged`.
void merge_pair(std::vector<int32_t>& symbols, int32_t first, int32_t second, int32_t merged) {
  size_t out = 0;
  for (size_t i = 0; i < symbols.size(); ++i) {
    if (i + 1 < symbols.size() && symbols[i] == first && symbols[i + 1] == second) {
      symbols[out++] = merged;
      ++i;
    } else {
      symbols[out++] = symbols[i];
    }
  }
  symbols.resize(out);
}

}  // namespace

PieceCutter::PieceCutter(std::string_view text, int max_piece_bytes, std::vector<std::string_view>& pieces)
    : text_(text), limit_(static_cast<size_t>(max_piece_bytes)), pieces_(pieces) {
  FEDMESH_CHECK(max_piece_bytes >= 1, "max_piece_bytes must be positive");
}

void PieceCutter::operator()(size_t begin, size_t end) const {
  for (; end - begin > limit_; begin += limit_) pieces_.push_back(text_.substr(begin, limit_));
  pieces_.push_back(text_.substr(begin, end - begin));
}

std::vector<std::string_view> pretokenize(std::string_view text, int max_piece_bytes) {
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  const PieceCutter add(text, max_piece_bytes, pieces);
  const auto cls = [&](size_t i) { return byte_class(static_cast<unsigned char>(text[i])); };
  size_t i = 0;
  while (i < n) {
    const size_t begin = i;
    if (cls(i) == ByteClass::kSpace) {
      size_t end = i;
      while (end < n && cls(end) == ByteClass::kSpace) ++end;
      if (end == n || text[end - 1] != ' ') {
        add(begin, end);
        i = end;
        continue;
      }
      // The space right before a word belongs to the word.
      if (end - begin > 1) {
        add(begin, end - 1);
        i = end - 1;
        continue;
      }
      ++i;  // a lone space: it and the word's run below are one piece
    }
    const ByteClass run = cls(i);
    while (i < n && cls(i) == run) ++i;
    add(begin, i);
  }
  return pieces;
}

Result<BpeTokenizer> BpeTokenizer::from_merges(std::vector<Merge> merges, int max_piece_bytes, BpeLayout layout) {
  if (max_piece_bytes < 1 || max_piece_bytes > kMaxPieceBytesLimit) {
    return corrupt("max_piece_bytes " + std::to_string(max_piece_bytes) + " is outside [1, " +
                   std::to_string(kMaxPieceBytesLimit) + "]");
  }
  if (merges.size() + layout.specials.size() > static_cast<size_t>(kMaxTokenizerVocabulary - 256)) {
    return corrupt(std::to_string(merges.size()) + " merges and " + std::to_string(layout.specials.size()) +
                   " special tokens make a vocabulary over the limit of " + std::to_string(kMaxTokenizerVocabulary));
  }
  BpeTokenizer tokenizer;
  tokenizer.max_piece_bytes_ = max_piece_bytes;
  for (int b = 0; b < 256; ++b) tokenizer.byte_id_[static_cast<size_t>(b)] = tokenizer.byte_of_id_[static_cast<size_t>(b)] = b;
  if (!layout.byte_ids.empty()) {
    if (layout.byte_ids.size() != 256) {
      return corrupt("byte_ids holds " + std::to_string(layout.byte_ids.size()) + " ids, not one per byte (256)");
    }
    std::array<bool, 256> taken{};
    for (int b = 0; b < 256; ++b) {
      const int32_t id = layout.byte_ids[static_cast<size_t>(b)];
      if (id < 0 || id > 255 || taken[static_cast<size_t>(id)]) {
        return corrupt("byte_ids is not a permutation of 0..255 (byte " + std::to_string(b) + " has id " +
                       std::to_string(id) + ")");
      }
      taken[static_cast<size_t>(id)] = true;
      tokenizer.byte_id_[static_cast<size_t>(b)] = id;
      tokenizer.byte_of_id_[static_cast<size_t>(id)] = b;
    }
  }
  if (layout.specials.size() > kMaxSpecialTokens) {
    return corrupt(std::to_string(layout.specials.size()) + " special tokens, at most " + std::to_string(kMaxSpecialTokens));
  }
  for (const std::string& special : layout.specials) {
    if (special.empty() || special.size() > kMaxSpecialTokenBytes) {
      return corrupt("a special token is empty or over " + std::to_string(kMaxSpecialTokenBytes) + " bytes");
    }
  }
  tokenizer.token_bytes_.reserve(256 + merges.size());
  for (int b = 0; b < 256; ++b) tokenizer.token_bytes_.emplace_back(1, static_cast<char>(b));
  tokenizer.merge_rank_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto [first, second] = merges[i];
    const int64_t created = 256 + static_cast<int64_t>(i);
    for (const int32_t id : {first, second}) {
      if (id < 0) return corrupt("merge " + std::to_string(i) + " names id " + std::to_string(id) + ", which is negative");
      if (id >= created) {
        return corrupt("merge " + std::to_string(i) + " names id " + std::to_string(id) +
                       ", which is created later (merge " + std::to_string(id - 256) + ")");
      }
    }
    const auto [it, inserted] = tokenizer.merge_rank_.emplace(pair_key(first, second), static_cast<int32_t>(i));
    if (!inserted) {
      return corrupt("merge " + std::to_string(i) + " repeats merge " + std::to_string(it->second) + " (" +
                     std::to_string(first) + ", " + std::to_string(second) + ")");
    }
    const size_t length = tokenizer.token_bytes_[static_cast<size_t>(first)].size() +
                          tokenizer.token_bytes_[static_cast<size_t>(second)].size();
    if (length > static_cast<size_t>(max_piece_bytes)) {
      return corrupt("merge " + std::to_string(i) + " makes a token of " + std::to_string(length) +
                     " bytes, longer than max_piece_bytes " + std::to_string(max_piece_bytes));
    }
    tokenizer.token_bytes_.push_back(tokenizer.token_bytes_[static_cast<size_t>(first)] +
                                     tokenizer.token_bytes_[static_cast<size_t>(second)]);
  }
  tokenizer.merges_ = std::move(merges);
  tokenizer.layout_ = std::move(layout);
  return tokenizer;
}

Result<BpeTokenizer> BpeTokenizer::parse(std::string_view text) {
  if (text.size() > kMaxTokenizerFileBytes) {
    return corrupt("a tokenizer file of " + std::to_string(text.size()) + " bytes is over the limit of " +
                   std::to_string(kMaxTokenizerFileBytes));
  }
  const nlohmann::json file = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (file.is_discarded()) return corrupt("not JSON (truncated or damaged?)");
  if (!file.is_object()) return corrupt("not a JSON object");
  static const char* const kKeys[] = {"format", "version", "pretokenizer", "max_piece_bytes", "vocab_size",
                                      "checksum", "merges", "byte_ids", "specials"};
  constexpr size_t kVersion1Keys = 7;  // version 2 adds byte_ids and specials
  if (!file.contains("version")) return corrupt("no \"version\"");
  int64_t version = 0;
  if (!integer_in(file["version"], kBpeFormatVersion, kBpeFormatVersion2, version)) {
    return corrupt("version " + shown(file["version"]) + " is not supported (this build reads versions " +
                   std::to_string(kBpeFormatVersion) + " and " + std::to_string(kBpeFormatVersion2) + ")");
  }
  const size_t keys = version == 1 ? kVersion1Keys : std::size(kKeys);
  for (size_t k = 0; k < keys; ++k) {
    if (!file.contains(kKeys[k])) return corrupt(std::string("no \"") + kKeys[k] + "\"");
  }
  for (const auto& item : file.items()) {
    const std::string& key = item.key();
    if (std::find_if(kKeys, kKeys + keys, [&](const char* k) { return key == k; }) == kKeys + keys) {
      return corrupt("unknown key " + shown(nlohmann::json(key)) + " (in a version " + std::to_string(version) + " file)");
    }
  }
  if (file["format"] != kBpeFormat) return corrupt("format " + shown(file["format"]) + " is not \"" + kBpeFormat + "\"");
  BpeLayout layout;
  if (file["pretokenizer"] == kGpt2Pretokenizer && version == kBpeFormatVersion2) {
    layout.pretokenizer = Pretokenizer::kGpt2;
  } else if (file["pretokenizer"] != kPretokenizer) {
    return corrupt("pretokenizer " + shown(file["pretokenizer"]) + " is unknown (this build knows \"" + kPretokenizer +
                   "\", and \"" + kGpt2Pretokenizer + "\" in version 2 files)");
  }
  if (version == kBpeFormatVersion2) {
    const nlohmann::json& ids = file["byte_ids"];
    if (!ids.is_array()) return corrupt("byte_ids is not an array");
    for (const nlohmann::json& id : ids) {
      int64_t value = 0;
      if (!integer_in(id, 0, 255, value)) return corrupt("byte_ids holds " + shown(id) + ", not an id in [0, 255]");
      layout.byte_ids.push_back(static_cast<int32_t>(value));
    }
    const nlohmann::json& specials = file["specials"];
    if (!specials.is_array() || specials.size() > kMaxSpecialTokens) {
      return corrupt("specials is not an array of at most " + std::to_string(kMaxSpecialTokens) + " strings");
    }
    for (const nlohmann::json& special : specials) {
      if (!special.is_string()) return corrupt("specials holds " + shown(special) + ", not a string");
      layout.specials.push_back(special.get<std::string>());
    }
  }
  int64_t piece_bytes = 0;
  if (!integer_in(file["max_piece_bytes"], 1, kMaxPieceBytesLimit, piece_bytes)) {
    return corrupt("max_piece_bytes " + shown(file["max_piece_bytes"]) + " is not an integer in [1, " +
                   std::to_string(kMaxPieceBytesLimit) + "]");
  }
  int64_t vocab_size = 0;
  if (!integer_in(file["vocab_size"], 256, kMaxTokenizerVocabulary, vocab_size)) {
    return corrupt("vocab_size " + shown(file["vocab_size"]) + " is not an integer in [256, " +
                   std::to_string(kMaxTokenizerVocabulary) + "] (kMaxTokenizerVocabulary)");
  }
  const nlohmann::json& list = file["merges"];
  if (!list.is_array()) return corrupt("merges is not an array");
  const auto special_count = static_cast<int64_t>(layout.specials.size());
  if (static_cast<int64_t>(list.size()) != vocab_size - 256 - special_count) {
    return corrupt("vocab_size " + std::to_string(vocab_size) + " needs " +
                   std::to_string(vocab_size - 256 - special_count) + " merges, the file has " +
                   std::to_string(list.size()));
  }
  std::vector<Merge> merges;
  merges.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& merge = list[i];
    int64_t first = 0, second = 0;
    if (!merge.is_array() || merge.size() != 2 || !integer_in(merge[0], INT32_MIN, INT32_MAX, first) ||
        !integer_in(merge[1], INT32_MIN, INT32_MAX, second)) {
      return corrupt("merge " + std::to_string(i) + " is not a pair of token ids: " + shown(merge));
    }
    merges.emplace_back(static_cast<int32_t>(first), static_cast<int32_t>(second));
  }
  Result<BpeTokenizer> tokenizer = from_merges(std::move(merges), static_cast<int>(piece_bytes), std::move(layout));
  if (!tokenizer.is_ok()) return tokenizer.status();
  if (!file["checksum"].is_string() || file["checksum"].get<std::string>() != tokenizer->fingerprint()) {
    return corrupt("checksum " + shown(file["checksum"]) + " does not match the merges (" +
                   tokenizer->fingerprint() + "): the file was changed or damaged");
  }
  return tokenizer;
}

Result<BpeTokenizer> BpeTokenizer::load(const std::string& path) {
  Result<std::string> text = read_file_bounded(path, kMaxTokenizerFileBytes);
  if (!text.is_ok()) {
    return Status(text.status().code(), "tokenizer file " + path + ": " + text.status().message());
  }
  Result<BpeTokenizer> tokenizer = parse(*text);
  if (!tokenizer.is_ok()) {
    return Status(tokenizer.status().code(), "tokenizer file " + path + ": " + tokenizer.status().message());
  }
  return tokenizer;
}

std::string BpeTokenizer::to_json() const {
  std::string out;
  out.reserve(200 + merges_.size() * 16);
  const bool plain = layout_.is_default();
  out += "{\n  \"format\": \"";
  out += kBpeFormat;
  out += "\",\n  \"version\": " + std::to_string(plain ? kBpeFormatVersion : kBpeFormatVersion2) +
         ",\n  \"pretokenizer\": \"";
  out += layout_.pretokenizer == Pretokenizer::kGpt2 ? kGpt2Pretokenizer : kPretokenizer;
  out += "\",\n  \"max_piece_bytes\": " + std::to_string(max_piece_bytes_) +
         ",\n  \"vocab_size\": " + std::to_string(vocabulary()) + ",\n  \"checksum\": \"" + fingerprint() + "\",";
  if (!plain) {
    nlohmann::json ids = nlohmann::json::array();
    for (const int32_t id : byte_id_) ids.push_back(id);
    out += "\n  \"byte_ids\": " + ids.dump() + ",\n  \"specials\": " +
           nlohmann::json(layout_.specials).dump(-1, ' ', /*ensure_ascii=*/true) + ",";
  }
  out += "\n  \"merges\": [";
  for (size_t i = 0; i < merges_.size(); ++i) {
    out += i == 0 ? "\n    [" : ",\n    [";
    out += std::to_string(merges_[i].first) + ", " + std::to_string(merges_[i].second) + "]";
  }
  out += merges_.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

Status BpeTokenizer::save(const std::string& path) const {
  return write_file_atomically(path, to_json(), 0644);
}

std::string BpeTokenizer::fingerprint() const {
  uint64_t hash = 0xcbf29ce484222325ULL;
  const char* pretokenizer = layout_.pretokenizer == Pretokenizer::kGpt2 ? kGpt2Pretokenizer : kPretokenizer;
  fnv1a(hash, pretokenizer, std::char_traits<char>::length(pretokenizer) + 1);
  fnv1a_u32(hash, static_cast<uint32_t>(max_piece_bytes_));
  for (const auto& [first, second] : merges_) {
    fnv1a_u32(hash, static_cast<uint32_t>(first));
    fnv1a_u32(hash, static_cast<uint32_t>(second));
  }
  if (!layout_.is_default()) {  // version 2's additions (a version 1 tokenizer's fingerprint is as it was)
    for (const int32_t id : byte_id_) fnv1a_u32(hash, static_cast<uint32_t>(id));
    fnv1a_u32(hash, static_cast<uint32_t>(layout_.specials.size()));
    for (const std::string& special : layout_.specials) {
      fnv1a_u32(hash, static_cast<uint32_t>(special.size()));
      fnv1a(hash, special.data(), special.size());
    }
  }
  char text[32];
  std::snprintf(text, sizeof text, "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
  return text;
}

std::string_view BpeTokenizer::token_bytes(int32_t id) const {
  FEDMESH_CHECK(id >= 0 && id < vocabulary(), "token id out of range");
  if (id < 256) return token_bytes_[static_cast<size_t>(byte_of_id_[static_cast<size_t>(id)])];
  const auto merged = static_cast<int32_t>(256 + merges_.size());
  if (id < merged) return token_bytes_[static_cast<size_t>(id)];
  return layout_.specials[static_cast<size_t>(id - merged)];
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  std::vector<int32_t> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) symbols[i] = static_cast<unsigned char>(piece[i]);
  // Pieces are at most max_piece_bytes long: the quadratic search is bounded.
  while (symbols.size() > 1) {
    int32_t best = INT32_MAX;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merge_rank_.find(pair_key(symbols[i], symbols[i + 1]));
      if (it != merge_rank_.end() && it->second < best) best = it->second;
    }
    if (best == INT32_MAX) break;
    const Merge& merge = merges_[static_cast<size_t>(best)];
    merge_pair(symbols, merge.first, merge.second, 256 + best);
  }
  for (int32_t& symbol : symbols) {  // a lone byte's token id (the layout's order)
    if (symbol < 256) symbol = byte_id_[static_cast<size_t>(symbol)];
  }
  out.insert(out.end(), symbols.begin(), symbols.end());
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens;
  tokens.reserve(text.size() / 2 + 16);
  // Words repeat: each distinct piece is encoded once (a bounded cache).
  std::unordered_map<std::string_view, std::pair<size_t, size_t>> cache;  // piece -> [begin, end) in `encoded`
  std::vector<int32_t> encoded;
  const std::vector<std::string_view> pieces = layout_.pretokenizer == Pretokenizer::kGpt2
                                                   ? pretokenize_gpt2(text, max_piece_bytes_)
                                                   : pretokenize(text, max_piece_bytes_);
  for (const std::string_view piece : pieces) {
    if (const auto it = cache.find(piece); it != cache.end()) {
      tokens.insert(tokens.end(), encoded.begin() + static_cast<std::ptrdiff_t>(it->second.first),
                    encoded.begin() + static_cast<std::ptrdiff_t>(it->second.second));
      continue;
    }
    const size_t begin = tokens.size();
    encode_piece(piece, tokens);
    if (cache.size() < kMaxEncodeCacheEntries) {
      cache.emplace(piece, std::make_pair(encoded.size(), encoded.size() + (tokens.size() - begin)));
      encoded.insert(encoded.end(), tokens.begin() + static_cast<std::ptrdiff_t>(begin), tokens.end());
    }
  }
  return tokens;
}

Result<std::string> BpeTokenizer::decode(std::span<const int32_t> tokens) const {
  std::string text;
  for (const int32_t t : tokens) {
    if (t < 0 || t >= vocabulary()) {
      return invalid_argument("token " + std::to_string(t) + " is outside the tokenizer's vocabulary of " +
                              std::to_string(vocabulary()));
    }
    text += token_bytes(t);
  }
  return text;
}

int64_t BpeTokenizer::byte_count(std::span<const int32_t> tokens) const {
  int64_t bytes = 0;
  for (const int32_t t : tokens) bytes += static_cast<int64_t>(token_bytes(t).size());
  return bytes;
}

Result<BpeTokenizer> train_bpe(const TextCorpus& corpus, const BpeTrainOptions& options) {
  if (options.vocabulary < 257 || options.vocabulary > kMaxTokenizerVocabulary) {
    return invalid_argument("vocabulary size " + std::to_string(options.vocabulary) + " is outside [257, " +
                            std::to_string(kMaxTokenizerVocabulary) + "] (256 bytes and at least one merge)");
  }
  if (options.max_piece_bytes < 2 || options.max_piece_bytes > kMaxPieceBytesLimit) {
    return invalid_argument("max_piece_bytes " + std::to_string(options.max_piece_bytes) + " is outside [2, " +
                            std::to_string(kMaxPieceBytesLimit) + "]");
  }
  if (options.progress_every < 1) return invalid_argument("progress_every must be at least 1");
  const int wanted = options.vocabulary - 256;

  // Word types with their counts, in byte order (the result does not depend
  // on the order; a fixed one keeps every step reproducible).
  std::unordered_map<std::string_view, int64_t> counted;
  for (const TextDocument& document : corpus.documents) {
    for (const std::string_view piece : pretokenize(document.text, options.max_piece_bytes)) ++counted[piece];
  }
  std::vector<std::pair<std::string_view, int64_t>> types(counted.begin(), counted.end());
  counted = {};
  std::sort(types.begin(), types.end());
  struct Word {
    std::vector<int32_t> symbols;
    int64_t count;
  };
  std::vector<Word> words;
  words.reserve(types.size());
  for (const auto& [piece, count] : types) {
    if (piece.size() < 2) continue;  // no pair in it, now or ever
    Word word{std::vector<int32_t>(piece.size()), count};
    for (size_t i = 0; i < piece.size(); ++i) word.symbols[i] = static_cast<unsigned char>(piece[i]);
    words.push_back(std::move(word));
  }

  // Pair counts over the word types, the words each pair occurs in (may
  // hold duplicates and words that lost the pair: checked when used), and a
  // max-heap of (count, pair) with stale entries skipped when popped.
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;
  struct Candidate {
    int64_t count;
    uint64_t key;
    bool operator<(const Candidate& other) const {  // the top is the largest count, then the smallest pair
      return count != other.count ? count < other.count : key > other.key;
    }
  };
  std::priority_queue<Candidate> heap;
  const auto add_pairs = [&](int32_t w, int64_t sign, std::vector<uint64_t>* changed) {
    const Word& word = words[static_cast<size_t>(w)];
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
      const uint64_t key = pair_key(word.symbols[i], word.symbols[i + 1]);
      pair_counts[key] += sign * word.count;
      if (sign > 0) {
        std::vector<int32_t>& list = where[key];
        if (list.empty() || list.back() != w) list.push_back(w);
      }
      if (changed) changed->push_back(key);
    }
  };
  for (size_t w = 0; w < words.size(); ++w) add_pairs(static_cast<int32_t>(w), +1, nullptr);
  for (const auto& [key, count] : pair_counts) heap.push({count, key});

  std::vector<BpeTokenizer::Merge> merges;
  merges.reserve(static_cast<size_t>(wanted));
  std::vector<uint64_t> changed;
  while (static_cast<int>(merges.size()) < wanted && !heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    const auto current = pair_counts.find(top.key);
    if (current == pair_counts.end() || current->second != top.count) continue;  // stale
    if (top.count < 2) break;
    const int32_t first = static_cast<int32_t>(top.key >> 32), second = static_cast<int32_t>(top.key & 0xffffffffu);
    const int32_t merged = 256 + static_cast<int32_t>(merges.size());
    merges.emplace_back(first, second);

    std::vector<int32_t> affected = std::move(where[top.key]);
    where.erase(top.key);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    changed.clear();
    for (const int32_t w : affected) {
      std::vector<int32_t>& symbols = words[static_cast<size_t>(w)].symbols;
      bool holds = false;
      for (size_t i = 0; i + 1 < symbols.size() && !holds; ++i) holds = symbols[i] == first && symbols[i + 1] == second;
      if (!holds) continue;
      add_pairs(w, -1, &changed);
      merge_pair(symbols, first, second, merged);
      add_pairs(w, +1, &changed);
    }
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    for (const uint64_t key : changed) {
      const auto it = pair_counts.find(key);
      FEDMESH_CHECK(it != pair_counts.end() && it->second >= 0, "BPE pair count went negative");
      if (it->second == 0) {
        pair_counts.erase(it);
      } else {
        heap.push({it->second, key});
      }
    }
    FEDMESH_CHECK(pair_counts.find(top.key) == pair_counts.end(), "a merged pair is left in some word");
    const int done = static_cast<int>(merges.size());
    if (options.on_progress && done % options.progress_every == 0 && done < wanted) options.on_progress(done, wanted);
  }
  if (options.on_progress) options.on_progress(static_cast<int>(merges.size()), wanted);
  Result<BpeTokenizer> tokenizer = BpeTokenizer::from_merges(std::move(merges), options.max_piece_bytes);
  FEDMESH_CHECK(tokenizer.is_ok(), "training made an invalid tokenizer: " + tokenizer.status().message());
  return tokenizer;
}

TextSplit split_documents(const TextCorpus& corpus, std::span<const size_t> documents, double holdout,
                          const BpeTokenizer& tokenizer) {
  TextSplit split;
  for (const size_t d : documents) {
    const std::string_view text = corpus.documents[d].text;
    const size_t cut = static_cast<size_t>(std::llround(static_cast<double>(text.size()) * (1.0 - holdout)));
    const std::vector<int32_t> train = tokenizer.encode(text.substr(0, cut));
    const std::vector<int32_t> validation = tokenizer.encode(text.substr(cut));
    split.train.insert(split.train.end(), train.begin(), train.end());
    split.validation.insert(split.validation.end(), validation.begin(), validation.end());
  }
  return split;
}

}  // namespace fedmesh::train::data
