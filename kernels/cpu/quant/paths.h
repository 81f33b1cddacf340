// The entry points of each CPU path's kernels (avx2.cpp, avx2_int8.cpp, avx512.cpp, vnni.cpp), each present when the build has its
// instructions (formats.h), and the tiling of M rows of x that every small-M kernel shares.
#pragma once

#include <type_traits>
#include <vector>

#include "formats.h"

namespace tandem {

// Calls f(std::integral_constant<int, MT>{}, m) over rows m of x in tiles of MT rows: of 8 (when MAX allows), then
// 4, then the 3, 2 or 1 left over. A kernel takes several rows per pass so each weight it dequantizes serves them all.
template <int MAX, class F>
inline void for_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  if constexpr (MAX >= 8)
    for (; m + 8 <= M; m += 8) f(std::integral_constant<int, 8>{}, m);
  for (; m + 4 <= M; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3: return f(std::integral_constant<int, 3>{}, m);
    case 2: return f(std::integral_constant<int, 2>{}, m);
    case 1: return f(std::integral_constant<int, 1>{}, m);
    default: return;
  }
}

template <int R, class F>
inline void tile_of_rest(int64_t rest, int64_t m, F& f) {  // f(integral_constant<rest>, m) for rest in 1..R
  if constexpr (R > 0) {
    if (rest == R) return f(std::integral_constant<int, R>{}, m);
    tile_of_rest<R - 1>(rest, m, f);
  }
}

// Calls f(std::integral_constant<int, MT>{}, m) over rows m of x in tiles of 16, then the 1-15 rows left over as one
// tile: a kernel whose accumulators fit 16 rows (AVX-512's 32 registers) dequantizes each weight once for any step
// of up to 16 rows, so a 9th row costs its multiply-adds, not a second pass over the weights.
template <class F>
inline void for_row_tiles_exact16(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 16 <= M; m += 16) f(std::integral_constant<int, 16>{}, m);
  tile_of_rest<15>(M - m, m, f);
}

#ifdef TANDEM_AVX2
// y[m * ldy] = x[m] . dequantize(row) for the M rows of x (K floats apart), any format, weights dequantized in
// registers; `s` is I8's per-channel scale.
void row_avx2(int64_t fmt, const uint8_t* row, float s, const float* x, int64_t M, int64_t K, float* y, int64_t ldy);
// One row of weights as float32, bit-identical to dequant_row_scalar.
void dequant_row_avx2(int64_t fmt, const uint8_t* row, float s, int64_t K, float* out);

struct Int8Rows {  // x [M, K] per block of 32 (quantize_block32): int8 values, dx, dx * sum(qx)
  std::vector<int8_t> q;  // [M, K / 32, 32]
  std::vector<float> dx;  // [M, K / 32]
  std::vector<float> sum;  // [M, K / 32]
  int64_t nb;
};
// Each row of x [M, K] quantized per block of 32 (the same integers and dx as quantize_rows of the VNNI path).
Int8Rows quantize_rows_avx2(const float* x, int64_t M, int64_t K);
// y[m * ldy] for every row of xq, integer dot products (maddubs + madd) with one row of a 32-wide format's blocks.
void row_int8_avx2(int64_t fmt, const uint8_t* row, const Int8Rows& xq, int64_t M, int64_t K, float* y, int64_t ldy);

struct Int8KRows {  // x [M, K] per super-block of 256 (quantize_block256, llama.cpp's Q8_K): int8, dx, sums per 16
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> dx;  // [M, K / 256]
  std::vector<int16_t> bsum;  // [M, K / 16]
  int64_t nsb;
  std::vector<int8_t> q_k4;  // q again, per 128 in the order of Q4_K's nibbles (order_rows_k4; avx512 path only)
};
Int8KRows quantize_rows_k(const float* x, int64_t M, int64_t K);
// The wide int8 GEMM of prefill chunks (avx2_int8.cpp): y [M, N] = x [M, K] (quantized per block of 32 as the
// small-M kernel quantizes it) @ dequantize(w).T for Q4_0, Q4_1, Q5_0, Q5_1 (`gemm_int8_format`), the weights
// repacked per group of 8 rows first; `threads` OpenMP threads.
bool gemm_int8_format(int64_t fmt);
void gemm_int8_avx2(int64_t fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N,
                    float* y, int threads);
// y[m * ldy] for every row of xq, integer dot products (maddubs + madd by the sub-block scales) with one row of a
// K-quant's super-blocks (Q4_K, Q5_K, Q6_K); the avx2 path's (the avx512 path takes row_int8k_avx512).
void row_int8k_avx2(int64_t fmt, const uint8_t* row, const Int8KRows& xq, int64_t M, int64_t K, float* y,
                    int64_t ldy);
#endif

#ifdef TANDEM_AVX512
// As row_avx2 / dequant_row_avx2 for every GGUF format (not I8), 16 lanes.
void row_avx512(int64_t fmt, const uint8_t* row, const float* x, int64_t M, int64_t K, float* y, int64_t ldy);
void dequant_row_avx512(int64_t fmt, const uint8_t* row, int64_t K, float* out);
// int8 activations, the K-quants 64 bytes at a time (avx512_k8.cpp): xq.q_k4 filled from xq.q by order_rows_k4, then
// y[m * ldy] for every row of xq as row_int8k_avx2 computes it (the same integers; float32 round-off apart).
void order_rows_k4(Int8KRows& xq, int64_t M, int64_t K);
void row_int8k_avx512(int64_t fmt, const uint8_t* row, const Int8KRows& xq, int64_t M, int64_t K, float* y,
                      int64_t ldy);
#endif

#ifdef TANDEM_VNNI
struct QuantizedRows {  // x [M, K] per block of 32: int8 values, per-lane scales (16 lanes a pair), dx * sum(qx)
  std::vector<int8_t> q;
  std::vector<float> lane_dx;  // [M, K / 64 pairs (rounded up), 16]: block 2p's dx in lanes 0-7, 2p + 1's in 8-15
  std::vector<float> lane_sum;  // [M, pairs, 16]: dx * sum(qx) of block 2p in lane 0, of 2p + 1 in lane 8, else 0
  int64_t pairs;
};
// Each row of x [M, K] quantized per block of 32 as llama.cpp does.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K);
// y[m * ldy] for every row of xq, integer dot products with one row of a 32-wide format's blocks.
void row_int8(int64_t fmt, const uint8_t* row, const QuantizedRows& xq, int64_t M, int64_t K, float* y, int64_t ldy);
#endif

}  // namespace tandem
