// A deliberately plain IDX pair parser over fully decoded bytes: the oracle
// that the mutation test and the fuzz target compare load_idx_pair with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "train/data/fashion_mnist.h"

namespace fedmesh::testing {

using IdxBytes = std::vector<uint8_t>;

inline constexpr size_t kIdxImagesHeaderBytes = 16, kIdxLabelsHeaderBytes = 8;

inline uint32_t load_be32(const IdxBytes& bytes, size_t at) {
  return (uint32_t{bytes[at]} << 24) | (uint32_t{bytes[at + 1]} << 16) | (uint32_t{bytes[at + 2]} << 8) |
         uint32_t{bytes[at + 3]};
}

// The data set an images/labels pair holds, or nullopt where the pair is not
// valid under the reader's documented limits.
inline std::optional<train::data::ImageDataset> reference_parse_idx(const IdxBytes& images, const IdxBytes& labels,
                                                             int num_classes) {
  using namespace fedmesh::train::data;
  if (images.size() < kIdxImagesHeaderBytes || labels.size() < kIdxLabelsHeaderBytes) return std::nullopt;
  if (load_be32(images, 0) != kIdxImagesMagic || load_be32(labels, 0) != kIdxLabelsMagic) return std::nullopt;
  const int64_t count = load_be32(images, 4), rows = load_be32(images, 8), cols = load_be32(images, 12);
  if (count < 1 || count > kMaxIdxImages || rows < 1 || rows > kMaxIdxSide || cols < 1 || cols > kMaxIdxSide) {
    return std::nullopt;
  }
  if (count * rows * cols > kMaxIdxPixelBytes || load_be32(labels, 4) != count) return std::nullopt;
  if (static_cast<int64_t>(images.size()) != static_cast<int64_t>(kIdxImagesHeaderBytes) + count * rows * cols ||
      static_cast<int64_t>(labels.size()) != static_cast<int64_t>(kIdxLabelsHeaderBytes) + count) {
    return std::nullopt;
  }
  ImageDataset out;
  out.count = count;
  out.rows = rows;
  out.cols = cols;
  out.num_classes = num_classes;
  out.pixels.assign(images.begin() + kIdxImagesHeaderBytes, images.end());
  out.labels.assign(labels.begin() + kIdxLabelsHeaderBytes, labels.end());
  for (uint8_t label : out.labels) {
    if (label >= num_classes) return std::nullopt;
  }
  return out;
}

}  // namespace fedmesh::testing
