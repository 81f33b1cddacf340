// The AVX2 + FMA + F16C path: every format in registers, 8 lanes. A block is read as groups of 32 weights (one
// group for the 32-wide formats, eight for a K-quant super-block), each group as four vectors of eight: the bits of
// a group are put together as 32 bytes (nibbles, Q5's fifth bits and Q6_K's high bits joined under byte masks) and
// widened to floats once; a K-quant's sub-block scales are decoded once per super-block. The arithmetic is
// dequant_row_scalar's, so the weights are bit-identical to it: every product d * q is exact in fp32 (see
// avx512.cpp), so `fma(d, q, m)` and `fms(d, q, dm)` round once, exactly as (d * q) + m and (d * q) - dm do.
#include "paths.h"

#ifdef TANDEM_AVX2

namespace tandem {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 bytes (weight i in byte i) widened to four vectors of eight floats, as unsigned or as signed bytes.
template <bool SIGNED>
inline void widen(__m256i b, __m256 v[4]) {
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j)
    v[j] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(part[j]) : _mm256_cvtepu8_epi32(part[j]));
}

// A 32-wide nibble block's 16 bytes as 32 bytes in element order: low nibbles (weights 0-15), then high (16-31).
inline __m256i nibbles32(const uint8_t* q) {
  const __m128i b = load16(q);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
}

// Q5_0 / Q5_1's 32 fifth bits (a little-endian uint32, bit i for weight i) as bytes of 16 or 0: byte i takes byte
// i / 8 of the word, then tests its bit i % 8.
inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// One block's scales decoded once; `group(g, w)` yields weights [32 g, 32 g + 32) as w[0..3].
template <int64_t FMT>
struct Block256;

template <>
struct Block256<Q8_0> {
  static constexpr int G = 1;
  const uint8_t* q;
  __m256 d;
  explicit Block256(const uint8_t* blk) : q(blk + 2), d(_mm256_set1_ps(fp16_to_fp32(blk))) {}
  inline void group(int, __m256 w[4]) const {
    widen<true>(load32(q), w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], d);
  }
};

// Q4_0 / Q4_1 / Q5_0 / Q5_1: the nibbles, plus 16 where a Q5 fifth bit is set; Q4_0 / Q5_0 take their offset (8,
// 16) off as bytes, so w = d * (q - c) with the same exact int as the scalar code, and Q4_1 / Q5_1 add m in one fma.
template <int64_t FMT>
struct Block256Small {
  static constexpr int G = 1;
  static constexpr bool Q5 = FMT == Q5_0 || FMT == Q5_1, MIN = FMT == Q4_1 || FMT == Q5_1;
  const uint8_t* blk;
  __m256 d, m;
  explicit Block256Small(const uint8_t* b)
      : blk(b), d(_mm256_set1_ps(fp16_to_fp32(b))), m(_mm256_set1_ps(MIN ? fp16_to_fp32(b + 2) : 0.f)) {}
  inline void group(int, __m256 w[4]) const {
    constexpr int qh_off = MIN ? 4 : 2, qs_off = qh_off + (Q5 ? 4 : 0);
    __m256i q = nibbles32(blk + qs_off);
    if constexpr (Q5) q = _mm256_or_si256(q, fifth_bits(load_u32(blk + qh_off)));
    if constexpr (MIN) {
      widen<false>(q, w);
      for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(d, w[j], m);
    } else {
      widen<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(Q5 ? 16 : 8)), w);
      for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, w[j]);
    }
  }
};
template <>
struct Block256<Q4_0> : Block256Small<Q4_0> {
  using Block256Small<Q4_0>::Block256Small;
};
template <>
struct Block256<Q4_1> : Block256Small<Q4_1> {
  using Block256Small<Q4_1>::Block256Small;
};
template <>
struct Block256<Q5_0> : Block256Small<Q5_0> {
  using Block256Small<Q5_0>::Block256Small;
};
template <>
struct Block256<Q5_1> : Block256Small<Q5_1> {
  using Block256Small<Q5_1>::Block256Small;
};

