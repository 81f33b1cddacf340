// Weight-only quantized matmul on CPU: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T, weights kept as stored.
//
// Formats (the `fmt` argument, kept in step with kernels/quant.py):
//   0 Q4_0  GGUF blocks of 32 along K: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   1 Q4_1  GGUF blocks of 32 along K: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
//   2 Q8_0  GGUF blocks of 32 along K: fp16 d, 32 int8; w = d * q
//   3 I8    one int8 row of K per output channel plus a float scale per channel; w = s[n] * q
//   4 Q5_0, 5 Q5_1 (blocks of 32), 6 Q4_K, 7 Q5_K, 8 Q6_K (super-blocks of 256), with gguf-py's arithmetic.
// In the nibble formats byte i holds element i (low nibble) and element i + 16 (high nibble), as GGUF stores them.
//
// CPU paths (the `isa` argument, chosen once per process by kernels/quant.py; `best_isa()` is this build's widest):
//   2 AVX-512 (F, BW, VL): every GGUF format in registers, 16 lanes (I8 takes the AVX2 kernel);
//   1 AVX2 + FMA + F16C: Q4_0 / Q4_1 / Q8_0 / I8 in registers, 8 lanes; the others row by row through a buffer;
//   0 portable: every format row by row through a buffer (the scalar dequantizer, then dot products).
//
// The small-M kernels stream each output row's blocks once and dequantize them in registers: every d * q is exact
// in fp32, so `fma(d, q, m)` rounds once, exactly as the numpy dequantizer transformers uses does (d * q) + m. The
// weights are therefore bit-identical to that dequantization on every path, and results differ from
// dequantize-then-matmul only by summation order. Rows of x are taken up to eight at a time, with two accumulators
// per row up to four rows so consecutive FMAs do not wait on each other. OpenMP over output rows.
//
// Wide steps go through `dequantize` (tiles of rows into fp32) and a BLAS GEMM, from kernels/quant.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

// The weights of a small-M step stream from memory once, in order, faster than the hardware prefetcher alone keeps
// up with when the compute per byte is small (Q8_0): each block's kernel asks for the bytes PREFETCH_BYTES further
// on. 4 KB measured best on the 2-core AVX-512 host (Gemma 3's 178 MB Q8_0 LM head: 12.2 -> 6.4 ms, 2 threads; 2 KB
// and 8 KB were 7.4 and 8.3 ms).
constexpr int64_t PREFETCH_BYTES = 4096;
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

enum Fmt : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, I8 = 3, Q5_0 = 4, Q5_1 = 5, Q4_K = 6, Q5_K = 7, Q6_K = 8 };

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
inline void k_scale_min(const uint8_t* s, int j, float& sc, float& mn) {
  if (j < 4) {
    sc = static_cast<float>(s[j] & 63);
    mn = static_cast<float>(s[j + 4] & 63);
  } else {
    sc = static_cast<float>((s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30));
    mn = static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
  }
}

// One block of the formats without a register kernel, exactly as gguf-py computes it (no FMA: the file is built
// with -ffp-contract=off). A template per format, with every per-sub-block choice hoisted out of the inner loops, so
// the compiler can vectorise them.
template <int64_t FMT>
void dequant_block_t(const uint8_t* blk, float* o) {
  if constexpr (FMT == Q5_0 || FMT == Q5_1) {
    const float d = fp16_to_fp32(blk);
    const float m = FMT == Q5_1 ? fp16_to_fp32(blk + 2) : 0.f;
    const uint8_t* qhp = blk + (FMT == Q5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, qhp, 4);
    const uint8_t* qs = qhp + 4;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 0x0f) | (((qh >> i) & 1) << 4);
      const int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      if constexpr (FMT == Q5_0) {
        o[i] = d * static_cast<float>(lo - 16);
        o[i + 16] = d * static_cast<float>(hi - 16);
      } else {
        o[i] = d * static_cast<float>(lo) + m;
        o[i + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (FMT == Q4_K || FMT == Q5_K) {
    const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
    const uint8_t* sc6 = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (FMT == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(sc6, j, sc, mn);
      const float dd = d * sc, dm = dmin * mn;
      const uint8_t* g = qs + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      float* oj = o + j * 32;
      for (int l = 0; l < 32; ++l) {
        int q = (g[l] >> shift) & 0x0f;
        if constexpr (FMT == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        oj[l] = dd * static_cast<float>(q) - dm;
      }
    }
  } else {  // Q6_K
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16_to_fp32(blk + 208);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* lo_bytes = ql + (j / 4) * 64 + (j % 2) * 32;
      const uint8_t* hi_bytes = qh + (j / 4) * 32;
      const int lo_shift = 4 * ((j / 2) % 2), hi_shift = 2 * (j % 4);
      for (int half = 0; half < 2; ++half) {  // 16 weights share one int8 scale
        const float ds = d * static_cast<float>(sc[j * 2 + half]);
        float* oj = o + j * 32 + half * 16;
        for (int l = 0; l < 16; ++l) {
          const int idx = half * 16 + l;
          const int lo = (lo_bytes[idx] >> lo_shift) & 0x0f;
          const int hi = (hi_bytes[idx] >> hi_shift) & 3;
          oj[l] = ds * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
        }
      }
    }
  }
}

template <int64_t FMT>
void dequant_row_t(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t bb = block_bytes(FMT), be = block_elems(FMT);
  for (int64_t b = 0; b < K / be; ++b) dequant_block_t<FMT>(row + b * bb, out + b * be);
}

void dequant_row_generic(int64_t fmt, const uint8_t* row, int64_t K, float* out) {
  switch (fmt) {
    case Q5_0: return dequant_row_t<Q5_0>(row, K, out);
    case Q5_1: return dequant_row_t<Q5_1>(row, K, out);
    case Q4_K: return dequant_row_t<Q4_K>(row, K, out);
    case Q5_K: return dequant_row_t<Q5_K>(row, K, out);
    default: return dequant_row_t<Q6_K>(row, K, out);
  }
}

// Scalar dequantization of one row (any format): the reference the vector paths must equal bit for bit.
void dequant_row_scalar(int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
  if (fmt >= Q5_0) return dequant_row_generic(fmt, row, K, out);
  if (fmt == I8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int64_t k = 0; k < K; ++k) out[k] = scale * static_cast<float>(q[k]);
    return;
  }
  const int64_t bb = block_bytes(fmt);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = fp16_to_fp32(blk);
    float* o = out + b * 32;
    if (fmt == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) o[i] = static_cast<float>(q[i]) * d;
    } else if (fmt == Q4_1) {
      const float m = fp16_to_fp32(blk + 2);
      const uint8_t* q = blk + 4;
      for (int i = 0; i < 16; ++i) {
        o[i] = d * static_cast<float>(q[i] & 0x0f) + m;
        o[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
      }
    } else {  // Q4_0
      const uint8_t* q = blk + 2;
      for (int i = 0; i < 16; ++i) {
        o[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
        o[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
      }
    }
  }
}

#ifdef TANDEM_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as four vectors of eight, bit-identical to dequant_row_scalar.
template <int64_t FMT>
inline void dequant_block(const uint8_t* blk, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(fp16_to_fp32(blk));
  if constexpr (FMT == Q8_0) {
    const uint8_t* q = blk + 2;
    for (int j = 0; j < 4; ++j) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), d);
    }
  } else {
    const uint8_t* q = blk + (FMT == Q4_1 ? 4 : 2);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, m4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m4);
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    if constexpr (FMT == Q4_1) {
      const __m256 m = _mm256_set1_ps(fp16_to_fp32(blk + 2));
      w[0] = _mm256_fmadd_ps(d, q0, m);  // d * q is exact, so one rounding, as (d * q) + m
      w[1] = _mm256_fmadd_ps(d, q1, m);
      w[2] = _mm256_fmadd_ps(d, q2, m);
      w[3] = _mm256_fmadd_ps(d, q3, m);
    } else {  // Q4_0: (q - 8) * d, the subtraction exact in fp32
      const __m256 eight = _mm256_set1_ps(8.f);
      w[0] = _mm256_mul_ps(d, _mm256_sub_ps(q0, eight));
      w[1] = _mm256_mul_ps(d, _mm256_sub_ps(q1, eight));
      w[2] = _mm256_mul_ps(d, _mm256_sub_ps(q2, eight));
      w[3] = _mm256_mul_ps(d, _mm256_sub_ps(q3, eight));
    }
  }
}

