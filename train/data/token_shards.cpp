#include "train/data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>

#include "base/file_io.h"

namespace fedmesh::train::data {

// The file is little-endian and read in place through the mapping.
static_assert(std::endian::native == std::endian::little, "token shards are read in place: little-endian hosts only");

namespace {

std::string format_header_expected() {
  return "a token shard starts with a header of 256 little-endian int32: magic " + std::to_string(kTokenShardMagic) +
         ", version (1: uint16 tokens, 2: uint32 tokens), token count (llm.c / nanoGPT .bin)";
}

// Reads exactly `size` bytes at `offset`; fewer bytes (the file ended) is
// reported through `got`.
Status read_at(int fd, const std::string& path, void* out, size_t size, off_t offset, size_t& got) {
  got = 0;
  auto* bytes = static_cast<char*>(out);
  while (got < size) {
    const ssize_t n = ::pread(fd, bytes + got, size - got, offset + static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(path + ": read failed: " + errno_text(errno));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  return Status::ok();
}

template <class Id>
int64_t read_token(const void* tokens, int64_t i) {
  Id id;
  std::memcpy(&id, static_cast<const char*>(tokens) + i * static_cast<int64_t>(sizeof(Id)), sizeof(Id));
  return static_cast<int64_t>(id);
}

}  // namespace

// --- TokenShard ---

TokenShard::TokenShard(TokenShard&& other) noexcept { *this = std::move(other); }

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    version_ = std::exchange(other.version_, 0);
    count_ = std::exchange(other.count_, 0);
    checked_vocabulary_ = std::exchange(other.checked_vocabulary_, 0);
  }
  return *this;
}

TokenShard::~TokenShard() { release(); }

void TokenShard::release() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);
  map_ = nullptr;
  fd_ = -1;
}

int64_t TokenShard::token(int64_t i) const {
  FEDMESH_CHECK(i >= 0 && i < count_, "token index out of range of the shard");
  const char* tokens = static_cast<const char*>(map_) + kTokenShardHeaderBytes;
  return version_ == 1 ? read_token<uint16_t>(tokens, i) : read_token<uint32_t>(tokens, i);
}

Status TokenShard::check_vocabulary(int64_t vocabulary) {
  if (vocabulary < 1 || vocabulary > kMaxTokenVocabulary) {
    return invalid_argument(path_ + ": vocabulary " + std::to_string(vocabulary) + " is outside [1, " +
                            std::to_string(kMaxTokenVocabulary) + "]");
  }
  const int64_t width = width_bytes();
  const int64_t chunk_tokens = kTokenCheckChunkBytes / width;
  std::vector<char> buffer(static_cast<size_t>(chunk_tokens * width));
  // What the pass read is dropped from the page cache behind it, in whole
  // aligned blocks: the cache holds the file in folios of up to 2 MiB, and
  // a folio only partly inside a dropped range stays.
  constexpr off_t kDropBlock = off_t{4} << 20;
  off_t dropped = 0;
  for (int64_t first = 0; first < count_; first += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, count_ - first);
    size_t got = 0;
    FEDMESH_RETURN_IF_ERROR(read_at(fd_, path_, buffer.data(), static_cast<size_t>(n * width),
                                    static_cast<off_t>(kTokenShardHeaderBytes + first * width), got));
    if (got != static_cast<size_t>(n * width)) {
      return io_error(path_ + ": ended at byte " +
                      std::to_string(kTokenShardHeaderBytes + first * width + static_cast<int64_t>(got)) +
                      " while its ids were checked; it was " + std::to_string(map_bytes_) +
                      " bytes when opened (changed since?)");
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = width == 2 ? read_token<uint16_t>(buffer.data(), i) : read_token<uint32_t>(buffer.data(), i);
      if (id >= vocabulary) {
        return corrupt(path_ + ": token " + std::to_string(first + i) + " (0-based) is id " + std::to_string(id) +
                       ", not below the vocabulary of " + std::to_string(vocabulary));
      }
    }
    // The pass leaves nothing behind in the page cache: pages cached in
    // large folios would later be mapped whole by the windows' faults, and
    // a run would hold the file rather than the windows it reads.
    const off_t done = static_cast<off_t>(kTokenShardHeaderBytes + (first + n) * width);
    const off_t behind = (done - kDropBlock) / kDropBlock * kDropBlock;
    if (behind > dropped) {
      (void)::posix_fadvise(fd_, dropped, behind - dropped, POSIX_FADV_DONTNEED);
      dropped = behind;
    }
  }
  (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);  // the rest, read-ahead included
  checked_vocabulary_ = checked_vocabulary_ == 0 ? vocabulary : std::min(checked_vocabulary_, vocabulary);
  return Status::ok();
}

