#include "kernels/half_arrays.h"

#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/half.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define FEDMESH_HALF_F16C 1
#endif

namespace fedmesh {
namespace {

// ---- half.h's loops (every CPU; the compiler vectorizes them) ----------------

inline void store_u16(uint8_t* out, uint16_t bits) { std::memcpy(out, &bits, 2); }
inline uint16_t load_u16(const uint8_t* in) {
  uint16_t bits;
  std::memcpy(&bits, in, 2);
  return bits;
}

template <class Half>
inline void narrow_loop(const float* in, uint8_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) store_u16(out + 2 * i, from_float<Half>(in[i]).bits);
}

template <class Half>
inline void widen_loop(const uint8_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = to_float(Half{load_u16(in + 2 * i)});
}

#ifdef FEDMESH_HALF_F16C

#define FEDMESH_F16C __attribute__((target("avx2,f16c")))

// vcvtps2ph rounds to nearest even as half.h does, Inf past 65504 included;
// only a NaN differs (it keeps payload bits), so NaNs are made half.h's quiet
// NaN with their sign first: fp32 0x7fc00000 converts to 0x7e00.
FEDMESH_F16C void fp32_to_fp16_f16c(const float* in, uint8_t* out, size_t n) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    x = _mm256_blendv_ps(x, _mm256_or_ps(_mm256_and_ps(x, sign), quiet), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  narrow_loop<fp16>(in + i, out + 2 * i, n - i);
}

// vcvtph2ps widens exactly (subnormals included) but sets a signaling NaN's
// quiet bit; half.h keeps the payload as it is, so NaN lanes take its bits.
FEDMESH_F16C void fp16_to_fp32_f16c(const uint8_t* in, float* out, size_t n) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fff);
  const __m256i infinity = _mm256_set1_epi32(0x7c00);
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const __m256i mantissa = _mm256_set1_epi32(0x3ff);
  const __m256i sign = _mm256_set1_epi32(0x8000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    const __m256i wide = _mm256_cvtepu16_epi32(h);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(wide, magnitude), infinity);
    const __m256i nan_bits =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(wide, sign), 16),
                        _mm256_or_si256(exponent, _mm256_slli_epi32(_mm256_and_si256(wide, mantissa), 13)));
    const __m256 widened = _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(nan_bits), _mm256_castsi256_ps(nan));
    _mm256_storeu_ps(out + i, widened);
  }
  widen_loop<fp16>(in + 2 * i, out + i, n - i);
}

// bf16 is integer work: half.h's loops, compiled for AVX2.
FEDMESH_F16C void fp32_to_bf16_avx2(const float* in, uint8_t* out, size_t n) { narrow_loop<bf16>(in, out, n); }
FEDMESH_F16C void bf16_to_fp32_avx2(const uint8_t* in, float* out, size_t n) { widen_loop<bf16>(in, out, n); }

// AVX2 as the compiler's runtime sees it (the OS saves the vector state
// too); F16C from CPUID leaf 1 (ECX bit 29), which clang's
// __builtin_cpu_supports does not name.
bool detect_f16c() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}

#endif

}  // namespace

bool half_arrays_use_f16c() {
#ifdef FEDMESH_HALF_F16C
  static const bool supported = detect_f16c();
  return supported;
#else
  return false;
#endif
}

void fp32_to_fp16(const float* in, void* out, size_t n) {
  auto* bytes = static_cast<uint8_t*>(out);
#ifdef FEDMESH_HALF_F16C
  if (half_arrays_use_f16c()) return fp32_to_fp16_f16c(in, bytes, n);
#endif
  narrow_loop<fp16>(in, bytes, n);
}

void fp32_to_bf16(const float* in, void* out, size_t n) {
  auto* bytes = static_cast<uint8_t*>(out);
#ifdef FEDMESH_HALF_F16C
  if (half_arrays_use_f16c()) return fp32_to_bf16_avx2(in, bytes, n);
#endif
  narrow_loop<bf16>(in, bytes, n);
}

void fp16_to_fp32(const void* in, float* out, size_t n) {
  const auto* bytes = static_cast<const uint8_t*>(in);
#ifdef FEDMESH_HALF_F16C
  if (half_arrays_use_f16c()) return fp16_to_fp32_f16c(bytes, out, n);
#endif
  widen_loop<fp16>(bytes, out, n);
}

void bf16_to_fp32(const void* in, float* out, size_t n) {
  const auto* bytes = static_cast<const uint8_t*>(in);
#ifdef FEDMESH_HALF_F16C
  if (half_arrays_use_f16c()) return bf16_to_fp32_avx2(bytes, out, n);
#endif
  widen_loop<bf16>(bytes, out, n);
}

}  // namespace fedmesh
