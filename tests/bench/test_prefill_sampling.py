"""Bookkeeping of bench/prefill.py and bench/sampling.py on tiny inputs: no model, no timing asserts.

Prompt generation and run order, min/median ratios, the first-token check, the case table, the allowed-set
reference against transformers' own warpers, and both samplers' draws staying inside it.
"""
import time
from types import SimpleNamespace

import pytest
import torch

from bench import prefill, sampling
from bench.report import rotated
from engine.config import SamplingParams
from engine.sampling import sample

# ---- prefill ---------------------------------------------------------------------------------------------------


def test_prompt_ids_are_seeded_distinct_and_skip_specials():
    special = frozenset(range(10))
    a = prefill.prompt_ids(300, 0, seed=0, vocab=50, exclude=special)
    assert len(a) == 300 and all(10 <= t < 50 for t in a)
    assert a == prefill.prompt_ids(300, 0, seed=0, vocab=50, exclude=special)
    others = [prefill.prompt_ids(300, 1, 0, 50, special), prefill.prompt_ids(300, 0, 1, 50, special),
              prefill.prompt_ids(301, 0, 0, 50, special)[:300]]
    # Distinct from the first 16 tokens on (one KV block), so no repetition's prompt hits another's prefix cache.
    assert all(o[:16] != a[:16] for o in others)


def test_rotation_puts_each_system_first_in_turn():
    names = ["tandem", "tandem_one_chunk", "transformers"]
    orders = [rotated(names, i) for i in range(6)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names * 2
    assert orders[1] == ["tandem_one_chunk", "transformers", "tandem"]


def test_summarize_divides_baseline_by_each_system():
    s = prefill.summarize({"tandem": [2.0, 1.0, 4.0], "tandem_one_chunk": [0.5, 0.8, 0.6],
                           "transformers": [3.0, 2.0, 2.5]})
    assert s["min_s"] == {"tandem": 1.0, "tandem_one_chunk": 0.5, "transformers": 2.0}
    assert s["median_s"] == {"tandem": 2.0, "tandem_one_chunk": 0.6, "transformers": 2.5}
    assert s["ratio"] == {"tandem": 2.0, "tandem_one_chunk": 4.0}  # the baseline itself has no ratio
    assert s["ratio_of_medians"] == pytest.approx({"tandem": 1.25, "tandem_one_chunk": 2.5 / 0.6})


def test_first_token_check_allows_only_near_ties():
    logits = torch.tensor([0.0, 5.0, 4.9995, 1.0])
    exact = prefill.first_token_check(logits, 1, tol=1e-3)
    assert exact["match"] and exact["ok"] and exact["reference_argmax"] == 1 and exact["logit_gap"] == 0.0
    assert exact["reference_top2_margin"] == pytest.approx(5e-4, abs=1e-6)
    tie = prefill.first_token_check(logits, 2, tol=1e-3)
    assert not tie["match"] and tie["ok"] and tie["logit_gap"] == pytest.approx(5e-4, abs=1e-6)
    wrong = prefill.first_token_check(logits, 3, tol=1e-3)
    assert not wrong["match"] and not wrong["ok"] and wrong["logit_gap"] == pytest.approx(4.0)


def test_time_lengths_reads_the_clock_chosen_by_clock(monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setitem(prefill.CLOCKS, "cpu", lambda: float(next(ticks)))  # each reading one second later
    logits = torch.tensor([0.0, 1.0, 0.5])
    systems = prefill.Systems({"tandem": lambda ids: (1, 0), prefill.BASELINE: lambda ids: (1, logits)}, {},
                              SimpleNamespace(config=SimpleNamespace(vocab_size=50)), frozenset())
    args = SimpleNamespace(lengths=[8], reps=2, seed=0, logit_tol=1e-3, clock="cpu")
    lengths, checks, cached = prefill.time_lengths(args, systems, [])
    assert lengths["8"]["seconds"] == {"tandem": [1.0, 1.0], "transformers": [1.0, 1.0]}
    assert all(c["ok"] for c in checks) and cached == 0
    assert prefill.CLOCKS["wall"] is time.perf_counter and "cpu" in prefill.CLOCKS


# ---- sampling --------------------------------------------------------------------------------------------------


def test_cases_cover_every_source_n_and_setting_once():
    table = sampling.cases(sampling.SOURCES, [16, 128])
    assert len(table) == len({c["name"] for c in table}) == 2 * 2 * 3
    assert {(c["source"], c["n"]) for c in table} == {(s, n) for s in sampling.SOURCES for n in (16, 128)}
    by_setting = {c["setting"]: c for c in table}
    # Every setting becomes valid SamplingParams, and only the knobs it names differ from the defaults.
    for c in by_setting.values():
        knobs = {k: c[k] for k in ("temperature", "top_k", "top_p") if k in c}
        p = SamplingParams(**knobs)
        assert not p.greedy and (p.top_k, p.top_p) == (knobs.get("top_k", 0), knobs.get("top_p", 1.0))
    assert [type(w).__name__ for w in sampling.hf_warpers(**{k: by_setting["t0.7_k50_p0.9"][k]
                                                             for k in ("temperature", "top_k", "top_p")})] == \
        ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert len(sampling.hf_warpers(temperature=1.0)) == 0  # plain sampling: softmax and multinomial only


def _logits(rows=6, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 1.0, 3.0, 6.0, 10.0, 20.0])[:rows].unsqueeze(-1)  # flat to peaked
    return torch.randn(rows, vocab, generator=g) * scale


SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.95), dict(temperature=0.7, top_k=50, top_p=0.9),
            dict(temperature=1.3, top_k=5), dict(temperature=0.5, top_p=0.5)]


