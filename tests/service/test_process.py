"""`tandem serve` as a real process: the client CLI, backpressure on a full queue, and SIGTERM draining."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncClient, TandemError
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from tests.service.process_harness import ROOT, ServeProcess

TANDEM = str(Path(sys.executable).parent / "tandem")
PROMPT = "Tell me a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def serve_proc():
    # One sequence per step and two waiting places (one for a lone stream) make "over its share" deterministic; the
    # flags and the TANDEM_* variables both reach the server.
    proc = ServeProcess("--max-num-seqs", "1", "--num-kv-blocks", "128", "--host", "127.0.0.1",
                        env={"TANDEM_MAX_WAITING": "2", "TANDEM_DRAIN_TIMEOUT": "120", "TANDEM_REPLICA": "proc-1"})
    yield proc
    proc.stop()


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([TANDEM, *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300)


def test_cli_generate_chat_and_rerank_against_the_server(serve_proc):
    target = ("--target", serve_proc.address)
    generated = _cli("generate", *target, "Hello", "--max-tokens", "8")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()
    chatted = _cli("chat", *target, "--max-tokens", "4", stdin="What is 2+2?\n")
    assert chatted.returncode == 0 and chatted.stdout.strip(), chatted.stderr
    reranked = _cli("rerank", *target, "--json", "--query", "capital of France", "Paris is in France.", "Bananas.")
    assert reranked.returncode == 0, reranked.stderr
    results = json.loads(reranked.stdout)
    assert sorted(r["index"] for r in results) == [0, 1] and results[0]["score"] >= results[1]["score"]
    info = _cli("info", *target)
    assert info.returncode == 0 and json.loads(info.stdout)["replica"] == "proc-1"  # from TANDEM_REPLICA
    assert json.loads(info.stdout)["limits"]["maxWaiting"] == 2  # from TANDEM_MAX_WAITING
    refused = _cli("rerank", *target, "--query", "", "doc")
    assert refused.returncode == 1 and "INVALID_ARGUMENT: query must be a non-empty string" in refused.stderr


def _request(request_id: str, max_tokens: int) -> pb.GenerateClientMessage:
    return pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id=request_id, prompt=PROMPT, params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


async def _read_until(call, request_id: str, kinds: tuple[str, ...]) -> pb.GenerateServerMessage:
    while True:
        message = await asyncio.wait_for(call.read(), 120)
        assert message is not grpc.aio.EOF
        if message.request_id == request_id and message.WhichOneof("kind") in kinds:
            return message


async def test_a_stream_over_its_share_of_the_waiting_queue_is_resource_exhausted_until_it_drains(serve_proc):
    async with grpc.aio.insecure_channel(serve_proc.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        call = stub.Generate()
        await call.write(_request("running", 2048 - 64))  # cannot end: the context is 2048
        await _read_until(call, "running", ("delta",))  # it holds the only sequence slot now
        # a lone stream's share of the two places is one (EngineBridge.fair_share): TANDEM_MAX_WAITING reached it
        for request_id in ("wait-1", "over"):
            await call.write(_request(request_id, 3))
        refused = (await _read_until(call, "over", ("error", "final"))).error
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "over its share of the waiting queue: 1 of its requests are waiting for the engine, its share is 1 " \
            "of --max-waiting 2" in refused.message
        await call.write(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id="running")))
        assert (await _read_until(call, "wait-1", ("final", "error"))).final.finish_reason == pb.FINISH_REASON_LENGTH
        await call.write(_request("again", 2))
        assert (await _read_until(call, "again", ("final", "error"))).final.usage.completion_tokens == 2
        await call.done_writing()


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status


async def test_sigterm_drains_in_flight_work_refuses_new_work_and_exits_zero(serve_proc):
    # "holder" cannot end on its own (EOS ignored, nearly the whole 2048-token context) and waits behind "inflight"
    # (--max-num-seqs 1), so the server is still draining, not gone, whatever the machine's speed, until a second
    # SIGTERM (what a second Ctrl-C sends as SIGINT) aborts it after the refusals were checked.
    async with AsyncClient(serve_proc.address, max_retries=0) as client, \
            grpc.aio.insecure_channel(serve_proc.address) as probe:
        assert await _health(probe) == health_pb2.HealthCheckResponse.SERVING
        inflight = client.generate(PROMPT, max_tokens=48, ignore_eos=True, request_id="inflight")
        deltas = [await inflight.__anext__()]
        held = pb_grpc.TandemStub(probe).Generate()
        await held.write(_request("holder", 2048 - 64))
        await held.write(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id="probe")))
        await _read_until(held, "probe", ("error",))  # messages are handled in order: "holder" is admitted
        serve_proc.proc.send_signal(signal.SIGTERM)
        while await _health(probe) != health_pb2.HealthCheckResponse.NOT_SERVING:
            await asyncio.sleep(0.02)
        with pytest.raises(TandemError) as on_stream:
            await client.complete("Hi", max_tokens=2)
        with pytest.raises(TandemError) as unary:
            await client.rerank("q", ["d"])
        deltas += [d async for d in inflight]
        serve_proc.proc.send_signal(signal.SIGTERM)  # the second signal aborts what still runs and stops now
        holder = (await _read_until(held, "holder", ("final", "error"))).final
    for refusal in (on_stream.value, unary.value):
        assert refusal.code is grpc.StatusCode.UNAVAILABLE and "draining" in refusal.message
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 48
    assert sum(len(d.token_ids) for d in deltas) == 48
    assert holder.finish_reason == pb.FINISH_REASON_ABORT and holder.usage.completion_tokens < 2048 - 64
    assert serve_proc.proc.wait(120) == 0
    said = "".join(serve_proc.rest())
    # Start-up said where traces and metrics go; the first signal said how to force the stop, the second did.
    assert "tracing off: set OTEL_TRACES_EXPORTER=console" in said and "Prometheus metrics" in said
    assert "Press Ctrl-C again (or send SIGTERM again) to abort them and stop now" in said
    assert "second SIGTERM: aborting 1 in-flight requests and stopping now" in said
    # and the last line said how it ended ("inflight" may have finished before the first signal on a fast machine)
    assert re.search(r"tandem serve stopped \(second SIGTERM\): drained [01] requests?, aborted 1\n$", said), said[-500:]
