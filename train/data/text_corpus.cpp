#include "train/data/text_corpus.h"

#include "train/data/token_shards.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fedmesh::train::data {

namespace {

constexpr const char* kDefaultBibleProgram = "/usr/bin/bible";

// FEDMESH_BIBLE names another `bible` program (a GPU machine without Debian's
// packages runs one unpacked into a private prefix: deploy/gpu_kit.sh).
std::string bible_program() {
  const char* program = std::getenv(kBibleProgramVariable);
  return program != nullptr && *program != '\0' ? program : kDefaultBibleProgram;
}

// The program's path as one word for popen's shell.
std::string shell_quoted(const std::string& word) {
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// "Ge1:1 In the beginning ..." -> book "Ge", text "In the beginning ...".
// Book abbreviations may start with a digit ("1Sm"); the reference ends at
// the first space.
bool parse_verse(std::string_view line, std::string& book, std::string_view& text) {
  const size_t space = line.find(' ');
  if (space == std::string_view::npos || space == 0) return false;
  const std::string_view reference = line.substr(0, space);
  const size_t colon = reference.find(':');
  if (colon == std::string_view::npos) return false;
  size_t digits = colon;
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(reference[digits - 1]))) --digits;
  if (digits == 0 || digits == colon) return false;
  book.assign(reference.substr(0, digits));
  text = line.substr(space + 1);
  return true;
}

Result<TextCorpus> load_bible() {
  const std::string program = bible_program();
  if (!std::filesystem::exists(program)) {
    return not_found(program + " is missing: install Debian's King James Bible with `apt-get install bible-kjv` "
                               "(deploy/setup.sh does), or name another bible program in " +
                     kBibleProgramVariable);
  }
  FILE* pipe = ::popen((shell_quoted(program) + " -f Gen1:1-Rev22:21 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return io_error("cannot run " + program);
  TextCorpus corpus;
  std::string line, book;
  char buffer[1 << 16];
  int64_t bytes = 0, skipped = 0;
  const auto take = [&](std::string_view full) {
    std::string_view text;
    if (!parse_verse(full, book, text)) {
      ++skipped;
      return;
    }
    if (corpus.documents.empty() || corpus.documents.back().name != book) corpus.documents.push_back({book, {}});
    corpus.documents.back().text.append(text).push_back('\n');
  };
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) {
    bytes += static_cast<int64_t>(n);
    if (bytes > kMaxCorpusBytes) break;
    for (size_t i = 0; i < n; ++i) {
      if (buffer[i] == '\n') {
        take(line);
        line.clear();
      } else {
        line.push_back(buffer[i]);
      }
    }
  }
  if (!line.empty()) take(line);
  const int status = ::pclose(pipe);
  if (status != 0) return io_error(program + " failed (status " + std::to_string(status) + ")");
  if (corpus.documents.size() != static_cast<size_t>(kBibleBooks)) {
    return corrupt(program + " printed " + std::to_string(corpus.documents.size()) +
                   " books, not " + std::to_string(kBibleBooks) + " (" + std::to_string(skipped) +
                   " lines without a verse reference)");
  }
  return corpus;
}

Result<TextCorpus> load_directory(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return not_found("text source '" + dir + "' is neither \"bible-kjv\" nor a directory of text files");
  }
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  if (ec) return io_error("cannot list " + dir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  TextCorpus corpus;
  int64_t total = 0;
  for (const auto& path : files) {
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) return io_error("cannot read " + path.string() + ": " + ec.message());
    total += static_cast<int64_t>(size);
    if (total > kMaxCorpusBytes) {
      return invalid_argument(dir + " holds more than " + std::to_string(kMaxCorpusBytes >> 30) + " GiB of text");
    }
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in && !in.eof()) return io_error("cannot read " + path.string());
    if (text.str().empty()) continue;
    corpus.documents.push_back({path.filename().string(), text.str()});
  }
  if (corpus.documents.empty()) return invalid_argument(dir + " holds no non-empty file to train on");
  return corpus;
}

}  // namespace