// y[m, n] for MT (1..4) rows of x starting at x, one output row of blocks.
template <int64_t FMT, int MT>
inline void row_blocks(const uint8_t* row, const float* x, int64_t ldx, int64_t nblocks, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT);
  // Up to 4 rows: two accumulators per row (independent FMA chains); 8 rows: one each (8 chains, 12 registers).
  constexpr int NA = MT <= 4 ? 2 : 1;
  __m256 acc[MT][NA];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    prefetch_ahead(row + b * BB);
    __m256 w[4];
    dequant_block<FMT>(row + b * BB, w);
    const float* xb = x + b * 32;
    for (int m = 0; m < MT; ++m) {
      const float* xm = xb + m * ldx;
      acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xm), acc[m][0]);
      acc[m][NA - 1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), acc[m][NA - 1]);
      acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), acc[m][0]);
      acc[m][NA - 1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), acc[m][NA - 1]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = hsum(NA == 2 ? _mm256_add_ps(acc[m][0], acc[m][NA - 1]) : acc[m][0]);
}

// Per-channel int8: y[m, n] = s * sum_k q[k] x[m, k]; K needs no alignment (a scalar tail).
template <int MT>
inline void row_i8(const int8_t* q, float s, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  constexpr int NA = MT <= 4 ? 2 : 1;
  __m256 acc[MT][NA];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
    const __m256 w1 =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + 8))));
    for (int m = 0; m < MT; ++m) {
      acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), acc[m][0]);
      acc[m][NA - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 8), acc[m][NA - 1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float tail = 0.f;
    for (int64_t t = k; t < K; ++t) tail += static_cast<float>(q[t]) * x[m * ldx + t];
    y[m * ldy] = s * (hsum(NA == 2 ? _mm256_add_ps(acc[m][0], acc[m][NA - 1]) : acc[m][0]) + tail);
  }
}

template <int MT>
inline void row_any(int64_t fmt, const uint8_t* row, float s, const float* x, int64_t ldx, int64_t K, float* y,
                    int64_t ldy) {
  switch (fmt) {
    case Q4_0: return row_blocks<Q4_0, MT>(row, x, ldx, K / 32, y, ldy);
    case Q4_1: return row_blocks<Q4_1, MT>(row, x, ldx, K / 32, y, ldy);
    case Q8_0: return row_blocks<Q8_0, MT>(row, x, ldx, K / 32, y, ldy);
    default: return row_i8<MT>(reinterpret_cast<const int8_t*>(row), s, x, ldx, K, y, ldy);
  }
}

void dequant_row(int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
  if (fmt == I8 || fmt >= Q5_0) return dequant_row_scalar(fmt, row, scale, K, out);  // vectorised by the compiler
  const int64_t bb = block_bytes(fmt);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 w[4];
    switch (fmt) {
      case Q4_0: dequant_block<Q4_0>(row + b * bb, w); break;
      case Q4_1: dequant_block<Q4_1>(row + b * bb, w); break;
      default: dequant_block<Q8_0>(row + b * bb, w); break;
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * 32 + 8 * j, w[j]);
  }
}

#if defined(TANDEM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TANDEM_AVX512 1

// ---- AVX-512: every block format in registers, 16 lanes ---------------------------------------------------------
// A block is read as groups of 32 weights (one group for the 32-wide formats, eight for a K-quant super-block),
// each group as two vectors of 16. The arithmetic is gguf-py's, so the weights are bit-identical to
// dequant_row_scalar: every product d * q here is exact in fp32 (an fp16 scale, times a 6- or 8-bit sub-block scale
// where there is one, times a quant of at most 6 bits: at most 24 significant bits), so `fma(d, q, m)` and
// `fms(d, q, dm)` round once, exactly as (d * q) + m and (d * q) - dm do.

