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

// Writes each token's K and V rows (`row` floats each: Hkv heads of D, contiguous) into its cache slot. Rows are
// read at a stride, so K and V may be views of one fused qkv projection, never copied. A negative slot (a padding
// row) writes nothing, as in the reference.
void write_rows(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int64_t T, int64_t row,
                torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "write_kv_cache: float32 caches only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv_cache: contiguous caches");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T, "write_kv_cache: one int64 slot per token");
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row, "write_kv_cache: rows must match the cache's heads");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "write_kv_cache: slot ", slot, " outside the cache (", num_slots, " slots)");
    std::copy_n(k + t * k_stride, row, kc + slot * row);
    std::copy_n(v + t * v_stride, row, vc + slot * row);
  }
}

// [T, H, D] float32 with each row's heads contiguous (a contiguous tensor, or a head slice of one).
void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              what, ": float32 [T, H, D] with each row's heads contiguous");
}

// Decode attention of B one-token queries read from rows of q (row stride q_stride floats, heads contiguous).
torch::Tensor decode_attention(const float* q, int64_t q_stride, int64_t B, int64_t Hq, int64_t D,
                               const torch::TensorOptions& options, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: int32 block tables and lengths");
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "paged_decode_attention: one row per query");
  const int64_t G = Hq / Hkv;
  auto out = torch::empty({B, Hq, D}, options);
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
      const float* qb = q + b * q_stride;
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

}  // namespace

// query [B, Hq, D] (row b is sequence b's single new token), k_cache/v_cache [num_blocks, block_size, Hkv, D],
// block_tables [B, W] int32, seq_lens [B] int32 (context length including the new token). Returns [B, Hq, D].
// window > 0: the token attends only to the last `window` positions (sliding window); softcap > 0: scores become
// softcap * tanh(score / softcap) before the softmax.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  query = query.contiguous();
  const int64_t Hq = query.size(1), D = query.size(2);
  return decode_attention(query.data_ptr<float>(), Hq * D, query.size(0), Hq, D, query.options(), k_cache, v_cache,
                          block_tables, seq_lens, scale, window, softcap);
}

// key/value [T, Hkv, D] (rows may be strided), slot_mapping [T] int64 (-1: skip). In place, like the reference.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  check_rows(key, "write_kv_cache: key");
  check_rows(value, "write_kv_cache: value");
  TORCH_CHECK(key.sizes() == value.sizes(), "write_kv_cache: key and value shapes differ");
  write_rows(key.data_ptr<float>(), key.stride(0), value.data_ptr<float>(), value.stride(0), key.size(0),
             key.size(1) * key.size(2), k_cache, v_cache, slot_mapping);
}

// One decode step of one layer in one call: qkv [B, Hq + 2 Hkv, D] (one token per sequence, q and k already
// rotated) has its K and V rows written to their slots, then its query heads attend. Returns [B, Hq, D]. Saves a
// decode step the split, the two cache writes and the query copy per layer (Python and dispatch, not arithmetic:
// the values are exactly those of write_kv_cache followed by paged_decode_attention).
torch::Tensor paged_decode_qkv(torch::Tensor qkv, int64_t num_q_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                               double scale, int64_t window, double softcap) {
  check_rows(qkv, "paged_decode_qkv: qkv");
  const int64_t Hkv = k_cache.size(2), Hq = num_q_heads, D = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == Hq + 2 * Hkv && k_cache.size(3) == D, "paged_decode_qkv: qkv must hold Hq + 2 Hkv heads");
  const float* p = qkv.data_ptr<float>();
  write_rows(p + Hq * D, qkv.stride(0), p + (Hq + Hkv) * D, qkv.stride(0), qkv.size(0), Hkv * D, k_cache, v_cache,
             slot_mapping);
  return decode_attention(qkv.data_ptr<float>(), qkv.stride(0), qkv.size(0), Hq, D, qkv.options(), k_cache, v_cache,
                          block_tables, seq_lens, scale, window, softcap);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("write_kv_cache", &write_kv_cache, "K/V rows into their cache slots (CPU, float32)");
  m.def("paged_decode_qkv", &paged_decode_qkv, "write K/V, then decode attention, of one layer (CPU, float32)");
  // paged_decode_qkv's address, for the quantized-matmul module's layer walker (DecodeLayers) to call without Python
  m.def("paged_decode_qkv_capsule", [] {
    return pybind11::capsule(reinterpret_cast<void*>(&paged_decode_qkv), "tandem.paged_decode_qkv");
  });
}
