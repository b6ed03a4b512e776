// libFuzzer target for the BPE tokenizer file parser
// (train/data/bpe_tokenizer.h): the input bytes are the file's text; and for
// the import of GPT-2's vocab.json + merges.txt (check_gpt2 below). How to
// build and run it: tests/fuzz/README.md.
//
// For every input, besides "no crash, no sanitizer report, no unbounded
// allocation":
//   - a rejection has the code kCorrupt and a non-empty ASCII message (so a
//     JSON error line can carry it whatever the file held);
//   - an accepted tokenizer is within its limits, its canonical file parses
//     back to the same merges and fingerprint, and the input itself, encoded
//     with it, decodes back to the same bytes with every id in range.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "train/data/bpe_tokenizer.h"
#include "train/data/gpt2_tokenizer.h"

namespace {

using fedmesh::StatusCode;
namespace data = fedmesh::train::data;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_tokenizer: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

// GPT-2's files (train/data/gpt2_tokenizer.h), the input cut at its first
// NUL into vocab.json and merges.txt: refused with kInvalidArgument and an
// ASCII message, or accepted as a tokenizer whose file reads back and which
// encodes the input and decodes it back. And the "gpt2" pretokenizer's
// pieces partition any input.
void check_gpt2(std::string_view text) {
  std::string joined;
  for (const std::string_view piece : data::pretokenize_gpt2(text, 16)) {
    if (piece.empty() || piece.size() > 16) violated("a gpt2 piece of " + std::to_string(piece.size()) + " bytes");
    joined += piece;
  }
  if (joined != text) violated("the gpt2 pieces do not partition the input");
  const size_t cut = text.find('\0');
  if (cut == std::string_view::npos) return;
  fedmesh::Result<data::BpeTokenizer> imported = data::import_gpt2_tokenizer(text.substr(0, cut), text.substr(cut + 1));
  if (!imported.is_ok()) {
    const fedmesh::Status& status = imported.status();
    if (status.code() != StatusCode::kInvalidArgument && status.code() != StatusCode::kCorrupt) {
      violated("import refused with code " + std::string(fedmesh::status_code_name(status.code())));
    }
    if (status.message().empty()) violated("import refused with an empty message");
    for (const char c : status.message()) {
      if (static_cast<unsigned char>(c) >= 0x80) violated("an import message that is not ASCII: " + status.message());
    }
    return;
  }
  const data::BpeTokenizer& tokenizer = imported.value();
  fedmesh::Result<data::BpeTokenizer> again = data::BpeTokenizer::parse(tokenizer.to_json());
  if (!again.is_ok()) violated("an imported tokenizer's file does not parse: " + again.status().message());
  if (again.value().fingerprint() != tokenizer.fingerprint()) violated("an imported tokenizer's file reads back to another");
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  for (const int32_t t : tokens) {
    if (t < 0 || t >= tokenizer.vocabulary()) violated("an imported tokenizer made token " + std::to_string(t));
  }
  fedmesh::Result<std::string> decoded = tokenizer.decode(tokens);
  if (!decoded.is_ok() || decoded.value() != text) violated("an imported tokenizer does not decode its encoding");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(bytes), size);
  check_gpt2(text);
  fedmesh::Result<data::BpeTokenizer> parsed = data::BpeTokenizer::parse(text);
  if (!parsed.is_ok()) {
    const fedmesh::Status& status = parsed.status();
    if (status.code() != StatusCode::kCorrupt) violated("rejected with code " + std::string(fedmesh::status_code_name(status.code())));
    if (status.message().empty()) violated("rejected with an empty message");
    for (const char c : status.message()) {
      if (static_cast<unsigned char>(c) >= 0x80) violated("a message that is not ASCII: " + status.message());
    }
    return 0;
  }
  const data::BpeTokenizer& tokenizer = parsed.value();
  if (tokenizer.vocabulary() > data::kMaxTokenizerVocabulary) violated("accepted a vocabulary over the limit");
  fedmesh::Result<data::BpeTokenizer> again = data::BpeTokenizer::parse(tokenizer.to_json());
  if (!again.is_ok()) violated("to_json output does not parse: " + again.status().message());
  if (again.value().merges() != tokenizer.merges() || again.value().fingerprint() != tokenizer.fingerprint()) {
    violated("to_json output parses to another tokenizer");
  }
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  for (const int32_t t : tokens) {
    if (t < 0 || t >= tokenizer.vocabulary()) violated("encode made token " + std::to_string(t));
  }
  fedmesh::Result<std::string> decoded = tokenizer.decode(tokens);
  if (!decoded.is_ok() || decoded.value() != text) violated("decode(encode(input)) is not the input");
  return 0;
}
