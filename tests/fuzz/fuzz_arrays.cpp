// libFuzzer target for arrays:FILE, fedmesh::train::data::parse_array_file:
// the input is one file's bytes (.npz, .npy or safetensors). How to build
// and run it: tests/fuzz/README.md.
//
// For every input the result must be
//   - accepted: every array's bytes lie inside the input or an inflated
//     buffer, and hold exactly elements() values of its type (all read
//     here); or
//   - refused: kCorrupt with a message that begins with the file's name.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "train/data/arrays.h"

namespace {

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_arrays: %s\n", what.c_str());
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fedmesh::train::data;
  std::vector<std::vector<uint8_t>> inflated;
  const std::string name = "fuzz.npz";
  fedmesh::Result<std::map<std::string, ArrayView>> arrays = parse_array_file({data, size}, name, inflated);
  if (!arrays.is_ok()) {
    if (arrays.status().code() != fedmesh::StatusCode::kCorrupt) violated("refused with another code");
    if (arrays.status().message().rfind(name, 0) != 0) violated("a refusal that does not name the file");
    return 0;
  }
  for (const auto& [key, view] : *arrays) {
    const int64_t width = view.dtype.size() == 2 ? view.dtype[1] - '0' : 0;
    if (width < 1 || view.elements() < 0 || static_cast<int64_t>(view.bytes.size()) != view.elements() * width) {
      violated("array '" + key + "' holds " + std::to_string(view.bytes.size()) + " bytes for its shape");
    }
    bool inside = view.bytes.empty() || (view.bytes.data() >= data && view.bytes.data() + view.bytes.size() <= data + size);
    for (const std::vector<uint8_t>& buffer : inflated) {
      inside = inside || (view.bytes.data() >= buffer.data() &&
                          view.bytes.data() + view.bytes.size() <= buffer.data() + buffer.size());
    }
    if (!inside) violated("array '" + key + "' points outside its file");
    volatile uint8_t sum = 0;
    for (uint8_t byte : view.bytes) sum = static_cast<uint8_t>(sum + byte);
  }
  return 0;
}
