// y[M, N] = x[M, K] @ dequantize(W)[N, K]^T on CPU, weights kept as stored: the checks, the choice of CPU path per
// format, OpenMP over output rows, and the torch entry points.
//
// The small-M kernels (paths.h) stream each output row's blocks once and dequantize them in registers: every d * q
// is exact in fp32, so `fma(d, q, m)` rounds once, exactly as the numpy dequantizer transformers uses does
// (d * q) + m. The weights are therefore bit-identical to that dequantization on every path, and results differ
// from dequantize-then-matmul only by summation order. Wide steps go through `dequantize` (tiles of rows into fp32)
// and a BLAS GEMM, from kernels/quant.py.
#include "matmul.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace tandem {
namespace {

inline const uint8_t* row_ptr(const torch::Tensor& w, int64_t n) {
  return static_cast<const uint8_t*>(w.data_ptr()) + n * w.size(1);
}

inline float scale_of(const torch::Tensor& scales, int64_t fmt, int64_t n) {
  return fmt == I8 ? scales.data_ptr<float>()[n] : 1.f;
}

// Threads for a small-M matmul over `bytes` of weights: one per THREAD_BYTES at least, so a tiny projection stays on
// the calling thread. Every projection of a real model's decode step (200 KB and up) takes them all: with one OpenMP
// pool in the process and a short spin before workers sleep (tandem serve's default), a worker is still awake for
// the next region, and splitting the step's small projections measured 1.1-1.3x faster per batch-1 token than
// keeping them on one thread (idle and beside two busy processes alike).
constexpr int64_t THREAD_BYTES = 32 * 1024;
int threads_for_bytes(int64_t bytes) { return num_threads_for(bytes / THREAD_BYTES); }

// Whether `isa` computes `fmt` with a kernel that keeps the weights in registers (else, on the portable path: a row
// dequantized into a buffer by the scalar code, then dot products). AVX2 and AVX-512 have every format (AVX-512's
// I8 is the AVX2 kernel).
bool in_registers(int64_t isa, int64_t) { return isa != PORTABLE; }

// One output row of weights times the M rows of x, in registers (in_registers(isa, fmt) holds).
void row_isa(int64_t isa, int64_t fmt, const uint8_t* row, float s, const float* x, int64_t M, int64_t K, float* y,
             int64_t ldy) {
#ifdef TANDEM_AVX512
  if (isa == AVX512 && fmt != I8) return row_avx512(fmt, row, x, M, K, y, ldy);
#endif
#ifdef TANDEM_AVX2
  row_avx2(fmt, row, s, x, M, K, y, ldy);
#endif
}

void dequant_row_isa(int64_t isa, int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
#ifdef TANDEM_AVX512
  if (isa == AVX512 && fmt != I8) return dequant_row_avx512(fmt, row, K, out);
#endif
#ifdef TANDEM_AVX2
  if (isa != PORTABLE) return dequant_row_avx2(fmt, row, scale, K, out);
#endif
  dequant_row_scalar(fmt, row, scale, K, out);
}

}  // namespace

int64_t best_isa() {
#if defined(TANDEM_AVX512)
  return AVX512;
#elif defined(TANDEM_AVX2)
  return AVX2;
#else
  return PORTABLE;
#endif
}

void check_isa(int64_t isa, const char* who) {
  TORCH_CHECK(isa >= PORTABLE && isa <= best_isa(), who, ": CPU path ", isa, " is not in this build (best: ",
              best_isa(), ")");
}

void check(const torch::Tensor& w, int64_t fmt, int64_t K, const torch::Tensor& scales, int64_t isa) {
  TORCH_CHECK(fmt >= Q4_0 && fmt <= Q6_K, "quant_matmul: unknown format ", fmt);
  check_isa(isa, "quant_matmul");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "quant_matmul: weights must be a contiguous 2-d tensor");
  if (fmt == I8) {
    TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.size(1) == K, "quant_matmul: int8 weights [N, K]");
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == w.size(0),
                "quant_matmul: one float32 scale per output channel");
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kUInt8, "quant_matmul: GGUF blocks as uint8");
    TORCH_CHECK(K % block_elems(fmt) == 0 && w.size(1) == K / block_elems(fmt) * block_bytes(fmt),
                "quant_matmul: blocks do not match K=", K);
  }
}

int num_threads_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work)));
}

