"""bench/rag.py's bookkeeping on fake records (SLOs, goodput with failures as misses, the seeded Poisson schedule,
top-k, the table over runs, each split's rerank shape) and one tiny end-to-end run through a real `tandem serve`.
No timing is asserted."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.rag import (RequestRecord, RerankApi, Slo, derive_slo, goodput, goodputs, judge, judge_session,
                       poisson_arrivals, table_rows, table_text, top_k)

SLO = Slo(ttft_s=2.0, tpot_s=0.05, source="test")


def _answered(ttft: float, gaps: list[float] | None = None) -> RequestRecord:
    return RequestRecord(0, 0.0, embed_s=0.1, rerank_s=0.2, answer_ttft_s=ttft / 2, ttft_s=ttft,
                         gaps_s=gaps if gaps is not None else [0.02] * 5, tokens=6)


def _failed(reason: str = "HTTPStatusError: 503") -> RequestRecord:
    return RequestRecord(0, 0.0, embed_s=0.1, error=reason)


def test_slo_is_the_factors_times_the_idle_medians_and_ignores_failed_idle_requests():
    idle = [_answered(1.0, [0.01, 0.02]), _answered(3.0, [0.03]), _answered(2.0, [0.04, 0.05]), _failed()]
    slo = derive_slo(idle, ttft_factor=2.5, tpot_factor=3.0)
    assert slo.ttft_s == pytest.approx(5.0)  # 2.5 x median(1, 2, 3)
    assert slo.tpot_s == pytest.approx(0.09)  # 3 x median(.01 .02 .03 .04 .05)
    with pytest.raises(RuntimeError, match="no idle request"):
        derive_slo([_failed()], 2.5, 3.0)


def test_a_rate_is_met_with_90_percent_in_the_ttft_slo_counting_failures_as_misses():
    nine_and_a_failure = [_answered(1.0)] * 9 + [_failed()]
    v = judge(0.1, nine_and_a_failure, SLO, attainment=0.9)
    assert (v.n, v.failed, v.ttft_attainment, v.tpot_met, v.met) == (10, 1, 0.9, True, True)
    two_misses = [_answered(1.0)] * 8 + [_failed(), _answered(2.5)]
    v = judge(0.1, two_misses, SLO, attainment=0.9)
    assert v.ttft_attainment == pytest.approx(0.8) and not v.met
    assert not judge(0.1, [], SLO, 0.9).met


def test_one_slow_answer_or_one_cut_off_mid_stream_misses_the_tpot_slo():
    slow = [_answered(1.0)] * 9 + [_answered(1.0, [0.02] * 3 + [0.2])]  # its p99 gap is over 50 ms
    v = judge(0.2, slow, SLO, 0.9)
    assert v.ttft_attainment == 1.0 and not v.tpot_met and not v.met
    cut = _answered(1.0)
    cut.error = "dropped: no answer within 600 s"  # started, then never finished
    assert not judge(0.2, [_answered(1.0)] * 9 + [cut], SLO, 0.9).tpot_met
    # a request that failed before its first token misses the TTFT SLO only
    assert judge(0.2, [_answered(1.0)] * 9 + [_failed()], SLO, 0.9).tpot_met


def test_goodput_is_the_highest_rate_met_with_every_lower_rate_met():
    def verdicts(mets: dict[float, bool]):
        good, bad = [_answered(1.0)] * 10, [_failed()] * 10
        return [judge(rate, good if met else bad, SLO, 0.9) for rate, met in mets.items()]

    assert goodput(verdicts({0.2: True, 0.05: True, 0.1: True, 0.3: False})) == 0.2
    assert goodput(verdicts({0.05: True, 0.1: True, 0.2: False, 0.3: True})) == 0.1  # a lucky 0.3 does not count
    assert goodput(verdicts({0.05: False, 0.1: True})) == 0.0


def test_the_poisson_schedule_is_seeded_increasing_and_has_the_rate_asked():
    a, b = poisson_arrivals(0.2, 50, seed=7), poisson_arrivals(0.2, 50, seed=7)
    assert a == b and a != poisson_arrivals(0.2, 50, seed=8)
    assert all(x < y for x, y in zip(a, a[1:])) and a[0] > 0
    long = poisson_arrivals(0.5, 20000, seed=1)
    assert long[-1] / len(long) == pytest.approx(2.0, rel=0.05)  # mean gap 1/rate


def test_top_k_ranks_by_cosine_not_by_dot_product():
    corpus = [[10.0, 10.0], [1.0, 0.0], [0.0, 1.0], [0.9, 0.1]]
    assert top_k([1.0, 0.0], corpus, 3) == [1, 3, 0]  # the long [10, 10] has the largest dot product, not cosine
    assert top_k([0.0, 1.0], corpus, 10) == [2, 0, 3, 1]  # k past the corpus: all, best first


def _session(goodput_rates: dict[str, list[RequestRecord]]) -> dict:
    return {"servers": "fake", "idle": [_answered(0.5)],
            "rates": {float(r): {"records": recs, "background": {}} for r, recs in goodput_rates.items()}}


def test_the_table_takes_medians_over_runs_and_reports_goodput_per_run():
    good, late = [_answered(1.0)] * 10, [_answered(3.0)] * 10
    runs = {"tandem": [judge_session(_session({"0.1": good, "0.2": good}), SLO, 0.9),
                       judge_session(_session({"0.1": good, "0.2": late}), SLO, 0.9),
                       judge_session(_session({"0.1": good, "0.2": good}), SLO, 0.9)]}
    rows = table_rows(runs)
    assert [(r["rate"], r["n"], r["met_runs"], r["runs"]) for r in rows] == [(0.1, 30, 3, 3), (0.2, 30, 2, 3)]
    assert rows[1]["ttft_p90_s"] == pytest.approx(1.0) and rows[1]["ttft_p90_spread_s"] == "1-3"
    g = goodputs(runs)["tandem"]
    assert g["per_run"] == [0.2, 0.1, 0.2] and g["median"] == 0.2 and (g["min"], g["max"]) == (0.1, 0.2)
    text = table_text(rows, goodputs(runs), SLO)
    assert "goodput tandem: 0.2 req/s (runs: 0.2, 0.1, 0.2)" in text
    record = runs["tandem"][0]["rates"]["0.1"]["records"][0]
    assert "gaps_s" not in record and record["tpot_p99_s"] == pytest.approx(0.02)


def test_the_issue_targets_divide_tandems_goodput_by_the_best_splits_and_its_loaded_p90_by_its_idle_p50():
    from bench.rag import issue_targets

    good, late = [_answered(1.0)] * 10, [_answered(3.0)] * 10
    runs = {"tandem": [judge_session(_session({"0.1": good, "0.2": good, "0.3": late}), SLO, 0.9)],
            "split_pinned": [judge_session(_session({"0.1": good, "0.2": late, "0.3": late}), SLO, 0.9)],
            "split_shared": [judge_session(_session({"0.1": late, "0.2": late, "0.3": late}), SLO, 0.9)]}
    got = issue_targets(runs, goodputs(runs))
    assert got["goodput_vs_best_split"] == pytest.approx(2.0)  # 0.2 over the pinned split's 0.1 (shared: 0)
    assert got["p90_ttft_at_0.2_over_idle_p50"] == pytest.approx(2.0)  # 1.0 s over the idle 0.5 s
    assert got["p90_ttft_at_0.3_over_idle_p50"] == pytest.approx(6.0)
    del runs["split_pinned"]
    got = issue_targets(runs, goodputs(runs))
    assert got["goodput_vs_best_split"] is None and "no bound" in got["goodput_vs_best_split_note"]


def test_each_split_rerank_shape_returns_the_kept_indices_best_first():
    import httpx

    from bench.rag import Endpoints, rerank

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/embeddings":  # query [1, 0]; documents at angles, the third closest
            vecs = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.9, 0.1]]
            return httpx.Response(200, json={"data": [{"index": i, "embedding": v}
                                                      for i, v in enumerate(vecs[:len(body["input"])])]})
        if "texts" in body:  # TEI's /rerank (bench/peers/st_server.py)
            return httpx.Response(200, json=[{"index": 1, "score": 0.2}, {"index": 0, "score": 0.9},
                                             {"index": 2, "score": 0.5}])
        assert body["model"] == "ce"  # Infinity's /rerank names the cross-encoder
        return httpx.Response(200, json={"results": [{"index": 0, "relevance_score": 0.1},
                                                     {"index": 2, "relevance_score": 0.7},
                                                     {"index": 1, "relevance_score": 0.3}]})

    async def ranked(api: RerankApi) -> list[int]:
        ep = Endpoints("http://x", "http://x", "/v1/embeddings", api, rerank_model="ce")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await rerank(http, ep, "q", ["a", "b", "c"], keep=2)

    assert asyncio.run(ranked(RerankApi.TEI)) == [0, 2]
    assert asyncio.run(ranked(RerankApi.INFINITY)) == [2, 1]
    assert asyncio.run(ranked(RerankApi.CLIENT_COSINE)) == [2, 1]


def test_a_tiny_run_through_tandem_serve_records_every_stage_and_writes_the_table(tmp_path):
    from bench import rag

    out = tmp_path / "rag.json"
    rag.main(["--systems", "tandem", "--rates", "4", "--requests", "3", "--runs", "1", "--docs", "12",
              "--doc-words", "40", "--candidates", "4", "--keep", "2", "--max-tokens", "3", "--idle-requests", "1",
              "--ingest-batch", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["host"]["vector_flags"] and result["commit"] and result["rerank_mode"] == "dense"
    assert result["slo"]["ttft_s"] > 0 and result["slo"]["tpot_s"] > 0 and "tandem's idle" in result["slo"]["source"]
    session = result["runs"]["tandem"][0]
    records = session["rates"]["4"]["records"]
    assert [r["index"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["error"] is None
        assert all(r[k] is not None for k in ("embed_s", "retrieve_s", "rerank_s", "answer_ttft_s", "ttft_s",
                                              "e2e_s", "tpot_p99_s"))
        assert r["completion_tokens"] == 3 and r["tokens"] >= 2 and r["prompt_tokens"] > 2 * 40
    assert session["rates"]["4"]["background"]["ingest_errors"] == 0
    why = session["rates"]["4"]["why"]  # the step log was read for the phase's window
    assert why["steps"] > 0 and len(why["ttft_misses"]) <= 3 and "why at 4 req/s" in result["table_text"]
    assert [(row["system"], row["rate"], row["n"], row["failed"]) for row in result["table"]] == [("tandem", 4.0, 3, 0)]
    assert result["goodput"]["tandem"]["per_run"] == [session["goodput_req_s"]]
    assert "goodput tandem:" in result["table_text"]


def test_a_step_log_named_in_the_tandem_flags_is_the_one_read_in_either_spelling():
    from pathlib import Path

    from bench.rag import _flag_value  # the step log start_system reads the why-lines from: the user's, if named

    assert _flag_value(["--reranker", "x", "--step-log", "/tmp/a.jsonl"], "--step-log") == Path("/tmp/a.jsonl")
    assert _flag_value(["--step-log=/tmp/b.jsonl", "--max-waiting", "8"], "--step-log") == Path("/tmp/b.jsonl")
    assert _flag_value(["--step-log", "/tmp/a", "--step-log=/tmp/c"], "--step-log") == Path("/tmp/c")  # the last
    assert _flag_value(["--deadline-stretch=0"], "--step-log") is None


def test_a_token_with_held_back_text_ends_a_gap_but_role_finish_and_usage_chunks_do_not():
    from bench.rag import token_chunk

    def delta(**d) -> dict:
        return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    assert not token_chunk(delta(role="assistant"), started=False)  # a role-only first chunk: no token yet
    assert not token_chunk(delta(role="assistant", content=""), started=False)  # nothing the user sees yet
    assert token_chunk(delta(role="assistant", content="The"), started=False)
    assert token_chunk(delta(content=""), started=True)  # a skipped special token: generated, text held back
    assert token_chunk(delta(content=" cat"), started=True)
    assert not token_chunk(delta(), started=True)  # a finish-only chunk (llama-server's last)
    assert not token_chunk(delta(content=None, tool_calls=[{"index": 0}]), started=True)
    assert not token_chunk({"choices": [], "usage": {"completion_tokens": 3}}, started=True)


def test_vllms_tpot_reading_averages_an_answer_so_one_long_gap_misses_only_the_p99_reading():
    one_stall = RequestRecord(0, 0.0, ttft_s=1.0, e2e_s=1.0 + 0.02 * 62 + 0.2, gaps_s=[0.02] * 62 + [0.2], tokens=64,
                              completion_tokens=64)
    assert one_stall.tpot_mean_s == pytest.approx((0.02 * 62 + 0.2) / 63)
    v = judge(0.1, [one_stall] * 10, SLO, 0.9)
    assert not v.tpot_met and not v.met  # its p99 gap (0.2 s) is over 0.05
    assert v.tpot_mean_met and v.met_mean  # its mean (~0.023 s) is within
    slow = RequestRecord(0, 0.0, ttft_s=1.0, e2e_s=1.0 + 0.06 * 63, gaps_s=[0.06] * 63, tokens=64, completion_tokens=64)
    assert not judge(0.1, [one_stall] * 9 + [slow], SLO, 0.9).met_mean  # every answer, not most
    assert goodput([v], mean_tpot=True) == 0.1 and goodput([v]) == 0.0
    session = judge_session(_session({"0.1": [one_stall] * 10}), SLO, 0.9)
    assert (session["goodput_req_s"], session["goodput_mean_tpot_req_s"]) == (0.0, 0.1)
    rows = table_rows({"tandem": [session]})
    text = table_text(rows, goodputs({"tandem": [session]}), SLO,
                      goodputs({"tandem": [session]}, "goodput_mean_tpot_req_s"))
    assert "goodput tandem: 0 req/s" in text and "goodput, vLLM's TPOT tandem: 0.1 req/s" in text