inline __m512 u8x16_to_ps(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One block's scales decoded once; `group(g, w)` yields weights [32 g, 32 g + 32) as w[0], w[1].
template <int64_t FMT>
struct Block512;

template <>
struct Block512<Q4_0> {
  static constexpr int G = 1;
  const uint8_t* q;
  __m512 d;
  explicit Block512(const uint8_t* blk) : q(blk + 2), d(_mm512_set1_ps(fp16_to_fp32(blk))) {}
  inline void group(int, __m512 w[2]) const {
    const __m128i bytes = load16(q), m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, m4), eight);  // q - 8, exact as int8
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4), eight);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
  }
};

template <>
struct Block512<Q4_1> {
  static constexpr int G = 1;
  const uint8_t* q;
  __m512 d, m;
  explicit Block512(const uint8_t* blk)
      : q(blk + 4), d(_mm512_set1_ps(fp16_to_fp32(blk))), m(_mm512_set1_ps(fp16_to_fp32(blk + 2))) {}
  inline void group(int, __m512 w[2]) const {
    const __m128i bytes = load16(q), m4 = _mm_set1_epi8(0x0f);
    w[0] = _mm512_fmadd_ps(d, u8x16_to_ps(_mm_and_si128(bytes, m4)), m);
    w[1] = _mm512_fmadd_ps(d, u8x16_to_ps(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4)), m);
  }
};

template <>
struct Block512<Q8_0> {
  static constexpr int G = 1;
  const uint8_t* q;
  __m512 d;
  explicit Block512(const uint8_t* blk) : q(blk + 2), d(_mm512_set1_ps(fp16_to_fp32(blk))) {}
  inline void group(int, __m512 w[2]) const {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(q))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(q + 16))), d);
  }
};

// Q5_0 / Q5_1: the fifth bits are one little-endian uint32, bit i for weight i: a byte mask adds 16 to the nibbles
// before they are widened. Q5_0's d * (v - 16) is one fms, d * v - 16 d: exact, as the product is (16 bits).
template <int64_t FMT>
struct Block512Q5 {
  static constexpr int G = 1;
  const uint8_t* q;
  uint32_t qh;
  __m512 d, m;
  explicit Block512Q5(const uint8_t* blk)
      : q(blk + (FMT == Q5_1 ? 8 : 6)), qh(load_u32(blk + (FMT == Q5_1 ? 4 : 2))),
        d(_mm512_set1_ps(fp16_to_fp32(blk))),
        m(_mm512_set1_ps(FMT == Q5_1 ? fp16_to_fp32(blk + 2) : 16.f * fp16_to_fp32(blk))) {}
  inline __m512 half(__m128i nibbles, __mmask16 high) const {
    const __m512 v = u8x16_to_ps(_mm_mask_add_epi8(nibbles, high, nibbles, _mm_set1_epi8(16)));
    if constexpr (FMT == Q5_0) return _mm512_fmsub_ps(d, v, m);
    return _mm512_fmadd_ps(d, v, m);
  }
  inline void group(int, __m512 w[2]) const {
    const __m128i bytes = load16(q), m4 = _mm_set1_epi8(0x0f);
    w[0] = half(_mm_and_si128(bytes, m4), static_cast<__mmask16>(qh & 0xffff));
    w[1] = half(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4), static_cast<__mmask16>(qh >> 16));
  }
};
template <>
struct Block512<Q5_0> : Block512Q5<Q5_0> {
  using Block512Q5<Q5_0>::Block512Q5;
};
template <>
struct Block512<Q5_1> : Block512Q5<Q5_1> {
  using Block512Q5<Q5_1>::Block512Q5;
};

// Q4_K / Q5_K: eight sub-blocks of 32, each with its own 6-bit scale and min; group g takes the low (g even) or
// high (g odd) nibbles of bytes [32 (g / 2), 32 (g / 2) + 32), and for Q5_K bit g of qh[l] as the fifth bit.
template <int64_t FMT>
struct Block512K {
  static constexpr int G = 8;
  const uint8_t* qs;
  const uint8_t* qh;
  float dd[8], dm[8];
  explicit Block512K(const uint8_t* blk) : qs(blk + (FMT == Q5_K ? 48 : 16)), qh(blk + 16) {
    const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(blk + 4, j, sc, mn);
      dd[j] = d * sc;
      dm[j] = dmin * mn;
    }
  }
  inline __m512 half(const uint8_t* bytes, int g, int h) const {  // the bits picked as bytes, then widened once
    const __m128i b = load16(bytes + 16 * h);
    __m128i v = _mm_and_si128(g & 1 ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
    if constexpr (FMT == Q5_K) {
      const __mmask16 high = _mm_test_epi8_mask(load16(qh + 16 * h), _mm_set1_epi8(static_cast<char>(1 << g)));
      v = _mm_mask_add_epi8(v, high, v, _mm_set1_epi8(16));
    }
    return _mm512_fmsub_ps(_mm512_set1_ps(dd[g]), u8x16_to_ps(v), _mm512_set1_ps(dm[g]));
  }
  inline void group(int g, __m512 w[2]) const {
    const uint8_t* bytes = qs + (g / 2) * 32;
    w[0] = half(bytes, g, 0);
    w[1] = half(bytes, g, 1);
  }
};
template <>
struct Block512<Q4_K> : Block512K<Q4_K> {
  using Block512K<Q4_K>::Block512K;
};
template <>
struct Block512<Q5_K> : Block512K<Q5_K> {
  using Block512K<Q5_K>::Block512K;
};

