#include "crypto/replay_guard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>

#include "crypto/keys.h"

namespace fedmesh::crypto {

namespace {

constexpr std::string_view kReplayHeader = "fedmesh-replay-v1";
constexpr size_t kMaxSequenceDigits = 20;  // UINT64_MAX = 18446744073709551615
// Header line, then per sender a name, a space, a sequence and a newline.
constexpr size_t kMaxReplayFileBytes =
    kReplayHeader.size() + 1 + kMaxReplaySenders * (kMaxSiteNameBytes + 1 + kMaxSequenceDigits + 1);
constexpr mode_t kReplayFileMode = 0600;

std::string errno_text(int error) { return std::error_code(error, std::generic_category()).message(); }

Result<uint64_t> parse_sequence(std::string_view text) {
  if (text.empty() || text.size() > kMaxSequenceDigits || (text.size() > 1 && text[0] == '0')) {
    return invalid_argument("bad sequence number");
  }
  uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return invalid_argument("sequence is not a decimal number");
    const auto digit = static_cast<uint64_t>(c - '0');
    if (value > (UINT64_MAX - digit) / 10) return invalid_argument("sequence overflows 64 bits");
    value = value * 10 + digit;
  }
  // Only sequences above 0 are ever committed, so a 0 was not written by us.
  if (value == 0) return invalid_argument("sequence 0 is never recorded");
  return value;
}

Status fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error(dir.string() + ": cannot open directory: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) return io_error(dir.string() + ": fsync failed: " + errno_text(error));
  return Status::ok();
}

// Temporary file in the same directory, fsync, rename, fsync the directory.
Status write_atomically(const std::filesystem::path& file, std::string_view bytes, mode_t mode) {
  const std::filesystem::path dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::string temp_name = ".";  // hidden, so a directory listing does not show it
  temp_name += file.filename().string();
  temp_name += ".tmp-XXXXXX";
  std::string temp = (dir / temp_name).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) return io_error(file.string() + ": cannot create a temporary file: " + errno_text(errno));
  Status status;
  if (::fchmod(fd, mode) != 0) status = io_error(temp + ": chmod failed: " + errno_text(errno));
  size_t done = 0;
  while (status.is_ok() && done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) status = io_error(temp + ": write failed: " + errno_text(errno));
    else done += static_cast<size_t>(n);
  }
  if (status.is_ok() && ::fsync(fd) != 0) status = io_error(temp + ": fsync failed: " + errno_text(errno));
  if (::close(fd) != 0 && status.is_ok()) status = io_error(temp + ": close failed: " + errno_text(errno));
  if (status.is_ok() && ::rename(temp.c_str(), file.c_str()) != 0) {
    status = io_error(file.string() + ": rename failed: " + errno_text(errno));
  }
  if (!status.is_ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  return fsync_directory(dir);
}

Result<std::string> read_file(const std::filesystem::path& file, bool& missing) {
  missing = false;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      missing = true;
      return std::string();
    }
    return io_error(file.string() + ": cannot open replay table: " + errno_text(error));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return invalid_argument(file.string() + ": replay table is not a regular file");
  }
  if (static_cast<uint64_t>(info.st_size) > kMaxReplayFileBytes) {
    ::close(fd);
    return corrupt(file.string() + ": replay table has " + std::to_string(info.st_size) +
                   " bytes, more than the limit of " + std::to_string(kMaxReplayFileBytes));
  }
  std::string text(static_cast<size_t>(info.st_size) + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return io_error(file.string() + ": read failed: " + errno_text(error));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got > static_cast<size_t>(info.st_size)) return io_error(file.string() + ": changed while being read");
  text.resize(got);
  return text;
}

}  // namespace

