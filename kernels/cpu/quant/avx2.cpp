// The AVX2 + FMA + F16C path: every format in registers, 8 lanes. A block is read as groups of 32 weights (one
// group for the 32-wide formats, eight for a K-quant super-block), each group as four vectors of eight: the bits of
// each 16 weights are put together as bytes (nibbles, Q5's fifth bits and Q5_K's high bits added under byte masks,
// Q6_K's low and high bits joined) and widened to floats once; a K-quant's sub-block scales are decoded once per
// super-block (Q4_K / Q5_K's eight 6-bit pairs with word masks, into one vector each). The arithmetic is
// dequant_row_scalar's, so the weights are bit-identical to it: every product d * q is exact in fp32 (see
// avx512.cpp), so `fma(d, q, m)` and `fms(d, q, dm)` round once, exactly as (d * q) + m and (d * q) - dm do.
#include "paths.h"

#ifdef TANDEM_AVX2

namespace tandem {
namespace {

TANDEM_ALWAYS_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TANDEM_ALWAYS_INLINE __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 16 bytes (weight i in byte i) widened to two vectors of eight floats, as unsigned or as signed bytes.
template <bool SIGNED>
TANDEM_ALWAYS_INLINE void widen16(__m128i b, __m256 v[2]) {
  const __m128i up = _mm_srli_si128(b, 8);
  v[0] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  v[1] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(up) : _mm256_cvtepu8_epi32(up));
}

// 16 of Q5_0 / Q5_1's fifth bits (bits 16 h .. 16 h + 15 of the little-endian uint32 qh, one per weight) as bytes of
// 16 or 0: byte i takes byte 2 h + i / 8 of the word, then tests its bit i % 8.
TANDEM_ALWAYS_INLINE __m128i fifth_bits(uint32_t qh, int h) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(qh)),
                                          h ? _mm_set_epi64x(0x0303030303030303, 0x0202020202020202)
                                            : _mm_set_epi64x(0x0101010101010101, 0));
  const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
}