int64_t TextCorpus::bytes() const {
  int64_t total = 0;
  for (const TextDocument& d : documents) total += static_cast<int64_t>(d.text.size());
  return total;
}

Result<TextCorpus> load_text_corpus(const std::string& source) {
  if (source == kBibleCorpus) return load_bible();
  // One testament: a model pretrained on one and fine-tuned on the other.
  if (source == kOldTestament || source == kNewTestament) {
    Result<TextCorpus> bible = load_bible();
    if (!bible.is_ok()) return bible;
    if (bible->documents.size() != static_cast<size_t>(kBibleBooks)) {
      return corrupt(bible_program() + " gave " + std::to_string(bible->documents.size()) + " books, not " +
                     std::to_string(kBibleBooks) + ": cannot tell the testaments apart");
    }
    auto& books = bible->documents;
    if (source == kOldTestament) books.resize(kOldTestamentBooks);
    else books.erase(books.begin(), books.begin() + kOldTestamentBooks);
    return bible;
  }
  if (source.rfind("jsonl:", 0) == 0) {
    const std::string path = source.substr(6);
    Result<std::vector<std::string>> documents = read_jsonl_documents(path, "text");
    if (!documents.is_ok()) return documents.status();
    TextCorpus corpus;
    for (size_t i = 0; i < documents->size(); ++i) {
      corpus.documents.push_back({path + ":" + std::to_string(i + 1), std::move((*documents)[i])});
    }
    return corpus;
  }
  return load_directory(source);
}

