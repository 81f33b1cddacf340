"""The engine on CUDA in bfloat16: close to float32, not identical.

bf16 keeps 8 bits of mantissa, so greedy decoding drifts from float32 once two candidates are close; a broken
kernel instead gives garbage from the first token. Bound: at least 5 of the 8 prompts share their first 3 greedy
tokens with the float32 CPU engine (all of them where it stopped sooner). Rerank: scores finite, in
[0, 1], and within 0.1 of the float32 CPU scores.
"""
from __future__ import annotations

import math

import pytest

from tests.engine.conftest import assert_no_leaks
from tests.gpu.engines import GREEDY, RERANK_DOCS, RERANK_QUERY, common_prefix, cuda_llm


@pytest.fixture(scope="module")
def bf16_llm():
    return cuda_llm(dtype="bfloat16")  # the default: CUDA graphs on


def test_greedy_follows_float32_for_the_first_tokens(bf16_llm, prompts, cpu_greedy) -> None:
    outs = bf16_llm.generate(prompts, GREEDY)
    assert all(o.token_ids for o in outs)
    shared = [common_prefix(o.token_ids, want) for o, want in zip(outs, cpu_greedy)]
    assert sum(n >= min(3, len(want)) for n, want in zip(shared, cpu_greedy)) >= 5, (
        f"greedy tokens shared with float32, per prompt: {shared}")
    assert_no_leaks(bf16_llm)


def test_rerank_scores_are_finite_and_near_float32(bf16_llm, cpu_llm) -> None:
    got = bf16_llm.rerank(RERANK_QUERY, RERANK_DOCS)
    want = cpu_llm.rerank(RERANK_QUERY, RERANK_DOCS)
    assert len(got) == len(RERANK_DOCS)
    assert all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in got), got
    assert max(abs(a - b) for a, b in zip(got, want)) <= 0.1, (got, want)
    assert_no_leaks(bf16_llm)
