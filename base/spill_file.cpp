#include "base/spill_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "base/file_io.h"

namespace fedmesh {

namespace {

// O_TMPFILE where the file system has it; else a name made and removed at
// once (the file lives on while it is open).
int open_unnamed(const std::filesystem::path& dir, int& error) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
    error = errno;
    return -1;
  }
  std::string name = (dir / ".fedmesh-spill-XXXXXX").string();
  fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    error = errno;
    return -1;
  }
  ::unlink(name.c_str());
  return fd;
}

}  // namespace

Result<std::unique_ptr<SpillFile>> SpillFile::create(const std::filesystem::path& dir, uint64_t bytes) {
  int error = 0;
  const int fd = open_unnamed(dir, error);
  if (fd < 0) return io_error(dir.string() + ": cannot create a scratch file: " + errno_text(error));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    error = errno;
    ::close(fd);
    return io_error(dir.string() + ": cannot size a scratch file to " + std::to_string(bytes) +
                    " bytes: " + errno_text(error));
  }
  return std::unique_ptr<SpillFile>(new SpillFile(fd, bytes, dir));
}

SpillFile::~SpillFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SpillFile::write(uint64_t offset, std::span<const uint8_t> bytes) {
  if (offset > size_ || bytes.size() > size_ - offset) {
    return invalid_argument("a scratch write of " + std::to_string(bytes.size()) + " bytes at " +
                            std::to_string(offset) + " passes the file's end (" + std::to_string(size_) + ")");
  }
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return io_error(dir_.string() + ": writing a scratch file failed: " + errno_text(n < 0 ? errno : ENOSPC));
    }
    bytes = bytes.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

Status SpillFile::read(uint64_t offset, std::span<uint8_t> out) const {
  if (offset > size_ || out.size() > size_ - offset) {
    return invalid_argument("a scratch read of " + std::to_string(out.size()) + " bytes at " +
                            std::to_string(offset) + " passes the file's end (" + std::to_string(size_) + ")");
  }
  while (!out.empty()) {
    const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return io_error(dir_.string() + ": reading a scratch file failed: " +
                      (n < 0 ? errno_text(errno) : std::string("it ended early")));
    }
    out = out.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

}  // namespace fedmesh
