// The AVX-512 (F + BW + VL) path: every GGUF block format in registers, 16 lanes (I8 takes the AVX2 kernel).
// A block is read as groups of 32 weights (one group for the 32-wide formats, eight for a K-quant super-block),
// each group as two vectors of 16. The arithmetic is gguf-py's, so the weights are bit-identical to
// dequant_row_scalar: every product d * q here is exact in fp32 (an fp16 scale, times a 6- or 8-bit sub-block scale
// where there is one, times a quant of at most 6 bits: at most 24 significant bits), so `fma(d, q, m)` and
// `fms(d, q, dm)` round once, exactly as (d * q) + m and (d * q) - dm do.
#include "paths.h"

#ifdef TANDEM_AVX512

namespace tandem {
namespace {

inline __m512 u8x16_to_ps(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

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

// y[m, n] for MT (1..16) rows of x, one output row of blocks.
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

}  // namespace

void row_avx512(int64_t fmt, const uint8_t* row, const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  auto tiles = [&](auto fmt_c) {
    for_row_tiles_exact16(M, [&](auto mt, int64_t m) {
      row512<decltype(fmt_c)::value, decltype(mt)::value>(row, x + m * K, K, K, y + m * ldy, ldy);
    });
  };
  switch (fmt) {
    case Q4_0: return tiles(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return tiles(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return tiles(std::integral_constant<int64_t, Q8_0>{});
    case Q5_0: return tiles(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return tiles(std::integral_constant<int64_t, Q5_1>{});
    case Q4_K: return tiles(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return tiles(std::integral_constant<int64_t, Q5_K>{});
    default: return tiles(std::integral_constant<int64_t, Q6_K>{});
  }
}

void dequant_row_avx512(int64_t fmt, const uint8_t* row, int64_t K, float* out) {
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

}  // namespace tandem

#endif  // TANDEM_AVX512
