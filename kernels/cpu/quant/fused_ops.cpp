// The small fused ops of a CPU float32 decode step (fused_ops.h).
#include "fused_ops.h"

#include <cmath>

#include "matmul.h"

namespace tandem {

void rms_row(const float* x, const float* w, float eps, int64_t D, float* out) {
  double ss = 0.0;  // double accumulation: the mean of squares does not depend on summation order in practice
  for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(x[d]) * x[d];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * inv);  // weight * (x * rsqrt(mean + eps)), as HF
}

// residual += x (in place, when x is given), then RMSNorm(residual) * weight. x, residual [T, D] float32.
torch::Tensor add_rms_norm(std::optional<torch::Tensor> x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.scalar_type() == torch::kFloat32 && residual.is_contiguous() && residual.dim() == 2,
              "add_rms_norm: contiguous float32 [T, D] residual");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(), "add_rms_norm: float32 weight");
  const int64_t T = residual.size(0), D = residual.size(1);
  TORCH_CHECK(weight.numel() == D, "add_rms_norm: weight size");
  torch::Tensor xc;
  if (x.has_value()) {
    xc = x->contiguous();
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32 && xc.sizes() == residual.sizes(), "add_rms_norm: x like residual");
  }
  auto out = torch::empty_like(residual);
  float* r = residual.data_ptr<float>();
  const float* xp = x.has_value() ? xc.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
#pragma omp parallel for num_threads(num_threads_for(T / 32 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* rt = r + t * D;
    if (xp != nullptr)
      for (int64_t d = 0; d < D; ++d) rt[d] += xp[t * D + d];
    rms_row(rt, w, feps, D, o + t * D);
  }
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I], silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2, "silu_mul: float32 [T, 2I]");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float a = g[t * 2 * I + i];
      o[t * I + i] = a / (1.f + std::exp(-a)) * g[t * 2 * I + I + i];
    }
  return out;
}

// Rotate-half RoPE of q and k inside qkv [T, Hq + 2 Hkv, D] in place (v untouched); cos, sin [T, D].
void rotary_(torch::Tensor qkv, int64_t num_rotated_heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 3, "rotary_: qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "rotary_: tables");
  const int64_t T = qkv.size(0), H = qkv.size(1), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == D && num_rotated_heads <= H, "rotary_: shapes");
  float* p = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
#pragma omp parallel for num_threads(num_threads_for(T / 8 + 1)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < num_rotated_heads; ++h) {
      float* v = p + (t * H + h) * D;
      const float* ct = c + t * D;
      const float* st = s + t * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        // x * cos + rotate_half(x) * sin, each product rounded before the sum (built without FP contraction)
        const float lo = a * ct[i] + (-b) * st[i];
        const float hi = b * ct[i + half] + a * st[i + half];
        v[i] = lo;
        v[i + half] = hi;
      }
    }
}

}  // namespace tandem
