// Paged attention for one-token (decode) queries on CPU, reading K/V straight from the block cache.
//
// The torch reference gathers each sequence's blocks into a padded copy and then runs SDPA over it: three
// passes over the context. Here each sequence reads its keys and values once, in place, with the
// softmax computed exactly (scores kept, max subtracted) so results match the reference to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float p, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

}  // namespace

// query [B, Hq, D] (row b is sequence b's single new token), k_cache/v_cache [num_blocks, block_size, Hkv, D],
// block_tables [B, W] int32, seq_lens [B] int32 (context length including the new token). Returns [B, Hq, D].
// window > 0: the token attends only to the last `window` positions (sliding window); softcap > 0: scores become
// softcap * tanh(score / softcap) before the softmax.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: int32 block tables and lengths");
  query = query.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t G = Hq / Hkv;
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t token_stride = Hkv * D;  // floats between consecutive tokens of a block
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);

  // One task per sequence, all its KV heads together: each cached token's K (and V) row of Hkv * D floats is
  // contiguous, so a task reads whole rows. (One task per KV head read a third of each row: twice the memory
  // traffic once the hardware prefetcher had pulled in the neighbouring heads' lines.)
  // OpenMP directly (this file is built with -fopenmp), with torch's thread count: contexts differ in length, so
  // sequences are handed out dynamically.
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B)));
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc(Hq * D), inv_sum(Hq);
#pragma omp for schedule(dynamic, 4)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t ctx = lens[b];
      const int64_t t0 = (window > 0 && ctx > window) ? ctx - window : 0;  // first position in the window
      const int64_t L = ctx - t0;  // scores are indexed from t0
      const int32_t* table = tables + b * W;
      const float* qb = q + b * Hq * D;
      scores.resize(Hq * L);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t p = t0 + t;
        const float* k = kc + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
                                  token_stride;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = h * G + g;  // query heads h*G .. h*G+G-1 share KV head h
            float s = dot(qb + head * D, k + h * D, D) * fscale;
            if (fcap > 0.f) s = std::tanh(s / fcap) * fcap;
            scores[head * L + t] = s;
          }
      }
      for (int64_t head = 0; head < Hq; ++head) {
        float* s = scores.data() + head * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[head] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t p = t0 + t;
        const float* v = vc + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
                                  token_stride;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = h * G + g;
            axpy(scores[head * L + t], v + h * D, acc.data() + head * D, D);
          }
      }
      float* ob = o + b * Hq * D;
      for (int64_t head = 0; head < Hq; ++head)
        for (int64_t d = 0; d < D; ++d) ob[head * D + d] = acc[head * D + d] * inv_sum[head];
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
