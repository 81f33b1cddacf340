// The Python module: the quantized matmul, the fused decode ops and the layer walker, as kernels/quant.py calls them.
#include <torch/extension.h>

#include "fused_ops.h"
#include "layer_walker.h"
#include "matmul.h"

using namespace tandem;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Projection>(m, "Projection", "a projection's weight parts as stored, their formats, K and a bias")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>, int64_t,
                    std::optional<torch::Tensor>, std::vector<bool>>(),
           py::arg("data"), py::arg("fmts"), py::arg("scales"), py::arg("K"), py::arg("bias"),
           py::arg("int8") = std::vector<bool>())
      .def_readonly("N", &Projection::N)
      .def_readonly("int8", &Projection::int8)
      .def("__call__", [](const Projection& p, torch::Tensor x, int64_t isa) {
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "Projection: x must be float32 [M, K]");
        check_isa(isa, "Projection");
        return p(x.contiguous(), isa);
      });
  py::class_<DecodeLayers>(m, "DecodeLayers", "every layer of a small decode step in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, bool, const py::capsule&>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate-half RoPE of q and k in place");
  m.def("best_isa", &best_isa, "the widest CPU path in this build: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("quant_matmul_int8", &quant_matmul_int8, "x @ dequantize(w).T with x quantized to int8 per block of 32");
  m.def("quant_gemm_int8", &quant_gemm_int8, "the wide int8 GEMM: x @ dequantize(w).T, x per block of 32, w repacked");
  m.def("has_gemm_int8", &has_gemm_int8, "whether CPU path isa has the wide int8 GEMM for format fmt");
  m.def("int8_kernel", &int8_kernel, "the int8-activation kernel of a CPU path: vnni, avx2 or '' (none)");
  m.def("quant_matmul", &quant_matmul, "x @ dequantize(w).T for small M (CPU, float32)");
  m.def("dequantize", &dequantize, "rows [start, start + count) as float32");
  m.def("dequantize_bf16", &dequantize_bf16, "rows [start, start + count) as bfloat16 (the wide steps' bf16 GEMM)");
  m.def("dequantize_rows", &dequantize_rows, "the rows named by ids as float32 (embedding lookup)");
}
