// Small models for the gossip unit tests: a weight and a bias of random
// normal values, and compression plans by spec.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/random.h"
#include "protocol/compression_spec.h"
#include "protocol/update_transfer.h"

namespace fedmesh::gossip::testing {

using Model = std::vector<std::vector<float>>;

// "w" (rows x cols) and "b" (cols).
inline std::vector<protocol::TensorShape> two_tensors(int64_t rows, int64_t cols) {
  return {{"w", {rows, cols}}, {"b", {cols}}};
}

inline Model random_model(const std::vector<protocol::TensorShape>& manifest, uint64_t seed, float scale) {
  Rng rng(seed);
  Model m;
  for (const protocol::TensorShape& shape : manifest) {
    m.emplace_back(shape.element_count());
    for (float& v : m.back()) v = scale * static_cast<float>(rng.normal());
  }
  return m;
}

inline protocol::CompressionPlan plan(const std::string& spec) {
  Result<protocol::CompressionPlan> p = protocol::make_compression_plan(spec, {}, 0);
  EXPECT_TRUE(p.is_ok()) << p.status().message();
  return p.is_ok() ? *p : protocol::CompressionPlan{};
}

}  // namespace fedmesh::gossip::testing
