// A scratch file for values too large to hold in memory while they arrive
// (an upload of a large model, staged chunk by chunk until it is whole and
// verified). It has no name: created with O_TMPFILE (or created and removed
// at once where the file system lacks it), so nothing is left behind when
// the process dies, and the space is freed when the last owner closes it.
// What was written lately lives in the kernel's page cache, which gives it
// back under pressure; the process itself holds none of it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "base/status.h"

namespace fedmesh {

class SpillFile {
 public:
  // A file of `bytes` zero bytes in `dir` (sparse: no block is written yet).
  // kIoError naming the directory when it cannot be made.
  static Result<std::unique_ptr<SpillFile>> create(const std::filesystem::path& dir, uint64_t bytes);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  uint64_t size() const { return size_; }
  // Writes `bytes` at `offset` (kInvalidArgument past the end; kIoError, with
  // the system's reason, when the disk refuses, e.g. it is full).
  Status write(uint64_t offset, std::span<const uint8_t> bytes);
  // Reads out.size() bytes from `offset` (kInvalidArgument past the end).
  Status read(uint64_t offset, std::span<uint8_t> out) const;

 private:
  SpillFile(int fd, uint64_t size, std::filesystem::path dir) : fd_(fd), size_(size), dir_(std::move(dir)) {}
  int fd_ = -1;
  uint64_t size_ = 0;
  std::filesystem::path dir_;  // for messages
};

}  // namespace fedmesh
