// The real Fashion-MNIST files, loaded once per test binary: Debian's, or
// those in $FEDMESH_TEST_FASHION_MNIST_DIR (deploy/gpu_kit.sh carries a slice
// of them to GPU machines that have no Debian packages).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "train/data/fashion_mnist.h"

namespace fedmesh::testing {

inline const train::data::ImageDataset& fashion_split(train::data::Split split) {
  static const auto load = [](train::data::Split s) {
    const char* dir = std::getenv("FEDMESH_TEST_FASHION_MNIST_DIR");
    auto dataset = train::data::load_fashion_mnist(dir != nullptr ? std::string(dir) : train::data::kDefaultFashionMnistDir, s);
    // deploy/setup.sh installs dataset-fashion-mnist, so its absence is a setup failure.
    if (!dataset.is_ok()) ADD_FAILURE() << dataset.status().to_string();
    return dataset.is_ok() ? std::move(dataset).value() : train::data::ImageDataset{};
  };
  static const train::data::ImageDataset train = load(train::data::Split::kTrain);
  static const train::data::ImageDataset test = load(train::data::Split::kTest);
  return split == train::data::Split::kTrain ? train : test;
}

}  // namespace fedmesh::testing
