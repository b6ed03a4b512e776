// A payload's bytes handed to the store front to back, a row at a time,
// without joining them first: the pieces of one that lies in memory (a
// header and a model's tensors where they are), or a prefix and a scratch
// file read a buffer at a time (an upload staged on disk, never in memory).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/spill_file.h"
#include "base/status.h"

namespace fedmesh::store {

class PayloadSource {
 public:
  virtual ~PayloadSource() = default;
  virtual uint64_t size() const = 0;
  // The next `bytes` bytes (at most what is left) as parts laid end to end,
  // valid until the next call.
  virtual Status next(size_t bytes, std::vector<std::span<const uint8_t>>& parts) = 0;
  // Back to the first byte.
  virtual void rewind() = 0;
};

// Pieces in memory, which must outlive the source.
class PiecesSource final : public PayloadSource {
 public:
  explicit PiecesSource(std::span<const std::span<const uint8_t>> pieces);
  uint64_t size() const override { return size_; }
  Status next(size_t bytes, std::vector<std::span<const uint8_t>>& parts) override;
  void rewind() override { piece_ = within_ = 0; }

 private:
  std::span<const std::span<const uint8_t>> pieces_;
  uint64_t size_ = 0;
  size_t piece_ = 0, within_ = 0;  // where the next byte is
};

// `prefix` (copied), then all of `file` (which must outlive the source),
// read into one buffer of the largest part asked for.
class SpillSource final : public PayloadSource {
 public:
  SpillSource(std::span<const uint8_t> prefix, const SpillFile& file);
  uint64_t size() const override { return prefix_.size() + file_.size(); }
  Status next(size_t bytes, std::vector<std::span<const uint8_t>>& parts) override;
  void rewind() override { at_ = 0; }

 private:
  std::vector<uint8_t> prefix_;
  const SpillFile& file_;
  std::vector<uint8_t> buffer_;
  uint64_t at_ = 0;
};

}  // namespace fedmesh::store
