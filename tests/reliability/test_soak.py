"""Bounded soak over loopback against a `tandem serve` subprocess: 64 concurrent Generate streams with random lengths,
random cancels, client disconnects and short deadlines, mixed with Rerank calls, in rounds of fixed work
(TANDEM_SOAK_ROUNDS, default 8; `make soak` runs 15). Every outcome must be one the client asked for; at the end every
KV block is free and nothing runs or waits, and the server's resident memory shows no upward trend after the warm-up
rounds.

The server is its own process, so its resident memory is its own (measured in the pytest process it moved with
every other module's leftovers); it is read between rounds from /proc/PID/status, when no request is in flight. A
leak is judged by a trend, not by two samples: the Theil-Sen slope (the median of the slopes between every two
rounds) must stay under a bound, so one round that the allocator happens to trim or not moves nothing, while a
steady leak, however small per request, moves every pair (`test_rss_trend_*` below show both). The work is counted,
not timed, so a fast and a slow machine do the same requests.

Why 8 rounds in `make test` (issue #64 asked that each fixed cost say what it buys): 2 warm-up rounds, then 6 samples,
the fewest whose Theil-Sen slope still catches a ~13 KB-a-request leak under +-4 MiB noise with one round trimmed
(test_rss_trend_catches_a_steady_leak_under_noise, checked for 200 noise seeds) while one odd round cannot make a
trend (test_rss_trend_ignores_one_round_that_trimmed_or_not). Longer soaks are `make soak`'s (15 rounds).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import socket
import statistics
from collections import Counter

import grpc
import httpx
import pytest

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from tests.service.process_harness import ServeProcess

ROUNDS = int(os.environ.get("TANDEM_SOAK_ROUNDS", "8"))
WARMUP_ROUNDS = 2  # first-use allocations (arenas, caches, gRPC pools) happen here; the trend starts after them
STREAMS = 64
STREAMS_PER_ROUND = 2  # Generate streams per worker per round (1-4 requests each): ~320 requests a round
RERANKS_PER_ROUND = 8  # per rerank worker per round
# The steepest trend allowed after warm-up, per round of ~320 requests (measured flat: see the report in the test's
# output). A per-request leak of ~6 KB crosses it, whatever the number of rounds.
RSS_SLOPE_LIMIT = 2 * 2**20
WORDS = "the river ran past seven blue stones under a quick grey cloud".split()


def process_rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def rss_slope(samples: list[int]) -> float:
    """Growth per round of a series of RSS samples (one per round): the Theil-Sen estimate, the median of the slopes
    between every two samples, robust to a single round's dip or spike."""
    if len(samples) < 2:
        raise ValueError("a trend needs at least two samples")
    return statistics.median((b - a) / (j - i) for (i, a), (j, b) in itertools.combinations(enumerate(samples), 2))


def leak_message(samples: list[int], first_round: int) -> str | None:
    """None when the samples (rounds first_round, first_round + 1, ...) show no upward trend past RSS_SLOPE_LIMIT,
    else what the failure says."""
    slope = rss_slope(samples)
    if slope < RSS_SLOPE_LIMIT:
        return None
    return (f"resident memory trends up {slope / 2**20:.2f} MiB a round over rounds {first_round}-"
            f"{first_round + len(samples) - 1} (limit {RSS_SLOPE_LIMIT / 2**20:.1f}): {[r >> 20 for r in samples]} MiB")


def test_rss_trend_ignores_one_round_that_trimmed_or_not() -> None:
    """The series the pytest-process measure failed on (one dip, then flat), and a spike, are no trend."""
    mib = 2**20
    assert leak_message([3050 * mib, 3018 * mib, 3050 * mib, 3050 * mib, 3050 * mib], 1) is None
    assert leak_message([900 * mib, 901 * mib, 960 * mib, 900 * mib, 901 * mib, 900 * mib], 2) is None


