// Paged attention for one-token (decode) queries on CPU, reading K/V straight from the block cache.
//
// The torch reference gathers each sequence's blocks into a padded copy and then runs SDPA over it: three
// passes over the context. Here each (sequence, KV head) reads its keys and values once, in place, with the
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
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
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

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = lens[b];
      const int32_t* table = tables + b * W;
      const float* qh = q + (b * Hq + h * G) * D;  // the G query heads that share KV head h
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* k = kc + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) *
                                  token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qh + g * D, k, D) * fscale;
      }
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* v = vc + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) *
                                  token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], v, acc.data() + g * D, D);
      }
      float* oh = o + (b * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[g * D + d] * inv_sum[g];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
