// int8 activations on the AVX-512 path, the K-quants (Q4_K, Q5_K, Q6_K): avx2_int8.cpp's row_k8 at 64 bytes a
// vector. x is quantized per super-block of 256 as there (quantize_block256, llama.cpp's Q8_K: the same integers,
// dx and sums per 16); a super-block's products are summed by `vpmaddubsw` (unsigned weight bytes times signed
// qx, adjacent pairs to int16) and `vpmaddwd` by the sub-block scales (pairs to int32), so every int32 lane holds
// exact integers, and one fma per super-block and term scales them:
//   Q4_K, Q5_K: sum_k w_k x_k ~= d dx sum_j sc_j sum_{k in j} q_k qx_k - dmin dx sum_j m_j sum_{k in j} qx_k
//   Q6_K:       sum_k w_k x_k ~= d dx (sum_j sc_j sum_{k in j} q_k qx_k - 32 sum_j sc_j sum_{k in j} qx_k)
// (Q6_K's weights as unsigned 6-bit q, the offset 32 taken out with the sums per 16 the quantizer keeps).
//
// What differs from row_k8 (one thread, the 1.7B model's Q4_K rows from cache: 1.09x faster; Q6_K: 1.45x; from
// memory both near one thread's stream rate; docs/benchmarks.md "At 1.7B"):
//  * 64 weight bytes per instruction: a Q4_K super-block's 128 bytes of nibbles are two loads, each giving two
//    sub-blocks' low nibbles and two sub-blocks' high nibbles. The low nibbles of bytes 32 i .. 32 i + 31 are
//    sub-block 2 i, so the int8 x the kernel multiplies them with is kept a second time in that order (x_k4:
//    per 128 elements [0, 32) [64, 96) [32, 64) [96, 128)), one load per 64 products; Q6_K's ql / qh layout gives
//    elements in order when qh is taken per 256-bit half with its own shift, so it reads x as stored.
//  * the 6-bit scales and mins decoded into one vector of 16 bytes (formats.h k_scales_mins16, row_k8's too),
//    widened once and spread to the sub-blocks' lanes by `vpermw`.
//  * the Q4_K / Q5_K mins as one `vpmaddwd` of the sums per 16 with the mins; Q6_K's offset likewise.
// Every int32 lane converted to float is below 2^24, so the conversion is exact: Q4_K / Q5_K's after the two
// halves are added (8 x 2 x 31 x 127 x 63 = 3.97e6), Q6_K's sums of q qx before (4 x 2 x 2 x 63 x 127 x 128 =
// 1.64e7) and its offset sums (2 x 16 x 127 x 128 = 5.2e5, times 32 in float: exact, a power of two).
#include "paths.h"

#ifdef TANDEM_AVX512

#include <cstring>

