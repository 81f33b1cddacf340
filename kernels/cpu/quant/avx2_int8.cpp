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

#include <algorithm>
#include <cstring>
#include <memory>

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

// ---- the wide int8 GEMM (prefill chunks): Q4_0, Q4_1, Q5_0, Q5_1 ----------------------------------------------
//
// The small-M kernel above takes one output row at a time and pays, per block and row, a maddubs + madd, a
// conversion and a scale: at 8 rows it is slower than float32. Past small_m the weights are first repacked, once
// per call, for a register-blocked GEMM as llama.cpp's repacked q4_0x8 AVX2 GEMM lays them out: per group of 8
// output rows (columns of y) and block of 32, 8 chunks of 32 bytes, chunk c holding elements 4c..4c+3 of each of
// the 8 weight rows as unsigned bytes u (Q4: 0-15, Q5: 0-31), plus the 8 rows' d and b = m - c d (the weight is
// d (u - c) + m = d u + b, c = 8 / 16 for Q4_0 / Q5_0, c = 0 with the min m for Q4_1 / Q5_1). A row of x's block
// is then 8 broadcasts of 4 int8 values, each multiplied by one chunk with maddubs: lane j of the int32 sums is
// weight row j's dot product, so 256 products cost 8 maddubs, their int16 sums (exact: at most 8 * 2 * 15 * 127 =
// 30,480 for Q4, 4 chunks for Q5, 31,496) and one madd, and the block adds d dx sum(u qx) + b dx sum(qx) to 8
// float lanes with two fma. The integer sums are those of the small-M kernel (the same quantize_block32 rows), so
// the two kernels differ by float32 round-off only.

namespace {

constexpr int64_t G8_BYTES = 256;  // a group's block: 8 chunks x 8 rows x 4 bytes

// The group of rows n0..n0+7 (rows past N zero), blocks [0, nb): bytes [nb][8 chunks][8 rows][4], d and b [nb][8].
template <int64_t FMT>
void repack_group8(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t n0, int64_t nb, uint8_t* out, float* dv,
                   float* bv) {
  constexpr int64_t BB = block_bytes(FMT);
  constexpr int c = FMT == Q4_0 ? 8 : FMT == Q5_0 ? 16 : 0;
  alignas(32) uint8_t u[8][32];
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 8; ++j) {
      const int64_t n = n0 + j;
      if (n >= N) {
        std::memset(u[j], 0, 32);
        dv[b * 8 + j] = 0.f;
        bv[b * 8 + j] = 0.f;
        continue;
      }
      const uint8_t* blk = w + n * row_bytes + b * BB;
      __m256i q = block_bytes32<FMT>(blk);
      if constexpr (c != 0) q = _mm256_add_epi8(q, _mm256_set1_epi8(c));  // signed q - c back to unsigned q
      _mm256_store_si256(reinterpret_cast<__m256i*>(u[j]), q);
      const float d = fp16_to_fp32(blk);
      dv[b * 8 + j] = d;
      bv[b * 8 + j] = (FMT == Q4_1 || FMT == Q5_1) ? fp16_to_fp32(blk + 2) : -static_cast<float>(c) * d;
    }
    uint8_t* o = out + b * G8_BYTES;
    for (int ch = 0; ch < 8; ++ch)
      for (int j = 0; j < 8; ++j) std::memcpy(o + ch * 32 + j * 4, u[j] + ch * 4, 4);
  }
}

// 32 activations rounded as quantize_block32 rounds them, 8 lanes at a time: the same max, the same products x * inv
// and the same round-to-nearest-even (vroundps in the default rounding mode is nearbyint), so the same bytes and
// dx bit for bit; the scalar loop called libm's fmaxf per element and took 10% of a 512-row GEMM.
TANDEM_ALWAYS_INLINE int quantize_block32_avx2(const float* xb, int8_t* qb, float& dx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
               v3 = _mm256_loadu_ps(xb + 24);
  // max_ps(a, b) is b where a is NaN: a NaN element is skipped, as std::fmax skips it
  __m256 mx = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_setzero_ps());
  mx = _mm256_max_ps(_mm256_andnot_ps(sign, v1), mx);
  mx = _mm256_max_ps(_mm256_andnot_ps(sign, v2), mx);
  mx = _mm256_max_ps(_mm256_andnot_ps(sign, v3), mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  dx = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), R));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), R));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), R));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), R));
  // |values| <= 127: the saturating packs are exact; they interleave 128-bit lanes, which the permute undoes
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}

