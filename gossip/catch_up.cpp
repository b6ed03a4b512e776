#include "gossip/catch_up.h"

#include <algorithm>

#include "protocol/codec.h"

namespace fedmesh::gossip {

std::pair<size_t, size_t> slice_range(size_t n, uint32_t slice, uint32_t slices) {
  return {n * slice / slices, n * (slice + 1) / slices};
}

Result<std::vector<protocol::EncodedTensor>> encode_catch_up_slice(
    const std::vector<protocol::TensorShape>& manifest, const std::vector<std::vector<float>>& model,
    const std::vector<std::vector<float>>& reference, uint32_t slice, uint32_t slices, size_t max_segment_bytes) {
  if (model.size() != manifest.size() || reference.size() != manifest.size() || slices == 0 || slice >= slices) {
    return invalid_argument("a catch-up slice of a model that does not match its manifest");
  }
  std::vector<protocol::EncodedTensor> tensors;
  for (size_t t = 0; t < manifest.size(); ++t) {
    const auto [begin, end] = slice_range(model[t].size(), slice, slices);
    std::vector<uint64_t> indices;
    std::vector<float> values;
    for (size_t i = begin; i < end; ++i) {
      indices.push_back(i);
      values.push_back(model[t][i] - reference[t][i]);
    }
    const protocol::SparseIndexCost cost = protocol::sparse_index_cost(indices, model[t].size());
    const protocol::Encoding encoding = protocol::sparse_with_bitmap(protocol::Encoding::kSparseF32, cost.bitmap_smaller());
    Result<std::vector<protocol::EncodedSegment>> segments = protocol::encode_sparse(
        static_cast<uint32_t>(t), model[t].size(), indices, values, encoding, max_segment_bytes);
    if (!segments.is_ok()) return segments.status();
    protocol::EncodedTensor tensor;
    tensor.descriptor = {manifest[t].name, manifest[t].dims, encoding, 0};
    tensor.segments = std::move(*segments);
    tensors.push_back(std::move(tensor));
  }
  return tensors;
}

CatchUp::CatchUp(std::vector<std::pair<uint64_t, std::string>> ahead, uint32_t donors) : ahead_(std::move(ahead)) {
  FEDMESH_CHECK(!ahead_.empty(), "a catch-up needs a member ahead");
  std::sort(ahead_.rbegin(), ahead_.rend());
  slices_ = static_cast<uint32_t>(std::min<size_t>(ahead_.size(), std::max<uint32_t>(donors, 1)));
}

std::vector<std::pair<uint32_t, std::string>> CatchUp::first_requests() {
  std::vector<std::pair<uint32_t, std::string>> requests;
  for (uint32_t s = 0; s < slices_; ++s) {
    donor_[s] = ahead_[s].second;
    asked_.push_back(ahead_[s].second);
    requests.emplace_back(s, ahead_[s].second);
  }
  return requests;
}

std::vector<std::pair<uint32_t, std::string>> CatchUp::requests_again() {
  std::vector<std::pair<uint32_t, std::string>> requests;
  size_t next = 0;
  for (uint32_t s = 0; s < slices_; ++s) {
    if (received_.contains(s)) continue;
    const std::string& donor = ahead_[(s + 1 + next++) % ahead_.size()].second;
    donor_[s] = donor;
    asked_.push_back(donor);
    requests.emplace_back(s, donor);
  }
  return requests;
}

bool CatchUp::take(const std::string& from, uint32_t slice, uint32_t slices, std::vector<std::vector<float>>& values) {
  if (slices != slices_) return false;
  const auto donor = donor_.find(slice);
  if (donor == donor_.end() || donor->second != from) return false;
  received_[slice] = std::move(values);
  return true;
}

std::vector<std::string> CatchUp::donors_asked() const {
  std::vector<std::string> donors = asked_;
  std::sort(donors.begin(), donors.end());
  donors.erase(std::unique(donors.begin(), donors.end()), donors.end());
  return donors;
}

std::vector<std::vector<float>> CatchUp::assemble(const std::vector<std::vector<float>>& current,
                                                  const std::vector<std::vector<float>>& reference) const {
  std::vector<std::vector<float>> model = current;
  for (const auto& [slice, values] : received_) {
    for (size_t t = 0; t < model.size() && t < values.size(); ++t) {
      const auto [begin, end] = slice_range(model[t].size(), slice, slices_);
      for (size_t i = begin; i < end && i < values[t].size(); ++i) model[t][i] = reference[t][i] + values[t][i];
    }
  }
  return model;
}

}  // namespace fedmesh::gossip
