// Writes the fuzz_image seeds (tests/fuzz/corpus/image/): small PNGs of every
// color type and depth the decoder takes, JPEGs (gray, RGB, progressive,
// CMYK), and the truncated and oversized forms it refuses. Not built by
// meson; run by hand from the repository root:
//   c++ -std=c++20 -Itests tests/fuzz/make_image_corpus.cpp -lz -ljpeg -o /tmp/make_image_corpus
//   /tmp/make_image_corpus tests/fuzz/corpus/image
#include "support/image_files.h"

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

using fedmesh::testing::Bytes;

// A PNG with every row filter type marked.
Bytes png_bytes(uint32_t width, uint32_t height, int color_type, int bit_depth, const Bytes& samples,
                const Bytes& palette = {}) {
  return fedmesh::testing::png_bytes(width, height, color_type, bit_depth, samples, palette, /*filter_cycle=*/true);
}

// A JPEG of a pattern.
Bytes jpeg_bytes(uint32_t width, uint32_t height, int components, J_COLOR_SPACE space, bool progressive) {
  Bytes pixels(width * height * components);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 7);
  return fedmesh::testing::jpeg_bytes(width, height, components, space, pixels, 75, progressive);
}

Bytes ramp(size_t n) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i * 13);
  return out;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_image_corpus DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  auto put = [&](const std::string& name, const Bytes& bytes) {
    std::ofstream(dir + "/" + name, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  Bytes palette_indexes = ramp(6 * 5);
  for (uint8_t& index : palette_indexes) index %= 3;
  put("png_gray_8", png_bytes(6, 5, 0, 8, ramp(6 * 5)));
  put("png_gray_16", png_bytes(6, 5, 0, 16, ramp(6 * 5 * 2)));
  put("png_rgb_8", png_bytes(5, 6, 2, 8, ramp(5 * 6 * 3)));
  put("png_rgb_16", png_bytes(3, 3, 2, 16, ramp(3 * 3 * 6)));
  put("png_palette", png_bytes(6, 5, 3, 8, palette_indexes, {0, 0, 0, 255, 0, 0, 0, 255, 0}));
  put("png_gray_alpha", png_bytes(4, 4, 4, 8, ramp(4 * 4 * 2)));
  put("png_rgba", png_bytes(4, 4, 6, 8, ramp(4 * 4 * 4)));
  const Bytes gray_png = png_bytes(6, 5, 0, 8, ramp(6 * 5));
  put("png_truncated", Bytes(gray_png.begin(), gray_png.end() - 20));
  put("png_too_wide", png_bytes(20000, 1, 0, 8, Bytes(20000, 0)));
  put("jpeg_gray", jpeg_bytes(9, 7, 1, JCS_GRAYSCALE, false));
  put("jpeg_rgb", jpeg_bytes(17, 9, 3, JCS_RGB, false));
  const Bytes progressive = jpeg_bytes(16, 16, 3, JCS_RGB, true);
  put("jpeg_progressive", progressive);
  put("jpeg_cmyk", jpeg_bytes(8, 8, 4, JCS_CMYK, false));
  put("jpeg_truncated", Bytes(progressive.begin(), progressive.begin() + progressive.size() / 2));
  put("not_an_image", Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  return 0;
}
