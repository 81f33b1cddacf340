"""Rerank over real sockets: equal to the offline LLM.rerank, sorted, top_n/return_documents, streaming."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from clients import AsyncClient
from engine.config import RerankParams
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.core import RerankInput
from tests.service.conftest import DOCUMENTS, MAX_DOCUMENTS, QUERY
from tests.service.harness import assert_all_blocks_free


async def test_rerank_is_sorted_with_input_indices_and_equals_offline(served, offline):
    async with AsyncClient(served.address) as client:
        results = await client.rerank(QUERY, DOCUMENTS)
    scores = [r.score for r in results]
    assert sorted(r.index for r in results) == list(range(len(DOCUMENTS)))
    assert scores == sorted(scores, reverse=True)
    assert {r.index: r.score for r in results} == {i: pytest.approx(s, abs=1e-4) for i, s in enumerate(offline.scores)}
    assert all(r.document is None for r in results)
    assert results.usage.prompt_tokens > 0
    # the client hands back the mode and the model that scored (RerankResponse.mode / .model), whatever was named
    assert (results.mode, results.model) == ("fusion", served.core.rerank_name)
    assert "+" in results.model  # fusion: the embedder's id and the LLM's name
    assert_all_blocks_free(await served.idle_stats())


async def test_top_n_and_return_documents(served, offline):
    async with AsyncClient(served.address) as client:
        top = await client.rerank(QUERY, DOCUMENTS, top_n=2, return_documents=True)
        everything = await client.rerank(QUERY, DOCUMENTS, top_n=len(DOCUMENTS) + 3)
    assert len(top) == 2 and len(everything) == len(DOCUMENTS)
    assert [r.index for r in top] == [r.index for r in everything][:2]
    assert [r.document for r in top] == [DOCUMENTS[r.index] for r in top]
    assert [r.score for r in top] == pytest.approx([offline.scores[r.index] for r in top], abs=1e-4)


async def test_rerank_stream_answers_each_request_by_id(served, offline):
    requests = [pb.RerankRequest(request_id="a", query=QUERY, documents=DOCUMENTS, top_n=1),
                pb.RerankRequest(request_id="b", query=QUERY, documents=DOCUMENTS[:2], return_documents=True),
                pb.RerankRequest(request_id="bad", query="", documents=DOCUMENTS)]
    async with grpc.aio.insecure_channel(served.address) as channel:
        replies = {m.request_id: m async for m in pb_grpc.TandemStub(channel).RerankStream(iter(requests))}
    assert set(replies) == {"a", "b", "bad"}
    best = max(range(len(DOCUMENTS)), key=lambda i: offline.scores[i])
    assert [r.index for r in replies["a"].response.results] == [best]
    assert [r.document for r in replies["b"].response.results] == \
        [DOCUMENTS[i] for i in sorted((0, 1), key=lambda i: -offline.scores[i])]
    assert replies["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "query must be a non-empty string" in replies["bad"].error.message


async def test_results_say_how_many_document_tokens_were_scored_and_model_info_gives_the_pair_limit(served, offline):
    tokenizer = offline.llm.tokenizer
    async with AsyncClient(served.address) as client:
        results = await client.rerank(QUERY, DOCUMENTS)
        info = await client.model_info()
        with pytest.raises(Exception) as refused:
            await client.rerank(QUERY, ["word " * 9000], truncate="none")
    for r in results:
        assert not r.truncated
        assert r.document_tokens == len(tokenizer(DOCUMENTS[r.index], add_special_tokens=False).input_ids)
    assert info.rerank_max_pair_tokens == info.max_model_len == 8192
    assert "max_position_embeddings" in info.rerank_limit_by
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "over the rerank pair limit of 8192" in refused.value.message
    assert_all_blocks_free(await served.idle_stats())


def test_the_cli_marks_truncated_documents(monkeypatch):
    import argparse
    import io

    from clients import cli
    from clients.types import RerankResult, RerankResults

    class Fake:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def rerank(self, *args, **kwargs):
            return RerankResults([RerankResult(1, 0.9, "short", 1, False), RerankResult(0, 0.5, "long ...", 300, True)])

    monkeypatch.setattr(cli, "_client", lambda args: Fake())
    out = io.StringIO()
    args = argparse.Namespace(query="q", documents=["long ...", "short"], top_n=None, instruction=None,
                              truncate="end", timeout=None, json=False, full=False, max_windows=None)
    assert cli._rerank(args, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("short") and lines[1].endswith("long ...  [truncated to 300 tokens]")


async def test_a_rerank_cancelled_mid_flight_is_aborted_and_frees_everything(served):
    """Cancelled one loop turn after its submission: its 8 long pairs take many steps at a 512-token budget, and the
    abort reaches the engine right behind the job (the intake thread keeps their order)."""
    documents = [" ".join(DOCUMENTS * 10) + f" ({i})" for i in range(MAX_DOCUMENTS)]

    async def cancel_after_submit() -> None:
        task = asyncio.create_task(served.core.rerank(RerankInput("cancel-rerank", QUERY, documents, RerankParams()),
                                                      {}))
        await asyncio.sleep(0)  # the task runs up to its await: the job is submitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await served.acall(cancel_after_submit())
    assert_all_blocks_free(await served.idle_stats())
    assert [lc.finish_reason for lc in served.recorder.finished["cancel-rerank"]] == ["abort"]
