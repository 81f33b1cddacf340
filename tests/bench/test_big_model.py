"""bench/big_model.py: the random SmolLM2-shaped HF model it writes (config, tied embeddings, seeded and
shard-independent weights, the embedded tokenizer) and llama.cpp's own converter and quantizer on a tiny shape.
The converter runs from the llama.cpp source tree bench.peers.llama_server keeps in its cache, the quantizer is its built
binary: those two tests skip, saying so, only where that tree or binary is not there."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench.big_model import (SMOLLM2_1P7B, ModelSize, Quant, Shape, convert_to_gguf, embedded_tokenizer, made_dir,
                             model_file, quantize, tensor_specs, write_random_hf)
from bench.peers.llama_server import source_dir, tool_path

# rows of 256: llama-quantize's K-quants need them (narrower rows fall back to other types)
TINY = Shape(hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2, max_positions=256)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return write_random_hf(tmp_path_factory.mktemp("tiny") / "hf", TINY, seed=3, shard_bytes=1 << 20)


def test_the_1p7b_shape_has_smollm2_1p7b_parameter_count() -> None:
    params = sum(int(np.prod(dims)) for _, dims in tensor_specs(SMOLLM2_1P7B))
    assert 1.70e9 < params < 1.72e9  # SmolLM2-1.7B: 1.71B parameters with its tied embeddings
    names = [n for n, _ in tensor_specs(SMOLLM2_1P7B)]
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * 24


def test_transformers_loads_the_written_model_with_its_shape_and_tied_head(tiny_hf) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_hf)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.max_position_embeddings) == (
        TINY.hidden, TINY.layers, TINY.intermediate, TINY.heads, TINY.kv_heads, TINY.vocab, TINY.max_positions)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == TINY.rope_theta
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    w = model.model.layers[1].mlp.down_proj.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    with torch.no_grad():  # activations stay finite and in range through the layers
        logits = model(torch.tensor([[1, 504, 3000, 77]])).logits
    assert torch.isfinite(logits).all() and float(logits.abs().max()) < 50


def test_weights_are_seeded_and_do_not_depend_on_sharding(tiny_hf, tmp_path) -> None:
    assert len(list(tiny_hf.glob("*.safetensors"))) > 1  # 1 MiB shards: the embedding alone is 24 MiB
    again = _tensors(write_random_hf(tmp_path / "one", TINY, seed=3))  # one shard
    first = _tensors(tiny_hf)
    assert first.keys() == again.keys() == {n for n, _ in tensor_specs(TINY)}
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = _tensors(write_random_hf(tmp_path / "other", TINY, seed=4))
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_the_tokenizer_is_the_embedded_one(tiny_hf) -> None:
    from transformers import AutoTokenizer

    text = "The old lighthouse stood on the cliff, 42 steps up."
    ours = AutoTokenizer.from_pretrained(tiny_hf)
    assert ours(text)["input_ids"] == embedded_tokenizer()(text)["input_ids"]
    assert ours.eos_token_id == embedded_tokenizer().eos_token_id


def test_model_sizes_map_to_files(tmp_path, monkeypatch) -> None:
    from engine.models.loader import embedded_gguf_path

    assert model_file("135m") == embedded_gguf_path()
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert made_dir() == tmp_path / "bench-models" / "smollm2-1.7b-random-s0"
    with pytest.raises(ValueError):
        model_file("7b")
    assert {m.value for m in ModelSize} == {"135m", "gemma-270m", "1.7b"}


def _converter() -> Path:
    script = source_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp's source tree is not in the cache ({script} is missing): "
                    "`python -m bench.peers.llama_server --source-only` extracts it")
    return script


@pytest.fixture(scope="module")
def tiny_f16(tiny_hf, tmp_path_factory) -> Path:
    return convert_to_gguf(tiny_hf, tmp_path_factory.mktemp("gguf") / "f16.gguf", _converter())


def test_llama_cpps_converter_writes_the_model_as_f16(tiny_hf, tiny_f16) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(tiny_f16))
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp's LM head is token_embd
    assert len(tensors) == 2 + 9 * TINY.layers
    embd = tensors["token_embd.weight"]
    ours = _tensors(tiny_hf)["model.embed_tokens.weight"].to(torch.float16).numpy()
    assert np.array_equal(np.asarray(embd.data).reshape(ours.shape), ours)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == "llama"


@pytest.mark.parametrize("quant", list(Quant))
def test_llama_quantize_writes_the_asked_type(tiny_f16, quant, tmp_path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    binary = tool_path("avx2", "llama-quantize")
    if not os.access(binary, os.X_OK):
        pytest.skip(f"llama-quantize is not built ({binary}): `python -m bench.peers.llama_server --build avx2`")
    out = quantize(tiny_f16, tmp_path / f"{quant}.gguf", quant, binary, threads=1)
    types = {t.name: t.tensor_type for t in GGUFReader(str(out)).tensors}
    main = GGMLQuantizationType.Q8_0 if quant is Quant.Q8_0 else GGMLQuantizationType.Q4_K
    assert types["blk.0.attn_q.weight"] == main and types["blk.1.ffn_gate.weight"] == main
    if quant is Quant.Q4_K_M:  # its mixture: the tied embedding, which is also the LM head, in Q6_K
        assert types["token_embd.weight"] == GGMLQuantizationType.Q6_K
    assert out.stat().st_size < tiny_f16.stat().st_size