// Q6_K: sixteen sub-blocks of 16 with int8 scales; a group of 32 is two of them. Low 4 bits from ql, high 2 from qh.
template <>
struct Block512<Q6_K> {
  static constexpr int G = 8;
  const uint8_t* ql;
  const uint8_t* qh;
  float ds[16];
  explicit Block512(const uint8_t* blk) : ql(blk), qh(blk + 128) {
    const float d = fp16_to_fp32(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(sc[i]);
  }
  inline void group(int j, __m512 w[2]) const {
    const uint8_t* lo_bytes = ql + (j / 4) * 64 + (j % 2) * 32;
    const uint8_t* hi_bytes = qh + (j / 4) * 32;
    const __m128i lo_shift = _mm_cvtsi32_si128(4 * ((j / 2) % 2)), hi_shift = _mm_cvtsi32_si128(2 * (j % 4));
    for (int h = 0; h < 2; ++h) {  // the six bits put together as bytes (q - 32 as int8), then widened once
      const __m128i lo = _mm_and_si128(_mm_srl_epi16(load16(lo_bytes + 16 * h), lo_shift), _mm_set1_epi8(0x0f));
      const __m128i hi = _mm_and_si128(_mm_srl_epi16(load16(hi_bytes + 16 * h), hi_shift), _mm_set1_epi8(3));
      const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
      w[h] = _mm512_mul_ps(_mm512_set1_ps(ds[j * 2 + h]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
  }
};

// y[m, n] for MT (1..8) rows of x, one output row of blocks.
template <int64_t FMT, int MT>
inline void row512(const uint8_t* row, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT), BE = block_elems(FMT);
  constexpr int NA = MT <= 4 ? 2 : 1;  // two FMA chains per row while registers allow
  __m512 acc[MT][NA];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / BE; ++b) {
    prefetch_ahead(row + b * BB);
    const Block512<FMT> blk(row + b * BB);
    for (int g = 0; g < Block512<FMT>::G; ++g) {
      __m512 w[2];
      blk.group(g, w);
      const float* xb = x + b * BE + g * 32;
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + m * ldx), acc[m][0]);
        acc[m][NA - 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + m * ldx + 16), acc[m][NA - 1]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    y[m * ldy] = _mm512_reduce_add_ps(NA == 2 ? _mm512_add_ps(acc[m][0], acc[m][NA - 1]) : acc[m][0]);
}

template <int64_t FMT>
void dequant_row512_t(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t BB = block_bytes(FMT), BE = block_elems(FMT);
  for (int64_t b = 0; b < K / BE; ++b) {
    const Block512<FMT> blk(row + b * BB);
    for (int g = 0; g < Block512<FMT>::G; ++g) {
      __m512 w[2];
      blk.group(g, w);
      _mm512_storeu_ps(out + b * BE + g * 32, w[0]);
      _mm512_storeu_ps(out + b * BE + g * 32 + 16, w[1]);
    }
  }
}

template <int MT>
inline void row_any512(int64_t fmt, const uint8_t* row, const float* x, int64_t ldx, int64_t K, float* y,
                       int64_t ldy) {
  switch (fmt) {
    case Q4_0: return row512<Q4_0, MT>(row, x, ldx, K, y, ldy);
    case Q4_1: return row512<Q4_1, MT>(row, x, ldx, K, y, ldy);
    case Q8_0: return row512<Q8_0, MT>(row, x, ldx, K, y, ldy);
    case Q5_0: return row512<Q5_0, MT>(row, x, ldx, K, y, ldy);
    case Q5_1: return row512<Q5_1, MT>(row, x, ldx, K, y, ldy);
    case Q4_K: return row512<Q4_K, MT>(row, x, ldx, K, y, ldy);
    case Q5_K: return row512<Q5_K, MT>(row, x, ldx, K, y, ldy);
    default: return row512<Q6_K, MT>(row, x, ldx, K, y, ldy);
  }
}

void dequant_row512(int64_t fmt, const uint8_t* row, int64_t K, float* out) {
  switch (fmt) {
    case Q4_0: return dequant_row512_t<Q4_0>(row, K, out);
    case Q4_1: return dequant_row512_t<Q4_1>(row, K, out);
    case Q8_0: return dequant_row512_t<Q8_0>(row, K, out);
    case Q5_0: return dequant_row512_t<Q5_0>(row, K, out);
    case Q5_1: return dequant_row512_t<Q5_1>(row, K, out);
    case Q4_K: return dequant_row512_t<Q4_K>(row, K, out);
    case Q5_K: return dequant_row512_t<Q5_K>(row, K, out);
    default: return dequant_row512_t<Q6_K>(row, K, out);
  }
}

#endif  // AVX-512

#if defined(TANDEM_AVX512) && defined(__AVX512VNNI__)
#define TANDEM_VNNI 1

// ---- int8 activations (AVX-512 VNNI), the 32-wide formats ------------------------------------------------------
// Each row of x is quantized per block of 32 as llama.cpp does (dx = max|x| / 127, qx = round(x / dx)); a block's
// dot product is then one integer sum: the weights as unsigned bytes u (Q8_0: q + 128; Q4_0 / Q5_0: q, their offset
// 8 / 16 taken out afterwards) times qx by vpdpbusd, so
//   sum_k w_k x_k ~= dx (d * sum_k u_k qx_k + (m - c d) * sum_k qx_k)
// with c the offset and m the block's min (Q4_1 / Q5_1; 0 otherwise). Two blocks per 512-bit vector. The integer
// sums are exact; the only difference to the float32 path is the rounding of x to 8 bits.

struct QuantizedRows {  // x [M, K] per block of 32: int8 values, per-lane scales (16 lanes a pair), dx * sum(qx)
  std::vector<int8_t> q;
  std::vector<float> lane_dx;  // [M, K / 64 pairs (rounded up), 16]: block 2p's dx in lanes 0-7, 2p + 1's in 8-15
  std::vector<float> lane_sum;  // [M, pairs, 16]: dx * sum(qx) of block 2p in lane 0, of 2p + 1 in lane 8, else 0
  int64_t pairs;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  QuantizedRows r;
  r.pairs = (nb + 1) / 2;
  r.q.assign(M * r.pairs * 64, 0);  // padded to whole pairs: an odd last block leaves zeros beside it
  r.lane_dx.assign(M * r.pairs * 16, 0.f);
  r.lane_sum.assign(M * r.pairs * 16, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = r.q.data() + m * r.pairs * 64 + b * 32;
      int s = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        qb[i] = static_cast<int8_t>(v);
        s += v;
      }
      float* lanes = r.lane_dx.data() + (m * r.pairs + b / 2) * 16 + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) lanes[i] = dx;
      r.lane_sum[(m * r.pairs + b / 2) * 16 + (b % 2) * 8] = dx * static_cast<float>(s);
    }
  return r;
}

