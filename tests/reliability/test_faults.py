"""Fault injection against a live server: a model step that raises, an OTLP collector that is down or never
answers, and a client that stops reading."""
from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest

from engine import LLM, EngineConfig, SamplingParams
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from service.tracing import TracingHooks, tracer_provider_from_env
from tests.reliability.tiny import FaultyRunner, tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

POISON = 4242  # a prompt token id that makes the (wrapped) model step raise, once


def _gen(rid: str, max_tokens: int = 6, ids: list[int] | None = None, prompt: str = "Hello there"):
    request = pb.GenerateRequest(request_id=rid, params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))
    if ids is not None:
        request.token_ids.ids.extend(ids)
    else:
        request.prompt = prompt
    return pb.GenerateClientMessage(request=request)


async def _run_stream(stub, messages) -> dict[str, pb.GenerateServerMessage]:
    """Write messages, half-close, return each request's last message."""
    call = stub.Generate()
    for m in messages:
        await call.write(m)
    await call.done_writing()
    last = {}
    async for reply in call:
        last[reply.request_id] = reply
    return last


# ---- an exception inside one model step -----------------------------------------------------------------


@pytest.fixture
def faulty_server(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=128, block_size=16, max_num_batched_tokens=256,
                         max_num_seqs=2)
    fired = threading.Event()

    def fail_when(batch):
        if not fired.is_set() and any(POISON in s.token_ids for s in batch.seqs):
            fired.set()
            return RuntimeError("injected: the GPU fell off the bus")
        return None
    engine.runner = FaultyRunner(engine.runner, fail_when)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    yield server, engine.runner
    server.close()


async def test_a_failing_step_fails_only_its_requests_and_the_engine_keeps_serving(faulty_server):
    server, runner = faulty_server
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        # max_num_seqs=2: n0 is decoding when the poisoned request joins it in the failing step; the rest wait.
        # n0 cannot end before that (EOS ignored, 2000 of the 2048 context tokens to fill).
        call = stub.Generate()
        await call.write(_gen("n0", max_tokens=2000))
        first = await call.read()
        assert first.request_id == "n0" and first.WhichOneof("kind") == "delta"
        for m in [_gen("poison", ids=[1, 2, POISON, 3]), *(_gen(f"n{i}") for i in range(1, 4))]:
            await call.write(m)
        await call.done_writing()
        last = {first.request_id: first}
        while (reply := await call.read()) is not grpc.aio.EOF:
            last[reply.request_id] = reply
        assert len(runner.failed_batches) == 1
        in_failed_step = {lc.client_id for lcs in server.recorder.finished.values() for lc in lcs
                          if lc.engine_id in runner.failed_batches[0]}
        for rid, reply in last.items():
            if rid in in_failed_step:
                assert reply.WhichOneof("kind") == "error", reply
                assert reply.error.code == grpc.StatusCode.INTERNAL.value[0]
                assert "model step failed" in reply.error.message and "fell off the bus" in reply.error.message
            else:
                assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH, reply
                assert reply.final.usage.completion_tokens == 6
        assert in_failed_step == {"poison", "n0"} and set(last) == {"poison", "n0", "n1", "n2", "n3"}
        # The engine goes on serving: the same poisoned prompt now runs, like everything else.
        again = await _run_stream(stub, [_gen("poison2", ids=[1, 2, POISON, 3]), _gen("later")])
        assert all(r.final.finish_reason == pb.FINISH_REASON_LENGTH for r in again.values()), again
    assert_all_blocks_free(await server.idle_stats())


def test_tiny_temperature_is_greedy_not_a_failed_step(tiny_model_dir):
    """Found by the fuzzer: temperature 5e-324 divided logits into inf, NaN probabilities, and every request
    of that step failed. It now samples greedily (as vLLM does below 1e-5), and its batch-mate is unharmed."""
    llm = LLM(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    greedy, tiny, other = llm.generate(["Hello there", "Hello there", "Another prompt"], [
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=5e-324, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.7, seed=1, ignore_eos=True)])
    assert tiny.finish_reason == other.finish_reason == "length"
    assert tiny.token_ids == greedy.token_ids and len(other.token_ids) == 5


# ---- the OTLP collector down, or accepting and never answering --------------------------------------------


class Blackhole:
    """A TCP listener that accepts connections and never says a word (a hung collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class WatchedExporter:
    """Wraps the real OTLP exporter, recording when exports start and finish."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.in_flight = 0
        self.finished = 0

    def export(self, spans):
        self.in_flight += 1
        self.started.set()
        try:
            return self.inner.export(spans)
        finally:
            self.in_flight -= 1
            self.finished += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("collector", ["down", "hung"])