TANDEM_ALWAYS_INLINE int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The assembly tiles' text, one chunk of 32 bytes of weights at a time: both groups' weights at byte WOFF of the block
// (I8_LOAD_W), then per row of x its 4 bytes at XOFF broadcast and multiplied by both (I8_FIRST: the chunk that starts
// the row's int16 sums; I8_ADD: one added to them through %[p]). Q5's three rows widen the int16 sums of chunks 0-3
// into their int32 sums %[tRG] (I8_MADD3_TO_T) and add those of chunks 4-7 (I8_MADD3_ADD_T).
#define I8_LOAD_W(WOFF) "vmovdqa " #WOFF "(%[w0]), %[wa]\n\t" "vmovdqa " #WOFF "(%[w1]), %[wb]\n\t"
#define I8_FIRST(XOFF, X, S0, S1)                                                                  \
  "vpbroadcastd " #XOFF "(%[" #X "]), %[xv]\n\t" "vpmaddubsw %[xv], %[wa], %[" #S0 "]\n\t"        \
  "vpmaddubsw %[xv], %[wb], %[" #S1 "]\n\t"
#define I8_ADD(XOFF, X, S0, S1)                                                                    \
  "vpbroadcastd " #XOFF "(%[" #X "]), %[xv]\n\t" "vpmaddubsw %[xv], %[wa], %[p]\n\t"             \
  "vpaddw %[p], %[" #S0 "], %[" #S0 "]\n\t" "vpmaddubsw %[xv], %[wb], %[p]\n\t"                  \
  "vpaddw %[p], %[" #S1 "], %[" #S1 "]\n\t"
#define I8_FIRST3(XOFF) I8_FIRST(XOFF, x0, s00, s01) I8_FIRST(XOFF, x1, s10, s11) I8_FIRST(XOFF, x2, s20, s21)
#define I8_ADD3(XOFF) I8_ADD(XOFF, x0, s00, s01) I8_ADD(XOFF, x1, s10, s11) I8_ADD(XOFF, x2, s20, s21)
#define I8_FIRST5(XOFF) I8_FIRST3(XOFF) I8_FIRST(XOFF, x3, s30, s31) I8_FIRST(XOFF, x4, s40, s41)
#define I8_ADD5(XOFF) I8_ADD3(XOFF) I8_ADD(XOFF, x3, s30, s31) I8_ADD(XOFF, x4, s40, s41)
#define I8_MADD_TO_T(RG) "vpmaddwd %[ones], %[s" #RG "], %[t" #RG "]\n\t"
#define I8_MADD3_TO_T                                                                              \
  I8_MADD_TO_T(00) I8_MADD_TO_T(01) I8_MADD_TO_T(10) I8_MADD_TO_T(11) I8_MADD_TO_T(20) I8_MADD_TO_T(21)
#define I8_MADD_ADD_T(RG) "vpmaddwd %[ones], %[s" #RG "], %[s" #RG "]\n\t" "vpaddd %[s" #RG "], %[t" #RG "], %[t" #RG "]\n\t"
#define I8_MADD3_ADD_T                                                                             \
  I8_MADD_ADD_T(00) I8_MADD_ADD_T(01) I8_MADD_ADD_T(10) I8_MADD_ADD_T(11) I8_MADD_ADD_T(20) I8_MADD_ADD_T(21)

