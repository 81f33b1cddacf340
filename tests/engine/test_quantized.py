"""The engine on quantized weights (issue #19). The default engine (`llm` fixture) serves the embedded model's GGUF
blocks, so every parity test in test_hf_parity.py (logits, batched greedy, chunked prefill, preemption, prefix
caching: all token-identical to transformers on the same file, dequantized by transformers) runs on the 4-bit path.
The blocks are dequantized in registers to exactly the values transformers' loader computes (d * q is exact in
fp32, so fma(d, q, m) == (d * q) + m); only summation order differs, and on the 16 prompts x 32 tokens of these
tests no near-tie flips, so they demand full identity rather than the 15-of-16 the issue would allow."""
from __future__ import annotations

import pytest
import torch

from engine.models.quantized import QuantizedEmbedding, QuantizedLinear
from kernels import quant
from engine import SamplingParams
from tests.engine.conftest import GREEDY_32, assert_no_leaks, make_llm
from tests.engine.test_hf_parity import _ragged_logits


# The fresh engines' KV pool: their prompts are short, and the default 1 GiB (1,456 blocks) is zero-filled at every
# build (~0.6 s of a core); the shared ones keep the default, so that other files' asks still find them
FRESH_BLOCKS = 64

def test_the_embedded_model_serves_its_gguf_blocks_in_under_150_mb(llm) -> None:
    eng = llm.engine
    assert eng.quantization == "gguf"
    info, stats = eng.model_info(), eng.stats()
    assert info["quantization"] == "gguf" and info["weight_format"].startswith("gguf Q4_1 + Q8_0")
    assert stats["weight_bytes"] == info["weight_bytes"] < 150e6
    model = eng.model
    assert info["cpu_kernels"] == model.cpu_path.isa.label  # the path picked at start-up, named for the operator
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.args.num_layers + 1  # every projection and the LM head
    assert {m.qweight.fmt for m in layers[:-1]} == {"Q4_1"}
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.qweight is model.model.embed_tokens.qweight  # tied: one copy of the Q8_0 table
    assert not any(p.is_meta for p in model.parameters())


def test_dense_float32_path_is_still_token_identical(prompts, hf_greedy) -> None:
    llm = make_llm(quantization="none")
    assert llm.engine.quantization == "none" and llm.engine.model_info()["weight_format"] == "float32"
    assert llm.engine.model_info()["cpu_kernels"] == ""  # no quantized matmul runs
    assert llm.engine.stats()["weight_bytes"] > 500e6
    outs = llm.generate(prompts, GREEDY_32)
    assert [o.token_ids for o in outs] == hf_greedy
    assert_no_leaks(llm)


def test_without_the_kernel_the_engine_serves_dense_float32(monkeypatch, caplog, prompts, hf_greedy) -> None:
    monkeypatch.setattr(quant, "_module", lambda: None)  # as if the C++ build had failed
    llm = make_llm(fresh=True, num_kv_blocks=FRESH_BLOCKS)  # built under the patch: never shared
    assert llm.engine.quantization == "none"
    assert "serving dense float32 weights instead" in caplog.text
    outs = llm.generate(prompts[:4], GREEDY_32)
    assert [o.token_ids for o in outs] == hf_greedy[:4]


def test_judge_reads_two_lm_head_rows_from_the_blocks(llm) -> None:
    ids = [5, 17]
    rows = llm.engine.model.lm_head_rows(ids)
    dense = llm.engine.model.lm_head.qweight.dequantize()
    assert torch.equal(rows, dense[ids])
    scores = llm.rerank("capital of France", ["Paris is the capital of France.", "Bananas are yellow."])
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)


def test_int8_logits_match_transformers_on_the_same_int8_weights(model_dir, hf_model, tokenizer, prompts) -> None:
    """--quantization int8 on a dense checkpoint: per-output-channel int8 for every projection and the (tied)
    embedding. Reference: transformers with each of those weights replaced by its int8 dequantization."""
    llm = make_llm(model=str(model_dir), quantization="int8")
    eng = llm.engine
    assert eng.quantization == "int8" and eng.model_info()["weight_format"].startswith("int8 per-channel")
    assert eng.stats()["weight_bytes"] < 160e6  # about a quarter of the 538 MB of float32
    ref = type(hf_model)(hf_model.config).eval()
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    for name, tensor in state.items():
        if tensor.dim() == 2:  # projections, embedding (tied with lm_head): as the engine quantizes them
            state[name] = quant.quantize_int8(tensor).dequantize()
    ref.load_state_dict(state)
    token_lists = [tokenizer(p).input_ids for p in (prompts[1], prompts[13])]
    ours = _ragged_logits(llm, token_lists)
    with torch.inference_mode():
        for ids, mine in zip(token_lists, ours):
            assert (mine - ref(torch.tensor([ids])).logits[0]).abs().max().item() <= 1e-3
    outs = llm.generate(prompts[:2], GREEDY_32)
    assert all(len(o.token_ids) > 0 for o in outs)
    assert_no_leaks(llm)


