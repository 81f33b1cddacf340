// int8 activations on AVX2: the 32-wide formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q4_K, Q5_K, Q6_K,
// below row_k8), as llama.cpp's AVX2 path computes
// them: each row of x is quantized per block of 32 (quantize_block32, the VNNI path's integers and dx), and a block's
// dot product is one integer sum of 32 products, `_mm256_maddubs_epi16` (unsigned bytes times signed bytes, adjacent
// pairs summed to int16) then `_mm256_madd_epi16` by ones (pairs of those to int32):
//   Q4_0, Q5_0, Q8_0: the weights as signed bytes q - c (c = 8, 16, 0); maddubs takes |q - c| and qx with the sign
//     of q - c moved onto it (`_mm256_sign_epi8`), so sum_k w_k x_k ~= d dx sum_k (q_k - c) qx_k;
//   Q4_1, Q5_1: the weights as unsigned bytes q (0-31), so sum_k w_k x_k ~= d dx sum_k q_k qx_k + m dx sum_k qx_k.
// No int16 sum can saturate: |q - c| <= 128 and |qx| <= 127 make a pair at most 32,512. The integer sums are exact,
// so the result differs from the float32 path by the rounding of x to 8 bits and from the VNNI path (which takes
// every format as unsigned bytes and its offset from the block sums) by float32 round-off only.
#include "paths.h"

#ifdef TANDEM_AVX2

namespace tandem {

Int8Rows quantize_rows_avx2(const float* x, int64_t M, int64_t K) {
  Int8Rows r;
  r.nb = K / 32;
  r.q.resize(M * K);
  r.dx.resize(M * r.nb);
  r.sum.resize(M * r.nb);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < r.nb; ++b) {
      float dx;
      const int s = quantize_block32(x + m * K + b * 32, r.q.data() + (m * r.nb + b) * 32, dx);
      r.dx[m * r.nb + b] = dx;
      r.sum[m * r.nb + b] = dx * static_cast<float>(s);
    }
  return r;
}

namespace {

// A block's 32 weights as bytes in element order: signed q - c (Q4_0, Q5_0, Q8_0) or unsigned q (Q4_1, Q5_1).
template <int64_t FMT>
TANDEM_ALWAYS_INLINE __m256i block_bytes32(const uint8_t* blk) {
  if constexpr (FMT == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    constexpr int off = FMT == Q4_0 ? 2 : FMT == Q4_1 ? 4 : FMT == Q5_0 ? 6 : 8;
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
    // low nibbles are elements 0-15, high nibbles 16-31
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
    if constexpr (FMT == Q4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    if constexpr (FMT == Q5_0 || FMT == Q5_1) {
      // bit i of qh (little-endian) onto byte i: byte i takes byte i / 8 of the word, then tests its bit i % 8
      const uint32_t qh = load_u32(blk + (FMT == Q5_0 ? 2 : 4));
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(qh)),
          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      if constexpr (FMT == Q5_1) return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      // Q5_0: q - 16 as a signed byte, i.e. the nibble with 0xF0 set where the fifth bit is clear
      return _mm256_or_si256(q, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xf0))));
    }
    return q;
  }
}

template <int64_t FMT, int MT>
void row_q8(const uint8_t* row, const Int8Rows& xq, int64_t m0, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT);
  constexpr bool SIGNED = FMT == Q4_0 || FMT == Q5_0 || FMT == Q8_0;
  constexpr bool MIN = FMT == Q4_1 || FMT == Q5_1;
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  float corr[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps(), corr[m] = 0.f;
  const int8_t* qx0 = xq.q.data() + m0 * nb * 32;
  const float* dx0 = xq.dx.data() + m0 * nb;
  const float* sum0 = xq.sum.data() + m0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * BB;
    prefetch_ahead(blk);
    const float d = fp16_to_fp32(blk);
    const float mn = MIN ? fp16_to_fp32(blk + 2) : 0.f;
    const __m256i w = block_bytes32<FMT>(blk);
    const __m256i aw = SIGNED ? _mm256_sign_epi8(w, w) : w;
    for (int m = 0; m < MT; ++m) {
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx0 + (m * nb + b) * 32));
      if constexpr (SIGNED) qx = _mm256_sign_epi8(qx, w);
      const __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, qx), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dx0[m * nb + b]), acc[m]);
      if constexpr (MIN) corr[m] += mn * sum0[m * nb + b];
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[m * ldy] = _mm_cvtss_f32(s) + corr[m];
  }
}