// The 64 unsigned weight bytes of blocks A and B (B may be null: zeros), their scales d and their (m - c d).
template <int64_t FMT>
inline __m512i pair_u8(const uint8_t* a, const uint8_t* b, float d[2], float corr[2]) {
  constexpr float c = FMT == Q8_0 ? 128.f : FMT == Q4_0 ? 8.f : FMT == Q5_0 ? 16.f : 0.f;
  const uint8_t* blk[2] = {a, b};
  for (int i = 0; i < 2; ++i) {
    d[i] = blk[i] ? fp16_to_fp32(blk[i]) : 0.f;
    const float m = (FMT == Q4_1 || FMT == Q5_1) && blk[i] ? fp16_to_fp32(blk[i] + 2) : 0.f;
    corr[i] = m - c * d[i];
  }
  if constexpr (FMT == Q8_0) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2));
    const __m256i qb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)) : _mm256_set1_epi8(-128);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128 as unsigned
  } else {
    constexpr int off = FMT == Q4_0 ? 2 : FMT == Q4_1 ? 4 : FMT == Q5_0 ? 6 : 8;
    const __m128i ba = load16(a + off), bb = b ? load16(b + off) : _mm_setzero_si128();
    const __m256i both = _mm256_set_m128i(bb, ba);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(both, m4), hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), m4);
    // [loA loB hiA hiB] -> [loA hiA loB hiB]: each block's 32 weights in element order
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    w = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
    if constexpr (FMT == Q5_0 || FMT == Q5_1) {
      constexpr int qh_off = FMT == Q5_0 ? 2 : 4;
      const uint64_t qh = static_cast<uint64_t>(load_u32(a + qh_off)) |
                          (b ? static_cast<uint64_t>(load_u32(b + qh_off)) << 32 : 0);
      w = _mm512_mask_add_epi8(w, static_cast<__mmask64>(qh), w, _mm512_set1_epi8(16));
    }
    return w;
  }
}

template <int64_t FMT, int MT>
inline void row_q8(const uint8_t* row, const QuantizedRows& xq, int64_t m0, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT);
  const int64_t nb = K / 32;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t p = 0; p < xq.pairs; ++p) {
    const int64_t b = 2 * p;
    prefetch_ahead(row + b * BB);
    float d[2], c[2];
    const __m512i w = pair_u8<FMT>(row + b * BB, b + 1 < nb ? row + (b + 1) * BB : nullptr, d, c);
    const __m512 dw = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(d[0], d[1], 0.f, 0.f)));
    // (m - c d) of block A in lane 0 and of block B in lane 8, zeros elsewhere: times lane_sum, the offset/min term
    const __m512 cw = _mm512_maskz_permutexvar_ps(0x0101, idx, _mm512_castps128_ps512(_mm_setr_ps(c[0], c[1], 0.f, 0.f)));
    for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const __m512i qx = _mm512_loadu_si512(xq.q.data() + (r * xq.pairs + p) * 64);
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qx);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(xq.lane_dx.data() + (r * xq.pairs + p) * 16));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(cw, _mm512_loadu_ps(xq.lane_sum.data() + (r * xq.pairs + p) * 16), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = _mm512_reduce_add_ps(acc[m]);
}

template <int MT>
inline void row_any_q8(int64_t fmt, const uint8_t* row, const QuantizedRows& xq, int64_t m0, int64_t K, float* y,
                       int64_t ldy) {
  switch (fmt) {
    case Q4_0: return row_q8<Q4_0, MT>(row, xq, m0, K, y, ldy);
    case Q4_1: return row_q8<Q4_1, MT>(row, xq, m0, K, y, ldy);
    case Q5_0: return row_q8<Q5_0, MT>(row, xq, m0, K, y, ldy);
    case Q5_1: return row_q8<Q5_1, MT>(row, xq, m0, K, y, ldy);
    default: return row_q8<Q8_0, MT>(row, xq, m0, K, y, ldy);
  }
}

#endif  // VNNI

#else  // portable fallback: dequantize a row into a stack buffer and take plain dot products

template <int MT>
inline void row_any(int64_t fmt, const uint8_t* row, float s, const float* x, int64_t ldx, int64_t K, float* y,
                    int64_t ldy) {
  std::vector<float> w(K);
  dequant_row_scalar(fmt, row, s, K, w.data());
  for (int m = 0; m < MT; ++m) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += w[k] * x[m * ldx + k];
    y[m * ldy] = acc;
  }
}

void dequant_row(int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
  dequant_row_scalar(fmt, row, scale, K, out);
}

#endif

enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };  // kept in step with kernels/quant.py CpuIsa

// The widest path this build has. It is built with -march=native for this CPU (the module's name is keyed by the
// CPU), so what it was compiled with is what the CPU runs.
int64_t best_isa() {
#if defined(TANDEM_AVX512)
  return AVX512;
#elif defined(TANDEM_AVX2)
  return AVX2;
#else
  return PORTABLE;
#endif
}

void check_isa(int64_t isa, const char* who) {
  TORCH_CHECK(isa >= PORTABLE && isa <= best_isa(), who, ": CPU path ", isa, " is not in this build (best: ",
              best_isa(), ")");
}

void check(const torch::Tensor& w, int64_t fmt, int64_t K, const torch::Tensor& scales, int64_t isa) {
  TORCH_CHECK(fmt >= Q4_0 && fmt <= Q6_K, "quant_matmul: unknown format ", fmt);
  check_isa(isa, "quant_matmul");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "quant_matmul: weights must be a contiguous 2-d tensor");
  if (fmt == I8) {
    TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.size(1) == K, "quant_matmul: int8 weights [N, K]");
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == w.size(0),
                "quant_matmul: one float32 scale per output channel");
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kUInt8, "quant_matmul: GGUF blocks as uint8");
    TORCH_CHECK(K % block_elems(fmt) == 0 && w.size(1) == K / block_elems(fmt) * block_bytes(fmt),
                "quant_matmul: blocks do not match K=", K);
  }
}

inline const uint8_t* row_ptr(const torch::Tensor& w, int64_t n) {
  return static_cast<const uint8_t*>(w.data_ptr()) + n * w.size(1);
}

inline float scale_of(const torch::Tensor& scales, int64_t fmt, int64_t n) {
  return fmt == I8 ? scales.data_ptr<float>()[n] : 1.f;
}

int num_threads_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work)));
}