async def test_an_unreachable_or_hung_collector_does_not_hold_up_serving(tiny_model_dir, monkeypatch, collector):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # export as soon as there is anything
    hole = Blackhole() if collector == "hung" else None
    port = hole.port if hole else _closed_port()
    exporter = WatchedExporter(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=3600))
    tracing = TracingHooks(tracer_provider_from_env(exporter=exporter))
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=128, block_size=16)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    server.bridge.hooks.append(tracing)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.TandemStub(channel)
            first = await _run_stream(stub, [_gen("first")])
            assert first["first"].final.finish_reason == pb.FINISH_REASON_LENGTH
            assert await asyncio.to_thread(exporter.started.wait, 30), "the exporter never tried"
            # While an export is stuck (or retrying), serving goes on at full pace.
            results = await asyncio.gather(*(_run_stream(stub, [_gen(f"s{i}r{j}", 8) for j in range(3)])
                                             for i in range(8)))
            ranked = await stub.Rerank(pb.RerankRequest(query="blue", documents=["sky", "stone"]))
            assert exporter.in_flight == 1 and exporter.finished == 0, "the export was not stuck after all"
        assert sum(len(r) for r in results) == 24
        assert all(m.final.finish_reason == pb.FINISH_REASON_LENGTH for r in results for m in r.values())
        assert len(ranked.results) == 2
        if hole:
            assert hole.accepted, "the exporter never reached the hung collector"
        assert_all_blocks_free(await server.idle_stats())
    finally:
        server.close()
        if hole:
            hole.close()
        # Closing the exporter's channel ends the stuck export, so exit does not wait out its timeout.
        threading.Thread(target=exporter.inner.shutdown, kwargs={"timeout_millis": 100}, daemon=True).start()
        await asyncio.to_thread(tracing.shutdown, 0.1)


# ---- a client that stops reading ------------------------------------------------------------------------


@pytest.fixture
def small_buffer_server(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=256, block_size=16, max_num_batched_tokens=512,
                         max_rerank_documents=8)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, max_stream_buffer_bytes=256 * 1024))
    yield server
    server.close()


async def test_a_client_that_stops_reading_fails_its_own_stream_not_the_others(small_buffer_server):
    server = small_buffer_server
    big_doc = "stone " * 3000  # 18 KB; scored truncated, returned whole
    async with grpc.aio.insecure_channel(server.address) as stalled_channel, \
            grpc.aio.insecure_channel(server.address) as channel:
        stalled = pb_grpc.TandemStub(stalled_channel).RerankStream()
        sent = 120  # responses of ~150 KB each: far more than the transport's windows plus the 256 KiB buffer
        for i in range(sent):
            await stalled.write(pb.RerankRequest(request_id=f"big{i}", query="stones", documents=[big_doc] * 8,
                                                 return_documents=True))
        # Never reading `stalled`, other clients still get served, and the stalled stream's requests end:
        # the engine ends up idle with every block free while that client still has not read a byte.
        stub = pb_grpc.TandemStub(channel)
        for round_ in range(3):
            last = await _run_stream(stub, [_gen(f"other{round_}r{j}", 8) for j in range(4)])
            assert all(m.final.finish_reason == pb.FINISH_REASON_LENGTH for m in last.values())
        assert_all_blocks_free(await server.idle_stats())
        # Now it reads: what the transport held, then the stream's failure.
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await stalled.read() is not grpc.aio.EOF:
                received += 1
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream buffer full" in info.value.details() and "--max-stream-buffer-bytes" in info.value.details()
        assert received < sent  # the rest were dropped, not held
    assert_all_blocks_free(await server.idle_stats())


async def test_a_generate_stream_that_stops_reading_is_bounded_once_and_frees_every_request(small_buffer_server):
    """A Generate stream has one bounded channel (the session's outbox, --max-stream-buffer-bytes): the core's stream
    behind each of its requests only relays. A client that writes requests and never reads fails its own stream
    with RESOURCE_EXHAUSTED through that one path (never a per-request RESOURCE_EXHAUSTED from a second buffer),
    every request on it ends and frees its KV blocks, and the engine goes back to idle while the client has read
    nothing."""
    server = small_buffer_server
    ids = [42 + i for i in range(300)]
    # each response carries 300 prompt positions x 20 log-probabilities (~60 KB): 2.4 MB in all, far more than the
    # 256 KiB buffer plus the transport's window (64 KiB: the stalled client's window does not grow)
    sent = 40
    async with grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)]) as stalled_channel, \
            grpc.aio.insecure_channel(server.address) as channel:
        stalled = pb_grpc.TandemStub(stalled_channel).Generate()
        for i in range(sent):
            request = pb.GenerateRequest(request_id=f"big{i}", params=pb.SamplingParams(
                max_tokens=1, prompt_logprobs=20, ignore_eos=True))
            request.token_ids.ids.extend(ids)
            await stalled.write(pb.GenerateClientMessage(request=request))
        # the last request admitted has ended (cut off, or, a failure, finished); idle_stats below waits for the rest
        await asyncio.to_thread(server.recorder.wait_finished, lambda lc: lc.client_id == f"big{sent - 1}")
        last = await _run_stream(pb_grpc.TandemStub(channel), [_gen(f"other{j}", 8) for j in range(4)])
        assert all(m.final.finish_reason == pb.FINISH_REASON_LENGTH for m in last.values())
        stats = await server.idle_stats()
        assert_all_blocks_free(stats)
        assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (reply := await stalled.read()) is not grpc.aio.EOF:
                received.append(reply)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream buffer full" in info.value.details() and "every request on this stream" in info.value.details()
        assert len(received) < sent  # one response each (max_tokens=1), had nothing been dropped
        assert not [r for r in received if r.WhichOneof("kind") == "error"
                    and r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert_all_blocks_free(await server.idle_stats())
