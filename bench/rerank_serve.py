"""Rerank request latency through `tandem serve`'s HTTP door, one rerank mode per server (issue #47's cost figure).

What a RAG pipeline does on every question: one `/v2/rerank` request of --docs documents (AlpacaEval answers cut into
windows of --words words, ~150-200 words as a first stage returns them) and one query, waiting for the answer. For
each mode of --modes a fresh `tandem serve --rerank-mode MODE --num-threads T` (this checkout's code, the embedded
SmolLM2 and all-MiniLM-L6-v2, everything else its defaults) gets one warm-up request, then --requests requests one
after another (no concurrency: the figure is a lone request's latency); the client times each from send to parsed
answer. Reported per mode: p50 / p90 / max / mean seconds, the mode the server says scored it (the
x-tandem-rerank-mode header), the request's tokens (the usage Jina's fields add), and the load: `uptime`
before and after each mode, and the CPU model and vector flags. Timing needs an idle machine: on a shared host read
the figures with the load beside them. Writes bench/results/rerank_serve.json (or --out) and prints it as one line.

    python -m bench.rerank_serve                                  # dense, cascade, fusion; 2 threads (~5 minutes)
    python -m bench.rerank_serve --modes dense cascade --requests 20
    python -m bench.rerank_serve --modes cascade --cascade-k 4
    python -m bench.rerank_serve --quick                          # wiring only
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from bench.cpu_peer import cpu_identity
from bench.report import RESULTS, percentile, write_result
from bench.servers import Spawned
from service.cluster import free_port

QUICK = dict(modes=["dense", "cascade"], docs=4, words=20, requests=2, mode_requests=[])


def rerank_work(n_requests: int, n_docs: int, words: int, seed: int) -> list[tuple[str, list[str]]]:
    """Per request: an AlpacaEval instruction, and n_docs windows of `words` words from the answers (the first from
    its own answer, the others from seeded other answers), each window whole words."""
    from bench.datasets import alpaca_eval

    rows = alpaca_eval()
    stream = " ".join(r["output"] for r in rows).split()
    starts, at = [], 0
    for r in rows:
        starts.append(at)
        at += len(r["output"].split())
    rng = random.Random(seed)
    work = []
    for q in rng.sample(range(len(rows)), n_requests):
        picks = [q, *rng.sample([i for i in range(len(rows)) if i != q], n_docs - 1)]
        docs = [" ".join(stream[starts[i]:starts[i] + words]) for i in picks]
        work.append((rows[q]["instruction"], docs))
    return work


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class Server(Spawned):
    """`tandem serve` of this checkout with one rerank mode, its HTTP door on a free port at `url`."""

    def __init__(self, mode: str, threads: int, extra: list[str]) -> None:
        self.http_port = free_port()
        super().__init__(["--http-port", str(self.http_port), "--log-level", "WARNING", "--no-access-log",
                          "--num-threads", str(threads), "--rerank-mode", mode, *extra])
        self.url = f"http://127.0.0.1:{self.http_port}"


def timed(client: httpx.Client, query: str, docs: list[str]) -> tuple[float, str, dict]:
    t = time.perf_counter()
    r = client.post("/v2/rerank", json={"model": "", "query": query, "documents": docs})
    body = r.json()
    seconds = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"/v2/rerank answered {r.status_code}: {body}")
    return seconds, r.headers.get("x-tandem-rerank-mode", ""), body.get("usage", {})


def measure(mode: str, work: list[tuple[str, list[str]]], requests: int, args) -> dict:
    before = uptime()
    server = Server(mode, args.threads, args.serve_args)
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            timed(client, *work[0])  # warm-up: first-touch costs (allocations, the step-time model's first fits)
            runs = [timed(client, *work[1 + i % (len(work) - 1)]) for i in range(requests)]
    finally:
        server.stop()
    seconds = [s for s, _, _ in runs]
    return {"mode": mode, "scored_by": sorted({m for _, m, _ in runs}), "requests": len(runs),
            "p50_s": statistics.median(seconds), "p90_s": percentile(seconds, 90), "max_s": max(seconds),
            "mean_s": statistics.fmean(seconds), "seconds": seconds, "usage": runs[-1][2],
            "uptime_before": before, "uptime_after": uptime()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["dense", "cascade", "fusion"])
    ap.add_argument("--docs", type=int, default=40, help="documents per request")
    ap.add_argument("--words", type=int, default=175, help="words per document")
    ap.add_argument("--requests", type=int, default=10, help="timed requests per mode (after one warm-up)")
    ap.add_argument("--mode-requests", nargs="*", default=["fusion=3"], metavar="MODE=N",
                    help="per-mode override of --requests (fusion costs ~25 s a request on 2 idle cores)")
    ap.add_argument("--threads", type=int, default=2, help="tandem serve --num-threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cascade-k", type=int, default=None, help="tandem serve --rerank-cascade-k (default: its own)")
    ap.add_argument("--serve-args", nargs="*", default=[],
                    help="more `tandem serve` flags, as one quoted string each: --serve-args='--max-num-seqs=64'")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the wiring (figures mean nothing)")
    ap.add_argument("--out", type=Path, default=RESULTS / "rerank_serve.json")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.cascade_k is not None:
        args.serve_args = [*args.serve_args, f"--rerank-cascade-k={args.cascade_k}"]
    per_mode = dict(item.split("=", 1) for item in args.mode_requests)
    most = max([args.requests, *map(int, per_mode.values())])
    work = rerank_work(most + 1, args.docs, args.words, args.seed)
    t0 = time.perf_counter()
    modes = {m: measure(m, work, int(per_mode.get(m, args.requests)), args) for m in args.modes}
    result = {"setting": f"{args.docs} documents of {args.words} words a request through /v2/rerank, one request at "
                         f"a time, tandem serve --num-threads {args.threads} {' '.join(args.serve_args)}".strip(),
              "docs": args.docs, "words": args.words, "threads": args.threads, "serve_args": args.serve_args,
              "cpu": cpu_identity(), "cpu_count": os.cpu_count(), "quick": args.quick, "modes": modes,
              "wall_s": time.perf_counter() - t0}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