void matmul_into(const float* xp, int64_t M, int64_t K, const torch::Tensor& w, int64_t fmt,
                 const torch::Tensor& scales, int64_t isa, float* yp, int64_t ldy) {
  const int64_t N = w.size(0);
  if (!in_registers(isa, fmt)) {  // each row dequantized once into a per-thread buffer, then M dot products
#pragma omp parallel num_threads(threads_for_bytes(w.numel() * w.element_size() * M))
    {
      std::vector<float> buf(K);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        dequant_row_scalar(fmt, row_ptr(w, n), scale_of(scales, fmt, n), K, buf.data());
        const float* wr = buf.data();
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xp + m * K;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < K; ++k) acc += wr[k] * xm[k];
          yp[m * ldy + n] = acc;
        }
      }
    }
    return;
  }
  // Output rows in contiguous chunks per thread: each thread streams its own slice of the weights once.
#pragma omp parallel for num_threads(threads_for_bytes(w.numel() * w.element_size() * M)) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    row_isa(isa, fmt, row_ptr(w, n), scale_of(scales, fmt, n), xp, M, K, yp + n, ldy);
}

// x [M, K] float32, w: blocks [N, row bytes] uint8 or int8 [N, K]; scales [N] float32 for I8 (else ignored); isa: the
// CPU path (Isa) to compute with.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales,
                           int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "quant_matmul: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  matmul_into(x.data_ptr<float>(), M, K, w, fmt, scales, isa, y.data_ptr<float>(), N);
  return y;
}

// Which kernel multiplies int8 activations on CPU path `isa`: "vnni" (AVX-512 VNNI, vnni.cpp) on the AVX-512 path
// where the build has it, "avx2" (maddubs, avx2_int8.cpp) on the AVX2 path and on an AVX-512 path without VNNI,
// "" where there is none (the portable path, or a path this build lacks).
std::string int8_kernel(int64_t isa) {
  if (isa < PORTABLE || isa > best_isa()) return "";
#if defined(TANDEM_VNNI)
  if (isa == AVX512) return "vnni";
#endif
#if defined(TANDEM_AVX2)
  if (isa != PORTABLE) return "avx2";
#endif
  return "";
}

bool int8_format(int64_t fmt) {
  return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0 || int8_kquant(fmt);
}

Int8Activations quantize_activations(const float* xp, int64_t M, int64_t K, int64_t isa, bool blocks32,
                                     bool blocks256) {
  const std::string kernel = int8_kernel(isa);
  TORCH_CHECK(!kernel.empty(), "int8 activations: CPU path ", isa, " has no int8-activation kernel in this build");
  TORCH_CHECK(K % 32 == 0 && (!blocks256 || K % 256 == 0), "int8 activations: K must be a multiple of the block");
  Int8Activations xq;
  xq.vnni = kernel == "vnni";
#if defined(TANDEM_AVX2)
  // The K-quants: one quantizer for both paths; the avx2 path multiplies with row_k8 (avx2_int8.cpp), the avx512
  // path with avx512_k8.cpp, which also wants the row in Q4_K's nibble order (order_rows_k4).
  if (blocks256) xq.k = quantize_rows_k(xp, M, K);
#endif
#if defined(TANDEM_AVX512)
  if (blocks256 && isa == AVX512) {
    order_rows_k4(xq.k, M, K);
    xq.k512 = true;
  }
#endif
#if defined(TANDEM_VNNI)
  if (xq.vnni) {
    if (blocks32) xq.pairs = quantize_rows(xp, M, K);
    return xq;
  }
#endif
#if defined(TANDEM_AVX2)
  if (blocks32) xq.avx2 = quantize_rows_avx2(xp, M, K);
#endif
  (void)M, (void)blocks32;
  return xq;
}

void matmul_int8_into(const Int8Activations& xq, int64_t M, int64_t K, const torch::Tensor& w, int64_t fmt,
                      float* yp, int64_t ldy) {
  TORCH_CHECK(int8_format(fmt), "int8 activations cover the GGUF block formats, not format ", fmt);
  const int64_t N = w.size(0);
  const int threads = threads_for_bytes(w.numel() * w.element_size() * M);
#if defined(TANDEM_AVX2)
  if (int8_kquant(fmt)) {
    TORCH_CHECK(static_cast<int64_t>(xq.k.dx.size()) == M * (K / 256), "int8 activations: no super-block rows");
#if defined(TANDEM_AVX512)
    if (xq.k512) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t n = 0; n < N; ++n) row_int8k_avx512(fmt, row_ptr(w, n), xq.k, M, K, yp + n, ldy);
      return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) row_int8k_avx2(fmt, row_ptr(w, n), xq.k, M, K, yp + n, ldy);
    return;
  }
#endif
#if defined(TANDEM_VNNI)
  if (xq.vnni) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) row_int8(fmt, row_ptr(w, n), xq.pairs, M, K, yp + n, ldy);
    return;
  }
#endif
#if defined(TANDEM_AVX2)
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) row_int8_avx2(fmt, row_ptr(w, n), xq.avx2, M, K, yp + n, ldy);
#endif
  (void)threads, (void)N, (void)K, (void)yp, (void)ldy;
}

