// GPT-2's tokenizer as its weights were trained with it: its vocab.json and
// merges.txt (Hugging Face's files for gpt2, or OpenAI's encoder.json and
// vocab.bpe, the same data) imported into a BpeTokenizer
// (`fedmesh tokenizer import`), and the pretokenizer it needs.
//
// The "gpt2" pretokenizer is GPT-2's regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// over the text's code points (UTF-8; a byte that is not valid UTF-8 counts
// as one character that is neither letter, number nor space), with Unicode's
// letters, numbers and white space (unicode_classes.h). Its quirks are
// kept: a run of white space before a word gives its last character to the
// word when that is a space and stands alone otherwise ("\n\nWord" is "\n",
// "\n", "Word"), and contractions are lowercase only.
//
// The files: merges.txt is an optional "#version" line, then one merge per
// line, two tokens separated by one space; vocab.json maps every token to
// its id. Tokens are written in GPT-2's byte alphabet (bytes_to_unicode:
// the printable bytes ! .. ~, ¡ .. ¬, ® .. ÿ as themselves, the other 68
// bytes as U+0100 onwards, so ' ' is 'Ġ'). The import requires what GPT-2's
// files have: the 256 byte tokens at ids 0..255 (in any order), merge i's
// token at id 256 + i, and any other entries (<|endoftext|>) after them, as
// special tokens. Both files are untrusted input: sizes are bounded and a
// flaw is refused naming the file, the line or the token.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/data/bpe_tokenizer.h"

namespace fedmesh::train::data {

// The pieces of `text` under the "gpt2" pretokenizer, in order; they
// partition it. A piece longer than max_piece_bytes is cut as pretokenize()
// cuts one.
std::vector<std::string_view> pretokenize_gpt2(std::string_view text, int max_piece_bytes);

// GPT-2's byte alphabet: the character (a code point) standing for each byte.
char32_t gpt2_byte_char(unsigned char byte);

Result<BpeTokenizer> import_gpt2_tokenizer(std::string_view vocab_json, std::string_view merges_txt);
Result<BpeTokenizer> import_gpt2_tokenizer_files(const std::string& vocab_path, const std::string& merges_path);

}  // namespace fedmesh::train::data
