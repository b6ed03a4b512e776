// `arrays:FILE`: a data set as any tool exports it: an array of samples `x`
// (N, ...) and an array of class ids `y` (N) in one file, written by NumPy
// (`np.savez(FILE, x=..., y=...)`, stored or `savez_compressed`) or as
// safetensors (tensors "x" and "y"). Stored arrays are read in place from a
// read-only memory mapping (a batch converts its rows); deflated ones are
// inflated into memory once. Samples keep their shape: (N, F) is a table's
// rows, (N, C, H, W) images. Every header field is checked before it
// decides an allocation; a flaw names the file and the array.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

// Bounds on what a header may declare.
inline constexpr int64_t kMaxArrayDims = 8;
inline constexpr int64_t kMaxArrayFileBytes = int64_t{1} << 40;

// One array found in a file: its element type ("f4", "f8", "u1", "i1",
// "i2", "i4", "i8", "u2", "u4", "u8"; little-endian), its shape, and its
// bytes (row-major) inside the file or an inflated buffer.
struct ArrayView {
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
  int64_t elements() const;
  // The element at flat position i (< elements()) as a double, whatever its
  // type (a parsed view's dtype is always one of the above).
  double value(int64_t i) const;
};

// The arrays of a .npz, .npy (one array, named "x") or safetensors file
// given as bytes; deflated .npz members are inflated into `inflated`, which
// must outlive the views. `name` is how messages call the file.
Result<std::map<std::string, ArrayView>> parse_array_file(std::span<const uint8_t> bytes, const std::string& name,
                                                          std::vector<std::vector<uint8_t>>& inflated);

struct ArraysSpec {
  std::string path;                   // the training arrays
  std::string test_path;              // optional: the test arrays (same x shape); else test_fraction of path
  double test_fraction = 0.2;         // a seeded split
  uint64_t seed = 0;
  std::vector<std::string> classes;   // names of the class ids 0..K-1; empty: "0".."K-1", K = max(y) + 1
  // y is a real-valued target (any numeric type, finite), standardized by
  // the training rows' mean and std under normalize "standard".
  bool regression = false;
  std::string normalize = "standard"; // "standard": per feature, from the training rows | "none"
  int64_t train_limit = 0, test_limit = 0;
};

Result<LoadedData> load_arrays(const ArraysSpec& spec);

}  // namespace fedmesh::train::data
