// Writes the fuzz_image seeds (tests/fuzz/corpus/image/): small PNGs of every
// color type and depth the decoder takes, JPEGs (gray, RGB, progressive,
// CMYK), and the truncated and oversized forms it refuses. Not built by
// meson; run by hand from the repository root:
//   c++ -std=c++20 tests/fuzz/make_image_corpus.cpp -lz -ljpeg -o /tmp/make_image_corpus
//   /tmp/make_image_corpus tests/fuzz/corpus/image
#include <zlib.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include <jpeglib.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

using Bytes = std::vector<uint8_t>;

void append_be32(Bytes& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(value >> shift));
}

void append_chunk(Bytes& out, const char* type, const Bytes& data) {
  append_be32(out, static_cast<uint32_t>(data.size()));
  Bytes body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  out.insert(out.end(), body.begin(), body.end());
  append_be32(out, static_cast<uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size()))));
}

// samples: height rows of equal length (without filter bytes).
Bytes png_bytes(uint32_t width, uint32_t height, int color_type, int bit_depth, const Bytes& samples,
                const Bytes& palette = {}) {
  Bytes out = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
  Bytes header;
  append_be32(header, width);
  append_be32(header, height);
  header.insert(header.end(), {static_cast<uint8_t>(bit_depth), static_cast<uint8_t>(color_type), 0, 0, 0});
  append_chunk(out, "IHDR", header);
  if (!palette.empty()) append_chunk(out, "PLTE", palette);
  const size_t row_bytes = samples.size() / height;
  Bytes filtered;
  for (uint32_t r = 0; r < height; ++r) {
    filtered.push_back(static_cast<uint8_t>(r % 5));  // every PNG filter type
    filtered.insert(filtered.end(), samples.begin() + r * row_bytes, samples.begin() + (r + 1) * row_bytes);
  }
  uLongf packed_size = compressBound(static_cast<uLong>(filtered.size()));
  Bytes packed(packed_size);
  compress(packed.data(), &packed_size, filtered.data(), static_cast<uLong>(filtered.size()));
  packed.resize(packed_size);
  append_chunk(out, "IDAT", packed);
  append_chunk(out, "IEND", {});
  return out;
}

Bytes jpeg_bytes(uint32_t width, uint32_t height, int components, J_COLOR_SPACE space, bool progressive) {
  Bytes pixels(width * height * components);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 7);
  jpeg_compress_struct cinfo;
  jpeg_error_mgr errors;
  cinfo.err = jpeg_std_error(&errors);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = width;
  cinfo.image_height = height;
  cinfo.input_components = components;
  cinfo.in_color_space = space;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, 75, TRUE);
  if (progressive) jpeg_simple_progression(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = pixels.data() + cinfo.next_scanline * width * components;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  Bytes out(buffer, buffer + size);
  std::free(buffer);
  return out;
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
