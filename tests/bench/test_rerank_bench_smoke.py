"""The rerank speed benchmark runs end to end at tiny sizes and writes JSON with the expected keys and sane
values.

Behaviour only: no assertion on wall-clock figures beyond their being positive and finite.
"""
import json
import math

from bench import rerank


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_rerank_bench_quick(tmp_path, monkeypatch):
    # The judge's part on one query of three documents instead of two of six, at a 192-token budget so that a
    # rerank still spans steps (pairs chunked, as at six documents and 512): what is asserted (the cache on computes
    # fewer of the same prompt tokens and scores the same; a share, a ratio and a median exist) needs only a query
    # with more than one document after a prefix; every rerank's tokens are model work.
    monkeypatch.setitem(rerank.QUICK, "llm_queries", 1)
    monkeypatch.setitem(rerank.QUICK, "llm_docs", 3)
    monkeypatch.setitem(rerank.QUICK, "llm_budget", 192)
    out = tmp_path / "rerank.json"
    rerank.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["threads"] == 2
    assert _positive(result["matmul_peak_gflops"])
    assert isinstance(result["contended"], bool) and result["loadavg_1min_max"] >= 0

    ce = result["cross_encoder"]
    assert _positive(ce["tandem_pairs_s"]) and _positive(ce["tandem_mfu"])
    assert ce["pairs"] == ce["queries"] * ce["docs_per_query"]
    # Ragged batching runs exactly the real tokens.
    assert ce["tandem_tokens_from_steps"] == ce["tokens_real"]
    assert ce["tandem_steps"] >= 1 and 0 < ce["tandem_budget_use"] <= 1
    assert 0 < ce["tandem_forward_share"] <= ce["tandem_step_share"] <= 1
    if ce["baseline"] is None:  # sentence-transformers is a bench-only extra: skipped, and the JSON says why
        assert "sentence-transformers" in ce["sentence_transformers_skipped"]
        assert "sentence_transformers_pairs_s" not in ce
    else:
        name = ce["baseline"]
        assert _positive(ce[f"{name}_pairs_s"]) and _positive(ce[f"{name}_mfu"])
        assert _positive(ce[f"ratio_vs_{name}"]) and _positive(ce[f"p90_latency_ratio_vs_{name}"])
        assert 0 <= ce[f"{name}_padding_waste_est"] < 1
        # Same weights, same tokens: the real library scores what tandem scores.
        assert ce["parity_pairs_compared"] > 0 and ce["parity_max_abs_diff"] < 1e-4

    llm = result["llm_judge"]
    assert _positive(llm["cache_on_pairs_s"]) and _positive(llm["cache_off_pairs_s"])
    assert _positive(llm["ratio_cache_on_vs_off"]) and _positive(llm["ratio_median_per_query_cache_on_vs_off"])
    assert 0 < llm["cache_on_cached_fraction"] < 1
    assert llm["cache_off_cached_fraction"] == 0
    assert llm["cache_on_prompt_tokens"] == llm["cache_off_prompt_tokens"] == llm["cache_off_computed_tokens"]
    assert llm["cache_on_computed_tokens"] < llm["cache_off_computed_tokens"]
    assert llm["max_abs_score_diff_on_vs_off"] < 1e-4  # the prefix cache does not change scores
    for name in ("cache_on", "cache_off"):
        assert 0 < llm[f"{name}_budget_use"] <= 1 and _positive(llm[f"{name}_mfu"])


def test_rerank_bench_without_sentence_transformers(tmp_path, monkeypatch):
    """With the library missing, the quick run still works and records why the baseline was skipped."""
    import builtins

    real_import = builtins.__import__

    def no_st(name, *args, **kwargs):
        if name == "sentence_transformers" or name.startswith("sentence_transformers."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_st)
    out = tmp_path / "rerank.json"
    rerank.main(["--quick", "--skip", "llm_judge", "--out", str(out)])
    ce = json.loads(out.read_text())["cross_encoder"]
    assert ce["baseline"] is None and "No module named" in ce["sentence_transformers_skipped"]
    assert _positive(ce["tandem_pairs_s"])