def test_gguf_tensors_are_cached_as_stored(tmp_path) -> None:
    """The first start writes what read_gguf returned to the cache; later starts read it back unchanged
    without parsing the GGUF file again."""
    from engine.models import gguf_file as gmod
    from tests.kernels.test_quant import make

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    tensors = {"model.norm.weight": torch.randn(8), "model.layers.0.mlp.down_proj.weight": make("Q4_1", 8, 64),
               "lm_head.weight": make("Q8_0", 5, 32)}
    calls = []
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gmod, "read_gguf", lambda *a: calls.append(a) or ("llama", tensors))
        first = gmod.load_gguf(path, tmp_path / "cache")
        second = gmod.load_gguf(path, tmp_path / "cache")
    assert len(calls) == 1
    for got in (first, second):
        assert got.keys() == tensors.keys()
        assert torch.equal(got["model.norm.weight"], tensors["model.norm.weight"])
        for name, w in tensors.items():
            if name != "model.norm.weight":
                assert (got[name].fmt, got[name].shape) == (w.fmt, w.shape)
                assert torch.equal(got[name].data, w.data)


def test_quantization_config_is_validated() -> None:
    import pytest

    from engine import EngineConfig

    assert EngineConfig().quantization is None
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="runs on device 'cpu' with dtype 'float32'"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="runs on device 'cpu' with dtype 'float32'"):
        EngineConfig(quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="embedded model's GGUF file or a .gguf path"):
        EngineConfig(model="/some/dir", quantization="gguf")


def test_int8_activations_are_one_setting_away_and_stay_close_to_float32(llm, prompts) -> None:
    """cpu_activations='int8': the Q4_1 / Q8_0 projections of the embedded model multiply int8-rounded rows in
    steps of up to small_m rows (decode steps; these short prompts too). Logprobs move (the rounding is real) and
    stay near float32's. On a path with no int8 kernel (TANDEM_CPU_ISA=portable) the setting is refused, naming it."""
    # Asked of the engine `llm`, built from TANDEM_CPU_ISA (a skipif would ask at collection, of this CPU's auto path,
    # and see the widest path whatever the variable says).
    if not quant.int8_activations_available(llm.engine.model.cpu_path):
        with pytest.raises(ValueError, match="needs the avx2 or avx512 CPU path; this engine's is portable"):
            make_llm(cpu_activations="int8")
        return
    int8 = make_llm(cpu_activations="int8")
    assert int8.engine.model_info()["cpu_kernels"] == f"{int8.engine.model.cpu_path.isa.label} int8-activations"
    linears = [m for m in int8.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.activations is quant.Activations.INT8 for m in linears)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
    moved = []
    for ref, got in zip(llm.generate(prompts[:3], params), int8.generate(prompts[:3], params)):
        for i in range(2):
            if got.token_ids[:i + 1] != ref.token_ids[:i + 1]:
                break
            moved.append(abs(got.logprobs[i][got.token_ids[i]] - ref.logprobs[i][ref.token_ids[i]]))
    assert moved and max(moved) < 0.5 and max(moved) > 0
    assert_no_leaks(int8)


@pytest.mark.skipif(not quant.available(), reason="the C++ kernels did not build here")
def test_two_engines_in_one_process_each_compute_on_their_own_cpu_path(monkeypatch, prompts) -> None:
    """The CPU path is a value each engine's model holds (issue #62 item 4), not process state: an engine built with
    TANDEM_CPU_ISA=portable and TANDEM_QUANT_SMALL_M=3 keeps that path after a second engine is built on the auto
    path beside it, and each routes a 5-row step by its own (dequantize + GEMM past 3 rows; the in-register kernel
    to 16), names its own path in ModelInfo and walks decode steps up to its own width."""
    monkeypatch.setenv("TANDEM_CPU_ISA", "portable")
    monkeypatch.setenv("TANDEM_QUANT_SMALL_M", "3")
    forced = make_llm(fresh=True, num_kv_blocks=FRESH_BLOCKS)
    monkeypatch.delenv("TANDEM_CPU_ISA")
    monkeypatch.delenv("TANDEM_QUANT_SMALL_M")
    # built last (not the shared one): a process-wide path would now be this one for both
    auto = make_llm(fresh=True, num_kv_blocks=FRESH_BLOCKS)
    narrow, wide = forced.engine.model, auto.engine.model
    assert narrow.cpu_path == quant.CpuPath(quant.CpuIsa.PORTABLE, 3)
    assert wide.cpu_path.isa == quant.best_isa() and wide.cpu_path.small_m is None
    for model in (narrow, wide):  # every quantized module multiplies on its model's path
        held = {m.path for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
        assert held == {model.cpu_path}
    assert forced.engine.model_info()["cpu_kernels"] == "portable"
    assert auto.engine.model_info()["cpu_kernels"] == quant.best_isa().label
    assert (forced.engine.narrow_rows, narrow.walker_rows) == (3, 3)
    assert (auto.engine.narrow_rows, wide.walker_rows) == (16, 16)
    qkv_narrow, qkv_wide = narrow.model.layers[0].self_attn.qkv_proj, wide.model.layers[0].self_attn.qkv_proj
    w = qkv_wide.qweight
    assert torch.equal(qkv_narrow.qweight.data, w.data)  # the same blocks: only the path differs
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(62))
    gemm = quant._dequantize_gemm(x, w)
    kernel = quant._module().quant_matmul(x, w.data, quant.CPP_FORMATS[w.fmt], w.shape[1], w._scales(),
                                          int(wide.cpu_path.isa))
    assert not torch.equal(gemm, kernel)  # the two routes are told apart by their bits
    for _ in range(2):  # interleaved: neither call leaves anything behind for the other
        assert torch.equal(qkv_narrow(x), gemm)
        assert torch.equal(qkv_wide(x), kernel)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for llm in (forced, auto):  # decode steps of 2 rows: walked on each engine's own path
        assert all(len(o.token_ids) == 3 for o in llm.generate(prompts[:2], params))
        assert_no_leaks(llm)


