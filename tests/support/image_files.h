// Image files made in memory for tests and fuzz seeds: a PNG writer with
// every choice in the caller's hands (color type, bit depth, palette, the
// row filter), so that the decoder meets files libpng's simplified writer
// would not make (16 bits without gAMA, a palette, gray + alpha), and a
// JPEG writer (gray, RGB or CMYK, baseline or progressive) through libjpeg.
#pragma once

#include <zlib.h>

// jpeglib.h needs FILE and size_t declared before it.
#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include <jpeglib.h>

#include <cstdint>
#include <vector>

namespace fedmesh::testing {

using Bytes = std::vector<uint8_t>;

inline constexpr int kPngGray = 0, kPngRgb = 2, kPngPalette = 3, kPngGrayAlpha = 4, kPngRgba = 6;

inline void append_be32(Bytes& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(value >> shift));
}

inline void append_png_chunk(Bytes& out, const char* type, const Bytes& data) {
  append_be32(out, static_cast<uint32_t>(data.size()));
  Bytes body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  out.insert(out.end(), body.begin(), body.end());
  append_be32(out, static_cast<uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size()))));
}

// samples: `height` rows of equal length without filter bytes (16-bit
// samples big-endian, 2 bytes each). Row r is marked with filter type
// `filter_cycle ? r % 5 : 0` (the bytes themselves are left unfiltered:
// the decoder must undo whatever the marks say, which fuzz seeds want).
inline Bytes png_bytes(uint32_t width, uint32_t height, int color_type, int bit_depth, const Bytes& samples,
                       const Bytes& palette = {}, bool filter_cycle = false) {
  Bytes out = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
  Bytes header;
  append_be32(header, width);
  append_be32(header, height);
  header.insert(header.end(), {static_cast<uint8_t>(bit_depth), static_cast<uint8_t>(color_type), 0, 0, 0});
  append_png_chunk(out, "IHDR", header);
  if (!palette.empty()) append_png_chunk(out, "PLTE", palette);
  const size_t row_bytes = height == 0 ? 0 : samples.size() / height;
  Bytes filtered;
  for (uint32_t r = 0; r < height; ++r) {
    filtered.push_back(filter_cycle ? static_cast<uint8_t>(r % 5) : 0);
    filtered.insert(filtered.end(), samples.begin() + r * row_bytes, samples.begin() + (r + 1) * row_bytes);
  }
  uLongf packed_size = compressBound(static_cast<uLong>(filtered.size()));
  Bytes packed(packed_size);
  if (compress(packed.data(), &packed_size, filtered.data(), static_cast<uLong>(filtered.size())) != Z_OK) return {};
  packed.resize(packed_size);
  append_png_chunk(out, "IDAT", packed);
  append_png_chunk(out, "IEND", {});
  return out;
}

// pixels: (height, width, components); space JCS_GRAYSCALE, JCS_RGB or JCS_CMYK.
inline Bytes jpeg_bytes(uint32_t width, uint32_t height, int components, J_COLOR_SPACE space, const Bytes& pixels,
                        int quality = 95, bool progressive = false) {
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
  jpeg_set_quality(&cinfo, quality, TRUE);
  if (progressive) jpeg_simple_progression(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + cinfo.next_scanline * width * components;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  Bytes out(buffer, buffer + size);
  std::free(buffer);
  return out;
}

}  // namespace fedmesh::testing