// The 32 weights of a Q4_0 / Q4_1 / Q8_0 block as four vectors of eight, bit-identical to dequant_row_scalar.
template <int64_t FMT>
TANDEM_ALWAYS_INLINE void dequant_block(const uint8_t* blk, __m256 w[4]) {
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

template <int64_t FMT>
struct Block256Plain {  // Q4_0, Q4_1, Q8_0
  static constexpr int G = 1;
  const uint8_t* blk;
  TANDEM_ALWAYS_INLINE explicit Block256Plain(const uint8_t* b) : blk(b) {}
  TANDEM_ALWAYS_INLINE void group(int, __m256 w[4]) const { dequant_block<FMT>(blk, w); }
};

// Q5_0 / Q5_1: the nibbles plus 16 where the fifth bit is set, put together as bytes; Q5_0 takes its offset 16 off
// as bytes, so w = d * (q - 16) with the scalar code's exact int, and Q5_1 adds m in one fma.
template <int64_t FMT>
struct Block256Q5 {
  static constexpr int G = 1;
  const uint8_t* qs;
  uint32_t qh;
  __m256 d, m;
  TANDEM_ALWAYS_INLINE explicit Block256Q5(const uint8_t* blk)
      : qs(blk + (FMT == Q5_1 ? 8 : 6)), qh(load_u32(blk + (FMT == Q5_1 ? 4 : 2))),
        d(_mm256_set1_ps(fp16_to_fp32(blk))), m(_mm256_set1_ps(FMT == Q5_1 ? fp16_to_fp32(blk + 2) : 0.f)) {}
  TANDEM_ALWAYS_INLINE void group(int, __m256 w[4]) const {
    const __m128i bytes = load16(qs), m4 = _mm_set1_epi8(0x0f);
    const __m128i half[2] = {_mm_and_si128(bytes, m4), _mm_and_si128(_mm_srli_epi16(bytes, 4), m4)};
    for (int h = 0; h < 2; ++h) {
      const __m128i q = _mm_or_si128(half[h], fifth_bits(qh, h));
      if constexpr (FMT == Q5_1) {
        widen16<false>(q, w + 2 * h);
        w[2 * h] = _mm256_fmadd_ps(d, w[2 * h], m);
        w[2 * h + 1] = _mm256_fmadd_ps(d, w[2 * h + 1], m);
      } else {
        widen16<true>(_mm_sub_epi8(q, _mm_set1_epi8(16)), w + 2 * h);
        w[2 * h] = _mm256_mul_ps(d, w[2 * h]);
        w[2 * h + 1] = _mm256_mul_ps(d, w[2 * h + 1]);
      }
    }
  }
};

// Q4_K / Q5_K: eight sub-blocks of 32, each with its own 6-bit scale and min; group g takes the low (g even) or
// high (g odd) nibbles of bytes [32 (g / 2), 32 (g / 2) + 32), and for Q5_K bit g of qh[l] as the fifth bit.
template <int64_t FMT>
struct Block256K {
  static constexpr int G = 8;
  const uint8_t* qs;
  const uint8_t* qh;
  __m256 dd, dm;  // lane j: sub-block j's d * scale and dmin * min
  TANDEM_ALWAYS_INLINE explicit Block256K(const uint8_t* blk) : qs(blk + (FMT == Q5_K ? 48 : 16)), qh(blk + 16) {
    // gguf-py's get_scale_min on whole words (llama.cpp's masks): bytes 0-3 of the 12 hold scales 0-3 and the top
    // bits of scales 4-7, bytes 4-7 the mins 0-3 and the top bits of mins 4-7, bytes 8-11 the low bits of 4-7.
    const uint32_t s0 = load_u32(blk + 4), s1 = load_u32(blk + 8), s2 = load_u32(blk + 12);
    const uint32_t sc_hi = (s2 & 0x0f0f0f0f) | (((s0 >> 6) & 0x03030303) << 4);
    const uint32_t mn_hi = ((s2 >> 4) & 0x0f0f0f0f) | (((s1 >> 6) & 0x03030303) << 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(s0 & 0x3f3f3f3f, sc_hi, 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(s1 & 0x3f3f3f3f, mn_hi, 0, 0)));
    dd = _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(blk)), sc);  // the scalar code's d * sc, lane by lane
    dm = _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(blk + 2)), mn);
  }
  TANDEM_ALWAYS_INLINE void group(int g, __m256 w[4]) const {
    const uint8_t* bytes = qs + (g / 2) * 32;
    for (int h = 0; h < 2; ++h) {
      const __m128i b = load16(bytes + 16 * h);
      __m128i q = _mm_and_si128(g & 1 ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
      if constexpr (FMT == Q5_K) {
        const __m128i bit = _mm_set1_epi8(static_cast<char>(1 << g));
        q = _mm_or_si128(q, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(load16(qh + 16 * h), bit), bit),
                                          _mm_set1_epi8(16)));
      }
      widen16<false>(q, w + 2 * h);
    }
    const __m256i lane = _mm256_set1_epi32(g);
    const __m256 scale = _mm256_permutevar8x32_ps(dd, lane), min = _mm256_permutevar8x32_ps(dm, lane);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmsub_ps(scale, w[j], min);
  }
};

// Q6_K: sixteen sub-blocks of 16 with int8 scales; a group of 32 is two of them. Low 4 bits from ql, high 2 from qh,
// joined as bytes (q - 32 as int8) and widened once.
struct Block256Q6 {
  static constexpr int G = 8;
  const uint8_t* ql;
  const uint8_t* qh;
  float ds[16];
  TANDEM_ALWAYS_INLINE explicit Block256Q6(const uint8_t* blk) : ql(blk), qh(blk + 128) {
    const float d = fp16_to_fp32(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(sc[i]);
  }
  TANDEM_ALWAYS_INLINE void group(int j, __m256 w[4]) const {
    const uint8_t* lo_bytes = ql + (j / 4) * 64 + (j % 2) * 32;
    const uint8_t* hi_bytes = qh + (j / 4) * 32;
    const __m128i lo_shift = _mm_cvtsi32_si128(4 * ((j / 2) % 2)), hi_shift = _mm_cvtsi32_si128(2 * (j % 4));
    for (int h = 0; h < 2; ++h) {  // 16 weights of one int8 scale
      const __m128i lo = _mm_and_si128(_mm_srl_epi16(load16(lo_bytes + 16 * h), lo_shift), _mm_set1_epi8(0x0f));
      const __m128i hi = _mm_and_si128(_mm_srl_epi16(load16(hi_bytes + 16 * h), hi_shift), _mm_set1_epi8(3));
      widen16<true>(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)), w + 2 * h);
      const __m256 scale = _mm256_set1_ps(ds[2 * j + h]);
      w[2 * h] = _mm256_mul_ps(scale, w[2 * h]);
      w[2 * h + 1] = _mm256_mul_ps(scale, w[2 * h + 1]);
    }
  }
};