def test_small_decode_steps_of_the_embedded_model_walk_its_layers_in_one_call(llm, prompts, hf_greedy) -> None:
    """Issue #28 item 3: the embedded model's decode steps of up to small_m sequences run every layer in one C++ call
    (GIL released), still token-identical to transformers; steps of more sequences, prefill and mixed steps keep the
    Python layer loop. Dense weights have no walker."""
    from tests.models.test_tiny_decoders import _CountingWalker

    model = llm.engine.model
    inner = model.walker
    assert inner is not None and inner.num_layers() == model.args.num_layers
    counter = model.walker = _CountingWalker(inner)
    steps: list = []
    llm.engine.add_observer(steps.append)
    try:
        outs = llm.generate(prompts[:4], GREEDY_32)
    finally:
        model.walker = inner
        llm.engine.remove_observer(steps.append)
    assert [o.token_ids for o in outs] == hf_greedy[:4]
    decode_only = [s for s in steps if s.prefill_tokens == 0 and s.rerank_tokens == 0
                   and 0 < s.decode_tokens <= quant.small_m(model.cpu_path.isa, model.cpu_path)]
    assert decode_only and counter.calls == len(decode_only)
    assert make_llm(quantization="none").engine.model.walker is None


# The int8 walker on the path this CPU takes by default and on AVX2 forced (the path most CPUs take; on an AVX-512
# VNNI host the two run different int8 kernels).
INT8_PATHS = [pytest.param("auto", marks=pytest.mark.skipif(
    not quant.int8_activations_available(), reason="this CPU's auto path (portable) has no int8-activation kernel")),
    pytest.param("avx2", marks=pytest.mark.skipif(
        quant.best_isa() < quant.CpuIsa.AVX2, reason=f"this CPU's kernels go up to {quant.best_isa().label}, not avx2"))]


@pytest.mark.parametrize("path", INT8_PATHS)
def test_int8_decode_steps_walk_the_layers_with_the_loops_values(path: str, prompts, monkeypatch) -> None:
    """--cpu-activations int8 keeps the layer walker: its projections quantize each row once per call and multiply
    it with the same int8 kernel, tiles and quantizer as QuantizedLinear does part by part, so every sampled token
    and log-probability is bit-identical to the Python layer loop's (TANDEM_LAYER_WALKER=0) with int8."""
    from tests.models.test_tiny_decoders import _CountingWalker

    monkeypatch.setenv("TANDEM_CPU_ISA", path)
    # Fresh engines: built for this test's path and walker setting, and the walked one's walker is replaced for good
    # below.
    walked = make_llm(cpu_activations="int8", fresh=True, num_kv_blocks=FRESH_BLOCKS)
    monkeypatch.setenv("TANDEM_LAYER_WALKER", "0")
    looped = make_llm(cpu_activations="int8", fresh=True, num_kv_blocks=FRESH_BLOCKS)
    isa = quant.best_isa() if path == "auto" else quant.CpuIsa.AVX2
    assert walked.engine.model.cpu_path.isa == looped.engine.model.cpu_path.isa == isa
    assert walked.engine.model_info()["cpu_kernels"] == f"{isa.label} int8-activations"
    assert walked.engine.model.walker is not None and looped.engine.model.walker is None
    counter = walked.engine.model.walker = _CountingWalker(walked.engine.model.walker)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    for batch in (prompts[:3], prompts[3:4]):  # decode steps of 3 rows, then of 1
        ours, theirs = walked.generate(batch, params), looped.generate(batch, params)
        for a, b in zip(ours, theirs):
            assert a.token_ids == b.token_ids
            assert [lp[t] for lp, t in zip(a.logprobs, a.token_ids)] == [
                lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
        int8 = ours[-1]
    assert counter.calls >= 2 * 5  # every decode step after the prefill
    # and the int8 rounding is real: float32 activations through the walker give other log-probabilities
    monkeypatch.delenv("TANDEM_LAYER_WALKER")
    f32 = make_llm(fresh=True, num_kv_blocks=FRESH_BLOCKS).generate(prompts[3:4], params)[0]
    assert [lp[t] for lp, t in zip(f32.logprobs, f32.token_ids)] != [
        lp[t] for lp, t in zip(int8.logprobs, int8.token_ids)]
    assert_no_leaks(walked)
