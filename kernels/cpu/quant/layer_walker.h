// A small decode step's layers in one call. For a decode-only step of a few sequences, Python per layer (module
// lookups, argument parsing, a dozen calls) cost as much as the small ops themselves. `DecodeLayers` holds every
// layer's weights and settings once, at load, and `forward` walks the layers in C++, calling the same functions the
// Python layer loop calls (the projections' small-M kernel, add_rms_norm, rotary_, silu_mul or torch's tanh GELU, the
// paged decode attention), so the values are those of the loop, bit for bit.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace tandem {

// The attention of one layer of a decode-only step (kernels/cpu/paged_decode.cpp's `paged_decode_qkv`, another
// extension module): handed over once as a PyCapsule holding its address.
using AttendFn = torch::Tensor (*)(torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                   torch::Tensor, double, int64_t, double);
constexpr const char* ATTEND_CAPSULE = "tandem.paged_decode_qkv";

// One projection: its output columns are the parts' rows in order (a fused q/k/v or gate/up whose parts share a
// format is one part), plus an optional bias. `int8[i]`: part i multiplies int8 activations (x quantized once per
// call, per block of 32 and / or per super-block of 256, for all such parts) where its format has an int8 kernel and
// the CPU path has one; the other parts, and every part on a path without one, take float32 activations (what
// QuantizedLinear does per part; kernels/quant.py `takes_int8` decides per format).
struct Projection {
  std::vector<torch::Tensor> data, scales;
  std::vector<int64_t> fmts;
  int64_t K = 0, N = 0;
  torch::Tensor bias;  // undefined: none
  std::vector<bool> int8;  // one per part

  Projection(std::vector<torch::Tensor> data_, std::vector<int64_t> fmts_, std::vector<torch::Tensor> scales_,
             int64_t K_, std::optional<torch::Tensor> bias_, std::vector<bool> int8_);
  // x [M, K] -> [M, N]
  torch::Tensor operator()(const torch::Tensor& x, int64_t isa) const;
};

struct Layer {
  Projection qkv, o, gate_up, down;
  // norm weights as the layer multiplies by them; undefined: the model has none there
  torch::Tensor q_norm, k_norm, attn_post_norm, mlp_norm, mlp_post_norm, next_norm;
  double scale, softcap;
  int64_t window, rope;
};

class DecodeLayers {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool gelu,
               const pybind11::capsule& attend);

  void add_layer(Projection qkv, Projection o, Projection gate_up, Projection down,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                 std::optional<torch::Tensor> attn_post_norm, torch::Tensor mlp_norm,
                 std::optional<torch::Tensor> mlp_post_norm, torch::Tensor next_norm, double scale, int64_t window,
                 double softcap, int64_t rope);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h: layer 0's normed input [T, hidden]; residual [T, hidden], updated in place; kv_caches [layers, 2, blocks,
  // block, Hkv, D]; cos / sin: one [T, D] table per rope; the paged inputs of a decode-only step (one token per
  // sequence). Returns the final norm's output [T, hidden], as the Python layer loop does.
  torch::Tensor forward(torch::Tensor h, torch::Tensor residual, torch::Tensor kv_caches,
                        std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens, int64_t isa) const;

 private:
  int64_t nq_, nkv_, D_;
  float eps_;
  bool gelu_;
  AttendFn attend_ = nullptr;
  std::vector<Layer> layers_;
};

}  // namespace tandem
