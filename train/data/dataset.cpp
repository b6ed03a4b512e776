#include "train/data/dataset.h"

#include <cstdio>

namespace fedmesh::train::data {

std::string fnv1a64_text(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  char out[32];
  std::snprintf(out, sizeof out, "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
  return out;
}

std::string DataSchema::fingerprint() const { return fnv1a64_text(canonical); }

DataSchema idx_schema(const ImageDataset& images) {
  DataSchema schema;
  schema.sample_shape = {images.channels, images.rows, images.cols};
  schema.classes = images.num_classes;
  schema.canonical = "idx v1; " + std::to_string(images.channels) + "x" + std::to_string(images.rows) + "x" +
                     std::to_string(images.cols) + "; classes " + std::to_string(images.num_classes) + "; normalize";
  for (size_t c = 0; c < images.mean.size() && c < images.std.size(); ++c) {
    char text[64];
    std::snprintf(text, sizeof text, " %.6g/%.6g", images.mean[c], images.std[c]);
    schema.canonical += text;
  }
  return schema;
}

}  // namespace fedmesh::train::data