Result<TokenShard> open_token_shard(const std::string& path) {
  TokenShard shard;
  shard.path_ = path;
  shard.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (shard.fd_ < 0) {
    const int error = errno;
    if (error == ENOENT) return not_found(path + ": no such file");
    return io_error(path + ": cannot open: " + errno_text(error));
  }
  struct stat info {};
  if (::fstat(shard.fd_, &info) != 0) return io_error(path + ": cannot stat: " + errno_text(errno));
  if (!S_ISREG(info.st_mode)) return invalid_argument(path + ": not a regular file");
  const int64_t file_bytes = info.st_size;

  int32_t header[kTokenShardHeaderInts] = {};
  size_t got = 0;
  FEDMESH_RETURN_IF_ERROR(read_at(shard.fd_, path, header, sizeof header, 0, got));
  if (got < sizeof(int32_t) || header[0] != kTokenShardMagic) {
    const std::string found =
        got < sizeof(int32_t) ? "a file of " + std::to_string(got) + " bytes" : "int32 " + std::to_string(header[0]);
    return corrupt(path + ": not a token shard: found " + found + " where the magic " +
                   std::to_string(kTokenShardMagic) + " should be; " + format_header_expected());
  }
  if (got < sizeof header) {
    return corrupt(path + ": truncated: " + std::to_string(file_bytes) + " bytes, shorter than the " +
                   std::to_string(kTokenShardHeaderBytes) + "-byte header");
  }
  const int32_t version = header[1];
  if (version != 1 && version != 2) {
    return corrupt(path + ": version " + std::to_string(version) +
                   " is not supported (1: uint16 tokens, 2: uint32 tokens)");
  }
  const int64_t count = header[2];
  if (count < 2) {
    return corrupt(path + ": the header says " + std::to_string(count) +
                   " tokens; a window needs at least 2 (an input and its target)");
  }
  const int64_t width = version == 1 ? 2 : 4;
  const int64_t expected = kTokenShardHeaderBytes + count * width;
  if (file_bytes != expected) {
    return corrupt(path + ": " + std::to_string(file_bytes) + " bytes, but its header says " + std::to_string(count) +
                   (version == 1 ? " uint16" : " uint32") + " tokens: " + std::to_string(kTokenShardHeaderBytes) +
                   " + " + std::to_string(count) + " x " + std::to_string(width) + " = " + std::to_string(expected) +
                   " bytes" + (file_bytes < expected ? " (truncated?)" : ""));
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_PRIVATE, shard.fd_, 0);
  if (map == MAP_FAILED) return io_error(path + ": cannot map: " + errno_text(errno));
  shard.map_ = map;
  shard.map_bytes_ = static_cast<size_t>(file_bytes);
  shard.version_ = version;
  shard.count_ = count;
  // The sequential reader is check_vocabulary, through the descriptor: it
  // gets the sequential advice. The trainer reads windows in shuffled
  // order: random advice makes a fault read (and map) the window's pages
  // rather than a read-around of up to read_ahead_kb. Measured on a 1 GiB
  // shard not in the page cache, 800 windows of 1024 tokens spread over it:
  // resident set +4.8 MB with MADV_RANDOM, +49 MB with MADV_SEQUENTIAL,
  // +53 MB with none (Linux 6.18, ext4). Advice is only a hint: failure is
  // harmless.
  (void)::posix_fadvise(shard.fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  (void)::madvise(map, static_cast<size_t>(file_bytes), MADV_RANDOM);
  return shard;
}

// --- TokenWindows ---

TokenWindows::TokenWindows(std::shared_ptr<const TokenShard> shard, int64_t begin, int64_t end, int64_t context,
                           int64_t vocabulary)
    : shard_(std::move(shard)), begin_(begin), end_(end), context_(context), vocabulary_(vocabulary) {
  FEDMESH_CHECK(shard_ != nullptr, "token windows need a shard");
  FEDMESH_CHECK(context >= 1, "token windows need a context >= 1");
  FEDMESH_CHECK(begin >= 0 && begin <= end && end <= shard_->size(), "token window range outside the shard");
  FEDMESH_CHECK(shard_->checked_vocabulary() > 0 && shard_->checked_vocabulary() <= vocabulary,
                shard_->path() + ": token windows over ids not checked against the vocabulary " +
                    std::to_string(vocabulary) + " (call check_vocabulary first)");
}

int64_t TokenWindows::size() const {
  const int64_t n = end_ - begin_;
  return n > context_ ? (n - context_ - 1) / context_ + 1 : 0;
}

void TokenWindows::make_batch(std::span<const int64_t> indices, DType, Tensor& inputs,
                              std::vector<int32_t>& targets) const {
  const int64_t batch = static_cast<int64_t>(indices.size());
  Tensor::reuse(inputs, {batch, context_}, DType::kF32);
  targets.resize(static_cast<size_t>(batch * context_));
  float* ids = inputs.data<float>();
  const int64_t windows = size();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t index = indices[static_cast<size_t>(b)];
    FEDMESH_CHECK(index >= 0 && index < windows, "token window index out of range");
    const int64_t first = begin_ + index * context_;
    int64_t id = shard_->token(first);
    for (int64_t t = 0; t < context_; ++t) {
      const int64_t next = shard_->token(first + t + 1);
      FEDMESH_CHECK(id < vocabulary_ && next < vocabulary_,
                    shard_->path() + ": an id at token " + std::to_string(first + t) + " is not below the vocabulary " +
                        std::to_string(vocabulary_) +
                        ", though the file passed its check: it changed under the mapping");
      ids[b * context_ + t] = static_cast<float>(id);
      targets[static_cast<size_t>(b * context_ + t)] = static_cast<int32_t>(next);
      id = next;
    }
  }
}

