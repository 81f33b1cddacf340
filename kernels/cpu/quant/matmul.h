// The quantized matmul's torch entry points (matmul.cpp) and what the layer walker shares with them.
#pragma once

#include <torch/extension.h>

#include <string>

#include "paths.h"

namespace tandem {

// The widest path this build has: it is built with -march=native for this CPU, so what it was compiled with is what
// the CPU runs.
int64_t best_isa();
void check_isa(int64_t isa, const char* who);
// Refuses weights that do not match fmt and K (and I8 without one float32 scale per output channel), or an isa
// this build lacks.
void check(const torch::Tensor& w, int64_t fmt, int64_t K, const torch::Tensor& scales, int64_t isa);
// Threads for `work` independent pieces: at most torch's thread count, at least one.
int num_threads_for(int64_t work);

// y[m, ldy-strided row][0, N) = x[M, K] @ dequantize(w).T: the small-M kernel writing into a slice of a wider output
// (the parts of a projection whose weights are stored in different formats fill their own columns).
void matmul_into(const float* xp, int64_t M, int64_t K, const torch::Tensor& w, int64_t fmt,
                 const torch::Tensor& scales, int64_t isa, float* yp, int64_t ldy);

// int8 activations (quant_matmul_int8, the layer walker): x's rows quantized once for the int8 kernel of a CPU path
// and shared by every part of a projection: per block of 32 for the 32-wide formats, per super-block of 256 for the
// K-quants. int8_format: the formats those kernels multiply (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); I8
// keeps float32 activations.
struct Int8Activations {
  bool vnni = false;
  bool k512 = false;  // the K-quants through avx512_k8.cpp (the avx512 path), else avx2_int8.cpp's row_k8
#ifdef TANDEM_AVX2
  Int8Rows avx2;
  Int8KRows k;
#endif
#ifdef TANDEM_VNNI
  QuantizedRows pairs;
#endif
};
bool int8_format(int64_t fmt);
inline bool int8_kquant(int64_t fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K; }
// int8_kernel(isa) must name a kernel; blocks32 / blocks256: for a 32-wide format / a K-quant part.
Int8Activations quantize_activations(const float* xp, int64_t M, int64_t K, int64_t isa, bool blocks32,
                                     bool blocks256);
// As matmul_into, for a format with int8_format, from the rows quantize_activations made.
void matmul_int8_into(const Int8Activations& xq, int64_t M, int64_t K, const torch::Tensor& w, int64_t fmt,
                      float* yp, int64_t ldy);

torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales,
                           int64_t isa);
torch::Tensor quant_matmul_int8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, int64_t isa);
std::string int8_kernel(int64_t isa);
torch::Tensor quant_gemm_int8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, int64_t isa);
bool has_gemm_int8(int64_t isa, int64_t fmt);
torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, int64_t start, int64_t count,
                         int64_t isa);
torch::Tensor dequantize_bf16(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, int64_t start,
                              int64_t count, int64_t isa);
torch::Tensor dequantize_rows(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, torch::Tensor ids,
                              int64_t isa);

}  // namespace tandem
