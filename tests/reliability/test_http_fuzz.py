"""Fuzzing the HTTP door against a live server (tiny model): malformed JSON, wrong types, huge bodies, slow
senders and a reader that stops reading, a few hundred concurrent streams. Every answer is a documented status
in its API's error shape (never 500, never a stack trace), and afterwards both doors serve and every KV block is
free."""
from __future__ import annotations

import asyncio
import json
import random
import socket

import httpx
import pytest

from service.server import ServerConfig
from tests.reliability.test_fuzz import _assert_healthy
from tests.reliability.tiny import tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

MAX_BODY = 64 * 1024
# service/http/errors.py: the statuses the HTTP door answers with (500 would be a bug).
DOCUMENTED = {200, 400, 401, 403, 404, 405, 413, 429, 503, 504}
CHAT = {"model": "", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "temperature": 0}
TEMPLATES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "", "prompt": "Hello there", "max_tokens": 2, "temperature": 0},
    "/v1/rerank": {"query": "what is blue", "documents": ["the sky", {"text": "a stone"}], "top_n": 1},
    "/v2/rerank": {"model": "", "query": "what is blue", "documents": ["the sky", "a stone"]},
    "/rerank": {"query": "what is blue", "texts": ["the sky", "a stone"], "return_text": True},
}
VALUES = [None, True, -1, 2**64, 1.5, "", "é" * 50, [1, "a"], {"text": 5}]


def _shape_ok(path: str, status: int, text: str) -> bool:
    """The body is JSON in the route's own error shape (or any JSON for 200)."""
    if status == 200:
        return True
    body = json.loads(text)
    if path == "/rerank":
        return set(body) == {"error", "error_type"}
    if path.endswith("/rerank"):
        return set(body) == {"message"}
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def door(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=512, block_size=16, max_num_batched_tokens=256,
                         max_num_seqs=32, max_model_len=96, max_rerank_documents=16)
    config = ServerConfig(host="127.0.0.1", port=0, max_message_bytes=MAX_BODY,
                          max_stream_buffer_bytes=4096)
    server = ServerThread(engine, config, max_waiting=4096)
    http = server.add_http(config)
    yield server, http
    server.close()


async def _send_all(url: str, cases: list[tuple[str, bytes]]) -> dict[str, list]:
    """POST every (path, body); returns undocumented answers by case."""
    wrong: dict[str, list] = {}
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=32)) as client:
        async def one(path: str, body: bytes) -> None:
            async with sem:
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
            text = r.text
            if r.status_code not in DOCUMENTED or not _shape_ok(path, r.status_code, text) or "Traceback" in text:
                wrong.setdefault(f"{path} {body[:80]!r}", []).append((r.status_code, text[:200]))
        await asyncio.gather(*(one(path, body) for path, body in cases))
    return wrong


def _malformed(rng: random.Random) -> list[bytes]:
    out = [b"", b"{", b"[]", b"null", b"42", b'"x"', b"{}", b'{"a":}', b"\xff\xfe{}", b"{'a': 1}",
           b'{"messages": NaN}', b'{"max_tokens": Infinity}', b"[" * 5000 + b"]" * 5000, b'{"a": "\xc3\x28"}',
           b'{"query": "x", "query": 5}', b"\x00" * 10, "{\"prompt\": \"\ud800\"}".encode("utf-8", "surrogatepass")]
    for template in TEMPLATES.values():
        raw = json.dumps(template).encode()
        out += [raw[:rng.randrange(1, len(raw))] for _ in range(4)]
        for _ in range(4):
            i = rng.randrange(len(raw))
            out.append(raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:])
    return out


def _wrong_types() -> list[tuple[str, bytes]]:
    cases = []
    for path, template in TEMPLATES.items():
        for field in [*template, "stream", "logprobs", "response_format", "logit_bias"]:
            for value in VALUES:
                body = {**template, field: value}
                if field in ("max_tokens", "n") and isinstance(value, int) and value > 4:
                    continue  # a valid large value is a long generation, not a type error
                cases.append((path, json.dumps(body).encode()))
    return cases


