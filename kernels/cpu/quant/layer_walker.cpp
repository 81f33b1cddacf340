// The layer walker (layer_walker.h): a decode-only step's layers in C++, with the loop's own functions.
#include "layer_walker.h"

#include <string>

#include "fused_ops.h"
#include "matmul.h"

namespace tandem {

Projection::Projection(std::vector<torch::Tensor> data_, std::vector<int64_t> fmts_,
                       std::vector<torch::Tensor> scales_, int64_t K_, std::optional<torch::Tensor> bias_,
                       std::vector<bool> int8_)
    : data(std::move(data_)), scales(std::move(scales_)), fmts(std::move(fmts_)), K(K_), int8(std::move(int8_)) {
  TORCH_CHECK(!data.empty() && data.size() == fmts.size() && data.size() == scales.size(),
              "Projection: one format and one scales tensor per part");
  if (int8.empty()) int8.assign(data.size(), false);
  TORCH_CHECK(int8.size() == data.size(), "Projection: one int8 flag per part");
  for (size_t i = 0; i < data.size(); ++i) {
    check(data[i], fmts[i], K, scales[i], PORTABLE);
    N += data[i].size(0);
  }
  if (bias_.has_value()) {
    bias = bias_->contiguous();
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.numel() == N, "Projection: float32 bias of N");
  }
}

torch::Tensor Projection::operator()(const torch::Tensor& x, int64_t isa) const {
  TORCH_CHECK(x.is_contiguous() && x.size(1) == K, "Projection: contiguous [M, K] input");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  bool blocks32 = false, blocks256 = false;
  const bool has_kernel = !int8_kernel(isa).empty();
  auto quantized = [&](size_t i) { return has_kernel && int8[i] && int8_format(fmts[i]); };
  for (size_t i = 0; i < fmts.size(); ++i)
    if (quantized(i)) {
      blocks256 = blocks256 || int8_kquant(fmts[i]);
      blocks32 = blocks32 || !int8_kquant(fmts[i]);
    }
  const bool quantize = blocks32 || blocks256;
  Int8Activations xq;
  if (quantize) xq = quantize_activations(x.data_ptr<float>(), M, K, isa, blocks32, blocks256);
  int64_t col = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    if (quantized(i)) {
      matmul_int8_into(xq, M, K, data[i], fmts[i], yp + col, N);
    } else {
      matmul_into(x.data_ptr<float>(), M, K, data[i], fmts[i], scales[i], isa, yp + col, N);
    }
    col += data[i].size(0);
  }
  if (bias.defined()) {
    const float* b = bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] += b[n];
  }
  return y;
}

namespace {
torch::Tensor weight_or_none(const std::optional<torch::Tensor>& w) {
  if (!w.has_value()) return torch::Tensor();
  TORCH_CHECK(w->scalar_type() == torch::kFloat32 && w->is_contiguous() && w->dim() == 1,
              "DecodeLayers: norm weights must be contiguous float32 vectors");
  return *w;
}

// RMSNorm of each row of `rows` rows x D floats, `stride` floats apart, in place.
void rms_rows_(float* p, int64_t rows, int64_t stride, int64_t D, const torch::Tensor& weight, float eps) {
  TORCH_CHECK(weight.numel() == D, "DecodeLayers: norm weight size");
  for (int64_t r = 0; r < rows; ++r) rms_row(p + r * stride, weight.data_ptr<float>(), eps, D, p + r * stride);
}
}  // namespace

DecodeLayers::DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool gelu,
                           const pybind11::capsule& attend)
    : nq_(num_heads), nkv_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)), gelu_(gelu) {
  TORCH_CHECK(attend.name() != nullptr && std::string(attend.name()) == ATTEND_CAPSULE,
              "DecodeLayers: the attention must be a ", ATTEND_CAPSULE, " capsule");
  attend_ = reinterpret_cast<AttendFn>(attend.get_pointer());
}

void DecodeLayers::add_layer(Projection qkv, Projection o, Projection gate_up, Projection down,
                             std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                             std::optional<torch::Tensor> attn_post_norm, torch::Tensor mlp_norm,
                             std::optional<torch::Tensor> mlp_post_norm, torch::Tensor next_norm, double scale,
                             int64_t window, double softcap, int64_t rope) {
  TORCH_CHECK(qkv.N == (nq_ + 2 * nkv_) * D_ && o.K == nq_ * D_ && gate_up.N % 2 == 0 && down.K == gate_up.N / 2 &&
                  o.N == qkv.K && gate_up.K == qkv.K && down.N == qkv.K,
              "DecodeLayers: projection shapes do not fit the heads");
  layers_.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), weight_or_none(q_norm),
                          weight_or_none(k_norm), weight_or_none(attn_post_norm), weight_or_none(mlp_norm),
                          weight_or_none(mlp_post_norm), weight_or_none(next_norm), scale, softcap, window, rope});
}

torch::Tensor DecodeLayers::forward(torch::Tensor h, torch::Tensor residual, torch::Tensor kv_caches,
                                    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                                    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                                    int64_t isa) const {
  TORCH_CHECK(h.scalar_type() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(),
              "DecodeLayers: h must be contiguous float32 [T, hidden]");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == num_layers() && kv_caches.size(1) == 2,
              "DecodeLayers: kv_caches must be [layers, 2, blocks, block, Hkv, D]");
  TORCH_CHECK(cos.size() == sin.size(), "DecodeLayers: one sin table per cos table");
  check_isa(isa, "DecodeLayers");
  const int64_t T = h.size(0), H = nq_ + 2 * nkv_;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& L = layers_[i];
    TORCH_CHECK(L.rope >= 0 && L.rope < static_cast<int64_t>(cos.size()), "DecodeLayers: no rope table ", L.rope);
    auto qkv = L.qkv(h, isa).view({T, H, D_});
    float* qp = qkv.data_ptr<float>();
    if (L.q_norm.defined()) {
      for (int64_t t = 0; t < T; ++t) {
        rms_rows_(qp + t * H * D_, nq_, D_, D_, L.q_norm, eps_);
        rms_rows_(qp + (t * H + nq_) * D_, nkv_, D_, D_, L.k_norm, eps_);
      }
    }
    rotary_(qkv, nq_ + nkv_, cos[L.rope], sin[L.rope]);
    auto cache = kv_caches.select(0, static_cast<int64_t>(i));
    auto attn = attend_(qkv, nq_, cache.select(0, 0), cache.select(0, 1), slot_mapping, block_tables, seq_lens,
                        L.scale, L.window, L.softcap);
    auto o = L.o(attn.view({T, nq_ * D_}), isa);
    if (L.attn_post_norm.defined()) rms_rows_(o.data_ptr<float>(), T, o.size(1), o.size(1), L.attn_post_norm, eps_);
    h = add_rms_norm(o, residual, L.mlp_norm, eps_);
    auto gate_up = L.gate_up(h, isa);
    const int64_t I = L.gate_up.N / 2;
    torch::Tensor act;
    if (gelu_) {  // torch's own tanh GELU, as TorchOps.act_mul computes it
      act = at::gelu(gate_up.slice(1, 0, I), "tanh") * gate_up.slice(1, I, 2 * I);
    } else {
      act = silu_mul(gate_up);
    }
    auto m = L.down(act.contiguous(), isa);
    if (L.mlp_post_norm.defined()) rms_rows_(m.data_ptr<float>(), T, m.size(1), m.size(1), L.mlp_post_norm, eps_);
    h = add_rms_norm(m, residual, L.next_norm, eps_);
  }
  return h;
}

}  // namespace tandem