// acc[r][g] for rows r of x (MR of them, nb * 32 bytes apart) and groups g of 8 weight rows (NG of them, gstride
// blocks of the repacked weights apart) over every block; SUM chunks' int16 products are added before madd. Each
// chunk of weights is loaded once for the MR rows and each broadcast of 4 bytes of x serves the NG groups: per
// block, row and group 8 maddubs, 7 adds, one madd (two and an add for Q5) and four float operations. The main
// tiles have their integer part written in assembly: Q4's 5 rows x 2 groups (10 int16 sums, 2 chunks of weights, a
// broadcast and a product in 14 ymm registers; the float accumulators live in L1), Q5's 3 x 2 (6 int16 sums and 6
// int32 sums: all 16). On Zen 3 the adds, not the maddubs, set the pace (3 vector integer pipes for the adds and
// maddubs, 2 of them for maddubs); per block the 5-row tile measured 8% faster than 4 rows and 13% than 3 (one
// thread, SmolLM2's shapes, 512 rows), 6 rows slower again.
template <int MR, int NG, int SUM>
TANDEM_ALWAYS_INLINE void gemm8_tile(const uint8_t* wq, const float* dv, const float* bv, int64_t gstride,
                                     const int8_t* qx, const float* dx, const float* sx, int64_t nb, float* y,
                                     int64_t ldy, const int* ncols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* w[NG];
    for (int g = 0; g < NG; ++g) w[g] = reinterpret_cast<const __m256i*>(wq + (g * gstride + b) * G8_BYTES);
    const int8_t* xb = qx + b * 32;
    __m256i s32[MR][NG];
    if constexpr (MR == 5 && NG == 2 && SUM == 8) {
      __m256i s00, s01, s10, s11, s20, s21, s30, s31, s40, s41, wa, wb, xv, p;
      // The 80 products of a block, written out: from intrinsics gcc either hoists the products of every chunk
      // ahead of their sums and spills them (unrolled) or copies each sum once a chunk (rolled), either way a
      // third to a half more instructions than the 2 loads, 5 broadcasts, 10 maddubs and 10 adds a chunk needs.
      __asm__(
      I8_LOAD_W(0) I8_FIRST5(0)
      I8_LOAD_W(32) I8_ADD5(4)
      I8_LOAD_W(64) I8_ADD5(8)
      I8_LOAD_W(96) I8_ADD5(12)
      I8_LOAD_W(128) I8_ADD5(16)
      I8_LOAD_W(160) I8_ADD5(20)
      I8_LOAD_W(192) I8_ADD5(24)
      I8_LOAD_W(224) I8_ADD5(28)
      : [s00] "=&x"(s00), [s01] "=&x"(s01),
        [s10] "=&x"(s10), [s11] "=&x"(s11),
        [s20] "=&x"(s20), [s21] "=&x"(s21),
        [s30] "=&x"(s30), [s31] "=&x"(s31),
        [s40] "=&x"(s40), [s41] "=&x"(s41),
        [wa] "=&x"(wa), [wb] "=&x"(wb), [xv] "=&x"(xv), [p] "=&x"(p)
      : [w0] "r"(w[0]), [w1] "r"(w[1]), [x0] "r"(xb), [x1] "r"(xb + nb * 32), [x2] "r"(xb + 2 * nb * 32),
        [x3] "r"(xb + 3 * nb * 32), [x4] "r"(xb + 4 * nb * 32)
      : "memory");
      s32[0][0] = _mm256_madd_epi16(s00, ones), s32[0][1] = _mm256_madd_epi16(s01, ones);
      s32[1][0] = _mm256_madd_epi16(s10, ones), s32[1][1] = _mm256_madd_epi16(s11, ones);
      s32[2][0] = _mm256_madd_epi16(s20, ones), s32[2][1] = _mm256_madd_epi16(s21, ones);
      s32[3][0] = _mm256_madd_epi16(s30, ones), s32[3][1] = _mm256_madd_epi16(s31, ones);
      s32[4][0] = _mm256_madd_epi16(s40, ones), s32[4][1] = _mm256_madd_epi16(s41, ones);
    } else if constexpr (MR == 3 && NG == 2 && SUM == 4) {
      // Q5: the int16 sums of chunks 0-3 and 4-7 each widened by madd (with ones from memory: the int32 sums take
      // the last six registers)
      __m256i s00, s01, s10, s11, s20, s21, wa, wb, xv, p;
      __asm__(
      I8_LOAD_W(0) I8_FIRST3(0)
      I8_LOAD_W(32) I8_ADD3(4)
      I8_LOAD_W(64) I8_ADD3(8)
      I8_LOAD_W(96) I8_ADD3(12)
      I8_MADD3_TO_T
      I8_LOAD_W(128) I8_FIRST3(16)
      I8_LOAD_W(160) I8_ADD3(20)
      I8_LOAD_W(192) I8_ADD3(24)
      I8_LOAD_W(224) I8_ADD3(28)
      I8_MADD3_ADD_T
      : [s00] "=&x"(s00), [s01] "=&x"(s01), [s10] "=&x"(s10), [s11] "=&x"(s11), [s20] "=&x"(s20),
        [s21] "=&x"(s21), [wa] "=&x"(wa), [wb] "=&x"(wb), [xv] "=&x"(xv), [p] "=&x"(p), [t00] "=&x"(s32[0][0]),
        [t01] "=&x"(s32[0][1]), [t10] "=&x"(s32[1][0]), [t11] "=&x"(s32[1][1]), [t20] "=&x"(s32[2][0]),
        [t21] "=&x"(s32[2][1])
      : [w0] "r"(w[0]), [w1] "r"(w[1]), [x0] "r"(xb), [x1] "r"(xb + nb * 32), [x2] "r"(xb + 2 * nb * 32),
        [ones] "m"(ones)
      : "memory");
    } else {
      for (int c0 = 0; c0 < 8; c0 += SUM) {
        __m256i s16[MR][NG];
        {
          __m256i wv[NG];
          for (int g = 0; g < NG; ++g) wv[g] = _mm256_load_si256(w[g] + c0);
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = _mm256_set1_epi32(load_i32(xb + r * nb * 32 + 4 * c0));
            for (int g = 0; g < NG; ++g) s16[r][g] = _mm256_maddubs_epi16(wv[g], xv);
          }
        }
        // a rolled loop: unrolled, gcc hoists every load and product ahead of the sums and spills them
#pragma GCC unroll 1
        for (int c = c0 + 1; c < c0 + SUM; ++c) {
          __m256i wv[NG];
          for (int g = 0; g < NG; ++g) wv[g] = _mm256_load_si256(w[g] + c);
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = _mm256_set1_epi32(load_i32(xb + r * nb * 32 + 4 * c));
            for (int g = 0; g < NG; ++g) s16[r][g] = _mm256_add_epi16(s16[r][g], _mm256_maddubs_epi16(wv[g], xv));
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int g = 0; g < NG; ++g) {
            const __m256i t = _mm256_madd_epi16(s16[r][g], ones);
            s32[r][g] = c0 == 0 ? t : _mm256_add_epi32(s32[r][g], t);
          }
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 dxr = _mm256_broadcast_ss(dx + r * nb + b), sxr = _mm256_broadcast_ss(sx + r * nb + b);
      for (int g = 0; g < NG; ++g) {
        const __m256 ddx = _mm256_mul_ps(_mm256_loadu_ps(dv + (g * gstride + b) * 8), dxr);
        acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r][g]), ddx, acc[r][g]);
        acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(bv + (g * gstride + b) * 8), sxr, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < NG; ++g) {
      float* yr = y + r * ldy + 8 * g;
      if (ncols[g] == 8) {
        _mm256_storeu_ps(yr, acc[r][g]);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, acc[r][g]);
        for (int j = 0; j < ncols[g]; ++j) yr[j] = t[j];
      }
    }
}