// Threads for a small-M matmul over `bytes` of weights: one per THREAD_BYTES at least, so a tiny projection stays on
// the calling thread. Every projection of a real model's decode step (200 KB and up) takes them all: with one OpenMP
// pool in the process and a short spin before workers sleep (tandem serve's default), a worker is still awake for
// the next region, and splitting the step's small projections measured 1.1-1.3x faster per batch-1 token than
// keeping them on one thread (idle and beside two busy processes alike).
constexpr int64_t THREAD_BYTES = 32 * 1024;
int threads_for_bytes(int64_t bytes) { return num_threads_for(bytes / THREAD_BYTES); }

// Whether `isa` computes `fmt` with a kernel that keeps the weights in registers (else: a row dequantized into a
// buffer by the scalar code, then dot products).
bool in_registers(int64_t isa, int64_t fmt) {
  if (isa == AVX512) return true;  // every GGUF format; I8 takes the AVX2 kernel
  return isa == AVX2 && fmt <= I8;
}

template <int MT>
inline void row_isa(int64_t isa, int64_t fmt, const uint8_t* row, float s, const float* x, int64_t K, float* y,
                    int64_t ldy) {
#if defined(TANDEM_AVX512)
  if (isa == AVX512 && fmt != I8) return row_any512<MT>(fmt, row, x, K, K, y, ldy);
#endif
  row_any<MT>(fmt, row, s, x, K, K, y, ldy);
}

void dequant_row_isa(int64_t isa, int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
#if defined(TANDEM_AVX512)
  if (isa == AVX512 && fmt != I8) return dequant_row512(fmt, row, K, out);
#endif
  if (isa == PORTABLE) return dequant_row_scalar(fmt, row, scale, K, out);
  dequant_row(fmt, row, scale, K, out);
}

}  // namespace

namespace {

// y[m, ldy-strided row][0, N) = x[M, K] @ dequantize(w).T: the small-M kernel writing into a slice of a wider output
// (the parts of a projection whose weights are stored in different formats fill their own columns).
void matmul_into(const float* xp, int64_t M, int64_t K, const torch::Tensor& w, int64_t fmt,
                 const torch::Tensor& scales, int64_t isa, float* yp, int64_t ldy) {
  const int64_t N = w.size(0);
  if (!in_registers(isa, fmt)) {  // each row dequantized once into a per-thread buffer, then M dot products
#pragma omp parallel num_threads(threads_for_bytes(w.numel() * w.element_size() * M))
    {
      std::vector<float> buf(K);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        dequant_row_scalar(fmt, row_ptr(w, n), scale_of(scales, fmt, n), K, buf.data());
        const float* wr = buf.data();
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xp + m * K;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < K; ++k) acc += wr[k] * xm[k];
          yp[m * ldy + n] = acc;
        }
      }
    }
    return;
  }
  // Output rows in contiguous chunks per thread: each thread streams its own slice of the weights once.
#pragma omp parallel for num_threads(threads_for_bytes(w.numel() * w.element_size() * M)) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = row_ptr(w, n);
    const float s = scale_of(scales, fmt, n);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) row_isa<8>(isa, fmt, row, s, xp + m * K, K, yp + m * ldy + n, ldy);
    for (; m + 4 <= M; m += 4) row_isa<4>(isa, fmt, row, s, xp + m * K, K, yp + m * ldy + n, ldy);
    switch (M - m) {
      case 3: row_isa<3>(isa, fmt, row, s, xp + m * K, K, yp + m * ldy + n, ldy); break;
      case 2: row_isa<2>(isa, fmt, row, s, xp + m * K, K, yp + m * ldy + n, ldy); break;
      case 1: row_isa<1>(isa, fmt, row, s, xp + m * K, K, yp + m * ldy + n, ldy); break;
      default: break;
    }
  }
}

}  // namespace

// x [M, K] float32, w: blocks [N, row bytes] uint8 or int8 [N, K]; scales [N] float32 for I8 (else ignored); isa: the
// CPU path (Isa) to compute with.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales,
                           int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "quant_matmul: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  matmul_into(x.data_ptr<float>(), M, K, w, fmt, scales, isa, y.data_ptr<float>(), N);
  return y;
}

// x [M, K] float32 with its rows quantized to int8 per block of 32, w: blocks of a 32-wide format (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0). Needs AVX-512 VNNI (`has_int8_activations()`).
torch::Tensor quant_matmul_int8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K) {
#if defined(TANDEM_VNNI)
  TORCH_CHECK(fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0,
              "quant_matmul_int8: int8 activations cover Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, not format ", fmt);
  check(w, fmt, K, torch::Tensor(), PORTABLE);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "quant_matmul_int8: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  float* yp = y.data_ptr<float>();
#pragma omp parallel for num_threads(threads_for_bytes(w.numel() * w.element_size() * M)) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = row_ptr(w, n);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_any_q8<4>(fmt, row, xq, m, K, yp + m * N + n, N);
    switch (M - m) {
      case 3: row_any_q8<3>(fmt, row, xq, m, K, yp + m * N + n, N); break;
      case 2: row_any_q8<2>(fmt, row, xq, m, K, yp + m * N + n, N); break;
      case 1: row_any_q8<1>(fmt, row, xq, m, K, yp + m * N + n, N); break;
      default: break;
    }
  }
  return y;
#else
  TORCH_CHECK(false, "quant_matmul_int8: this build has no AVX-512 VNNI path");
  return x;
#endif
}

bool has_int8_activations() {
#if defined(TANDEM_VNNI)
  return true;
#else
  return false;
#endif
}

// Rows [start, start + count) of the weights as float32 [count, K].
torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, int64_t start,
                         int64_t count, int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= w.size(0), "dequantize: rows out of range");
  auto out = torch::empty({count, K}, torch::dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(count / 16 + 1)) schedule(static)
  for (int64_t r = 0; r < count; ++r)
    dequant_row_isa(isa, fmt, row_ptr(w, start + r), scale_of(scales, fmt, start + r), K, o + r * K);
  return out;
}

// The rows named by ids (any shape, int64) as float32 [*ids.shape, K]: the embedding lookup.
torch::Tensor dequantize_rows(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, torch::Tensor ids,
                              int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "dequantize_rows: int64 ids");
  auto flat = ids.contiguous().view(-1);
  const int64_t T = flat.numel(), N = w.size(0);
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "dequantize_rows: id out of range");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    dequant_row_isa(isa, fmt, row_ptr(w, idp[t]), scale_of(scales, fmt, idp[t]), K, o + t * K);
  auto shape = ids.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
}

