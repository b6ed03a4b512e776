// Helpers for the store tests: a fresh directory per test and tensors with
// recognizable contents.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "kernels/tensor.h"

namespace fedmesh::store::testing {

// An empty directory named after the running test, removed first if present.
inline std::filesystem::path fresh_directory() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("fedmesh-store-" + std::string(info->test_suite_name()) + "-" + info->name() +
                                     "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Bytes i*31+seed (mod 256): distinct per tensor, easy to find in a file.
inline Tensor patterned(Shape shape, DType dtype, uint8_t seed) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(i * 31 + seed);
  return t;
}

// A tensor of seeded random bytes: no run of it appears anywhere else.
inline Tensor random_tensor(Shape shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  std::mt19937_64 rng(seed);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(rng() >> 56);
  return t;
}

inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace fedmesh::store::testing
