"""bench/rag_steps.py: a RAG request's misses put down to the step log's steps, on hand-made step records and stamps
(each reason, the TTFT stage, the printed line, a torn step log). No timing is measured."""
from __future__ import annotations

import json

import pytest

from bench.rag_steps import GapReason, Stage, Stamps, explain, gap_reason, read_steps, stage_mix, summary_line

SLO = 0.040  # s


def _step(start: float, duration: float, predicted: float | None = None, **tokens) -> dict:
    return {"start_time": start, "duration_s": duration, "predicted_s": predicted, "limit_s": None,
            "decode_tokens": tokens.get("decode", 1), "prefill_tokens": tokens.get("prefill", 0),
            "rerank_tokens": tokens.get("rerank", 0), "embed_tokens": tokens.get("embed", 0), "num_waiting": 2}


def test_a_step_longer_than_the_slo_is_admitted_over_when_predicted_so_and_overran_when_not():
    reason, longest = gap_reason([_step(10.0, 0.060, predicted=0.055, embed=300)], 9.99, 10.07, SLO)
    assert reason is GapReason.ADMITTED_OVER and longest["embed_tokens"] == 300
    assert longest["duration_ms"] == pytest.approx(60.0) and longest["predicted_ms"] == pytest.approx(55.0)
    reason, _ = gap_reason([_step(10.0, 0.060, predicted=0.020)], 9.99, 10.07, SLO)
    assert reason is GapReason.OVERRAN
    reason, _ = gap_reason([_step(10.0, 0.060, predicted=None)], 9.99, 10.07, SLO)  # no model: not the planner's
    assert reason is GapReason.OVERRAN


def test_several_short_steps_in_one_gap_are_skipped_and_time_outside_steps_is_between_steps():
    steps = [_step(10.000, 0.025, 0.02), _step(10.026, 0.025, 0.02)]  # neither over 40 ms, 50 ms busy
    reason, _ = gap_reason(steps, 9.999, 10.055, SLO)
    assert reason is GapReason.SKIPPED
    reason, longest = gap_reason([_step(10.000, 0.010, 0.01)], 9.999, 10.080, SLO)  # one short step, 70 ms idle
    assert reason is GapReason.BETWEEN_STEPS and longest["duration_ms"] == pytest.approx(10.0)
    assert gap_reason([], 9.0, 9.1, SLO) == (GapReason.BETWEEN_STEPS, None)


def test_a_ttft_miss_goes_to_the_stage_furthest_over_its_idle_median_with_that_windows_steps():
    idle = {Stage.EMBED: 0.05, Stage.RERANK: 0.5, Stage.ANSWER: 1.0}
    rec = {"index": 3, "ttft_s": 4.0, "error": None, "embed_s": 0.1, "rerank_s": 2.5, "answer_ttft_s": 1.3}
    st = Stamps(arrival=100.0, embed_sent=100.0, rerank_sent=100.1, answer_sent=102.6,
                tokens=[103.9, 103.915, 103.990])
    steps = [_step(100.2, 1.0, 0.9, rerank=400, decode=0), _step(101.5, 0.5, 0.4, embed=64, decode=2),
             _step(103.0, 0.9, 0.8, prefill=550, decode=0), _step(103.92, 0.065, 0.06, decode=1, embed=90)]
    why = explain([rec], [st], steps, ttft_slo_s=3.0, tpot_slo_s=SLO, idle=idle)
    (miss,) = why["ttft_misses"]
    assert miss["stage"] == "rerank_s" and miss["stage_over_idle_s"] == pytest.approx(2.0)
    mix = miss["steps"]
    assert mix["steps"] == 2 and mix["rerank_tokens"] == 400 and mix["embed_tokens"] == 64
    assert mix["busy_share"] == pytest.approx(1.5 / 2.5)
    # the second gap (75 ms) holds a 65 ms step predicted at 60: the planner's; the first (15 ms) is within the SLO
    assert why["long_gaps"] == 1 and why["gap_reasons"] == {"admitted_over": 1}
    assert why["worst_gaps"][0]["longest_step"]["embed_tokens"] == 90
    line = summary_line(0.2, why)
    assert "TTFT misses 1 (rerank_s 1)" in line and "admitted_over 1" in line and "embed 90" in line


def test_a_request_that_failed_before_its_answer_is_a_ttft_miss_with_its_error():
    rec = {"index": 0, "ttft_s": None, "error": "HTTPStatusError: 429", "embed_s": 0.1, "rerank_s": None,
           "answer_ttft_s": None}
    why = explain([rec], [Stamps(1.0, embed_sent=1.0)], [], 3.0, SLO, {Stage.EMBED: 0.05})
    assert why["ttft_misses"][0]["error"].endswith("429") and why["ttft_misses"][0]["stage"] == "embed_s"
    assert why["ttft_misses"][0]["steps"] is None  # its window never closed: no next stage


def test_the_step_log_is_read_in_its_window_and_a_torn_last_line_is_skipped(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(json.dumps(_step(t, 0.01)) for t in (3.0, 1.0, 2.0)) + '\n{"start_time": 4.')
    assert [r["start_time"] for r in read_steps(log, 1.5, 3.5)] == [2.0, 3.0]
    assert read_steps(tmp_path / "missing.jsonl") == []
    assert stage_mix(read_steps(log), (0.0, 10.0))["steps"] == 3
