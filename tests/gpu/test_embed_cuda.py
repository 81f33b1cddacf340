"""Embedders on CUDA give the CPU's vectors (float32), alone and through the engine's staged encoder rows.

Tiny random encoders built here (no weights to carry): a BERT with mean pooling and Normalize, a ModernBERT with a
local attention window shorter than the inputs, and a last-token Qwen3 decoder embedder; all read the embedded
SmolLM2 tokenizer (their vocabularies are its size). Through the engine the rows share steps with a generation
and are cut into stages by a small budget, as in `tandem serve`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.embed import Embedder
from engine.embed.job import EmbedParams
from engine.models.loader import default_model_dir
from engine.settings import Settings
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_embed import tiny_modernbert, tiny_qwen3_embedder

TEXTS = ["A lighthouse keeper trims the wick and winds the clockwork that turns the lens every night of the year.",
         "Fog horns sound when the light cannot be seen.", "Bananas.",
         "Ships read the light's pattern of flashes on their charts to know which lighthouse they are passing by. " * 4]
VOCAB = 49152  # SmolLM2's


def _sentence_modules(directory: Path, dim: int, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": dim, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "lasttoken"}))


def _bert(directory: Path) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=512)
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(directory)
    _sentence_modules(directory, 32, "mean", normalize=True)


def _modernbert(directory: Path) -> None:
    tiny_modernbert(directory, vocab_size=VOCAB, cls=1, sep=2)
    _sentence_modules(directory, 32, "cls", normalize=False)


def _qwen3(directory: Path) -> None:
    tiny_qwen3_embedder(directory, max_positions=512)


@pytest.fixture(scope="module", params=["bert", "modernbert", "qwen3"])
def embedder_dir(request, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp(request.param)  # its name says which
    {"bert": _bert, "modernbert": _modernbert, "qwen3": _qwen3}[request.param](directory)
    if request.param != "qwen3":  # tiny_qwen3_embedder saves it
        AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir)).save_pretrained(directory)
    return directory


def _cpu_vectors(directory: Path) -> torch.Tensor:
    cpu = Embedder.load(str(directory))
    rows = [r.token_ids for r in cpu.rows(TEXTS, None, EmbedParams())]
    return torch.stack([torch.tensor(Embedder.finish(v, EmbedParams())) for v in cpu.embed(rows)])


def test_an_embedder_on_cuda_gives_the_cpu_vectors(embedder_dir: Path) -> None:
    gpu = Embedder.load(str(embedder_dir), device="cuda")
    rows = [r.token_ids for r in gpu.rows(TEXTS, None, EmbedParams())]
    assert max(len(r) for r in rows) > 64  # longer than ModernBERT's local window, several blocks of the kernel
    got = gpu.embed(rows)
    want = Embedder.load(str(embedder_dir)).embed(rows)
    assert (got.cpu() - want).abs().max().item() <= 1e-4
    assert want.std(0).mean().item() > 1e-3  # the random model tells the inputs apart


def test_the_engine_on_cuda_embeds_in_stages_beside_a_generation(embedder_dir: Path) -> None:
    decoder = embedder_dir.name.startswith("qwen3")  # a decoder embedder's row runs whole: a budget it fits
    llm = LLM(EngineConfig(device="cuda", embedder=str(embedder_dir), max_num_batched_tokens=256 if decoder else 64))
    records = []
    llm.engine.add_observer(records.append)
    llm.engine.add_request("chat", "The capital of France is", SamplingParams(max_tokens=24, temperature=0.0))
    got = torch.tensor(llm.embed(TEXTS))  # steps until the chat is done too
    assert any(r.embed_rows and (r.decode_tokens or r.prefill_tokens) for r in records), "no step carried both kinds"
    if not decoder:
        assert any(r.embed_rows > r.embed_rows_done for r in records), "no row was cut into stages"
    assert (got - _cpu_vectors(embedder_dir)).abs().max().item() <= 1e-4
    assert_no_leaks(llm)
