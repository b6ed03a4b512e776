#include "crypto/replay_guard.h"

#include <string>

#include "base/file_io.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

namespace {

constexpr std::string_view kReplayHeader = "fedmesh-replay-v1";
constexpr size_t kMaxSequenceDigits = 20;  // UINT64_MAX = 18446744073709551615
// Header line, then per sender a name, a space, a sequence and a newline.
constexpr size_t kMaxReplayFileBytes =
    kReplayHeader.size() + 1 + kMaxReplaySenders * (kMaxSiteNameBytes + 1 + kMaxSequenceDigits + 1);
constexpr mode_t kReplayFileMode = 0600;

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

}  // namespace

std::string replay_key(const SignPublicKey& sign_public) {
  return to_hex(std::span<const uint8_t>(sign_public.data(), sign_public.size()));
}

Result<ReplayGuard> ReplayGuard::open(std::filesystem::path file) {
  FEDMESH_CHECK(!file.empty(), "ReplayGuard::open needs a path; use in_memory() for none");
  Result<std::string> text = read_file_bounded(file, kMaxReplayFileBytes);
  // No table yet: nothing has been accepted, and the first commit creates it.
  const bool missing = !text.is_ok() && text.status().code() == StatusCode::kNotFound;
  if (!text.is_ok() && !missing) return text.status();
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

ReplayGuard ReplayGuard::persisted_by(std::map<std::string, uint64_t> counters, Persist persist) {
  ReplayGuard guard;
  for (auto& [sender, sequence] : counters) guard.last_.emplace(sender, sequence);
  guard.persist_ = std::move(persist);
  return guard;
}

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
  Status status = persist_ ? persist_(it->first, sequence) : persist();
  if (!status.is_ok()) {
    // Not durable, so not accepted: the caller must not acknowledge.
    if (added) last_.erase(it);
    else it->second = before;
  }
  return status;
}

void ReplayGuard::note_durable(std::string_view sender, uint64_t sequence) {
  auto it = last_.find(sender);
  if (it == last_.end()) {
    last_.emplace(std::string(sender), sequence);
  } else if (it->second < sequence) {
    it->second = sequence;
  }
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
  return write_file_atomically(file_, text, kReplayFileMode);
}

}  // namespace fedmesh::crypto