// --- load_token_data ---

namespace {

Result<std::shared_ptr<TokenShard>> open_checked(const std::string& path, int64_t vocabulary) {
  Result<TokenShard> shard = open_token_shard(path);
  if (!shard.is_ok()) return shard.status();
  auto shared = std::make_shared<TokenShard>(std::move(shard).value());
  FEDMESH_RETURN_IF_ERROR(shared->check_vocabulary(vocabulary));
  return shared;
}

// [begin, end) cut to the first `limit` windows (0: all).
int64_t limited_end(int64_t begin, int64_t end, int64_t context, int64_t limit) {
  return limit > 0 ? std::min(end, begin + limit * context + 1) : end;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string shard_text(const TokenShard& shard) {
  return with_commas(shard.size()) + (shard.version() == 1 ? " uint16" : " uint32") + " tokens of " + shard.path();
}

}  // namespace

Result<LoadedTokens> load_token_data(const TokenSpec& spec) {
  const std::string& path = spec.path;
  if (spec.context < 1) return invalid_argument(path + ": context " + std::to_string(spec.context) + " is below 1");
  if (spec.train_limit < 0 || spec.test_limit < 0) return invalid_argument(path + ": a limit is negative");
  if (spec.test_path.empty() && !(spec.test_fraction > 0.0 && spec.test_fraction < 1.0)) {
    return invalid_argument(path + ": test_fraction " + std::to_string(spec.test_fraction) + " is outside (0, 1)");
  }
  Result<std::shared_ptr<TokenShard>> train_shard = open_checked(path, spec.vocabulary);
  if (!train_shard.is_ok()) return train_shard.status();
  const std::shared_ptr<const TokenShard> train = *train_shard;
  std::shared_ptr<const TokenShard> test = train;
  int64_t train_end = train->size(), test_begin = 0;
  if (!spec.test_path.empty()) {
    Result<std::shared_ptr<TokenShard>> test_shard = open_checked(spec.test_path, spec.vocabulary);
    if (!test_shard.is_ok()) return test_shard.status();
    test = *test_shard;
  } else {
    const int64_t n = train->size();
    const int64_t held_out =
        std::min<int64_t>(n, static_cast<int64_t>(std::ceil(static_cast<double>(n) * spec.test_fraction)));
    train_end = n - held_out;
    test_begin = train_end;
  }
  const int64_t window = spec.context + 1;
  const std::string& test_name = spec.test_path.empty() ? path : spec.test_path;
  if (train_end < window) {
    return invalid_argument(path + ": " + std::to_string(train_end) + " training tokens" +
                            (spec.test_path.empty() ? " (after holding out the tail)" : "") +
                            ", fewer than one window of " + std::to_string(spec.context) + " + 1");
  }
  if (test->size() - test_begin < window) {
    return invalid_argument(test_name + ": " + std::to_string(test->size() - test_begin) + " held-out tokens" +
                            (spec.test_path.empty() ? " (the last " + std::to_string(spec.test_fraction) + ")" : "") +
                            ", fewer than one window of " + std::to_string(spec.context) + " + 1");
  }
  LoadedTokens loaded{
      TokenWindows(train, 0, limited_end(0, train_end, spec.context, spec.train_limit), spec.context, spec.vocabulary),
      TokenWindows(test, test_begin, limited_end(test_begin, test->size(), spec.context, spec.test_limit), spec.context,
                   spec.vocabulary),
      ""};
  loaded.description =
      shard_text(*train) + ": " + with_commas(loaded.train.size()) + " training windows of " +
      std::to_string(spec.context) + ", " + with_commas(loaded.test.size()) + " held out (" +
      (spec.test_path.empty() ? "its last " + with_commas(train->size() - test_begin) + " tokens" : shard_text(*test)) +
      ")";
  return loaded;
}

// --- jsonl:FILE ---

namespace {

// Keeps the one field of a line's top-level object and nothing else; stops
// at the first thing that makes the line unusable.
class DocumentSax {
 public:
  using json = nlohmann::json;
  explicit DocumentSax(const std::string& field) : field_(field) {}

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(json::number_integer_t) { return scalar("a number"); }
  bool number_unsigned(json::number_unsigned_t) { return scalar("a number"); }
  bool number_float(json::number_float_t, const json::string_t&) { return scalar("a number"); }
  bool binary(json::binary_t&) { return scalar("binary"); }
  bool string(json::string_t& value) {
    if (depth_ == 1 && at_field_) {
      text_ = std::move(value);
      found_ = "a string";
    }
    return scalar("a string");
  }
  bool start_object(std::size_t) { return open("an object"); }
  bool start_array(std::size_t) { return open("an array"); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& name) {
    at_field_ = depth_ == 1 && name == field_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception&) {
    if (error_.empty()) error_ = "not JSON (parsing failed at byte " + std::to_string(position) + " of the line)";
    return false;
  }

