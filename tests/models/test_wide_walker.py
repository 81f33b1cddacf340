"""The layer walker's width (engine/models/decoder_walker.py `walker_rows`): a decode step goes through the C++ walker
up to the least width at which every projection's in-register kernel takes it (`quant.register_rows`), so a walked
step multiplies with the loop's kernels. For K-quant projections under `--cpu-activations auto` that is the int8
kernel's width (64 with AVX-512 VNNI, 32 beside AMX's bf16 wide steps, every width on a CPU without AVX-512), past
small_m's 16: steps of 17+ decoding sequences walk too, with the Python layer loop's bits."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.models.decoder import ConcatLinear
from engine.models.decoder_walker import layer_walker, walker_rows
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear
from kernels import quant
from tests.engine.conftest import assert_no_leaks, make_llm
from tests.models.test_tiny_decoders import VOCAB, _CountingWalker

WIDE = 24  # decoding sequences: past small_m (16), inside every K-quant int8 width


def _q4_k(n: int, k: int, seed: int) -> quant.QuantWeight:
    """Random Q4_K blocks (gguf-py cannot quantize K-quants) with small fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    nb = k // quant.QK_K
    blocks = rng.integers(0, 256, size=(n, nb, quant.BLOCK_BYTES["Q4_K"]), dtype=np.uint8)
    for off in (0, 2):  # d and dmin
        blocks[..., off:off + 2] = (rng.standard_normal((n, nb, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    return quant.QuantWeight(torch.from_numpy(blocks.reshape(n, -1)), "Q4_K", (n, k))


def _kquant_llm(tmp_path, fmt_of=lambda name: "Q4_K"):
    """A tiny Llama (hidden 256, intermediate 512: K-quant widths) served from int8 blocks, its layers' projections
    then swapped for random Q4_K ones (or `fmt_of(name)` = "I8": kept) with `auto` activations, and the walker rebuilt
    for them as the builder builds it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir)).save_pretrained(tmp_path)
    llm = make_llm(model=str(tmp_path), quantization="int8", num_kv_blocks=128, enable_prefix_caching=False,
                   max_num_seqs=32)
    model = llm.engine.model
    seed = 0
    for layer in model.model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            old = getattr(owner, name)
            assert isinstance(old, QuantizedLinear) and not isinstance(old, ConcatLinear)
            if fmt_of(name) == "Q4_K":
                seed += 1
                setattr(owner, name, QuantizedLinear(_q4_k(*old.qweight.shape, seed), old.bias, quant.Activations.AUTO,
                                                     model.cpu_path))
    walker = layer_walker(model)
    model.use_ops(model.ops, walker, model.kernels, walker_rows(model))
    return llm


@pytest.mark.skipif(not quant.available(), reason="the C++ kernels did not build here")
def test_wide_decode_steps_of_kquant_projections_walk_with_the_loops_bits(tmp_path) -> None:
    llm = _kquant_llm(tmp_path)
    model = llm.engine.model
    path = model.cpu_path
    width = quant.register_rows("Q4_K", quant.Activations.AUTO, path)
    assert model.walker is not None
    assert model.walker_rows == (sys.maxsize if width is None else width)
    if quant.int8_kernel(path.isa):  # the avx2 / avx512 paths: wider than small_m
        assert model.walker_rows > quant.small_m(path.isa, path) and model.walker_rows >= WIDE
    else:  # the portable path: no int8 kernel, so the float32 small-M kernel's width
        assert model.walker_rows == quant.small_m(path.isa, path)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 20, (WIDE,), generator=g)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    walker = model.walker
    counter = model.walker = _CountingWalker(walker)
    steps: list = []
    llm.engine.add_observer(steps.append)
    try:
        walked = llm.generate(prompts, params)
    finally:
        llm.engine.remove_observer(steps.append)
    try:
        model.walker = None  # the Python layer loop, same weights and kernels
        looped = llm.generate(prompts, params)
    finally:
        model.walker = walker
    decode_only = [s for s in steps if s.prefill_tokens == 0 and s.rerank_tokens == 0 and s.decode_tokens > 0]
    assert any(s.decode_tokens == WIDE for s in decode_only), "no decode step of all the sequences together"
    assert counter.calls == sum(s.decode_tokens <= model.walker_rows for s in decode_only)
    for a, b in zip(walked, looped):
        assert a.token_ids == b.token_ids
        assert [lp[t] for lp, t in zip(a.logprobs, a.token_ids)] == [lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
    assert_no_leaks(llm)


@pytest.mark.skipif(not quant.available(), reason="the C++ kernels did not build here")
def test_one_float32_part_keeps_the_walker_at_small_m(tmp_path) -> None:
    """A projection whose kernel stops at small_m (here: int8 blocks, which multiply float32 activations) sets the
    walker's width for the whole model."""
    llm = _kquant_llm(tmp_path, fmt_of=lambda name: "I8" if name == "o_proj" else "Q4_K")
    path = llm.engine.model.cpu_path
    assert llm.engine.model.walker_rows == quant.small_m(path.isa, path)


def test_register_rows_is_matmuls_choice(monkeypatch) -> None:
    """`register_rows` names the widths `matmul` routes by: the int8 kernel's (`int8_rows`, with the bf16 wide steps'
    narrower AMX width where the path has them) for a format taking int8 activations, small_m otherwise."""
    isa = quant.CpuIsa.AVX512
    monkeypatch.setattr(quant, "int8_kernel", lambda isa=None: "vnni")
    monkeypatch.setattr(quant, "best_isa", lambda: isa)
    monkeypatch.setattr(quant, "amx", lambda: True)
    auto, f32 = quant.Activations.AUTO, quant.Activations.FLOAT32
    for bf16 in (False, True):
        path = quant.CpuPath(isa, None, bf16)
        assert quant.register_rows("Q4_K", auto, path) == quant.int8_rows(isa, "Q4_K", bf16)
        assert quant.register_rows("Q4_K", auto, path) == (32 if bf16 else 64)
        assert quant.register_rows("Q4_K", f32, path) == quant.register_rows("Q8_0", auto, path) == quant.small_m(isa)
        assert quant.register_rows("Q8_0", quant.Activations.INT8, path) == quant.small_m(isa)
    small = quant.CpuPath(isa, 3)  # TANDEM_QUANT_SMALL_M=3: every kernel's width
    assert quant.register_rows("Q4_K", auto, small) == quant.register_rows("Q8_0", auto, small) == 3
    monkeypatch.setattr(quant, "int8_kernel", lambda isa=None: "avx2")
    monkeypatch.setattr(quant, "best_isa", lambda: quant.CpuIsa.AVX2)
    avx2 = quant.CpuPath(quant.CpuIsa.AVX2)
    assert quant.register_rows("Q6_K", quant.Activations.AUTO, avx2) is None  # every width on a CPU without AVX-512


def _matmul_widths(model) -> list[int]:
    """Every quantized projection part's in-register width, as matmul routes it on the part's own path (None: every
    width)."""
    return [quant.register_rows(m.qweight.fmt, m.activations, m.path) for m in model.modules()
            if isinstance(m, QuantizedLinear) and not isinstance(m, ConcatLinear) and m in _projection_parts(model)]


def _projection_parts(model) -> list:
    from engine.models.decoder_walker import _parts, _projections

    return [p for layer in model.model.layers for m in _projections(layer) for p in _parts(m)]


def _hold_path(model, path: quant.CpuPath) -> None:
    """The model and its quantized modules on `path`, as build_decoder leaves a model built with it."""
    model.cpu_path = path
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            m.path = path


def _expected_narrow(model) -> int | None:
    widths = [w for w in _matmul_widths(model) if w is not None]
    return min(widths) if widths else None


@pytest.mark.parametrize("which", ["embedded", "gemma"])
def test_the_width_the_planner_prices_is_the_width_the_models_matmuls_use(which, request, monkeypatch) -> None:
    """One owner of the narrow-path width: the loaded model's `narrow_rows` (the least in-register width of its
    projections' kernels) is what the step-time model prices the wide jump at and what the walker takes; on this
    host's path and on the forced narrower ones (AVX2: the K-quants' int8 kernel takes every width, so no jump;
    the 32-wide formats stop at small_m on every path)."""
    from engine.models.decoder_walker import narrow_rows

    model_path = None if which == "embedded" else str(request.getfixturevalue("gemma_gguf"))
    llm = make_llm(model=model_path, tpot_target_ms="auto")
    engine = llm.engine
    model = engine.model
    assert engine.narrow_rows == narrow_rows(model) == _expected_narrow(model)
    assert engine.admission.model.wide_rows == engine.narrow_rows
    if model.walker is not None:
        assert model.walker_rows == (sys.maxsize if engine.narrow_rows is None else engine.narrow_rows)
    formats = {p.qweight.fmt for p in _projection_parts(model)}
    if which == "gemma":  # Q4_K_M mixes K-quants with a few 32-wide parts (Q8_0 here): those set the width
        assert formats & {"Q4_K", "Q6_K"}
        if formats <= {"Q4_K", "Q5_K", "Q6_K"} and quant.int8_kernel(model.cpu_path.isa):
            assert engine.narrow_rows is None or engine.narrow_rows > quant.small_m(model.cpu_path.isa, model.cpu_path)
    # the forced AVX2 path (on a host without AVX-512): the same model holding that path, its widths as matmul would
    # route them there
    monkeypatch.setattr(quant, "int8_kernel", lambda isa=None: "avx2")
    monkeypatch.setattr(quant, "best_isa", lambda: quant.CpuIsa.AVX2)
    _hold_path(model, quant.CpuPath(quant.CpuIsa.AVX2))
    assert narrow_rows(model) == _expected_narrow(model)
    if which == "gemma":
        if formats <= {"Q4_K", "Q5_K", "Q6_K"}:
            assert narrow_rows(model) is None  # every width stays on the int8 kernel: no jump to price