// The K-quants (llama.cpp's AVX2 ggml_vec_dot_q{4,5,6}_K_q8_K, with our scalar layout): per super-block of 256 and
// row of x, the products of each sub-block are summed by maddubs to int16 pairs and by madd with the sub-block's
// scale to int32, in 8 lanes; the lanes are exact integers below 2^24 (Q4_K / Q5_K: 8 sub-blocks x 63 x 4 x 31 x
// 127; Q6_K: 8 x 128 x 4 x 32 x 127), so converting them to float is exact, and
//   Q4_K, Q5_K: sum_k w_k x_k ~= d dx sum_j sc_j sum_{k in j} q_k qx_k - dmin dx sum_j m_j sum_{k in j} qx_k
//   Q6_K:       sum_k w_k x_k ~= d dx sum_j sc_j sum_{k in j} (q_k - 32) qx_k   (signed bytes, the sign moved onto x)
// with one fma per super-block and lane for each term.
template <int64_t FMT, int MT>
void row_k8(const uint8_t* row, const Int8KRows& xq, int64_t m0, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT);
  const int64_t nsb = K / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* qx0 = xq.q.data() + m0 * K;
  const float* dx0 = xq.dx.data() + m0 * nsb;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = row + sb * BB;
    prefetch_ahead(blk);
    prefetch_ahead(blk + 64);
    prefetch_ahead(blk + 128);
    if constexpr (BB > 192) prefetch_ahead(blk + 192);
    __m256i sumi[MT];
    for (int m = 0; m < MT; ++m) sumi[m] = _mm256_setzero_si256();
    if constexpr (FMT == Q4_K || FMT == Q5_K) {
      const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
      // the 8 scales (16-bit lanes 0-7) and mins (8-15), four word operations instead of 16 scalar decodes
      const __m256i sm = k_scales_mins16(blk + 4);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
      const uint8_t* qs = blk + (FMT == Q5_K ? 48 : 16);
      const __m256i qh = FMT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                     : _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles)
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
        __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
        if constexpr (FMT == Q5_K) {  // bit j of qh[l] is sub-block j's fifth bit of element l
          const __m256i one = _mm256_set1_epi8(1);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4));
        }
        const __m256i slo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(0x0101 * 4 * i + 0x0100)));
        const __m256i shi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(0x0101 * (4 * i + 2) + 0x0100)));
        for (int m = 0; m < MT; ++m) {
          const int8_t* qx = qx0 + m * K + sb * 256 + 64 * i;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32));
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), slo));
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), shi));
        }
      }
      // mins: m_j times the sums of qx over sub-block j (two sums of 16), as one madd of int16 vectors
      const __m128i mn = _mm256_extracti128_si256(sm, 1);
      const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
      for (int m = 0; m < MT; ++m) {
        const float dx = dx0[m * nsb + sb];
        const __m256i bs = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq.bsum.data() + (m0 + m) * (K / 16) + sb * 16));
        const __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * dx), acc[m]);
        acc[m] = _mm256_fnmadd_ps(msum, _mm256_set1_ps(dmin * dx), acc[m]);
      }
    } else {  // Q6_K
      const uint8_t* ql = blk;
      const uint8_t* qhp = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = fp16_to_fp32(blk + 208);
      const __m256i m2 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
      // sub-block scales widened once: scb[h] holds sc[8 h .. 8 h + 7] as 16-bit lanes in both 128-bit halves
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
      const __m256i scb[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)),
                              _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)))};
      for (int h = 0; h < 2; ++h) {  // 128 weights: groups of 32 from ql[64h ..], ql[64h + 32 ..] and qh[32h ..]
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qhp + 32 * h));
        for (int g = 0; g < 4; ++g) {
          const __m256i lb = (g % 2) ? l1 : l0;
          const __m256i low = g < 2 ? _mm256_and_si256(lb, m4) : _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4);
          const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), m2), 4);
          const __m256i w = _mm256_sub_epi8(_mm256_or_si256(low, high), c32);  // q - 32, signed
          const __m256i aw = _mm256_sign_epi8(w, w);
          // sub-blocks j = 8 h + 2 g and j + 1 (of 16): one per 128-bit lane
          const __m256i scv = _mm256_shuffle_epi8(  // sc[j] in the low half, sc[j + 1] in the high half
              scb[h], _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0101 * (4 * g + 2) + 0x0100)),
                                       _mm_set1_epi16(static_cast<int16_t>(0x0101 * 4 * g + 0x0100))));
          for (int m = 0; m < MT; ++m) {
            const __m256i x = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(qx0 + m * K + sb * 256 + 128 * h + 32 * g));
            sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)),
                                                                  scv));
          }
        }
      }
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * dx0[m * nsb + sb]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[m * ldy] = _mm_cvtss_f32(s);
  }
}

}  // namespace

Int8KRows quantize_rows_k(const float* x, int64_t M, int64_t K) {
  Int8KRows r;
  r.nsb = K / 256;
  r.q.resize(M * K);
  r.dx.resize(M * r.nsb);
  r.bsum.resize(M * K / 16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < r.nsb; ++b)
      r.dx[m * r.nsb + b] = quantize_block256(x + m * K + b * 256, r.q.data() + m * K + b * 256,
                                              r.bsum.data() + m * (K / 16) + b * 16);
  return r;
}

void row_int8k_avx2(int64_t fmt, const uint8_t* row, const Int8KRows& xq, int64_t M, int64_t K, float* y,
                    int64_t ldy) {
  auto tiles = [&](auto fmt_c) {
    for_row_tiles<4>(M, [&](auto mt, int64_t m) {
      row_k8<decltype(fmt_c)::value, decltype(mt)::value>(row, xq, m, K, y + m * ldy, ldy);
    });
  };
  switch (fmt) {
    case Q4_K: return tiles(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return tiles(std::integral_constant<int64_t, Q5_K>{});
    default: return tiles(std::integral_constant<int64_t, Q6_K>{});
  }
}

void row_int8_avx2(int64_t fmt, const uint8_t* row, const Int8Rows& xq, int64_t M, int64_t K, float* y,
                   int64_t ldy) {
  auto tiles = [&](auto fmt_c) {
    for_row_tiles<4>(M, [&](auto mt, int64_t m) {
      row_q8<decltype(fmt_c)::value, decltype(mt)::value>(row, xq, m, K, y + m * ldy, ldy);
    });
  };
  switch (fmt) {
    case Q4_0: return tiles(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return tiles(std::integral_constant<int64_t, Q4_1>{});
    case Q5_0: return tiles(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return tiles(std::integral_constant<int64_t, Q5_1>{});
    default: return tiles(std::integral_constant<int64_t, Q8_0>{});
  }
}

}  // namespace tandem

#endif  // TANDEM_AVX2