  const std::string& error() const { return error_; }
  const std::string& found() const { return found_; }  // the field's type; empty: no such field
  std::string& text() { return text_; }

 private:
  bool scalar(const char* kind) {
    if (depth_ == 0) return refuse(std::string("not an object but ") + kind);
    if (depth_ == 1 && at_field_) {
      found_ = kind;
      if (found_ != "a string") text_.clear();
    }
    at_field_ = false;
    return true;
  }
  bool open(const char* kind) {
    if (depth_ == 0 && std::string(kind) != "an object") return refuse(std::string("not an object but ") + kind);
    if (depth_ == 1 && at_field_) {
      found_ = kind;
      text_.clear();
    }
    at_field_ = false;
    if (++depth_ > kMaxJsonlDepth) return refuse("nested deeper than " + std::to_string(kMaxJsonlDepth) + " levels");
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }
  bool refuse(std::string why) {
    error_ = std::move(why);
    return false;
  }

  const std::string& field_;
  int depth_ = 0;
  bool at_field_ = false;
  std::string found_, text_, error_;
};

}  // namespace

Result<std::vector<std::string>> parse_jsonl_documents(std::string_view text, const std::string& path,
                                                       const std::string& field) {
  if (field.empty()) return invalid_argument(path + ": the JSON field to read is empty");
  if (text.size() > kMaxJsonlBytes) {
    return corrupt(path + ": " + std::to_string(text.size()) + " bytes, more than the limit of " +
                   std::to_string(kMaxJsonlBytes));
  }
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  std::vector<std::string> documents;
  int64_t line_number = 0;
  while (!text.empty()) {
    ++line_number;
    const size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = path + ": line " + std::to_string(line_number) + ": ";
    DocumentSax sax(field);
    bool parsed = false;
    try {
      parsed = nlohmann::json::sax_parse(line.begin(), line.end(), &sax);
    } catch (const std::exception&) {  // the SAX handler never throws; the parser should not either
      return corrupt(where + "not JSON");
    }
    if (!parsed) return corrupt(where + (sax.error().empty() ? std::string("not JSON") : sax.error()));
    if (sax.found().empty()) return corrupt(where + "no field \"" + field + "\"");
    if (sax.found() != "a string")
      return corrupt(where + "field \"" + field + "\" is " + sax.found() + ", not a string");
    documents.push_back(std::move(sax.text()));
  }
  if (documents.empty()) return corrupt(path + ": holds no document (one JSON object per line)");
  return documents;
}

Result<std::vector<std::string>> read_jsonl_documents(const std::string& path, const std::string& field) {
  Result<std::string> text = read_file_bounded(path, kMaxJsonlBytes);
  if (!text.is_ok()) return text.status();
  return parse_jsonl_documents(*text, path, field);
}

}  // namespace fedmesh::train::data
