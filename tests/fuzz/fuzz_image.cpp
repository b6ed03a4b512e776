// libFuzzer target for the image decoders behind `images:DIR`,
// fedmesh::train::data::decode_image (train/data/image_folder). How to build
// and run it: tests/fuzz/README.md.
//
// The input is the bytes of one file, as a folder could hold them: PNG and
// JPEG are told apart by their first bytes, anything else is refused. For
// every input the result must be
//   - is_ok() with 1 or 3 channels, both sides in [1, kMaxImageSide], at most
//     kMaxImagePixels pixels and exactly rows * cols * channels bytes; and
//     square_planes of it (gray and RGB, shrunk and enlarged) the size asked, or
//   - kCorrupt with a message that starts with the file's name.
// libjpeg's errors must come back as a Status (never exit(), never a jump
// out of the process), and libpng's likewise. A violation prints what was
// wrong and traps, which libFuzzer reports as a crash and saves the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "train/data/image_folder.h"

namespace {

using fedmesh::StatusCode;
using namespace fedmesh::train::data;

const std::string kName = "fuzz/input.img";

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_image: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fedmesh::Result<DecodedImage> got = decode_image({data, size}, kName);
  if (!got.is_ok()) {
    if (got.status().code() != StatusCode::kCorrupt) violated("refused with another code: " + got.status().to_string());
    if (got.status().message().rfind(kName + ": ", 0) != 0) {
      violated("message does not start with the name: '" + got.status().message() + "'");
    }
    return 0;
  }
  const DecodedImage& image = got.value();
  if (image.channels != 1 && image.channels != 3) violated("accepted with " + std::to_string(image.channels) + " channels");
  if (image.rows < 1 || image.cols < 1 || image.rows > kMaxImageSide || image.cols > kMaxImageSide ||
      image.rows * image.cols > kMaxImagePixels) {
    violated("accepted an image of " + std::to_string(image.cols) + "x" + std::to_string(image.rows));
  }
  if (static_cast<int64_t>(image.pixels.size()) != image.rows * image.cols * image.channels) {
    violated("pixels do not match the dimensions");
  }
  // Shrinking and enlarging, in both channel counts (small sizes: the
  // resize code is what is under test, not the allocator).
  for (int64_t channels : {int64_t{1}, int64_t{3}}) {
    for (int64_t out : {int64_t{1}, int64_t{5}, int64_t{33}}) {
      if (square_planes(image, channels, out).size() != static_cast<size_t>(channels * out * out)) {
        violated("square_planes returned the wrong size");
      }
    }
  }
  return 0;
}