async def test_malformed_json_and_wrong_types_get_documented_statuses(door):
    server, http = door
    rng = random.Random(26)
    cases = [(path, body) for body in _malformed(rng) for path in TEMPLATES] + _wrong_types()
    assert len(cases) > 500
    wrong = await _send_all(http.url, cases)
    assert not wrong, "\n".join(f"{case}: {got}" for case, got in list(wrong.items())[:20])
    await _assert_healthy(server)


async def test_huge_bodies_are_413(door):
    server, http = door
    async with httpx.AsyncClient(base_url=http.url, timeout=None) as client:
        big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
        for path in TEMPLATES:
            r = await client.post(path, content=big)
            assert r.status_code == 413 and _shape_ok(path, 413, r.text), (path, r.text)

        async def chunked():  # no Content-Length: the limit is counted as the body arrives
            for _ in range(MAX_BODY // 4096 + 2):
                yield b" " * 4096
        r = await client.post("/v1/chat/completions", content=chunked())
        assert r.status_code == 413
    assert_all_blocks_free(await server.idle_stats())


async def test_a_stalled_sender_holds_no_engine_work_and_blocks_nobody(door):
    server, http = door
    host, port = http.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 5000\r\n\r\n{\"messages\": [")
    await writer.drain()
    async with httpx.AsyncClient(base_url=http.url, timeout=None) as client:  # others are served meanwhile
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
    assert (await server.acall(server.bridge.stats()))["bridge_live"] == 0
    writer.write(b"]}" + b" " * (5000 - 16))  # the rest of the declared length: malformed JSON, 400
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    writer.close()


async def test_a_reader_that_stops_reading_is_cut_off(door):
    """The stream's buffer is bounded (max_stream_buffer_bytes): a client that reads nothing gets its requests
    aborted and their KV blocks freed, while the connection stays open."""
    server, http = door
    host, port = http.address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    # 16 completions x 20 alternatives a token overflow the 4,096-byte buffer within a few tokens; prompt +
    # max_tokens must fit this engine's 96-token context (a longer request is refused, not cut off).
    body = json.dumps({**CHAT, "max_tokens": 32, "n": 16, "logprobs": True, "top_logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    # once the request has ended (cut off, or, a failure, finished): waiting for idle alone could return before the
    # server has even read it
    aborted = await asyncio.to_thread(server.recorder.wait_finished,
                                      lambda lc: lc.metadata.get("door") == "http" and lc.completions == 16)
    stats = await server.idle_stats()
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].completion_tokens < 16 * 32
    assert_all_blocks_free(stats)
    sock.close()


async def test_hundreds_of_concurrent_streams_then_both_doors_serve(door):
    server, http = door
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)

    async def stream(client: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
        body = {**CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True, "temperature": 0.5, "seed": i}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]

    async with httpx.AsyncClient(base_url=http.url, timeout=None, limits=limits) as client:
        results = await asyncio.gather(*(stream(client, i) for i in range(300)))
        assert {status for status, _ in results} == {200}
        assert all(events[-1] == "data: [DONE]" and len(events) >= 2 for _, events in results)
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get("/health")).status_code == 200
    await _assert_healthy(server)


async def test_capacity_is_429_and_draining_is_503_in_each_shape(door):
    server, http = door

    async def set_bridge(name: str, value) -> None:
        setattr(server.bridge, name, value)

    async with httpx.AsyncClient(base_url=http.url, timeout=None) as client:
        for name, value, status in (("max_waiting", 0, 429), ("draining", True, 503)):
            before = getattr(server.bridge, name)
            await server.acall(set_bridge(name, value))
            try:
                for path, template in TEMPLATES.items():
                    r = await client.post(path, json={**template, "stream": True} if "rerank" not in path
                                          else template)
                    assert r.status_code == status and _shape_ok(path, status, r.text), (path, r.text)
            finally:
                await server.acall(set_bridge(name, before))
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
    assert_all_blocks_free(await server.idle_stats())
