"""A client that goes away mid-request (streaming or not) cancels its engine work and frees its KV blocks,
alone and while other HTTP streams run on."""
from __future__ import annotations

import asyncio
import json

import httpx

from service.access_log import status
from tests.service.conftest import CHAT
from tests.service.harness import assert_all_blocks_free

LONG = 400  # far more tokens than a cancelled request gets to generate before its abort lands


def _body(max_tokens: int, stream: bool = True) -> dict:
    return {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def _lifecycle(served, stream_id: str):
    # the response's id is the request's one id, the engine's and the lifecycle's (chatcmpl-<id>)
    found = [lc for lcs in served.recorder.finished.values() for lc in lcs if stream_id == f"chatcmpl-{lc.engine_id}"]
    assert len(found) == 1, stream_id
    return found[0]


async def _first_event(response: httpx.Response) -> dict:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("stream ended without an event")


async def _read_all(client: httpx.AsyncClient) -> tuple[str, int]:
    body = {**_body(12), "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[0])["id"], json.loads(events[-2])["usage"]["completion_tokens"]


async def _leave_mid_stream(client: httpx.AsyncClient) -> str:
    async with client.stream("POST", "/v1/chat/completions", json=_body(LONG)) as r:
        assert r.status_code == 200
        first = await _first_event(r)
    return first["id"]  # leaving the block closes the connection


async def test_stream_disconnect_frees_blocks(served, http_url):
    async with httpx.AsyncClient(base_url=http_url, timeout=None) as client:
        stream_id = await _leave_mid_stream(client)
    assert_all_blocks_free(await served.idle_stats())
    lc = _lifecycle(served, stream_id)
    assert lc.finish_reason == "abort" and lc.completion_tokens < LONG
    assert lc.metadata["door"] == "http"
    assert status(lc) == "499"  # the access log's status: nginx's "client closed request", not a 200 nobody read


async def test_disconnects_under_load_leave_other_streams_whole(served, http_url):
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=http_url, timeout=None, limits=limits) as client:
        results = await asyncio.gather(*(_read_all(client) for _ in range(4)),
                                       *(_leave_mid_stream(client) for _ in range(3)))
    assert_all_blocks_free(await served.idle_stats())
    for stream_id, tokens in results[:4]:
        assert tokens == 12 and _lifecycle(served, stream_id).finish_reason == "length"
        assert status(_lifecycle(served, stream_id)) == "200"
    for stream_id in results[4:]:
        lc = _lifecycle(served, stream_id)
        assert lc.finish_reason == "abort" and lc.completion_tokens < LONG


async def test_non_streaming_client_that_leaves_cancels_its_request(served, http_url):
    # The recorder keeps lifecycles by client id (every HTTP request's is "0"), so a new one may land in the middle
    # of the flattened list: tell new from old by identity, not by position.
    before = {id(lc) for lcs in served.recorder.finished.values() for lc in lcs}
    async with httpx.AsyncClient(base_url=http_url, timeout=None) as client:
        call = asyncio.create_task(client.post("/v1/chat/completions", json=_body(LONG, stream=False)))
        while (await served.acall(served.bridge.stats()))["num_running"] == 0:  # wait until it generates
            await asyncio.sleep(0.02)
        call.cancel()
    assert_all_blocks_free(await served.idle_stats())
    finished = [lc for lcs in served.recorder.finished.values() for lc in lcs if id(lc) not in before]
    aborted = [lc for lc in finished if lc.metadata.get("door") == "http" and lc.finish_reason == "abort"]
    assert aborted and all(lc.completion_tokens < LONG for lc in aborted)
    assert all(status(lc) == "499" for lc in aborted)


async def test_a_rerank_whose_client_leaves_is_logged_as_499(served, http_url):
    before = {id(lc) for lcs in served.recorder.finished.values() for lc in lcs}
    documents = [f"Document {i} about the capital of France. " * 40 for i in range(8)]
    async with httpx.AsyncClient(base_url=http_url, timeout=None) as client:
        call = asyncio.create_task(client.post("/v1/rerank", json={"query": "capital?", "documents": documents}))
        while (await served.acall(served.bridge.stats()))["num_running"] == 0:  # wait until its pairs run
            await asyncio.sleep(0.02)
        call.cancel()
    assert_all_blocks_free(await served.idle_stats())
    finished = [lc for lcs in served.recorder.finished.values() for lc in lcs if id(lc) not in before]
    reranks = [lc for lc in finished if lc.kind == "rerank" and lc.metadata.get("door") == "http"]
    assert reranks and all(lc.finish_reason == "abort" and status(lc) == "499" for lc in reranks)
