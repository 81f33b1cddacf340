// The block formats of the quantized matmul: codes, sizes, scale decoding and the scalar dequantizer every vector
// path must equal bit for bit. Shared by every file of kernels/cpu/quant/.
//
// Formats (the `fmt` argument, kept in step with kernels/quant.py CPP_FORMATS):
//   0 Q4_0  GGUF blocks of 32 along K: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   1 Q4_1  GGUF blocks of 32 along K: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
//   2 Q8_0  GGUF blocks of 32 along K: fp16 d, 32 int8; w = d * q
//   3 I8    one int8 row of K per output channel plus a float scale per channel; w = s[n] * q
//   4 Q5_0, 5 Q5_1 (blocks of 32), 6 Q4_K, 7 Q5_K, 8 Q6_K (super-blocks of 256), with gguf-py's arithmetic.
// In the nibble formats byte i holds element i (low nibble) and element i + 16 (high nibble), as GGUF stores them.
//
// CPU paths (the `isa` argument, kept in step with kernels/quant.py CpuIsa). Every file is built with -march=native
// for the CPU it runs on (the module's name is keyed by the CPU), so a path exists in a build when the compiler was
// allowed its instructions: TANDEM_AVX2, TANDEM_AVX512 and TANDEM_VNNI below.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TANDEM_AVX512 1
#if defined(__AVX512VNNI__)
#define TANDEM_VNNI 1
#endif
#endif
#endif

// For the pieces of a kernel's inner loop (a block's unpacking, a widening): GCC's inliner otherwise gives up inside
// the large functions a dispatch over formats and row counts makes, and an out-of-line call per block passes the
// weights through memory (the AVX2 Q4_0 kernel measured 1.3-2.4x slower that way).
#define TANDEM_ALWAYS_INLINE inline __attribute__((always_inline))

namespace tandem {

enum Fmt : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, I8 = 3, Q5_0 = 4, Q5_1 = 5, Q4_K = 6, Q5_K = 7, Q6_K = 8 };
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

// The weights of a small-M step stream from memory once, in order, faster than the hardware prefetcher alone keeps
// up with when the compute per byte is small (Q8_0): each block's kernel asks for the bytes PREFETCH_BYTES further
// on. 4 KB measured best on the 2-core AVX-512 host (Gemma 3's 178 MB Q8_0 LM head: 12.2 -> 6.4 ms, 2 threads; 2 KB
// and 8 KB were 7.4 and 8.3 ms).
constexpr int64_t PREFETCH_BYTES = 4096;
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef TANDEM_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 34;
  }
}
constexpr int64_t block_elems(int64_t fmt) { return fmt >= Q4_K ? 256 : 32; }

// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (gguf-py's Q4_K.get_scale_min).
inline void k_scale_min_int(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}
#ifdef TANDEM_AVX2
// All eight at once in vector registers (the scalar formula above, byte-parallel): the scales in 16-bit lanes 0-7,
// the mins in 8-15. Reads 16 bytes from s (the 12 packed bytes and the first 4 of the quants after them).
inline __m256i k_scales_mins16(const uint8_t* s) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  // low bits: sc0-3 = s[0-3] & 63, sc4-7 = s[8-11] & 15, mn0-3 = s[4-7] & 63, mn4-7 = s[8-11] >> 4
  const __m128i a = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i lo = _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0x8),
                                   _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  // high bits of sc4-7 and mn4-7: the top two bits of s[0-3] and s[4-7], moved to bits 4-5
  const __m128i h = _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30));
  return _mm256_cvtepu8_epi16(_mm_or_si128(lo, hi));
}
#endif
inline void k_scale_min(const uint8_t* s, int j, float& sc, float& mn) {
  int si, mi;
  k_scale_min_int(s, j, si, mi);
  sc = static_cast<float>(si);
  mn = static_cast<float>(mi);
}

// One block of 32 activations rounded to 8 bits as llama.cpp does (its Q8_0): dx = max|x| / 127, qb[i] =
// round(x[i] / dx) to nearest even (within [-127, 127]; all 0 where the block is). Returns dx and the sum of qb. Both
// int8 paths (vnni.cpp, avx2_int8.cpp) quantize with this one function, so they multiply the same integers.
inline int quantize_block32(const float* xb, int8_t* qb, float& dx) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
  dx = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int s = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
    qb[i] = static_cast<int8_t>(v);
    s += v;
  }
  return s;
}

// 256 activations (a K-quant super-block) rounded to 8 bits as llama.cpp's Q8_K rounds them, with the same rule as
// quantize_block32: dx = max|x| / 127, qb[i] = round(x[i] / dx) to nearest even; bsum[j] = sum of qb over elements
// 16 j .. 16 j + 15 (what the K-quants' mins need). Returns dx.
inline float quantize_block256(const float* xb, int8_t* qb, int16_t* bsum) {
  float amax = 0.f;
  for (int i = 0; i < 256; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 16; ++j) {
    int s = 0;
    for (int i = 16 * j; i < 16 * j + 16; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      qb[i] = static_cast<int8_t>(v);
      s += v;
    }
    bsum[j] = static_cast<int16_t>(s);
  }
  return amax / 127.f;
}

// Scalar dequantization of one row of any format (`scale`: I8's per-channel scale, else unused), exactly as gguf-py
// computes it: the reference the vector paths must equal bit for bit (formats.cpp).
void dequant_row_scalar(int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out);

}  // namespace tandem
