"""Prefix-aware routing vs round-robin through HAProxy: 2 replicas, one run, both arms.

Starts `tandem cluster` in-process (two `tandem serve` replicas, HAProxy with a hashing frontend and a
round-robin frontend over the same replicas), then runs the same workload through each frontend with
different content (so one arm never warms the other's prefixes): multi-turn chats (a fresh connection per
turn, as a stateless web tier would) and rerank queries paged over several document batches. Reports the
cluster-wide prefix-cache hit rate from the replicas' Prometheus counters, client-side TTFT of follow-up
turns and latency of follow-up rerank batches, each arm's figure and hash/round-robin ratios. Writes
bench/results/cluster.json.

    python -m bench.cluster                 # defaults: 16 chats x 4 turns, 16 queries x 4 batches
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.report import RESULTS, write_result
from clients import AsyncClient
from service.cluster import Cluster, ClusterConfig, free_port

SYSTEM = ("You are a careful travel assistant for a small agency. Answer in two short sentences, mention "
          "opening hours when you know them, never invent prices, and suggest walking or cycling routes when "
          "the weather allows. If the traveller has a dog, say whether dogs are allowed. ")
PLACES = ["Lisbon", "Kyoto", "Oslo", "Lima", "Cairo", "Hanoi", "Quebec", "Tbilisi", "Dakar", "Perth", "Bergen",
          "Cusco", "Seville", "Hobart", "Tallinn", "Oaxaca", "Zanzibar", "Krakow", "Ushuaia", "Luang Prabang"]
DOCS = [f"Fact {i}: " + s for i, s in enumerate(
    ["The museum opens at nine and closes at five on weekdays.", "Trains leave every twenty minutes.",
     "Bicycles can be rented near the harbour.", "The old town is best explored on foot early.",
     "Most restaurants serve lunch between noon and three.", "The ferry does not run in winter.",
     "Dogs are allowed on trams with a muzzle.", "The castle is closed on Mondays.",
     "A day pass covers buses and trams.", "The market is busiest on Saturday morning.",
     "Cash is still common in small shops.", "Tap water is safe to drink.",
     "Sunset over the bay is at about eight.", "Guided walks start at the cathedral.",
     "The botanical garden is free on Sundays.", "Night buses run hourly after midnight."])]


def first_turn(tag: str, place: str) -> str:
    return (f"[{tag}] We are two adults travelling to {place} for ten days next spring with a small dog and two "
            f"bicycles. We like museums, markets and long walks, and we dislike crowded tours. What should we "
            f"do on our first day, and where should we stay?")


def query(tag: str, place: str) -> str:
    return (f"[{tag}] Practical facts for a visitor to {place} arriving by train for a week without a car, "
            f"travelling with a dog, who wants to see the old town, museums, markets and the harbour")


async def chat(target: str, tag: str, place: str, turns: int, max_tokens: int, ttfts: list) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_turn(tag, place)}]
    for turn in range(turns):
        async with AsyncClient(target) as client:  # a fresh connection: the balancer places every turn
            start = time.perf_counter()
            text, first = [], None
            async for delta in client.generate(messages=messages, max_tokens=max_tokens, ignore_eos=True):
                if first is None and delta.token_ids:
                    first = time.perf_counter() - start
                text.append(delta.text)
        if turn:  # follow-up turns are the ones a warm prefix can speed up
            ttfts.append(first)
        messages += [{"role": "assistant", "content": "".join(text)},
                     {"role": "user", "content": f"Thank you. What about day {turn + 2}?"}]


async def rerank(target: str, tag: str, place: str, batches: int, per_batch: int, latencies: list) -> None:
    async with AsyncClient(target) as client:
        for b in range(batches):
            docs = [DOCS[(b * per_batch + i) % len(DOCS)] for i in range(per_batch)]
            start = time.perf_counter()
            await client.rerank(query(tag, place), docs)
            if b:
                latencies.append(time.perf_counter() - start)


def counters(cluster: Cluster) -> dict[str, dict[str, float]]:
    out: dict = defaultdict(lambda: defaultdict(float))
    for replica in cluster.replicas:
        text = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("tandem_prompt_tokens_total", "tandem_prefix_cache_hit_tokens_total"):
                    out[s.labels["kind"]][s.name] += s.value
    return out


def hit_rates(before: dict, after: dict) -> dict[str, float]:
    rates = {}
    for kind in ("generate", "rerank"):
        prompt = after[kind]["tandem_prompt_tokens_total"] - before[kind]["tandem_prompt_tokens_total"]
        hits = after[kind]["tandem_prefix_cache_hit_tokens_total"] - \
            before[kind]["tandem_prefix_cache_hit_tokens_total"]
        rates[kind] = hits / prompt if prompt else 0.0
    return rates


async def arm(cluster: Cluster, target: str, tag: str, args: argparse.Namespace) -> dict:
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    latencies: list[float] = []

    async def bounded(coro):
        async with gate:
            await coro

    before = counters(cluster)
    start = time.perf_counter()
    places = PLACES[:args.chats]
    await asyncio.gather(*(bounded(chat(target, tag, p, args.turns, args.max_tokens, ttfts)) for p in places),
                         *(bounded(rerank(target, tag, p, args.batches, args.docs, latencies))
                           for p in PLACES[:args.queries]))
    wall = time.perf_counter() - start
    rates = hit_rates(before, counters(cluster))
    return {"hit_rate_generate": rates["generate"], "hit_rate_rerank": rates["rerank"],
            "ttft_followup_p50_s": statistics.median(ttfts), "ttft_followup_mean_s": statistics.fmean(ttfts),
            "rerank_followup_p50_s": statistics.median(latencies),
            "rerank_followup_mean_s": statistics.fmean(latencies), "wall_s": wall}


async def arms(cluster: Cluster, args: argparse.Namespace) -> tuple[dict, dict]:
    hash_target = f"127.0.0.1:{cluster.cfg.port}"
    rr_target = f"127.0.0.1:{cluster.cfg.roundrobin_port}"
    # Warm-up, uncounted: both replicas cache the shared system prompts (judge and chat) once.
    warm = argparse.Namespace(**{**vars(args), "chats": 2, "queries": 2, "turns": 2, "batches": 2})
    await arm(cluster, rr_target, "warm", warm)
    return await arm(cluster, hash_target, "hash", args), await arm(cluster, rr_target, "rr", args)


def run(args: argparse.Namespace) -> dict:
    cfg = ClusterConfig(replicas=2, port=free_port(), http_port=free_port(), roundrobin_port=free_port(),
                        serve_args=["--num-threads", str(args.threads), "--max-documents", str(args.docs)],
                        env={"OMP_WAIT_POLICY": "PASSIVE", "TANDEM_LOG_LEVEL": "WARNING"})
    cluster = Cluster(cfg, out=sys.stderr)
    try:
        cluster.start()  # on this (main) thread: the replicas die with the thread that started them
        load_before = os.getloadavg()[0]
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            hashed, round_robin = runner.run(arms(cluster, args))
        load_after = os.getloadavg()[0]
    finally:
        cluster.stop()
    return {
        "bench": "cluster", "replicas": 2, "chats": args.chats, "turns": args.turns, "max_tokens": args.max_tokens,
        "queries": args.queries, "batches": args.batches, "docs_per_batch": args.docs,
        "concurrency": args.concurrency, "threads_per_replica": args.threads, "cpu_count": os.cpu_count(),
        "loadavg_1m_before": load_before, "loadavg_1m_after": load_after,
        "hash": hashed, "roundrobin": round_robin,
        "ratio_ttft_followup_p50": hashed["ttft_followup_p50_s"] / round_robin["ttft_followup_p50_s"],
        "ratio_rerank_followup_p50": hashed["rerank_followup_p50_s"] / round_robin["rerank_followup_p50_s"],
        "ratio_wall": hashed["wall_s"] / round_robin["wall_s"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = p.parse_args(argv)
    write_result(run(args), args.out)


if __name__ == "__main__":
    main()