namespace tandem {

void order_rows_k4(Int8KRows& xq, int64_t M, int64_t K) {
  xq.q_k4.resize(M * K);
  for (int64_t c = 0; c < M * K; c += 128) {  // K is a multiple of 256
    const int8_t* s = xq.q.data() + c;
    int8_t* d = xq.q_k4.data() + c;
    std::memcpy(d, s, 32);
    std::memcpy(d + 32, s + 64, 32);
    std::memcpy(d + 64, s + 32, 32);
    std::memcpy(d + 96, s + 96, 32);
  }
}

namespace {

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m512i halves(int lo, int hi) {  // 16-bit lanes 0-15 = lo, 16-31 = hi
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)), _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

// Lane l of index vector `i`: which 16-bit scale lane each of the 32 int16 pair sums of a 64-byte group takes.
struct KIndex {
  __m512i q4[4];  // Q4_K / Q5_K, groups (low 0, high 0, low 1, high 1): sub-blocks (0, 2), (1, 3), (4, 6), (5, 7)
  __m256i mins;  // the mins (lanes 8-15), each twice: one per sum of 16
  __m512i q6[4];  // Q6_K, groups (A 0, B 0, A 1, B 1): sub-blocks of 16, 8 int16 lanes each
  KIndex() {
    alignas(64) int16_t v[32];
    for (int g = 0; g < 4; ++g) {
      const int first = (g / 2) * 4 + (g % 2);  // 0, 1, 4, 5
      for (int l = 0; l < 32; ++l) v[l] = static_cast<int16_t>(first + (l < 16 ? 0 : 2));
      q4[g] = _mm512_load_si512(v);
      for (int l = 0; l < 32; ++l) v[l] = static_cast<int16_t>(8 * (g / 2) + 4 * (g % 2) + l / 8);
      q6[g] = _mm512_load_si512(v);
    }
    for (int l = 0; l < 16; ++l) v[l] = static_cast<int16_t>(8 + l / 2);
    mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
  }
};

// acc + the int32 pair sums of p (int16) times the scales s: one vpdpwssd with AVX-512 VNNI, else vpmaddwd + add.
TANDEM_ALWAYS_INLINE __m512i dot_add(__m512i acc, __m512i p, __m512i s) {
#ifdef TANDEM_VNNI
  return _mm512_dpwssd_epi32(acc, p, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}

inline __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

template <int64_t FMT, int MT>
void row_k8_512(const KIndex& ix, const uint8_t* row, const Int8KRows& xq, int64_t m0, int64_t K, float* y,
                int64_t ldy) {
  constexpr int64_t BB = block_bytes(FMT);
  const int64_t nsb = K / 256;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  __m256 acc[MT];
  __m512 acc6[MT];  // Q6_K's sums of q qx, kept 16 lanes wide (halves added, they could pass 2^24)
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps(), acc6[m] = _mm512_setzero_ps();
  const int8_t* qx0 = (FMT == Q6_K ? xq.q.data() : xq.q_k4.data()) + m0 * K;
  const float* dx0 = xq.dx.data() + m0 * nsb;
  const int16_t* bs0 = xq.bsum.data() + m0 * (K / 16);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = row + sb * BB;
    prefetch_ahead(blk);
    prefetch_ahead(blk + 64);
    prefetch_ahead(blk + 128);
    if constexpr (BB > 192) prefetch_ahead(blk + 192);
    __m512i sumi[MT];
    for (int m = 0; m < MT; ++m) sumi[m] = _mm512_setzero_si512();
    if constexpr (FMT == Q4_K || FMT == Q5_K) {
      const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
      const __m256i sm = k_scales_mins16(blk + 4);
      const __m512i sm512 = _mm512_castsi256_si512(sm);
      const uint8_t* qs = blk + (FMT == Q5_K ? 48 : 16);
      for (int i = 0; i < 2; ++i) {  // bytes 64 i .. 64 i + 63: sub-blocks 4i, 4i+2 (low nibbles), 4i+1, 4i+3 (high)
        const __m512i b = load512(qs + 64 * i);
        __m512i lo = _mm512_and_si512(b, m4), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
        if constexpr (FMT == Q5_K) {  // bit j of qh[l] is sub-block j's fifth bit of element l
          const __m512i qh = _mm512_broadcast_i64x4(load256(blk + 16));
          const __m512i one = _mm512_set1_epi8(1);
          lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, halves(4 * i, 4 * i + 2)),
                                                                       one), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, halves(4 * i + 1, 4 * i + 3)), one), 4));
        }
        const __m512i slo = _mm512_permutexvar_epi16(ix.q4[2 * i], sm512);
        const __m512i shi = _mm512_permutexvar_epi16(ix.q4[2 * i + 1], sm512);
        for (int m = 0; m < MT; ++m) {
          const int8_t* qx = qx0 + m * K + sb * 256 + 128 * i;
          sumi[m] = dot_add(sumi[m], _mm512_maddubs_epi16(lo, load512(qx)), slo);
          sumi[m] = dot_add(sumi[m], _mm512_maddubs_epi16(hi, load512(qx + 64)), shi);
        }
      }
      const __m256i mins = _mm256_permutexvar_epi16(ix.mins, sm);
      for (int m = 0; m < MT; ++m) {
        const float dx = dx0[m * nsb + sb];
        const __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(load256(bs0 + m * (K / 16) + sb * 16), mins));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold(sumi[m])), _mm256_set1_ps(d * dx), acc[m]);
        acc[m] = _mm256_fnmadd_ps(msum, _mm256_set1_ps(dmin * dx), acc[m]);
      }
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
      const float d = fp16_to_fp32(blk + 208);
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512i sc512 = _mm512_castsi256_si512(sc);
      const __m512i m3 = _mm512_set1_epi8(3);
      for (int h = 0; h < 2; ++h) {  // elements 128 h ..: A = [0, 64) from low nibbles, B = [64, 128) from high
        const __m512i L = load512(blk + 64 * h);
        const __m512i H = _mm512_broadcast_i64x4(load256(blk + 128 + 32 * h));
        const __m512i a = _mm512_or_si512(
            _mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, halves(0, 2)), m3), 4));
        const __m512i b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, halves(4, 6)), m3), 4));
        const __m512i sa = _mm512_permutexvar_epi16(ix.q6[2 * h], sc512);
        const __m512i sbv = _mm512_permutexvar_epi16(ix.q6[2 * h + 1], sc512);
        for (int m = 0; m < MT; ++m) {
          const int8_t* qx = qx0 + m * K + sb * 256 + 128 * h;
          sumi[m] = dot_add(sumi[m], _mm512_maddubs_epi16(a, load512(qx)), sa);
          sumi[m] = dot_add(sumi[m], _mm512_maddubs_epi16(b, load512(qx + 64)), sbv);
        }
      }
      for (int m = 0; m < MT; ++m) {  // two exact conversions (each lane below 2^24), two fmas
        const float ddx = d * dx0[m * nsb + sb];
        const __m256i off = _mm256_madd_epi16(load256(bs0 + m * (K / 16) + sb * 16), sc);
        acc6[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[m]), _mm512_set1_ps(ddx), acc6[m]);
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.f * ddx), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    if constexpr (FMT == Q6_K)
      acc[m] = _mm256_add_ps(acc[m], _mm256_add_ps(_mm512_castps512_ps256(acc6[m]),
                                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc6[m]), 1))));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[m * ldy] = _mm_cvtss_f32(s);
  }
}

}  // namespace

void row_int8k_avx512(int64_t fmt, const uint8_t* row, const Int8KRows& xq, int64_t M, int64_t K, float* y,
                      int64_t ldy) {
  static const KIndex ix;
  auto tiles = [&](auto fmt_c) {
    for_row_tiles<4>(M, [&](auto mt, int64_t m) {
      row_k8_512<decltype(fmt_c)::value, decltype(mt)::value>(ix, row, xq, m, K, y + m * ldy, ldy);
    });
  };
  switch (fmt) {
    case Q4_K: return tiles(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return tiles(std::integral_constant<int64_t, Q5_K>{});
    default: return tiles(std::integral_constant<int64_t, Q6_K>{});
  }
}

}  // namespace tandem

#endif  // TANDEM_AVX512
