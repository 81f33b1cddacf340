"""The rerank speed benchmark runs end to end at tiny sizes and writes JSON with the expected keys and sane
values.

Behaviour only: no assertion on wall-clock figures beyond their being positive and finite.
"""
import json
import math


from bench import rerank


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_rerank_bench_quick(tmp_path):
    out = tmp_path / "rerank.json"
    rerank.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["threads"] == 2
    assert _positive(result["matmul_peak_gflops"])
    assert isinstance(result["contended"], bool) and result["loadavg_1min_max"] >= 0

    ce = result["cross_encoder"]
    for name in ("tandem", "hf_padded", "hf_padded_sorted"):
        assert _positive(ce[f"{name}_pairs_s"]) and _positive(ce[f"{name}_mfu"])
    for name in ("hf_padded", "hf_padded_sorted"):
        assert _positive(ce[f"ratio_vs_{name}"]) and _positive(ce[f"ratio_median_per_query_vs_{name}"])
        assert 0 <= ce[f"{name}_padding_waste"] < 1
        assert ce[f"{name}_tokens_total"] >= ce["tokens_real"]
    assert ce["pairs"] == ce["queries"] * ce["docs_per_query"]
    # Ragged batching runs exactly the real tokens, and scores what the padded HF model scores.
    assert ce["tandem_tokens_from_steps"] == ce["tokens_real"]
    assert ce["max_abs_score_diff_tandem_vs_hf"] < 1e-4
    assert ce["tandem_steps"] >= 1 and 0 < ce["tandem_budget_use"] <= 1

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