std::vector<int32_t> byte_tokens(std::string_view text) {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

Result<std::string> byte_text(std::span<const int32_t> tokens) {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kByteVocabulary) {
      return invalid_argument("token " + std::to_string(tokens[i]) + " is not a byte (the byte tokenizer has 256)");
    }
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

TextSplit split_documents(const TextCorpus& corpus, std::span<const size_t> documents, double holdout) {
  TextSplit split;
  for (const size_t d : documents) {
    const std::string& text = corpus.documents[d].text;
    const size_t cut = static_cast<size_t>(std::llround(static_cast<double>(text.size()) * (1.0 - holdout)));
    const std::vector<int32_t> tokens = byte_tokens(text);
    split.train.insert(split.train.end(), tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(cut));
    split.validation.insert(split.validation.end(), tokens.begin() + static_cast<std::ptrdiff_t>(cut), tokens.end());
  }
  return split;
}

Status check_text_partition(std::string_view partition) {
  if (partition == "iid" || partition == "books" || partition == "contiguous" || partition == "testament") {
    return Status::ok();
  }
  return invalid_argument("unknown text partition '" + std::string(partition) +
                          "' (expected iid, books, contiguous or testament)");
}

Result<TextCorpus> site_corpus(const TextCorpus& corpus, std::string_view partition, int sites, int index) {
  TextCorpus parts;
  if (partition != "iid") {
    Result<std::vector<size_t>> mine = documents_for_site(corpus, partition, sites, index);
    if (!mine.is_ok()) return mine.status();
    for (const size_t d : *mine) parts.documents.push_back(corpus.documents[d]);
    return parts;
  }
  FEDMESH_RETURN_IF_ERROR(check_text_partition(partition));
  if (sites < 1 || index < 0 || index >= sites) return invalid_argument("site " + std::to_string(index) + " of " + std::to_string(sites));
  // The site's part of every document.
  for (const TextDocument& d : corpus.documents) {
    const size_t n = d.text.size(), begin = n * static_cast<size_t>(index) / static_cast<size_t>(sites),
                 end = n * static_cast<size_t>(index + 1) / static_cast<size_t>(sites);
    parts.documents.push_back({d.name, d.text.substr(begin, end - begin)});
  }
  return parts;
}

Result<std::vector<size_t>> documents_for_site(const TextCorpus& corpus, std::string_view partition, int sites,
                                               int index) {
  const size_t count = corpus.documents.size();
  if (sites < 1 || index < 0 || index >= sites) return invalid_argument("site " + std::to_string(index) + " of " + std::to_string(sites));
  FEDMESH_RETURN_IF_ERROR(check_text_partition(partition));
  if (partition == "iid") return invalid_argument("partition \"iid\" gives every site part of every document (site_text)");
  if (partition == "testament" && (count != static_cast<size_t>(kBibleBooks) || sites != 2)) {
    return invalid_argument("partition \"testament\" splits the Bible's 66 books between exactly 2 sites");
  }
  if (static_cast<size_t>(sites) > count) {
    return invalid_argument(std::to_string(sites) + " sites but only " + std::to_string(count) + " documents to share");
  }
  std::vector<size_t> mine;
  if (partition == "testament") {
    const size_t begin = index == 0 ? 0 : kOldTestamentBooks, end = index == 0 ? kOldTestamentBooks : count;
    for (size_t d = begin; d < end; ++d) mine.push_back(d);
  } else if (partition == "books") {
    for (size_t d = static_cast<size_t>(index); d < count; d += static_cast<size_t>(sites)) mine.push_back(d);
  } else {
    const size_t begin = count * static_cast<size_t>(index) / static_cast<size_t>(sites);
    const size_t end = count * static_cast<size_t>(index + 1) / static_cast<size_t>(sites);
    for (size_t d = begin; d < end; ++d) mine.push_back(d);
  }
  return mine;
}

TextWindows::TextWindows(std::vector<int32_t> tokens, int64_t context, int64_t stride)
    : tokens_(std::move(tokens)), context_(context), stride_(stride) {
  FEDMESH_CHECK(context >= 1 && stride >= 1, "text windows need context and stride >= 1");
}

int64_t TextWindows::size() const {
  const int64_t n = static_cast<int64_t>(tokens_.size());
  return n > context_ ? (n - context_ - 1) / stride_ + 1 : 0;
}

void TextWindows::make_batch(std::span<const int64_t> indices, DType, Tensor& inputs,
                             std::vector<int32_t>& targets) const {
  const int64_t batch = static_cast<int64_t>(indices.size());
  Tensor::reuse(inputs, {batch, context_}, DType::kF32);
  targets.resize(static_cast<size_t>(batch * context_));
  float* ids = inputs.data<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t index = indices[static_cast<size_t>(b)];
    FEDMESH_CHECK(index >= 0 && index < size(), "text window index out of range");
    const int32_t* window = tokens_.data() + index * stride_;
    for (int64_t t = 0; t < context_; ++t) {
      ids[b * context_ + t] = static_cast<float>(window[t]);
      targets[static_cast<size_t>(b * context_ + t)] = window[t + 1];
    }
  }
}

std::string text_source(const std::string& source) { return source == "fashion-mnist" ? kBibleCorpus : source; }

Result<TextWindows> held_out_token_windows(std::vector<int32_t> held_out, int64_t context, int64_t limit) {
  if (limit > 0) held_out.resize(std::min(held_out.size(), static_cast<size_t>(limit * context + 1)));
  TextWindows windows(std::move(held_out), context, context);
  if (windows.size() == 0) return invalid_argument("the held-out text is shorter than one window of " + std::to_string(context));
  return windows;
}

double unigram_cross_entropy(std::span<const int32_t> train, std::span<const int32_t> evaluated, int vocabulary) {
  std::vector<double> counts(static_cast<size_t>(vocabulary), 1.0);  // add-one
  for (const int32_t t : train) counts[static_cast<size_t>(t)] += 1.0;
  const double total = static_cast<double>(train.size()) + vocabulary;
  double loss = 0.0;
  for (const int32_t t : evaluated) loss -= std::log(counts[static_cast<size_t>(t)] / total);
  return evaluated.empty() ? 0.0 : loss / static_cast<double>(evaluated.size());
}

}  // namespace fedmesh::train::data
