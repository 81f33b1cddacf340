"""bench.rerank_serve's wiring: a `tandem serve` per mode, timed /v2/rerank requests, the mode the server says scored
them and the load beside the figures (no timing is asserted)."""
import json

from bench import rerank_serve


def test_quick_run_times_each_mode_through_its_own_server(tmp_path, monkeypatch):
    # --quick sets its own modes (dense and cascade), over --modes: one server, dense, is what this test asserts on;
    # the wiring is the same for every mode, and a second server doubled the test
    monkeypatch.setitem(rerank_serve.QUICK, "modes", ["dense"])
    out = tmp_path / "rerank_serve.json"
    rerank_serve.main(["--quick", "--modes", "dense", "--out", str(out)])
    result = json.loads(out.read_text())
    dense = result["modes"]["dense"]
    assert dense["scored_by"] == ["dense"] and dense["requests"] == len(dense["seconds"]) == rerank_serve.QUICK["requests"]
    assert dense["usage"]["prompt_tokens"] > 0 and "load average" in dense["uptime_before"] + dense["uptime_after"]
    assert result["docs"] == rerank_serve.QUICK["docs"] and result["threads"] == 2


def test_work_is_windows_of_whole_words_with_the_querys_own_answer_first():
    from bench.datasets import alpaca_eval

    work = rerank_serve.rerank_work(3, 5, 30, seed=1)
    rows = {r["instruction"]: r["output"] for r in alpaca_eval()}
    for query, docs in work:
        assert len(docs) == 5 and all(len(d.split()) == 30 for d in docs)
        assert rows[query].split()[:30] == docs[0].split()[:len(rows[query].split()[:30])]
