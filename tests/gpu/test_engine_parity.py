"""The whole engine on CUDA in float32 gives the CPU engine's greedy tokens and rerank scores.

Both engines take the same scheduling options (tests/gpu/engines.py), so every step carries the same batch:
chunked prefills beside decodes, then decode-only steps. Run eagerly (enforce_eager=True: every step a plain
forward through the Triton kernels) and with the default, where decode-only steps replay captured CUDA graphs.
"""
from __future__ import annotations

import math

import pytest

from tests.engine.conftest import assert_no_leaks
from tests.gpu.engines import GREEDY, RERANK_DOCS, RERANK_QUERY, common_prefix, cuda_llm


@pytest.fixture(scope="module", params=["eager", "cuda_graphs"])
def gpu_llm(request):
    return cuda_llm(dtype="float32", enforce_eager=request.param == "eager")


def test_greedy_tokens_match_cpu(gpu_llm, prompts, cpu_greedy) -> None:
    records = []
    gpu_llm.engine.add_observer(records.append)
    outs = gpu_llm.generate(prompts, GREEDY)
    assert any(r.decode_tokens and r.prefill_tokens for r in records), "no step mixed decodes and prefill chunks"
    got = [o.token_ids for o in outs]
    for i, (g, want) in enumerate(zip(got, cpu_greedy)):
        assert g == want, f"prompt {i} ({prompts[i][:40]!r}...): CUDA and CPU part at token {common_prefix(g, want)}"
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert_no_leaks(gpu_llm)


def test_decode_steps_use_cuda_graphs_unless_eager(gpu_llm, prompts) -> None:
    """With graphs on, the decode-only steps of a generate really were replays; enforce_eager captures none."""
    graphs = getattr(gpu_llm.engine.runner, "decode_graphs", None)
    if gpu_llm.engine.config.enforce_eager:
        assert graphs is None
        return
    assert graphs is not None, "no CUDA graphs were captured (the log says why: 'CUDA graph capture failed')"
    before = graphs.replays
    gpu_llm.generate(prompts, GREEDY)
    assert graphs.replays > before


def test_rerank_scores_match_cpu(gpu_llm, cpu_llm) -> None:
    got = gpu_llm.rerank(RERANK_QUERY, RERANK_DOCS)
    want = cpu_llm.rerank(RERANK_QUERY, RERANK_DOCS)
    assert len(got) == len(RERANK_DOCS) and all(math.isfinite(s) for s in got)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3, (got, want)
    assert_no_leaks(gpu_llm)
