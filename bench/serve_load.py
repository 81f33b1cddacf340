"""Open-loop serving load over gRPC: Poisson arrivals of mixed generations and reranks.

Requests arrive at exponential gaps (rate --rate per second) whether or not earlier ones finished, spread over
--streams shared Generate streams. Reports client-side TTFT, time per output token (TPOT), rerank latency
(p50/p99), throughput, and the same latencies of a baseline run in the same invocation: the same request
kinds sent one at a time to the idle server, so every loaded figure also appears as a ratio to it. Prints one
JSON object and writes it to bench/results/serve_load.json.

    python -m bench.serve_load --spawn --rate 4 --requests 64          # starts `tandem serve --port 0` itself
    python -m bench.serve_load --target localhost:50051 --rate 8 --requests 200
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from bench.report import percentile
from bench.servers import Spawned
from clients import AsyncClient

RESULTS = Path(__file__).parent / "results"
_TOPICS = ["the ocean", "a lighthouse", "prime numbers", "bread", "the Roman empire", "a robot painter",
           "volcanoes", "chess", "bees", "the moon landing", "jazz", "glaciers", "origami", "trains"]
_FILLER = "Please be specific and give examples. "


@dataclass(slots=True)
class Job:
    kind: str  # "generate" | "rerank"
    at: float  # seconds after the start
    prompt: str = ""
    query: str = ""
    documents: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    kind: str
    ok: bool
    latency_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    error: str = ""


def workload(n: int, rate: float, rerank_fraction: float, documents: int, seed: int) -> list[Job]:
    """n jobs with Poisson arrivals at `rate` per second; a seeded mix of chat prompts and rerank queries."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        topic = rng.choice(_TOPICS)
        if rng.random() < rerank_fraction:
            docs = [f"A note on {rng.choice(_TOPICS)}. " + _FILLER * rng.randint(0, 4) for _ in range(documents)]
            jobs.append(Job("rerank", t, query=f"What is known about {topic}?", documents=docs))
        else:
            jobs.append(Job("generate", t, prompt=f"Tell me about {topic}. " + _FILLER * rng.randint(0, 8)))
    return jobs


async def run_job(client: AsyncClient, job: Job, max_tokens: int) -> Result:
    start = time.perf_counter()
    try:
        if job.kind == "rerank":
            await client.rerank(job.query, job.documents)
            return Result("rerank", True, time.perf_counter() - start)
        first = last = None
        tokens = 0
        async for delta in client.chat([{"role": "user", "content": job.prompt}], max_tokens=max_tokens,
                                       temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            if delta.token_ids:
                first = first or now
                last = now
                tokens += len(delta.token_ids)
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return Result("generate", True, time.perf_counter() - start, (first or start) - start, tpot, tokens)
    except Exception as exc:  # a refusal is a result too (e.g. RESOURCE_EXHAUSTED under overload)
        return Result(job.kind, False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")


async def open_loop(target: str, jobs: list[Job], streams: int, max_tokens: int) -> tuple[list[Result], float]:
    clients = [AsyncClient(target) for _ in range(streams)]
    start = time.perf_counter()

    async def fire(i: int, job: Job) -> Result:
        await asyncio.sleep(max(0.0, job.at - (time.perf_counter() - start)))
        return await run_job(clients[i % streams], job, max_tokens)

    try:
        results = await asyncio.gather(*(fire(i, job) for i, job in enumerate(jobs)))
    finally:
        for client in clients:
            await client.close()
    return list(results), time.perf_counter() - start


async def sequential(target: str, jobs: list[Job], max_tokens: int) -> list[Result]:
    async with AsyncClient(target) as client:
        return [await run_job(client, job, max_tokens) for job in jobs]


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    gen = [r for r in ok if r.kind == "generate"]
    rr = [r for r in ok if r.kind == "rerank"]
    out = {"requests": len(results), "failed": len(results) - len(ok),
           "errors": sorted({r.error.split(":")[0] + ": " + r.error.split(":", 2)[-1].strip()[:80]
                             for r in results if not r.ok})[:5]}
    for name, values in (("ttft_s", [r.ttft_s for r in gen]),
                         ("tpot_s", [r.tpot_s for r in gen if r.tpot_s is not None]),
                         ("rerank_latency_s", [r.latency_s for r in rr])):
        out[name] = {"p50": _pct(values, 50), "p99": _pct(values, 99), "n": len(values)}
    return out


def _ratios(loaded: dict, baseline: dict) -> dict:
    out = {}
    for name in ("ttft_s", "tpot_s", "rerank_latency_s"):
        for q in ("p50", "p99"):
            a, b = loaded[name][q], baseline[name]["p50"]
            out[f"{name}_{q}_vs_idle_p50"] = a / b if a is not None and b else None
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT of a running tandem server")
    where.add_argument("--spawn", action="store_true", help="start `tandem serve --port 0` for this run")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `tandem serve` flag (with --spawn)")
    ap.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rerank-fraction", type=float, default=0.3)
    ap.add_argument("--documents", type=int, default=16, help="documents per rerank request")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per generation (EOS ignored)")
    ap.add_argument("--streams", type=int, default=4, help="Generate streams the load is spread over")
    ap.add_argument("--baseline-requests", type=int, default=8, help="requests per kind sent one at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    args = ap.parse_args(argv)

    server = Spawned(args.serve_arg) if args.spawn else None
    target = server.address if server else args.target
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            warm = workload(2, 0, 0.5, args.documents, args.seed + 1)
            runner.run(sequential(target, warm, args.max_tokens))  # first-call costs stay out of the figures
            idle_jobs = (workload(args.baseline_requests, 0, 0.0, args.documents, args.seed + 2)
                         + workload(args.baseline_requests, 0, 1.0, args.documents, args.seed + 3))
            baseline = summarize(runner.run(sequential(target, idle_jobs, args.max_tokens)))
            jobs = workload(args.requests, args.rate, args.rerank_fraction, args.documents, args.seed)
            results, elapsed = runner.run(open_loop(target, jobs, args.streams, args.max_tokens))
    finally:
        exit_code = server.stop() if server else None
    loaded = summarize(results)
    report = {
        "bench": "serve_load", "target": target, "rate_per_s": args.rate, "requests": args.requests,
        "rerank_fraction": args.rerank_fraction, "documents_per_rerank": args.documents,
        "max_tokens": args.max_tokens, "streams": args.streams, "elapsed_s": elapsed,
        "throughput": {
            "requests_per_s": sum(r.ok for r in results) / elapsed,
            "output_tokens_per_s": sum(r.tokens for r in results) / elapsed,
            "documents_per_s": sum(args.documents for r in results if r.ok and r.kind == "rerank") / elapsed,
        },
        "loaded": loaded, "idle_baseline": baseline, "ratios": _ratios(loaded, baseline),
        "spawned_server_exit_code": exit_code,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
