"""The benchmarks' bookkeeping on tiny fake workloads: no real model, no timing asserts.

Useful-token and rerank-pair counting, padding waste, percentiles and TPOT from step timelines, Poisson arrivals,
step-series thinning, and plots.plot_all writing PNGs from small synthetic JSONs.
"""
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from bench import latency, mixed, plots, report
from bench.datasets import RerankQuery
from bench.rerank import StepLog, st_tokens
from engine.outputs import RerankOutput, TokenDelta

PNG = b"\x89PNG\r\n\x1a\n"


# ---- percentiles and TPOT ------------------------------------------------------------------------------------

def test_percentile_matches_linear_interpolation():
    xs = [random.Random(0).random() for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert report.percentile(xs, q) == pytest.approx(torch.quantile(torch.tensor(xs, dtype=torch.float64),
                                                                      q / 100).item())
    assert report.percentile([3.0, 1.0], 50) == 2.0  # unsorted input, interpolated
    assert report.percentile([5.0], 99) == 5.0
    assert math.isnan(report.percentile([], 50))


def _gen(rid, n=1):
    return TokenDelta(request_id=rid, new_token_ids=list(range(n)))


def test_token_times_and_tpot_from_a_fake_timeline():
    # Step ends at t = 1, 2, 4, 5, 10. Request a: tokens at 1, 2, 4 (gaps 1, 2); request b: two tokens in the
    # step ending at 4 (a prefill that completed plus... any multi-token output: both stamped 4), then 10.
    # Request c: one token only, no gap. Rerank outputs and empty deltas are not tokens.
    events = [
        (1.0, [_gen("a")]),
        (2.0, [_gen("a"), RerankOutput(request_id="q", finished=True, scores=[0.5])]),
        (4.0, [_gen("a"), _gen("b", 2), _gen("c")]),
        (5.0, [TokenDelta(request_id="b")]),
        (10.0, [_gen("b")]),
    ]
    times = mixed.token_times(events)
    assert times == {"a": [1.0, 2.0, 4.0], "b": [4.0, 4.0, 10.0], "c": [4.0]}
    s = mixed.tpot_stats(times)
    assert s["requests"] == 3 and s["tokens"] == 7  # useful tokens: every generated token counted once
    assert s["gaps"] == 4  # a: 2 gaps, b: 2 gaps, c: none
    gaps = [1.0, 2.0, 0.0, 6.0]
    assert s["tpot_mean_s"] == pytest.approx(sum(gaps) / 4)
    assert s["tpot_p50_s"] == pytest.approx(report.percentile(gaps, 50)) == pytest.approx(1.5)
    assert s["tpot_p99_s"] == pytest.approx(report.percentile(gaps, 99))
    # Per-request means: a (4-1)/2 = 1.5, b (10-4)/2 = 3.
    assert s["request_tpot_p50_s"] == pytest.approx(2.25)
    # The step ending at 4 also ran prefill: gaps ending there (a: 2, b: 0) leave the steady figures.
    steady = mixed.tpot_stats(times, prefill_step_ends={4.0})
    assert steady["gaps"] == 4 and steady["steady_gaps"] == 2
    assert steady["steady_tpot_p50_s"] == pytest.approx(3.5)  # gaps 1 and 6
    assert s["steady_gaps"] == 4 and s["steady_tpot_p99_s"] == s["tpot_p99_s"]
    records = [SimpleNamespace(prefill_tokens=p) for p in (5, 0, 3, 0, 0)]
    assert mixed.prefill_step_ends(events, records) == {1.0, 4.0}


def test_latency_stats_ttft_from_scheduled_arrival():
    s = latency.latency_stats({"x": 0.0, "y": 1.0}, {"x": [0.5, 1.0, 1.5], "y": [3.0, 5.0]})
    assert s["requests"] == 2
    assert s["ttft_p50_s"] == pytest.approx(1.25)  # 0.5 and 2.0
    assert s["ttft_p99_s"] == pytest.approx(0.5 + 1.5 * 0.99)
    assert s["tpot_p50_s"] == pytest.approx(1.25)  # 0.5 and 2.0 per request
    assert s["itl_p50_s"] == pytest.approx(0.5)  # gaps 0.5, 0.5, 2.0


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = latency.poisson_arrivals(4.0, 2000, seed=7)
    assert a == latency.poisson_arrivals(4.0, 2000, seed=7)
    assert a != latency.poisson_arrivals(4.0, 2000, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.1)


def test_tradeoff_model():
    assert mixed.tradeoff(0.5) == {"tpot_ratio": 1.5, "rerank_throughput_ratio": pytest.approx(1 / 3)}
    assert mixed.tradeoff(4.0)["rerank_throughput_ratio"] == pytest.approx(0.8)  # needs TPOT 5x


# ---- step series ---------------------------------------------------------------------------------------------

def _record(i, **kw):
    base = dict(start_time=100.0 + i, duration_s=0.5, decode_tokens=i % 3, prefill_tokens=0, rerank_tokens=2 * i,
                rerank_pairs=1, num_running=1, num_waiting=0, forward_s=0.4)
    base.update(kw)
    return SimpleNamespace(**base)


def test_step_series_thins_to_the_limit():
    records = [_record(i) for i in range(25)]
    s = report.step_series(records, t0=100.0, limit=10)
    assert s["every"] == 3 and len(s["t"]) == 9 <= 10
    assert s["t"][:3] == [0.0, 3.0, 6.0] and s["rerank_tokens"][:3] == [0, 6, 12]
    assert all(len(s[k]) == len(s["t"]) for k in ("duration_s", "decode_tokens", "prefill_tokens", "num_running",
                                                   "num_waiting"))
    assert report.step_series(records, 100.0)["every"] == 1


# ---- padding waste -------------------------------------------------------------------------------------------

def test_sentence_transformers_padding_is_counted_per_sorted_batch():
    """sentence-transformers sorts a call's pairs by characters, longest first, and pads each batch to its longest."""
    work = [RerankQuery("q", ["aaaa", "a", "aaaaaaaa", "aa"])]  # characters with the query: 5, 2, 9, 3
    lengths = [[6, 3, 10, 4]]  # tokens per pair, input order
    # Sorted: pairs 2 (10 tokens), 0 (6) | 3 (4), 1 (3): batches pad to 10 and 4.
    assert st_tokens(lengths, work, batch_size=2) == 2 * 10 + 2 * 4
    assert st_tokens(lengths, work, batch_size=4) == 4 * 10
    assert st_tokens(lengths, work, batch_size=1) == sum(lengths[0])  # no padding at all


# ---- the mixed phases' counting on a fake engine ---------------------------------------------------------------

class FakeEngine:
    """Every step: one token per live generation; `pairs_per_step` rerank pairs scored (FIFO over jobs)."""

    def __init__(self, pairs_per_step=3):
        self.pairs_per_step = pairs_per_step
        self.gens, self.jobs, self.observers, self.pending, self.n = {}, {}, [], [], 0

    def add_observer(self, fn):
        self.observers.append(fn)

    def add_request(self, rid, prompt, params):
        self.gens[rid] = params.max_tokens

    def add_rerank(self, rid, query, docs, params):
        self.jobs[rid] = len(docs)

    def abort(self, rid):
        self.jobs.pop(rid, None)
        self.pending.append(RerankOutput(request_id=rid, finished=True, finish_reason="abort"))

    def has_unfinished(self):
        return bool(self.gens or self.jobs or self.pending)

    def step(self):
        outs, self.pending = self.pending, []
        decode = len(self.gens)
        for rid in list(self.gens):
            self.gens[rid] -= 1
            done = self.gens[rid] == 0
            if done:
                del self.gens[rid]
            outs.append(TokenDelta(request_id=rid, new_token_ids=[7], finished=done,
                                   finish_reason="length" if done else None))
        pairs = 0
        for rid in list(self.jobs):
            take = min(self.jobs[rid], self.pairs_per_step - pairs)
            self.jobs[rid] -= take
            pairs += take
            if not self.jobs[rid]:
                del self.jobs[rid]
                outs.append(RerankOutput(request_id=rid, finished=True, finish_reason="stop"))
        self.n += 1
        for fn in self.observers:
            fn(_record(self.n, decode_tokens=decode, rerank_pairs=pairs, rerank_pairs_scored=pairs, rerank_tokens=10 * pairs))
        return outs


def test_mixed_phase_counts_pairs_only_while_generation_runs():
    llm = SimpleNamespace(engine=FakeEngine(pairs_per_step=3))
    log = StepLog(llm)
    reqs = [SimpleNamespace(prompt_token_ids=[1, 2], max_tokens=n) for n in (4, 6)]
    queries = [SimpleNamespace(query="q", documents=["d"] * 5)] * 2  # 10 pairs a flood
    out, records, _ = mixed.run_mixed(llm, log, reqs, queries)
    # Generation lasts 6 steps. 3 pairs a step until the 10-pair flood runs dry in step 4 (3, 3, 3, 1), then it is
    # resubmitted and steps 5 and 6 score 3 each: 16 pairs in the window.
    assert out["tokens"] == 10 and out["gaps"] == 8 and out["requests"] == 2
    assert out["steps_in_window"] == len(records) == 6
    assert out["rerank_pairs"] == 16 and out["rerank_tokens"] == 160
    assert out["flood_resubmitted"] == 1
    assert not llm.engine.has_unfinished()  # the flood's rest was aborted and drained

    stats, recs = mixed.run_decode_alone(llm, log, reqs)
    assert stats["tokens"] == 10 and len(recs) == 6 and sum(r.rerank_pairs for r in recs) == 0
    rr, recs = mixed.run_rerank_alone(llm, log, queries)
    assert rr["pairs"] == 10 and rr["tokens"] == 100 and rr["steps"] == 4 == len(recs)


# ---- plots ---------------------------------------------------------------------------------------------------

def _steps(n):
    return {"every": 1, "t": [0.1 * i for i in range(n)], "duration_s": [0.1] * n, "decode_tokens": [4] * n,
            "prefill_tokens": [8] + [0] * (n - 1), "rerank_tokens": [100] * n, "num_running": [4] * n,
            "num_waiting": [0] * n}


def test_plot_all_writes_pngs(tmp_path):
    (tmp_path / "throughput.json").write_text(json.dumps(
        {"systems": {"tandem": {"tok_s": 90.0}, "hf_static8": {"tok_s": 15.0}}, "steps": _steps(5)}))
    (tmp_path / "rerank.json").write_text(json.dumps(
        {"cross_encoder": {"tandem_pairs_s": 40.0, "hf_padded_pairs_s": 24.0},
         "llm_judge": {"cache_on_pairs_s": 12.0, "cache_off_pairs_s": 7.0}}))
    rate = {"ttft_p50_s": 0.2, "ttft_p99_s": 0.5, "tpot_p50_s": 0.05, "tpot_p99_s": 0.09}
    (tmp_path / "latency.json").write_text(json.dumps(
        {"systems": ["continuous", "static"], "capacity_req_s": 2.0,
         "rates": [{"offered_req_s": r, "continuous": rate, "static": rate} for r in (0.5, 1.0, 2.0)]}))
    (tmp_path / "mixed.json").write_text(json.dumps(
        {"decode_alone": {"tpot_p99_s": 0.1}, "rerank_alone": {"pairs_s": 40.0},
         "settings": [{"rerank_share": 0.5, "tpot_p99_s": 0.3, "rerank_pairs_s": 20.0},
                      {"rerank_share": 0.25, "tpot_p99_s": 0.15, "rerank_pairs_s": 10.0}],
         "targets": {"tpot_p99_ratio_max": 1.5, "rerank_throughput_ratio_min": 0.8}, "steps": _steps(7)}))
    written = plots.plot_all(tmp_path)
    names = {p.name for p in written}
    assert names == {"throughput.png", "latency.png", "steps_throughput.png", "steps_mixed.png", "mixed.png"}
    for p in written:
        assert p.parent == tmp_path and p.read_bytes()[:8] == PNG


def test_plot_all_skips_what_is_missing(tmp_path):
    assert plots.plot_all(tmp_path) == []
    (tmp_path / "mixed.json").write_text(json.dumps({"steps": _steps(3)}))  # no phases: only the step plot
    (tmp_path / "latency.json").write_text("not json")
    (tmp_path / "throughput.json").write_text(json.dumps({"tandem_tok_s": 90.0, "hf_static8_tok_s": 15.7}))
    names = sorted(p.name for p in plots.plot_all(tmp_path))
    assert names == ["steps_mixed.png", "throughput.png"]


# ---- the targets table of python -m bench ------------------------------------------------------------------------

def test_targets_table_reads_each_ratio_and_judges_it_against_its_goal():
    from bench.__main__ import TARGETS, targets_table

    results = {"throughput": {"ratios": {"vs_hf_continuous": 4.5, "vs_hf_static8": 7.9},
                              "efficiency": {"overhead_share": 0.07, "mfu": 0.61}},
               "mixed": {"steady_tpot_p99_ratio": 1.2, "rerank_throughput_ratio": "n/a"}}
    rows, table = targets_table(results)
    by_name = {r["target"]: r for r in rows}
    assert len(rows) == len(TARGETS)
    assert by_name["Generation throughput vs transformers continuous batching"]["met"] is True
    assert by_name["Generation throughput vs HF generate, static batches of 8"]["met"] is False
    assert by_name["Engine overhead (outside model forward) at the widest steps"]["met"] is False  # lower is better
    assert by_name["Mixed: decode p99 TPOT during a rerank flood vs decode alone"]["met"] is True
    not_run = [r for r in rows if r["measured"] is None]
    assert {r["source"] for r in not_run} >= {"bench/results/rerank.json"}  # no rerank results at all
    assert by_name["Mixed: rerank throughput during decode vs rerank alone"]["measured"] is None  # not a number
    assert "| Generation throughput vs transformers continuous batching | >= 4x | 4.5x | yes |" in table
    assert table.count("not run") == len(not_run)
