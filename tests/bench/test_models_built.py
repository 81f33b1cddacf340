"""bench/models.py and tests/models_built.py build the MiniLM cross-encoder each for its own side (bench and tests
import neither the other): the same checkpoint, so the benchmarks time the model the tests check."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from bench.models import TOKENIZER_FILES, minilm_cross_encoder_dir
from tests.models_built import minilm_cross_encoder_dir as tests_minilm_cross_encoder_dir


def test_bench_and_tests_build_the_same_minilm_cross_encoder(tmp_path):
    bench_dir = minilm_cross_encoder_dir(tmp_path / "bench")
    tests_dir = tests_minilm_cross_encoder_dir(tmp_path / "tests")
    assert json.loads((bench_dir / "config.json").read_text()) == json.loads((tests_dir / "config.json").read_text())
    ours, theirs = load_file(bench_dir / "model.safetensors"), load_file(tests_dir / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in TOKENIZER_FILES:
        assert (bench_dir / name).read_bytes() == (tests_dir / name).read_bytes()