// ---- small fused ops of the decode step (float32, CPU) --------------------------------------------------------
// A decode step of a small batch spends as long in ~25 small torch ops per layer (each a dispatch, an allocation,
// a pass over a few KB) as in its matmuls; these do the same arithmetic in one call each.

namespace {
inline void rms_row(const float* x, const float* w, float eps, int64_t D, float* out) {
  double ss = 0.0;  // double accumulation: the mean of squares does not depend on summation order in practice
  for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(x[d]) * x[d];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * inv);  // weight * (x * rsqrt(mean + eps)), as HF
}
}  // namespace

// residual += x (in place, when x is given), then RMSNorm(residual) * weight. x, residual [T, D] float32.
torch::Tensor add_rms_norm(std::optional<torch::Tensor> x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.scalar_type() == torch::kFloat32 && residual.is_contiguous() && residual.dim() == 2,
              "add_rms_norm: contiguous float32 [T, D] residual");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(), "add_rms_norm: float32 weight");
  const int64_t T = residual.size(0), D = residual.size(1);
  TORCH_CHECK(weight.numel() == D, "add_rms_norm: weight size");
  torch::Tensor xc;
  if (x.has_value()) {
    xc = x->contiguous();
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32 && xc.sizes() == residual.sizes(), "add_rms_norm: x like residual");
  }
  auto out = torch::empty_like(residual);
  float* r = residual.data_ptr<float>();
  const float* xp = x.has_value() ? xc.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
#pragma omp parallel for num_threads(num_threads_for(T / 32 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* rt = r + t * D;
    if (xp != nullptr)
      for (int64_t d = 0; d < D; ++d) rt[d] += xp[t * D + d];
    rms_row(rt, w, feps, D, o + t * D);
  }
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I], silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2, "silu_mul: float32 [T, 2I]");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float a = g[t * 2 * I + i];
      o[t * I + i] = a / (1.f + std::exp(-a)) * g[t * 2 * I + I + i];
    }
  return out;
}

// Rotate-half RoPE of q and k inside qkv [T, Hq + 2 Hkv, D] in place (v untouched); cos, sin [T, D].
void rotary_(torch::Tensor qkv, int64_t num_rotated_heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 3, "rotary_: qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "rotary_: tables");
  const int64_t T = qkv.size(0), H = qkv.size(1), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == D && num_rotated_heads <= H, "rotary_: shapes");
  float* p = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < num_rotated_heads; ++h) {
      float* v = p + (t * H + h) * D;
      const float* ct = c + t * D;
      const float* st = s + t * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        // x * cos + rotate_half(x) * sin, each product rounded before the sum (built without FP contraction)
        const float lo = a * ct[i] + (-b) * st[i];
        const float hi = b * ct[i + half] + a * st[i + half];
        v[i] = lo;
        v[i + half] = hi;
      }
    }
}

// ---- a small decode step's layers in one call ----------------------------------------------------------------
// For a decode-only step of a few sequences, Python per layer (module lookups, argument parsing, a dozen calls) cost
// as much as the small ops themselves. `DecodeLayers` holds every layer's weights and settings once, at load, and
// `forward` walks the layers in C++, calling the same functions the Python layer loop calls (the projections'
// small-M kernel, add_rms_norm, rotary_, silu_mul or torch's tanh GELU, the paged decode attention), so the values
// are those of the loop, bit for bit.

namespace py = pybind11;

// The attention of one layer of a decode-only step (kernels/cpu/paged_decode.cpp's `paged_decode_qkv`, another
// extension module): handed over once as a PyCapsule holding its address.
using AttendFn = torch::Tensor (*)(torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                   torch::Tensor, double, int64_t, double);
constexpr const char* ATTEND_CAPSULE = "tandem.paged_decode_qkv";

// One projection: its output columns are the parts' rows in order (a fused q/k/v or gate/up whose parts share a
// format is one part), plus an optional bias.
struct Projection {
  std::vector<torch::Tensor> data, scales;
  std::vector<int64_t> fmts;
  int64_t K = 0, N = 0;
  torch::Tensor bias;  // undefined: none

  Projection(std::vector<torch::Tensor> data_, std::vector<int64_t> fmts_, std::vector<torch::Tensor> scales_,
             int64_t K_, std::optional<torch::Tensor> bias_)
      : data(std::move(data_)), scales(std::move(scales_)), fmts(std::move(fmts_)), K(K_) {
    TORCH_CHECK(!data.empty() && data.size() == fmts.size() && data.size() == scales.size(),
                "Projection: one format and one scales tensor per part");
    for (size_t i = 0; i < data.size(); ++i) {
      check(data[i], fmts[i], K, scales[i], PORTABLE);
      N += data[i].size(0);
    }
    if (bias_.has_value()) {
      bias = bias_->contiguous();
      TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.numel() == N, "Projection: float32 bias of N");
    }
  }

  // x [M, K] -> [M, N]
  torch::Tensor operator()(const torch::Tensor& x, int64_t isa) const {
    TORCH_CHECK(x.is_contiguous() && x.size(1) == K, "Projection: contiguous [M, K] input");
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, x.options());
    float* yp = y.data_ptr<float>();
    int64_t col = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      matmul_into(x.data_ptr<float>(), M, K, data[i], fmts[i], scales[i], isa, yp + col, N);
      col += data[i].size(0);
    }
    if (bias.defined()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) yp[m * N + n] += b[n];
    }
    return y;
  }
};

struct Layer {
  Projection qkv, o, gate_up, down;
  // norm weights as the layer multiplies by them; undefined: the model has none there
  torch::Tensor q_norm, k_norm, attn_post_norm, mlp_norm, mlp_post_norm, next_norm;
  double scale, softcap;
  int64_t window, rope;
};

