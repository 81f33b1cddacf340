// int8 activations on AVX-512 VNNI, the 32-wide formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
// Each row of x is quantized per block of 32 as llama.cpp does (dx = max|x| / 127, qx = round(x / dx)); a block's
// dot product is then one integer sum: the weights as unsigned bytes u (Q8_0: q + 128; Q4_0 / Q5_0: q, their offset
// 8 / 16 taken out afterwards) times qx by vpdpbusd, so
//   sum_k w_k x_k ~= dx (d * sum_k u_k qx_k + (m - c d) * sum_k qx_k)
// with c the offset and m the block's min (Q4_1 / Q5_1; 0 otherwise). Two blocks per 512-bit vector. The integer
// sums are exact; the only difference to the float32 path is the rounding of x to 8 bits.
#include "paths.h"

#ifdef TANDEM_VNNI

namespace tandem {

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  QuantizedRows r;
  r.pairs = (nb + 1) / 2;
  r.q.assign(M * r.pairs * 64, 0);  // padded to whole pairs: an odd last block leaves zeros beside it
  r.lane_dx.assign(M * r.pairs * 16, 0.f);
  r.lane_sum.assign(M * r.pairs * 16, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float dx;
      const int s = quantize_block32(x + m * K + b * 32, r.q.data() + m * r.pairs * 64 + b * 32, dx);
      float* lanes = r.lane_dx.data() + (m * r.pairs + b / 2) * 16 + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) lanes[i] = dx;
      r.lane_sum[(m * r.pairs + b / 2) * 16 + (b % 2) * 8] = dx * static_cast<float>(s);
    }
  return r;
}

namespace {

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

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

}  // namespace

void row_int8(int64_t fmt, const uint8_t* row, const QuantizedRows& xq, int64_t M, int64_t K, float* y, int64_t ldy) {
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

#endif  // TANDEM_VNNI
