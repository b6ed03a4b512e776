#include "base/file_io.h"

#include <fcntl.h>
#include <string.h>  // explicit_bzero
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <system_error>

namespace fedmesh {

namespace {

// Writes every byte (write may stop short) and fsyncs; `name` is the file
// the messages speak of.
Status write_all_and_fsync(int fd, std::string_view bytes, const std::string& name) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error(name + ": write failed: " + errno_text(errno));
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return io_error(name + ": fsync failed: " + errno_text(errno));
  return Status::ok();
}

// explicit_bzero, not memset: the compiler may drop a memset of a buffer
// that is about to be freed, leaving the secret in freed memory.
void wipe(std::string& text) { explicit_bzero(text.data(), text.size()); }

}  // namespace

std::string errno_text(int error) { return std::error_code(error, std::generic_category()).message(); }

Status fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error(dir.string() + ": cannot open directory: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) return io_error(dir.string() + ": fsync failed: " + errno_text(error));
  return Status::ok();
}

Status write_file_atomically(const std::filesystem::path& file, std::string_view bytes, mode_t mode) {
  const std::filesystem::path dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::string temp_name = ".";  // hidden, so a directory listing does not show it
  temp_name += file.filename().string();
  temp_name += ".tmp-XXXXXX";
  std::string temp = (dir / temp_name).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) return io_error(file.string() + ": cannot create a temporary file: " + errno_text(errno));
  Status status;
  // mkstemp creates 0600; the replaced file must end up exactly `mode`.
  if (::fchmod(fd, mode) != 0) status = io_error(temp + ": chmod failed: " + errno_text(errno));
  if (status.is_ok()) status = write_all_and_fsync(fd, bytes, temp);
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

Status create_file_exclusively(const std::filesystem::path& file, std::string_view bytes, mode_t mode) {
  const int fd = ::open(file.c_str(), O_CREAT | O_EXCL | O_NOFOLLOW | O_WRONLY | O_CLOEXEC, mode);
  if (fd < 0) {
    const int error = errno;
    if (error == EEXIST) {
      return invalid_argument(file.string() + " already exists; refusing to overwrite it (move it away or "
                                              "choose another name)");
    }
    return io_error(file.string() + ": cannot create: " + errno_text(error));
  }
  // The umask may have narrowed the mode; it must be exactly this.
  Status status = ::fchmod(fd, mode) == 0 ? Status::ok()
                                           : io_error(file.string() + ": chmod failed: " + errno_text(errno));
  if (status.is_ok()) status = write_all_and_fsync(fd, bytes, file.string());
  ::close(fd);
  if (!status.is_ok()) ::unlink(file.c_str());
  return status;
}

Result<std::string> read_file_bounded(const std::filesystem::path& file, size_t max_bytes,
                                      BoundedReadOptions options) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | (options.refuse_symlinks ? O_NOFOLLOW : 0));
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) return not_found(file.string() + ": no such file");
    if (options.refuse_symlinks && error == ELOOP) {
      return invalid_argument(file.string() + ": is a symbolic link; pass the file itself");
    }
    return io_error(file.string() + ": cannot open: " + errno_text(error));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return io_error(file.string() + ": cannot stat: " + errno_text(error));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return invalid_argument(file.string() + ": not a regular file");
  }
  if (options.secret && (info.st_mode & 077) != 0) {
    ::close(fd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    return invalid_argument(file.string() + ": secret file has mode " + mode +
                            ", readable by group or others; run `chmod 600 " + file.string() +
                            "` (and consider its contents exposed if others could read it)");
  }
  if (static_cast<uint64_t>(info.st_size) > max_bytes) {
    ::close(fd);
    return corrupt(file.string() + ": " + std::to_string(info.st_size) + " bytes, more than the limit of " +
                   std::to_string(max_bytes));
  }
  // One byte more than fstat reported, so a file that grew since is caught.
  std::string text(static_cast<size_t>(info.st_size) + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      if (options.secret) wipe(text);
      ::close(fd);
      return io_error(file.string() + ": read failed: " + errno_text(error));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got > static_cast<size_t>(info.st_size)) {
    if (options.secret) wipe(text);
    return io_error(file.string() + ": changed while being read; try again");
  }
  text.resize(got);  // shrinking never reallocates, so no unwiped copy is left behind
  return text;
}

}  // namespace fedmesh
