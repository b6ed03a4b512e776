#include "train/data/gpt2_tokenizer.h"

#include <array>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "train/data/unicode_classes.h"

namespace fedmesh::train::data {

namespace {

// A token or line as a message may quote it: printable ASCII kept, every
// other byte as \xNN (a JSON error line can carry it whatever the file held).
std::string shown_token(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const unsigned char c : text.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return text.size() > 80 ? out + "..." : out;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

struct Char {
  char32_t code = 0;
  size_t size = 1;
  CharClass kind = CharClass::kOther;
};

// The character at byte i: a valid UTF-8 sequence, or one byte of class other.
Char char_at(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  Char c;
  const unsigned char lead = byte(i);
  size_t size = 1;
  char32_t code = lead;
  if (lead >= 0x80) {
    if ((lead & 0xE0) == 0xC0) size = 2, code = lead & 0x1F;
    else if ((lead & 0xF0) == 0xE0) size = 3, code = lead & 0x0F;
    else if ((lead & 0xF8) == 0xF0) size = 4, code = lead & 0x07;
    else return c;  // a continuation or invalid lead byte
    if (i + size > text.size()) return c;
    for (size_t k = 1; k < size; ++k) {
      if ((byte(i + k) & 0xC0) != 0x80) return c;
      code = (code << 6) | (byte(i + k) & 0x3F);
    }
    const bool overlong = (size == 2 && code < 0x80) || (size == 3 && code < 0x800) || (size == 4 && code < 0x10000);
    if (overlong || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return c;
  }
  c.code = code;
  c.size = size;
  c.kind = is_unicode_letter(code)   ? CharClass::kLetter
           : is_unicode_number(code) ? CharClass::kNumber
           : is_unicode_space(code)  ? CharClass::kSpace
                                     : CharClass::kOther;
  return c;
}

void append_utf8(std::string& out, char32_t code) {
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else if (code < 0x800) {
    out += static_cast<char>(0xC0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3F));
  } else {  // the byte alphabet stays below U+0800; kept general
    out += static_cast<char>(0xE0 | (code >> 12));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code & 0x3F));
  }
}

// bytes_to_unicode: the printable bytes stand for themselves, the others
// for U+0100, U+0101, ... in byte order.
std::array<char32_t, 256> byte_alphabet() {
  std::array<char32_t, 256> chars{};
  char32_t next = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    chars[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return chars;
}

// A token written in the byte alphabet back to its bytes, or why not.
Result<std::string> token_from_alphabet(std::string_view written, const std::unordered_map<char32_t, char>& byte_of) {
  std::string bytes;
  for (size_t i = 0; i < written.size();) {
    const Char c = char_at(written, i);
    const auto found = byte_of.find(c.code);
    if (c.code == 0 && written[i] != '\0') return invalid_argument("it is not valid UTF-8");
    if (found == byte_of.end()) {
      return invalid_argument("its character '" + shown_token(written.substr(i, c.size)) + "' is not in GPT-2's byte alphabet");
    }
    bytes += found->second;
    i += c.size;
  }
  if (bytes.empty()) return invalid_argument("it is empty");
  return bytes;
}

}  // namespace

std::vector<std::string_view> pretokenize_gpt2(std::string_view text, int max_piece_bytes) {
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  const PieceCutter add(text, max_piece_bytes, pieces);
  static constexpr std::string_view kContractions[] = {"s", "t", "re", "ve", "m", "ll", "d"};
  size_t i = 0;
  while (i < n) {
    const size_t begin = i;
    // 's|'t|'re|'ve|'m|'ll|'d
    if (text[i] == '\'') {
      bool matched = false;
      for (const std::string_view c : kContractions) {
        if (text.substr(i + 1, c.size()) == c) {
          add(i, i + 1 + c.size());
          i += 1 + c.size();
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space and a run of one class.
    size_t start = i;
    Char first = char_at(text, i);
    if (text[i] == ' ' && i + 1 < n) {
      const Char next = char_at(text, i + 1);
      if (next.kind != CharClass::kSpace) {
        start = i + 1;
        first = next;
      }
    }
    if (first.kind != CharClass::kSpace) {
      size_t end = start;
      while (end < n) {
        const Char c = char_at(text, end);
        if (c.kind != first.kind) break;
        end += c.size;
      }
      add(begin, end);
      i = end;
      continue;
    }
    // '\s+(?!\S)' then '\s+': a run of white space, less its last character
    // when something follows (that character goes on alone, or as the
    // optional space of the next run).
    size_t end = i, last = i;
    while (end < n) {
      const Char c = char_at(text, end);
      if (c.kind != CharClass::kSpace) break;
      last = end;
      end += c.size;
    }
    if (end == n || last == i) {
      add(i, end);
      i = end;
    } else {
      add(i, last);
      i = last;
    }
  }
  return pieces;
}

char32_t gpt2_byte_char(unsigned char byte) {
  static const std::array<char32_t, 256> chars = byte_alphabet();
  return chars[byte];
}

Result<BpeTokenizer> import_gpt2_tokenizer(std::string_view vocab_json, std::string_view merges_txt) {
  std::unordered_map<char32_t, char> byte_of;
  for (int b = 0; b < 256; ++b) byte_of[gpt2_byte_char(static_cast<unsigned char>(b))] = static_cast<char>(b);

  // merges.txt, in the tokenizer's own ids: bytes 0..255, merge i 256 + i.
  std::unordered_map<std::string, int32_t> id_of;
  std::vector<std::string> token_of;
  for (int b = 0; b < 256; ++b) {
    id_of.emplace(std::string(1, static_cast<char>(b)), b);
    token_of.emplace_back(1, static_cast<char>(b));
  }
  std::vector<BpeTokenizer::Merge> merges;
  int64_t line_number = 0;
  for (size_t at = 0; at < merges_txt.size();) {
    const size_t newline = merges_txt.find('\n', at);
    std::string_view line = merges_txt.substr(at, newline == std::string_view::npos ? std::string_view::npos : newline - at);
    at = newline == std::string_view::npos ? merges_txt.size() : newline + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_number == 1 && line.starts_with("#version"))) continue;
    const std::string where = "merges.txt line " + std::to_string(line_number);
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
      return invalid_argument(where + " is not two tokens separated by one space");
    }
    int32_t pair[2];
    std::string joined;
    for (int k = 0; k < 2; ++k) {
      const std::string_view written = k == 0 ? line.substr(0, space) : line.substr(space + 1);
      Result<std::string> bytes = token_from_alphabet(written, byte_of);
      if (!bytes.is_ok()) return invalid_argument(where + ": token '" + shown_token(written) + "': " + bytes.status().message());
      const auto found = id_of.find(*bytes);
      if (found == id_of.end()) {
        return invalid_argument(where + ": token '" + shown_token(written) + "' is made by no earlier merge");
      }
      pair[k] = found->second;
      joined += *bytes;
    }
    const auto created = static_cast<int32_t>(256 + merges.size());
    if (!id_of.emplace(joined, created).second) {
      return invalid_argument(where + " makes a token an earlier merge made");
    }
    if (created >= kMaxTokenizerVocabulary) return invalid_argument("merges.txt makes over " + std::to_string(kMaxTokenizerVocabulary) + " tokens");
    token_of.push_back(joined);
    merges.emplace_back(pair[0], pair[1]);
  }

  // vocab.json: every token of the merges at the id GPT-2's files give it.
  const nlohmann::json vocab = nlohmann::json::parse(vocab_json, nullptr, /*allow_exceptions=*/false);
  if (vocab.is_discarded() || !vocab.is_object()) return invalid_argument("vocab.json is not a JSON object");
  std::map<int64_t, std::string> by_id;
  for (const auto& [written, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxTokenizerVocabulary) {
      return invalid_argument("vocab.json gives '" + shown_token(written) + "' the id " + id.dump(-1, ' ', true) + ", not one in [0, " +
                              std::to_string(kMaxTokenizerVocabulary) + ")");
    }
    if (!by_id.emplace(id.get<int64_t>(), written).second) {
      return invalid_argument("vocab.json gives the id " + id.dump() + " to '" + shown_token(written) + "' and '" +
                              shown_token(by_id[id.get<int64_t>()]) + "'");
    }
  }
  BpeLayout layout;
  layout.pretokenizer = Pretokenizer::kGpt2;
  layout.byte_ids.assign(256, -1);
  const auto merged_end = static_cast<int64_t>(256 + merges.size());
  for (const auto& [id, written] : by_id) {
    Result<std::string> bytes = token_from_alphabet(written, byte_of);
    const auto known = bytes.is_ok() ? id_of.find(*bytes) : id_of.end();
    if (id >= merged_end) {  // after the merged tokens: special tokens, in id order
      if (id != merged_end + static_cast<int64_t>(layout.specials.size())) {
        return invalid_argument("vocab.json skips ids before " + std::to_string(id) + " ('" + shown_token(written) + "')");
      }
      layout.specials.push_back(written);
      continue;
    }
    if (known == id_of.end()) {
      return invalid_argument("vocab.json gives '" + shown_token(written) + "' the id " + std::to_string(id) +
                              ", but neither a byte nor a merge of merges.txt makes it");
    }
    if (known->second < 256 && id < 256) {
      layout.byte_ids[static_cast<size_t>(known->second)] = static_cast<int32_t>(id);
    } else if (known->second != id) {
      return invalid_argument("vocab.json gives '" + shown_token(written) + "' the id " + std::to_string(id) + "; merges.txt makes it " +
                              (known->second < 256 ? "a byte token (ids 0..255)" : "as merge " + std::to_string(known->second - 256) +
                               " (id " + std::to_string(known->second) + ")"));
    }
  }
  if (static_cast<int64_t>(by_id.size() - layout.specials.size()) != merged_end) {
    int64_t missing = 0;
    while (by_id.contains(missing)) ++missing;
    return invalid_argument("vocab.json has no token with the id " + std::to_string(missing) + " (the 256 bytes and " +
                            std::to_string(merges.size()) + " merges of merges.txt need ids 0.." +
                            std::to_string(merged_end - 1) + ")");
  }
  for (int b = 0; b < 256; ++b) {
    if (layout.byte_ids[static_cast<size_t>(b)] < 0) {
      std::string written;
      append_utf8(written, gpt2_byte_char(static_cast<unsigned char>(b)));
      return invalid_argument("vocab.json has no id for the byte token '" + shown_token(written) + "' (byte " + std::to_string(b) + ")");
    }
  }
  // GPT-2 never cuts a piece: the largest bound keeps that for all but
  // pieces of over 4 KiB (a merge making a longer token is refused).
  return BpeTokenizer::from_merges(std::move(merges), kMaxPieceBytesLimit, std::move(layout));
}

Result<BpeTokenizer> import_gpt2_tokenizer_files(const std::string& vocab_path, const std::string& merges_path) {
  Result<std::string> vocab = read_file_bounded(vocab_path, kMaxTokenizerFileBytes);
  if (!vocab.is_ok()) return Status(vocab.status().code(), "vocab.json " + vocab_path + ": " + vocab.status().message());
  Result<std::string> merges = read_file_bounded(merges_path, kMaxTokenizerFileBytes);
  if (!merges.is_ok()) return Status(merges.status().code(), "merges.txt " + merges_path + ": " + merges.status().message());
  Result<BpeTokenizer> tokenizer = import_gpt2_tokenizer(*vocab, *merges);
  if (!tokenizer.is_ok()) {
    return Status(tokenizer.status().code(), vocab_path + " + " + merges_path + ": " + tokenizer.status().message());
  }
  return tokenizer;
}

}  // namespace fedmesh::train::data
