#include "aggregator/pending_values.h"

#include <algorithm>
#include <cstring>

namespace fedmesh::aggregator {

Result<std::shared_ptr<PendingValues>> PendingValues::open(store::CheckpointStore& store,
                                                           std::span<const uint8_t> update_id, int64_t values) {
  Result<store::PendingStream> stream = store.open_pending_stream(update_id);
  if (!stream.is_ok()) return stream.status();
  std::shared_ptr<PendingValues> pending(new PendingValues(std::move(*stream), values));
  FEDMESH_RETURN_IF_ERROR(pending->begin_pass());
  return pending;
}

Status PendingValues::begin_pass() {
  front_.resize(static_cast<size_t>(std::min<int64_t>(stream_.size(), store::kPendingHeaderBytes)));
  Status status = stream_.read(front_);
  Result<store::PendingLayout> layout = status.is_ok()
      ? store::read_pending_layout(front_, static_cast<uint64_t>(stream_.size()), static_cast<size_t>(values_))
      : Result<store::PendingLayout>(status);
  if (!layout.is_ok()) {
    (void)stream_.finish();  // ends the pass: the next one starts afresh
    return layout.status();
  }
  header_ = layout->header;
  front_at_ = layout->values_offset;
  in_pass_ = true;
  return Status::ok();
}

void PendingValues::read_first_pass_from(std::vector<std::vector<float>> values) {
  stream_.rewind();  // the store's pass, begun by open(), waits for the next one
  in_pass_ = false;
  in_memory_ = std::move(values);
  piece_ = within_ = 0;
}

void PendingValues::read_first_pass_from(std::shared_ptr<const SpillFile> values) {
  stream_.rewind();
  in_pass_ = false;
  spilled_ = std::move(values);
  spilled_at_ = 0;
}

Status PendingValues::read(std::span<float> out) {
  if (spilled_) {
    const std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(out.data()), out.size_bytes());
    if (spilled_at_ + bytes.size() > spilled_->size()) return corrupt("the update's staged values end before the model's");
    FEDMESH_RETURN_IF_ERROR(spilled_->read(spilled_at_, bytes));
    spilled_at_ += bytes.size();
    return Status::ok();
  }
  if (!in_memory_.empty()) {
    while (!out.empty()) {
      if (piece_ == in_memory_.size()) return corrupt("the update's values in memory end before the model's");
      const std::vector<float>& piece = in_memory_[piece_];
      const size_t take = std::min(out.size(), piece.size() - within_);
      std::copy_n(piece.begin() + static_cast<std::ptrdiff_t>(within_), take, out.begin());
      out = out.subspan(take);
      within_ += take;
      if (within_ == piece.size()) ++piece_, within_ = 0;
    }
    return Status::ok();
  }
  if (!in_pass_) FEDMESH_RETURN_IF_ERROR(begin_pass());
  // f32 little-endian in the payload, as in memory (store::pending_value_bytes).
  std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(out.data()), out.size_bytes());
  const size_t from_front = std::min(bytes.size(), front_.size() - front_at_);
  if (from_front > 0) std::memcpy(bytes.data(), front_.data() + front_at_, from_front);
  front_at_ += from_front;
  return stream_.read(bytes.subspan(from_front));
}

Status PendingValues::finish() {
  if (spilled_) {
    spilled_.reset();
    return Status::ok();
  }
  if (!in_memory_.empty()) {
    std::vector<std::vector<float>>().swap(in_memory_);
    return Status::ok();
  }
  in_pass_ = false;
  return stream_.finish();
}

}  // namespace fedmesh::aggregator