// Rows [m, mend) of x against NG groups of weights: tiles of MR rows, then one tile of the 1 to MR - 1 left over.
// Not inlined: inside gemm8's OpenMP body gcc runs out of registers for the tile and spills its sums.
template <int MR, int NG, int SUM>
__attribute__((noinline)) void gemm8_rows(const uint8_t* wq, const float* dv, const float* bv, int64_t gstride, const int8_t* qx,
                const float* dx, const float* sx, int64_t nb, int64_t m, int64_t mend, float* y, int64_t ldy,
                const int* ncols) {
  auto tile = [&](auto mr, int64_t m0) {
    gemm8_tile<decltype(mr)::value, NG, SUM>(wq, dv, bv, gstride, qx + m0 * nb * 32, dx + m0 * nb, sx + m0 * nb,
                                             nb, y + m0 * ldy, ldy, ncols);
  };
  for (; m + MR <= mend; m += MR) tile(std::integral_constant<int, MR>{}, m);
  tile_of_rest<MR - 1>(mend - m, m, tile);
}

// Scratch for one call, left uninitialized: every element is written before it is read (std::vector's zeroing of
// x's bytes and the repacked weights was 2% of a call).
template <class T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

template <int64_t FMT>
void gemm8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* y,
           int threads) {
  constexpr int SUM = (FMT == Q4_0 || FMT == Q4_1) ? 8 : 4;
  const int64_t nb = K / 32, groups = (N + 7) / 8;
  // x per block of 32 (quantize_block32: the small-M kernel's integers), dx and dx * sum(qx); rows in parallel
  const auto qx = scratch<int8_t>(M * K);
  const auto dx = scratch<float>(M * nb), sx = scratch<float>(M * nb);
  // the weights repacked per group of 8 rows (32 bytes of u per weight row and block, 1.6x the Q4 blocks)
  const auto wq = scratch<uint8_t>(groups * nb * G8_BYTES + 32);
  uint8_t* wq_base = wq.get() + ((32 - reinterpret_cast<uintptr_t>(wq.get()) % 32) % 32);
  const auto dv = scratch<float>(groups * nb * 8), bv = scratch<float>(groups * nb * 8);
  // Rows of x in chunks (of whole tiles) that stay in L2 beside a pair of groups' weights while every pair passes
  // over them; tiles of MR rows x 2 groups (16 columns of y), the last group of an odd count 4 rows x 1.
  constexpr int NG = 2, MR = SUM == 8 ? 5 : 3;  // the assembly tiles' (gemm8_tile)
  constexpr int64_t MC = 16 * MR;
  const int64_t units = (groups + NG - 1) / NG, gstride = nb;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < M * nb; ++i) {
      float d;
      const int s = quantize_block32_avx2(x + i * 32, qx.get() + i * 32, d);
      dx[i] = d;
      sx[i] = d * static_cast<float>(s);
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g)
      repack_group8<FMT>(w, row_bytes, N, g * 8, nb, wq_base + g * nb * G8_BYTES, dv.get() + g * nb * 8,
                         bv.get() + g * nb * 8);
    for (int64_t mc = 0; mc < M; mc += MC) {
      const int64_t mend = std::min(M, mc + MC);
#pragma omp for schedule(static)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t g = u * NG;
        const uint8_t* wg = wq_base + g * nb * G8_BYTES;
        const float* dg = dv.get() + g * nb * 8;
        const float* bg = bv.get() + g * nb * 8;
        const int ncols[2] = {static_cast<int>(std::min<int64_t>(8, N - g * 8)),
                              static_cast<int>(std::clamp<int64_t>(N - g * 8 - 8, 0, 8))};
        if (NG == 2 && g + 1 < groups)
          gemm8_rows<MR, NG, SUM>(wg, dg, bg, gstride, qx.get(), dx.get(), sx.get(), nb, mc, mend, y + g * 8, N,
                                  ncols);
        else  // the last group of an odd count
          gemm8_rows<4, 1, SUM>(wg, dg, bg, gstride, qx.get(), dx.get(), sx.get(), nb, mc, mend, y + g * 8, N,
                                ncols);
      }
    }
  }
}

}  // namespace

bool gemm_int8_format(int64_t fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1; }

void gemm_int8_avx2(int64_t fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N,
                    float* y, int threads) {
  switch (fmt) {
    case Q4_0: return gemm8<Q4_0>(x, M, K, w, row_bytes, N, y, threads);
    case Q4_1: return gemm8<Q4_1>(x, M, K, w, row_bytes, N, y, threads);
    case Q5_0: return gemm8<Q5_0>(x, M, K, w, row_bytes, N, y, threads);
    default: return gemm8<Q5_1>(x, M, K, w, row_bytes, N, y, threads);
  }
}

}  // namespace tandem

#endif  // TANDEM_AVX2