// x [M, K] float32 with its rows quantized to int8 per block of 32 (32-wide formats) or super-block of 256
// (K-quants), w: blocks of a format with int8_format, computed by int8_kernel(isa).
torch::Tensor quant_matmul_int8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, int64_t isa) {
  TORCH_CHECK(!int8_kernel(isa).empty(), "quant_matmul_int8: CPU path ", isa,
              " has no int8-activation kernel in this build");
  TORCH_CHECK(int8_format(fmt), "quant_matmul_int8: int8 activations cover the GGUF block formats, not format ",
              fmt);
  check(w, fmt, K, torch::Tensor(), PORTABLE);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "quant_matmul_int8: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const Int8Activations xq =
      quantize_activations(x.data_ptr<float>(), M, K, isa, !int8_kquant(fmt), int8_kquant(fmt));
  matmul_int8_into(xq, M, K, w, fmt, y.data_ptr<float>(), N);
  return y;
}

// The wide int8 GEMM (avx2_int8.cpp gemm_int8_avx2): x [M, K] float32 quantized per block of 32, w: Q4_0 / Q4_1 /
// Q5_0 / Q5_1 blocks, repacked per group of 8 rows; on the avx2 path and the avx512 path (AVX2 instructions).
torch::Tensor quant_gemm_int8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, int64_t isa) {
#ifdef TANDEM_AVX2
  TORCH_CHECK(isa >= AVX2, "quant_gemm_int8: the int8 GEMM needs the avx2 or avx512 path");
  check_isa(isa, "quant_gemm_int8");
  TORCH_CHECK(gemm_int8_format(fmt), "quant_gemm_int8: Q4_0, Q4_1, Q5_0 or Q5_1 blocks, not format ", fmt);
  check(w, fmt, K, torch::Tensor(), PORTABLE);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "quant_gemm_int8: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  gemm_int8_avx2(fmt, x.data_ptr<float>(), M, K, static_cast<const uint8_t*>(w.data_ptr()), w.size(1), N,
                 y.data_ptr<float>(), num_threads_for(N / 8));
  return y;
#else
  TORCH_CHECK(false, "quant_gemm_int8: this build has no AVX2 path");
#endif
}

bool has_gemm_int8(int64_t isa, int64_t fmt) {
#ifdef TANDEM_AVX2
  return isa >= AVX2 && isa <= best_isa() && gemm_int8_format(fmt);
#else
  return false;
#endif
}

// Rows [start, start + count) of the weights as float32 [count, K].
torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, int64_t start,
                         int64_t count, int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= w.size(0), "dequantize: rows out of range");
  auto out = torch::empty({count, K}, torch::dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(count / 16 + 1)) schedule(static)
  for (int64_t r = 0; r < count; ++r)
    dequant_row_isa(isa, fmt, row_ptr(w, start + r), scale_of(scales, fmt, start + r), K, o + r * K);
  return out;
}

// float32 -> bfloat16 bits, rounded to nearest even as torch's `.to(torch.bfloat16)` rounds (a NaN stays a quiet
// NaN); a plain integer loop the compiler vectorizes.
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Rows [start, start + count) as bfloat16 [count, K] for the wide steps' bf16 GEMM (kernels/quant.py): each row
// dequantized into a per-thread float32 buffer (L1-sized for every K here) and rounded once, so the values are
// exactly `dequantize(...).to(torch.bfloat16)` at half the memory traffic of writing float32 first.
torch::Tensor dequantize_bf16(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, int64_t start,
                              int64_t count, int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= w.size(0), "dequantize_bf16: rows out of range");
  auto out = torch::empty({count, K}, torch::dtype(torch::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#pragma omp parallel num_threads(num_threads_for(count / 16 + 1))
  {
    std::vector<float> row(K);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < count; ++r) {
      dequant_row_isa(isa, fmt, row_ptr(w, start + r), scale_of(scales, fmt, start + r), K, row.data());
      uint16_t* dst = o + r * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits(row[k]);
    }
  }
  return out;
}

// The rows named by ids (any shape, int64) as float32 [*ids.shape, K]: the embedding lookup.
torch::Tensor dequantize_rows(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor scales, torch::Tensor ids,
                              int64_t isa) {
  check(w, fmt, K, scales, isa);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "dequantize_rows: int64 ids");
  auto flat = ids.contiguous().view(-1);
  const int64_t T = flat.numel(), N = w.size(0);
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "dequantize_rows: id out of range");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    dequant_row_isa(isa, fmt, row_ptr(w, idp[t]), scale_of(scales, fmt, idp[t]), K, o + t * K);
  auto shape = ids.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
}

}  // namespace tandem