// Q4_K / Q5_K: eight sub-blocks of 32, each with its own 6-bit scale and min; group g takes the low (g even) or
// high (g odd) nibbles of bytes [32 (g / 2), 32 (g / 2) + 32), and for Q5_K bit g of qh[l] as the fifth bit.
template <int64_t FMT>
struct Block256K {
  static constexpr int G = 8;
  const uint8_t* qs;
  __m256i qh;
  float dd[8], dm[8];
  explicit Block256K(const uint8_t* blk)
      : qs(blk + (FMT == Q5_K ? 48 : 16)), qh(FMT == Q5_K ? load32(blk + 16) : _mm256_setzero_si256()) {
    const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(blk + 4, j, sc, mn);
      dd[j] = d * sc;
      dm[j] = dmin * mn;
    }
  }
  inline void group(int g, __m256 w[4]) const {
    const __m256i b = load32(qs + (g / 2) * 32);
    __m256i q = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(0x0f));
    if constexpr (FMT == Q5_K) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << g));
      q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                              _mm256_set1_epi8(16)));
    }
    widen<false>(q, w);
    const __m256 scale = _mm256_set1_ps(dd[g]), min = _mm256_set1_ps(dm[g]);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmsub_ps(scale, w[j], min);
  }
};
template <>
struct Block256<Q4_K> : Block256K<Q4_K> {
  using Block256K<Q4_K>::Block256K;
};
template <>
struct Block256<Q5_K> : Block256K<Q5_K> {
  using Block256K<Q5_K>::Block256K;
};

// Q6_K: sixteen sub-blocks of 16 with int8 scales; a group of 32 is two of them. Low 4 bits from ql, high 2 from qh,
// joined as bytes (q - 32 as int8) and widened once.
template <>
struct Block256<Q6_K> {
  static constexpr int G = 8;
  const uint8_t* ql;
  const uint8_t* qh;
  float ds[16];
  explicit Block256(const uint8_t* blk) : ql(blk), qh(blk + 128) {
    const float d = fp16_to_fp32(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(sc[i]);
  }
  inline void group(int j, __m256 w[4]) const {
    const __m128i lo_shift = _mm_cvtsi32_si128(4 * ((j / 2) % 2)), hi_shift = _mm_cvtsi32_si128(2 * (j % 4));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(load32(ql + (j / 4) * 64 + (j % 2) * 32), lo_shift),
                                        _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(load32(qh + (j / 4) * 32), hi_shift), _mm256_set1_epi8(3));
    widen<true>(_mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32)), w);
    const __m256 s0 = _mm256_set1_ps(ds[2 * j]), s1 = _mm256_set1_ps(ds[2 * j + 1]);
    w[0] = _mm256_mul_ps(s0, w[0]);
    w[1] = _mm256_mul_ps(s0, w[1]);
    w[2] = _mm256_mul_ps(s1, w[2]);
    w[3] = _mm256_mul_ps(s1, w[3]);
  }
};

// y[m, n] for MT (1..8) rows of x starting at x, one output row of blocks.
template <int64_t FMT, int MT>
inline void row256(const uint8_t* row, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT), BE = block_elems(FMT);
  // Up to 4 rows: two accumulators per row (independent FMA chains); 8 rows: one each (8 chains, 12 registers).
  constexpr int NA = MT <= 4 ? 2 : 1;
  __m256 acc[MT][NA];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / BE; ++b) {
    prefetch_ahead(row + b * BB);
    const Block256<FMT> blk(row + b * BB);
    for (int g = 0; g < Block256<FMT>::G; ++g) {
      __m256 w[4];
      blk.group(g, w);
      const float* xb = x + b * BE + g * 32;
      for (int m = 0; m < MT; ++m) {
        const float* xm = xb + m * ldx;
        acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xm), acc[m][0]);
        acc[m][NA - 1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), acc[m][NA - 1]);
        acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), acc[m][0]);
        acc[m][NA - 1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), acc[m][NA - 1]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = hsum(NA == 2 ? _mm256_add_ps(acc[m][0], acc[m][NA - 1]) : acc[m][0]);
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