def test_rss_trend_catches_a_steady_leak_under_noise() -> None:
    """~13 KB a request (4 MiB a round of ~320) under +-4 MiB of noise per sample and one round trimmed 32 MiB
    lower, over the 6 rounds the default soak measures: caught (for every one of 200 noise seeds; this is seed 0)."""
    rng = random.Random(0)
    mib = 2**20
    leaking = [int(900 * mib + 4 * mib * r + rng.uniform(-4, 4) * mib) for r in range(6)]
    leaking[1] -= 32 * mib
    message = leak_message(leaking, WARMUP_ROUNDS + 1)
    assert message is not None and "trends up" in message
    assert leak_message([900 * mib + 4 * mib * r for r in range(2)], 1) is not None  # two samples: their slope


# glibc's malloc with fixed thresholds: large blocks are mmapped and freed memory at the heap's top goes back at
# once, instead of thresholds that rise with the first big free and keep tens of MiB in one round and not the next
# (the in-process soak called malloc_trim between rounds; a separate process cannot be asked to).
_STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir):
    http_port = _free_port()
    proc = ServeProcess("--model", str(tiny_model_dir), "--host", "127.0.0.1", "--embedder", "none",
                        "--num-kv-blocks", "384", "--block-size", "16", "--max-num-batched-tokens", "512",
                        "--max-num-seqs", "96", "--max-model-len", "256", "--max-documents", "8",
                        "--max-waiting", "4096", "--http-port", str(http_port), "--no-access-log",
                        env={"TANDEM_DRAIN_TIMEOUT": "5", **_STEADY_MALLOC})
    proc.metrics_url = f"http://127.0.0.1:{http_port}/metrics"
    yield proc
    proc.stop()


class Soak:
    def __init__(self, stub: pb_grpc.TandemStub, seed: int) -> None:
        self.stub = stub
        self.rng = random.Random(seed)
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []
        self.tokens = 0

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 60)))

    async def stream_worker(self, worker: int, round_: int) -> None:
        for n in range(STREAMS_PER_ROUND):
            await self._one_stream(f"r{round_}w{worker}s{n}")

    async def _one_stream(self, name: str) -> None:
        rng = self.rng
        plan = rng.choices(["normal", "cancel", "disconnect", "deadline", "timeout_ms"], [10, 3, 2, 2, 2])[0]
        timeout = rng.uniform(0.05, 0.4) if plan == "deadline" else 120
        call = self.stub.Generate(timeout=timeout)
        requests = {f"{name}r{i}": rng.randint(1, 48) for i in range(rng.randint(1, 4))}
        finals: dict[str, list[str]] = {}  # request id -> its final reasons / error codes, in order
        cancelled: set[str] = set()
        try:
            for rid, max_tokens in requests.items():
                await call.write(pb.GenerateClientMessage(request=pb.GenerateRequest(
                    request_id=rid, prompt=self._prompt(),
                    timeout_ms=rng.randint(1, 30) if plan == "timeout_ms" else 0,
                    params=pb.SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]),
                                             ignore_eos=True))))
            if plan == "cancel":
                victim = rng.choice(list(requests))
                await asyncio.sleep(rng.uniform(0, 0.05))
                cancelled.add(victim)
                await call.write(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id=victim)))
            if plan == "disconnect":
                await asyncio.sleep(rng.uniform(0, 0.1))
                call.cancel()  # the client goes away mid-stream
                self.outcomes["disconnect"] += 1
                return
            if plan != "deadline":  # a deadline stream stays open: only its deadline can end it, however fast
                await call.done_writing()
            async for reply in call:
                kind = reply.WhichOneof("kind")
                if kind == "delta":
                    self.tokens += len(reply.delta.token_ids)
                elif kind == "final":
                    finals.setdefault(reply.request_id, []).append(pb.FinishReason.Name(reply.final.finish_reason))
                else:
                    code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
                    finals.setdefault(reply.request_id, []).append(code.name)
        except grpc.aio.AioRpcError as exc:
            if plan == "deadline" and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.outcomes["deadline"] += 1
                return
            if plan == "deadline" and exc.code() is grpc.StatusCode.INTERNAL \
                    and exc.details() == "Internal error from Core":
                # grpcio's aio client: a write that fails because the deadline already ended the call overwrites
                # its DEADLINE_EXCEEDED with this (grpc/grpc#36066); the server saw a deadline like any other.
                self.outcomes["deadline"] += 1
                return
            self.unexpected.append(f"{name} ({plan}): {exc.code().name} {exc.details()}")
            return
        except asyncio.CancelledError:
            raise
        for rid in requests:
            got = finals.get(rid, [])
            if rid in cancelled and got == ["FINISH_REASON_LENGTH", "NOT_FOUND"]:  # finished before the cancel
                self.outcomes["cancel too late"] += 1
            elif got == ["FINISH_REASON_LENGTH"] or (rid in cancelled and got == ["FINISH_REASON_ABORT"]) \
                    or (plan == "timeout_ms" and got == ["DEADLINE_EXCEEDED"]):
                self.outcomes[got[0]] += 1
            else:
                self.unexpected.append(f"{name} ({plan}) {rid}: {got}")

    async def rerank_worker(self) -> None:
        for _ in range(RERANKS_PER_ROUND):
            docs = [self._prompt() for _ in range(self.rng.randint(1, 8))]
            short = self.rng.random() < 0.2
            try:
                ranked = await self.stub.Rerank(pb.RerankRequest(query=self._prompt(), documents=docs),
                                                timeout=self.rng.uniform(0.02, 0.2) if short else 120)
                assert sorted(r.index for r in ranked.results) == list(range(len(docs)))
                self.outcomes["rerank"] += 1
            except grpc.aio.AioRpcError as exc:
                if short and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.outcomes["rerank deadline"] += 1
                else:
                    self.unexpected.append(f"rerank: {exc.code().name} {exc.details()}")


