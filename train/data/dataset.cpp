#include "train/data/dataset.h"

#include <cstdio>

namespace fedmesh::train::data {

std::string DataSchema::fingerprint() const {
  uint64_t hash = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits
  for (unsigned char c : canonical) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  char text[32];
  std::snprintf(text, sizeof text, "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
  return text;
}

}  // namespace fedmesh::train::data