Result<ReplayGuard> ReplayGuard::open(std::filesystem::path file) {
  FEDMESH_CHECK(!file.empty(), "ReplayGuard::open needs a path; use in_memory() for none");
  bool missing = false;
  Result<std::string> text = read_file(file, missing);
  if (!text.is_ok()) return text.status();
  ReplayGuard guard;
  guard.file_ = std::move(file);
  if (missing) return guard;

  const std::string name = guard.file_.string();
  std::string_view rest = *text;
  size_t line_number = 0;
  std::string_view previous;
  // Every line, the header included, ends in '\n': the file is replaced
  // atomically, so a missing newline means it was damaged, not torn.
  auto bad = [&](const std::string& why) {
    return corrupt(name + ": line " + std::to_string(line_number) + ": " + why +
                   " (the replay table is damaged; it is not reset automatically, because that would reopen a "
                   "replay window: restore it from a backup, or remove it only if every sender has been re-keyed)");
  };
  while (!rest.empty()) {
    ++line_number;
    const size_t end = rest.find('\n');
    if (end == std::string_view::npos) return bad("no newline at the end");
    const std::string_view line = rest.substr(0, end);
    rest.remove_prefix(end + 1);
    if (line_number == 1) {
      if (line != kReplayHeader) return bad("expected the header '" + std::string(kReplayHeader) + "'");
      continue;
    }
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) return bad("expected '<sender> <sequence>'");
    const std::string_view sender = line.substr(0, space);
    if (Status s = check_site_name(sender); !s.is_ok()) return bad("sender " + s.message());
    if (line_number > 2 && sender <= previous) return bad("senders not in strictly increasing order");
    Result<uint64_t> sequence = parse_sequence(line.substr(space + 1));
    if (!sequence.is_ok()) return bad(sequence.status().message());
    if (guard.last_.size() >= kMaxReplaySenders) {
      return bad("more than " + std::to_string(kMaxReplaySenders) + " senders");
    }
    guard.last_.emplace(std::string(sender), *sequence);
    previous = sender;
  }
  if (line_number == 0) return corrupt(name + ": replay table is empty (expected at least its header line)");
  return guard;
}

ReplayGuard ReplayGuard::in_memory() { return ReplayGuard(); }

Status ReplayGuard::check(std::string_view sender, uint64_t sequence) const {
  const uint64_t last = last_accepted(sender);
  if (sequence > last) return Status::ok();
  return invalid_argument("replayed update from '" + std::string(sender) + "': sequence " + std::to_string(sequence) +
                          " is not above the last accepted " + std::to_string(last));
}

Status ReplayGuard::commit(std::string_view sender, uint64_t sequence) {
  // The name goes into a line-based file; only names a roster allows fit.
  if (Status s = check_site_name(sender); !s.is_ok()) return invalid_argument("replay guard: sender " + s.message());
  FEDMESH_RETURN_IF_ERROR(check(sender, sequence));
  auto it = last_.find(sender);
  const bool added = it == last_.end();
  if (added && last_.size() >= kMaxReplaySenders) {
    return unavailable("replay guard: table full (" + std::to_string(kMaxReplaySenders) + " senders)");
  }
  const uint64_t before = added ? 0 : it->second;
  if (added) it = last_.emplace(std::string(sender), sequence).first;
  it->second = sequence;
  Status status = persist();
  if (!status.is_ok()) {
    // Not durable, so not accepted: the caller must not acknowledge.
    if (added) last_.erase(it);
    else it->second = before;
  }
  return status;
}

uint64_t ReplayGuard::last_accepted(std::string_view sender) const {
  const auto it = last_.find(sender);
  return it == last_.end() ? 0 : it->second;
}

Status ReplayGuard::persist() const {
  if (file_.empty()) return Status::ok();
  std::string text(kReplayHeader);
  text += '\n';
  for (const auto& [sender, sequence] : last_) {
    text += sender;
    text += ' ';
    text += std::to_string(sequence);
    text += '\n';
  }
  return write_atomically(file_, text, kReplayFileMode);
}

}  // namespace fedmesh::crypto