namespace {
torch::Tensor weight_or_none(const std::optional<torch::Tensor>& w) {
  if (!w.has_value()) return torch::Tensor();
  TORCH_CHECK(w->scalar_type() == torch::kFloat32 && w->is_contiguous() && w->dim() == 1,
              "DecodeLayers: norm weights must be contiguous float32 vectors");
  return *w;
}

// RMSNorm of each row of `rows` rows x D floats, `stride` floats apart, in place.
void rms_rows_(float* p, int64_t rows, int64_t stride, int64_t D, const torch::Tensor& weight, float eps) {
  TORCH_CHECK(weight.numel() == D, "DecodeLayers: norm weight size");
  for (int64_t r = 0; r < rows; ++r) rms_row(p + r * stride, weight.data_ptr<float>(), eps, D, p + r * stride);
}
}  // namespace

class DecodeLayers {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool gelu,
               const py::capsule& attend)
      : nq_(num_heads), nkv_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)), gelu_(gelu) {
    TORCH_CHECK(attend.name() != nullptr && std::string(attend.name()) == ATTEND_CAPSULE,
                "DecodeLayers: the attention must be a ", ATTEND_CAPSULE, " capsule");
    attend_ = reinterpret_cast<AttendFn>(attend.get_pointer());
  }

  void add_layer(Projection qkv, Projection o, Projection gate_up, Projection down,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                 std::optional<torch::Tensor> attn_post_norm, torch::Tensor mlp_norm,
                 std::optional<torch::Tensor> mlp_post_norm, torch::Tensor next_norm, double scale, int64_t window,
                 double softcap, int64_t rope) {
    TORCH_CHECK(qkv.N == (nq_ + 2 * nkv_) * D_ && o.K == nq_ * D_ && gate_up.N % 2 == 0 && down.K == gate_up.N / 2 &&
                    o.N == qkv.K && gate_up.K == qkv.K && down.N == qkv.K,
                "DecodeLayers: projection shapes do not fit the heads");
    layers_.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), weight_or_none(q_norm),
                            weight_or_none(k_norm), weight_or_none(attn_post_norm), weight_or_none(mlp_norm),
                            weight_or_none(mlp_post_norm), weight_or_none(next_norm), scale, softcap, window, rope});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h: layer 0's normed input [T, hidden]; residual [T, hidden], updated in place; kv_caches [layers, 2, blocks,
  // block, Hkv, D]; cos / sin: one [T, D] table per rope; the paged inputs of a decode-only step (one token per
  // sequence). Returns the final norm's output [T, hidden], as the Python layer loop does.
  torch::Tensor forward(torch::Tensor h, torch::Tensor residual, torch::Tensor kv_caches,
                        std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens, int64_t isa) const {
    TORCH_CHECK(h.scalar_type() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(),
                "DecodeLayers: h must be contiguous float32 [T, hidden]");
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == num_layers() && kv_caches.size(1) == 2,
                "DecodeLayers: kv_caches must be [layers, 2, blocks, block, Hkv, D]");
    TORCH_CHECK(cos.size() == sin.size(), "DecodeLayers: one sin table per cos table");
    check_isa(isa, "DecodeLayers");
    const int64_t T = h.size(0), H = nq_ + 2 * nkv_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      TORCH_CHECK(L.rope >= 0 && L.rope < static_cast<int64_t>(cos.size()), "DecodeLayers: no rope table ", L.rope);
      auto qkv = L.qkv(h, isa).view({T, H, D_});
      float* qp = qkv.data_ptr<float>();
      if (L.q_norm.defined()) {
        for (int64_t t = 0; t < T; ++t) {
          rms_rows_(qp + t * H * D_, nq_, D_, D_, L.q_norm, eps_);
          rms_rows_(qp + (t * H + nq_) * D_, nkv_, D_, D_, L.k_norm, eps_);
        }
      }
      rotary_(qkv, nq_ + nkv_, cos[L.rope], sin[L.rope]);
      auto cache = kv_caches.select(0, static_cast<int64_t>(i));
      auto attn = attend_(qkv, nq_, cache.select(0, 0), cache.select(0, 1), slot_mapping, block_tables, seq_lens,
                          L.scale, L.window, L.softcap);
      auto o = L.o(attn.view({T, nq_ * D_}), isa);
      if (L.attn_post_norm.defined()) rms_rows_(o.data_ptr<float>(), T, o.size(1), o.size(1), L.attn_post_norm, eps_);
      h = add_rms_norm(o, residual, L.mlp_norm, eps_);
      auto gate_up = L.gate_up(h, isa);
      const int64_t I = L.gate_up.N / 2;
      torch::Tensor act;
      if (gelu_) {  // torch's own tanh GELU, as TorchOps.act_mul computes it
        act = at::gelu(gate_up.slice(1, 0, I), "tanh") * gate_up.slice(1, I, 2 * I);
      } else {
        act = silu_mul(gate_up);
      }
      auto m = L.down(act.contiguous(), isa);
      if (L.mlp_post_norm.defined()) rms_rows_(m.data_ptr<float>(), T, m.size(1), m.size(1), L.mlp_post_norm, eps_);
      h = add_rms_norm(m, residual, L.next_norm, eps_);
    }
    return h;
  }

 private:
  int64_t nq_, nkv_, D_;
  float eps_;
  bool gelu_;
  AttendFn attend_ = nullptr;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Projection>(m, "Projection", "a projection's weight parts as stored, their formats, K and a bias")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>, int64_t,
                    std::optional<torch::Tensor>>())
      .def_readonly("N", &Projection::N)
      .def("__call__", [](const Projection& p, torch::Tensor x, int64_t isa) {
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "Projection: x must be float32 [M, K]");
        check_isa(isa, "Projection");
        return p(x.contiguous(), isa);
      });
  py::class_<DecodeLayers>(m, "DecodeLayers", "every layer of a small decode step in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, bool, const py::capsule&>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate-half RoPE of q and k in place");
  m.def("best_isa", &best_isa, "the widest CPU path in this build: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("quant_matmul_int8", &quant_matmul_int8, "x @ dequantize(w).T with x quantized to int8 per block of 32");
  m.def("has_int8_activations", &has_int8_activations, "whether this build has the int8-activation path");
  m.def("quant_matmul", &quant_matmul, "x @ dequantize(w).T for small M (CPU, float32)");
  m.def("dequantize", &dequantize, "rows [start, start + count) as float32");
  m.def("dequantize_rows", &dequantize_rows, "the rows named by ids as float32 (embedding lookup)");
}
