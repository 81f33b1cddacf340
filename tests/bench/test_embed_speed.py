"""bench/embed_speed.py's bookkeeping (the run itself needs its peer venvs; `python -m bench.embed_speed --quick`
checks the wiring): the texts are real corpus windows of the asked token lengths, taken evenly, and the same ones
for the same seed; the cosine check catches a vector that differs."""
from __future__ import annotations

import collections

import numpy as np
from transformers import AutoTokenizer

from bench.embed_speed import corpus_texts, min_cosine
from bench.models import minilm_encoder_dir


def test_texts_are_corpus_windows_of_the_asked_lengths_taken_evenly_and_seeded():
    tok = AutoTokenizer.from_pretrained(str(minilm_encoder_dir()))
    texts, counts = corpus_texts(tok, 30, [16, 64, 512], seed=0)
    assert len(texts) == len(counts) == 30 and len(set(texts)) == 30
    nearest = [min((16, 64, 512), key=lambda n: abs(n - c)) for c in counts]
    assert collections.Counter(nearest) == {16: 10, 64: 10, 512: 10}
    assert all(abs(c - n) <= 2 for c, n in zip(counts, nearest))  # a window re-tokenized may gain a subword
    assert counts == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert corpus_texts(tok, 30, [16, 64, 512], seed=0)[0] == texts
    assert corpus_texts(tok, 30, [16, 64, 512], seed=1)[0] != texts


def test_min_cosine_is_the_worst_row():
    a = np.eye(3, dtype=np.float32)
    b = a.copy()
    assert min_cosine(a, b) == 1.0
    b[2] = [0, 1, 1]
    assert abs(min_cosine(a, b) - 2 ** -0.5) < 1e-6