@pytest.mark.parametrize("knobs", SETTINGS)
def test_allowed_mask_matches_transformers_warpers(knobs):
    logits = _logits()
    finite = torch.isfinite(sampling.hf_warpers(**knobs)(torch.zeros(6, 1, dtype=torch.int64), logits))
    loose = sampling.allowed_mask(logits, **knobs, slack=1e-4)
    tight = sampling.allowed_mask(logits, **knobs, slack=-1e-4)
    assert bool((finite <= loose).all()) and bool((tight <= finite).all())
    counts = loose.sum(-1)
    if knobs.get("top_k"):
        assert int(counts.max()) <= knobs["top_k"]
    if knobs.get("top_p"):
        assert int(counts[0]) > int(counts[-1]) >= 1  # the flat row keeps more tokens than the peaked one
    if not knobs.get("top_k") and not knobs.get("top_p"):
        assert bool((counts == 300).all())  # no filter: the whole vocabulary


@pytest.mark.parametrize("knobs", SETTINGS)
def test_both_samplers_draw_inside_the_allowed_set(knobs):
    logits = sampling.tile_rows(_logits(), 64, seed=1)
    mask = sampling.allowed_mask(logits, **knobs)
    params = [SamplingParams(**knobs)] * 64
    for _ in range(5):
        ours = sample(logits, params, [None] * 64)
        theirs = sampling.hf_sample(sampling.hf_warpers(**knobs), torch.zeros(64, 1, dtype=torch.int64), logits)
        assert sampling.outside_allowed(ours, mask) == 0
        assert sampling.outside_allowed(theirs, mask) == 0


def test_outside_allowed_counts_misses():
    mask = torch.tensor([[True, False, False], [False, True, True]])
    assert sampling.outside_allowed([0, 1], mask) == 0
    assert sampling.outside_allowed(torch.tensor([1, 0]), mask) == 2
    assert sampling.outside_allowed([2, 2], mask) == 1


def test_tile_rows_shuffles_and_cycles():
    rows = torch.arange(5).unsqueeze(-1).float()
    t = sampling.tile_rows(rows, 12, seed=3)
    assert t.shape == (12, 1)
    ids = t.squeeze(-1).long().tolist()
    assert ids[:5] == ids[5:10] and sorted(ids[:5]) == [0, 1, 2, 3, 4] and ids[10:] == ids[:2]
    assert torch.equal(t, sampling.tile_rows(rows, 12, seed=3))
    assert sampling.tile_rows(rows, 3, seed=3).shape == (3, 1)


# ---- the runner's figures --------------------------------------------------------------------------------------


def test_figures_table_lists_what_was_measured():
    from bench.__main__ import BENCHMARKS, figures_table

    assert {"prefill", "sampling"} <= set(BENCHMARKS)
    rows, table = figures_table({"prefill": {"ratios": {"tandem_1024": 1.04, "tandem_4096": 0.97}},
                                 "sampling": {"min_ratio": {"real": 3.2}}})
    assert [r["measured"] for r in rows] == [1.04, 0.97, 3.2]
    assert {r["source"] for r in rows} == {"bench/results/prefill.json", "bench/results/sampling.json"}
    assert "| Prefill 4096 tokens (TTFT), transformers / tandem | 0.97x |" in table
    assert figures_table({}) == ([], "")
