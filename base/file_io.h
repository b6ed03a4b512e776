// Small POSIX file helpers for the files fedmesh keeps on disk (keys, the
// roster, the replay table): durable writes that a crash cannot tear, and
// reads with a size bound so a hostile or mistaken path (a huge file,
// /dev/zero) is refused before it is read into memory. Every failure is a
// Status whose message names the file.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

#include "base/status.h"

namespace fedmesh {

// strerror-style text for an errno value, without strerror's shared buffer.
std::string errno_text(int error);

// fsync on the directory itself, so a create or rename in it survives a crash.
Status fsync_directory(const std::filesystem::path& dir);

// Replaces `file` with `bytes` (mode exactly `mode`, whatever the umask): a
// hidden temporary in the same directory (rename is atomic only within one
// file system), fsync, rename over `file`, fsync the directory. A reader sees
// the old contents or the new, never a torn file; on failure the temporary is
// removed and `file` is left as it was.
Status write_file_atomically(const std::filesystem::path& file, std::string_view bytes, mode_t mode);

// Creates `file` (mode exactly `mode`) and writes and fsyncs `bytes`; never
// replaces an existing file or follows a link at that name (kInvalidArgument).
// A file only partly written is removed. The caller fsyncs the directory
// (after creating all the files that belong together).
Status create_file_exclusively(const std::filesystem::path& file, std::string_view bytes, mode_t mode);

struct BoundedReadOptions {
  // Open with O_NOFOLLOW: a link at that name is refused (kInvalidArgument),
  // so a secret is read only from the file named, never through a planted link.
  bool refuse_symlinks = false;
  // The contents are secret: refuse a file that group or others may access
  // (kInvalidArgument, before a byte is read), and wipe the buffer when the
  // read fails. On success the caller owns, and wipes, the returned text.
  bool secret = false;
};

// Reads a whole regular file of at most max_bytes. A missing file is
// kNotFound, a larger one kCorrupt, one that grew while being read kIoError.
Result<std::string> read_file_bounded(const std::filesystem::path& file, size_t max_bytes,
                                      BoundedReadOptions options = {});

}  // namespace fedmesh
