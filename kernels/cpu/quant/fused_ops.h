// Small fused ops of the decode step (float32, CPU). A decode step of a small batch spends as long in ~25 small torch
// ops per layer (each a dispatch, an allocation, a pass over a few KB) as in its matmuls; these do the same
// arithmetic in one call each.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace tandem {

// out[0, D) = RMSNorm(x) * w, as HF computes it (x and out may be the same row).
void rms_row(const float* x, const float* w, float eps, int64_t D, float* out);
// residual += x (in place, when x is given), then RMSNorm(residual) * weight. x, residual [T, D] float32.
torch::Tensor add_rms_norm(std::optional<torch::Tensor> x, torch::Tensor residual, torch::Tensor weight, double eps);
// gate_up [T, 2I] -> silu(gate) * up [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up);
// Rotate-half RoPE of q and k inside qkv [T, Hq + 2 Hkv, D] in place (v untouched); cos, sin [T, D].
void rotary_(torch::Tensor qkv, int64_t num_rotated_heads, torch::Tensor cos, torch::Tensor sin);

}  // namespace tandem
