"""Bounded soak over loopback: 64 concurrent Generate streams with random lengths, random cancels, client
disconnects and short deadlines, mixed with Rerank calls, in rounds of fixed work (TANDEM_SOAK_ROUNDS, default 5;
`make soak` runs 15). Every outcome must be one the client asked for; at the end every KV block is free, the
bridge holds nothing, and resident memory did not grow past a bound after the warm-up rounds.

The work is counted, not timed, so a fast and a slow machine do the same requests; resident memory is read only
between rounds, when no request is in flight, after a garbage collection and glibc's malloc_trim (memory the
allocator kept but nobody holds is not a leak).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import random
from collections import Counter

import grpc
import pytest

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.reliability.tiny import tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

ROUNDS = int(os.environ.get("TANDEM_SOAK_ROUNDS", "5"))
WARMUP_ROUNDS = 2  # first-use allocations (arenas, caches, gRPC pools) happen here; RSS is compared after them
STREAMS = 64
STREAMS_PER_ROUND = 3  # Generate streams per worker per round (1-4 requests each): ~480 requests a round
RERANKS_PER_ROUND = 12  # per rerank worker per round
# Growth allowed over the measured rounds (measured: +5 MiB over rounds 3-5, and over 3-15 with `make soak`). Each round sends ~480 requests, so 3 rounds
# at the default are ~1,400 requests: a per-request leak of ~12 KB crosses it (and grows with `make soak`'s rounds).
RSS_GROWTH_LIMIT = 16 * 2**20
WORDS = "the river ran past seven blue stones under a quick grey cloud".split()


def rss_bytes() -> int:
    """Resident memory with nothing in flight: after a collection and malloc_trim, so freed memory glibc kept in
    its arenas does not count."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=384, block_size=16, max_num_batched_tokens=512,
                         max_num_seqs=96, max_model_len=256, max_rerank_documents=8)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, max_documents=8), max_waiting=4096)
    yield server
    server.close()


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


async def test_soak_streams_cancels_disconnects_deadlines_and_reranks(soak_server):
    assert ROUNDS > WARMUP_ROUNDS, f"TANDEM_SOAK_ROUNDS must be more than the {WARMUP_ROUNDS} warm-up rounds"
    rss: list[int] = []
    async with grpc.aio.insecure_channel(soak_server.address) as channel:
        soak = Soak(pb_grpc.TandemStub(channel), seed=1)
        for round_ in range(ROUNDS):
            workers = [soak.stream_worker(i, round_) for i in range(STREAMS)]
            workers += [soak.rerank_worker() for _ in range(4)]
            await asyncio.gather(*workers)
            await soak_server.idle_stats()  # the engine has let go of every request of the round
            soak_server.recorder.finished.clear()  # the harness's own record of each request is not the server's
            rss.append(rss_bytes())
    stats = await soak_server.idle_stats()
    growth = rss[-1] - rss[WARMUP_ROUNDS - 1]
    print(f"soak {ROUNDS} rounds: {dict(soak.outcomes)}, {soak.tokens} tokens, RSS after each round (MiB) "
          f"{[round(r / 2**20, 1) for r in rss]}, +{growth / 2**20:.1f} MiB after warm-up")
    assert not soak.unexpected, soak.unexpected[:10]
    assert_all_blocks_free(stats)
    assert growth < RSS_GROWTH_LIMIT, (f"resident memory grew {growth / 2**20:.1f} MiB over rounds "
                                       f"{WARMUP_ROUNDS + 1}-{ROUNDS}: {[r >> 20 for r in rss]} MiB")
    # Each kind of trouble really happened, and real work got done alongside it.
    for outcome in ("FINISH_REASON_LENGTH", "disconnect", "deadline", "rerank"):
        assert soak.outcomes[outcome] > 0, soak.outcomes
    assert soak.outcomes["FINISH_REASON_ABORT"] + soak.outcomes["cancel too late"] > 0, soak.outcomes
    assert soak.tokens > 0
