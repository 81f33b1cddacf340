// The AVX2 + FMA + F16C path: 8 lanes. Q4_0, Q4_1, Q8_0 and I8 in registers; the others through the scalar
// dequantizer (matmul.cpp's buffer path for small M, dequant_row_scalar here for the wide path).
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

// y[m, n] for MT (1..8) rows of x starting at x, one output row of blocks.
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

template <int64_t FMT>
void rows(const uint8_t* row, const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  for_row_tiles<8>(M, [&](auto mt, int64_t m) {
    row_blocks<FMT, decltype(mt)::value>(row, x + m * K, K, K / 32, y + m * ldy, ldy);
  });
}

}  // namespace

void row_avx2(int64_t fmt, const uint8_t* row, float s, const float* x, int64_t M, int64_t K, float* y, int64_t ldy) {
  switch (fmt) {
    case Q4_0: return rows<Q4_0>(row, x, M, K, y, ldy);
    case Q4_1: return rows<Q4_1>(row, x, M, K, y, ldy);
    case Q8_0: return rows<Q8_0>(row, x, M, K, y, ldy);
    default:
      return for_row_tiles<8>(M, [&](auto mt, int64_t m) {
        row_i8<decltype(mt)::value>(reinterpret_cast<const int8_t*>(row), s, x + m * K, K, K, y + m * ldy, ldy);
      });
  }
}

void dequant_row_avx2(int64_t fmt, const uint8_t* row, float s, int64_t K, float* out) {
  if (fmt == I8 || fmt >= Q5_0) return dequant_row_scalar(fmt, row, s, K, out);  // vectorised by the compiler
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

}  // namespace tandem

#endif  // TANDEM_AVX2