// One block of FMT with its scales decoded once; `group(g, w)` yields weights [32 g, 32 g + 32) as w[0..3]. An alias,
// not specialisations deriving from these: an inherited constructor is a function of its own, which GCC did not
// inline.
template <int64_t FMT>
using Block256 = std::conditional_t<
    FMT == Q6_K, Block256Q6,
    std::conditional_t<FMT == Q4_K || FMT == Q5_K, Block256K<FMT>,
                       std::conditional_t<FMT == Q5_0 || FMT == Q5_1, Block256Q5<FMT>, Block256Plain<FMT>>>>;

// y[m, n] for MT (1..8) rows of x starting at x, one output row of blocks. The loops over rows and accumulators are
// unrolled by pragma: left to GCC, the accumulators of two and four rows stayed in memory (Q4_0 and Q8_0 at two rows
// measured 1.7x slower).
template <int64_t FMT, int MT>
inline void row256(const uint8_t* row, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT), BE = block_elems(FMT);
  // Independent FMA chains per row while registers allow: four for one or two rows (a group's four products then
  // wait on no other), two up to four rows, one for eight (8 chains, 12 registers). One row and two rows take the
  // same arithmetic per row, so a sequence's values do not change when a second one joins its step.
  constexpr int NA = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  __m256 acc[MT][NA];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / BE; ++b) {
    prefetch_ahead(row + b * BB);
    const Block256<FMT> blk(row + b * BB);
#pragma GCC unroll 8
    for (int g = 0; g < Block256<FMT>::G; ++g) {
      __m256 w[4];
      blk.group(g, w);
      const float* xb = x + b * BE + g * 32;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {  // written out: a loop over the four left acc[] in memory
        const float* xm = xb + m * ldx;
        acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xm), acc[m][0]);
        acc[m][1 % NA] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), acc[m][1 % NA]);
        acc[m][2 % NA] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), acc[m][2 % NA]);
        acc[m][3 % NA] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), acc[m][3 % NA]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    __m256 s = acc[m][0];
    if constexpr (NA == 4) s = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
    if constexpr (NA == 2) s = _mm256_add_ps(acc[m][0], acc[m][1]);
    y[m * ldy] = hsum(s);
  }
}

template <int64_t FMT>
void dequant_row256(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t BB = block_bytes(FMT), BE = block_elems(FMT);
  for (int64_t b = 0; b < K / BE; ++b) {
    const Block256<FMT> blk(row + b * BB);
    for (int g = 0; g < Block256<FMT>::G; ++g) {
      __m256 w[4];
      blk.group(g, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * BE + g * 32 + 8 * j, w[j]);
    }
  }
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

// Calls f(std::integral_constant<int64_t, FMT>{}) for the GGUF format code fmt.
template <class F>
inline void with_format(int64_t fmt, F&& f) {
  switch (fmt) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case Q5_0: return f(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return f(std::integral_constant<int64_t, Q5_1>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    default: return f(std::integral_constant<int64_t, Q6_K>{});
  }
}

}  // namespace

void row_avx2(int64_t fmt, const uint8_t* row, float s, const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  if (fmt == I8) {
    return for_row_tiles<8>(M, [&](auto mt, int64_t m) {
      row_i8<decltype(mt)::value>(reinterpret_cast<const int8_t*>(row), s, x + m * K, K, K, y + m * ldy, ldy);
    });
  }
  with_format(fmt, [&](auto fmt_c) {
    for_row_tiles<8>(M, [&](auto mt, int64_t m) {
      row256<decltype(fmt_c)::value, decltype(mt)::value>(row, x + m * K, K, K, y + m * ldy, ldy);
    });
  });
}

void dequant_row_avx2(int64_t fmt, const uint8_t* row, float s, int64_t K, float* out) {
  if (fmt == I8) return dequant_row_scalar(fmt, row, s, K, out);  // vectorised by the compiler
  with_format(fmt, [&](auto fmt_c) { dequant_row256<decltype(fmt_c)::value>(row, K, out); });
}

}  // namespace tandem

#endif  // TANDEM_AVX2