_GAUGES = ("tandem_kv_cache_usage_ratio", "tandem_num_requests_running", "tandem_num_requests_waiting")


async def _settled(stub: pb_grpc.TandemStub, metrics_url: str, name: str) -> dict[str, float]:
    """Once nothing the soak sent is live in the server: one more request (1 token) runs a step after every abort,
    and that step's record, emitted after it let its finished sequences go, sets the gauges read here. Returns them
    (KV usage counts blocks live sequences hold; cached prefixes are free)."""
    call = stub.Generate(timeout=120)
    await call.write(pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id=name, prompt="settle", params=pb.SamplingParams(max_tokens=1, ignore_eos=True))))
    await call.done_writing()
    async for _ in call:
        pass
    async with httpx.AsyncClient() as http:
        text = (await http.get(metrics_url, timeout=30)).text
    return {g: float(re.search(rf"^{g} (\S+)$", text, re.M).group(1)) for g in _GAUGES}


async def test_soak_streams_cancels_disconnects_deadlines_and_reranks(soak_server):
    assert ROUNDS > WARMUP_ROUNDS + 1, f"TANDEM_SOAK_ROUNDS must be at least {WARMUP_ROUNDS + 2} (a trend needs two)"
    rss: list[int] = []
    async with grpc.aio.insecure_channel(soak_server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        soak = Soak(stub, seed=1)
        for round_ in range(ROUNDS):
            workers = [soak.stream_worker(i, round_) for i in range(STREAMS)]
            workers += [soak.rerank_worker() for _ in range(4)]
            await asyncio.gather(*workers)
            gauges = await _settled(stub, soak_server.metrics_url, f"settle-{round_}")
            rss.append(process_rss_bytes(soak_server.proc.pid))
    later = rss[WARMUP_ROUNDS:]
    print(f"soak {ROUNDS} rounds: {dict(soak.outcomes)}, {soak.tokens} tokens, server RSS after each round (MiB) "
          f"{[round(r / 2**20, 1) for r in rss]}, trend after warm-up {rss_slope(later) / 2**20:+.2f} MiB/round")
    assert not soak.unexpected, soak.unexpected[:10]
    assert gauges == dict.fromkeys(_GAUGES, 0.0), gauges  # every KV block free, nothing running or waiting
    assert leak_message(later, WARMUP_ROUNDS + 1) is None, leak_message(later, WARMUP_ROUNDS + 1)
    # Each kind of trouble really happened, and real work got done alongside it.
    for outcome in ("FINISH_REASON_LENGTH", "disconnect", "deadline", "rerank"):
        assert soak.outcomes[outcome] > 0, soak.outcomes
    assert soak.outcomes["FINISH_REASON_ABORT"] + soak.outcomes["cancel too late"] > 0, soak.outcomes
    assert soak.tokens > 0
