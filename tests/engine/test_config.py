"""Config dataclasses reject bad values with a ValueError that names the field."""
from __future__ import annotations

import math
import re

import pytest

from engine.config import EngineConfig, RerankParams, SamplingParams


# ---- SamplingParams --------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", "8"),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "0.5"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("stop", [""]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("priority", 1.5),
    ("priority", "high"),
])
def test_sampling_params_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accepts_boundaries():
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(top_p=1.0).top_p == 1.0
    assert SamplingParams(top_p=1e-6).top_p == 1e-6
    for k in (-1, 0, 1, 50):
        assert SamplingParams(top_k=k).top_k == k
    assert SamplingParams(priority=-3).priority == -3
    assert SamplingParams(stop_token_ids=[0, 2]).stop_token_ids == [0, 2]


def test_sampling_params_stop_string_becomes_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_sampling_params_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize("field", ["stop", "stop_token_ids"])
def test_sampling_params_none_lists_are_accepted_or_named(field):
    """vLLM users pass stop=None / stop_token_ids=None; that must mean 'none', or at worst be a
    ValueError naming the field, never a bare TypeError from iterating None."""
    try:
        p = SamplingParams(**{field: None})
    except ValueError as e:
        assert field in str(e)
    else:
        assert getattr(p, field) == []


@pytest.mark.parametrize("value", ["1", 1.5])
def test_sampling_params_rejects_non_integer_seed(value):
    """A non-integer seed is accepted here and only blows up later, in add_request (RuntimeError from Generator.manual_seed)."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=value)


# ---- EngineConfig ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("block_size", 0),
    ("block_size", -16),
    ("block_size", 8.0),
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", -1),
    ("max_num_seqs", 0),
    ("kv_cache_bytes", 0),
    ("kv_cache_bytes", -1),
    ("num_kv_blocks", 0),
    ("num_kv_blocks", -4),
    ("max_rerank_documents", 0),
    ("max_embed_inputs", 0),
    ("max_embed_inputs", -1),
    ("priority_aging_steps", 0),
    ("scoring_share", 0.0),
    ("scoring_share", 1.5),
    ("scoring_share", -0.5),
    ("scoring_share", math.nan),
    ("dtype", "float8"),
    ("dtype", "fp32"),
    ("dtype", "int8"),
    ("scheduling", "fifo"),
    ("enforce_eager", "yes"),
])
def test_engine_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("fields, message", [
    (dict(rerank_mode="bm25"), "rerank_mode must be one of likelihood, judge, cross-encoder, fusion, dense, "
                               "cascade, got 'bm25'"),
    (dict(rerank_mode="dense"), "rerank_mode 'dense' scores by the embedder's cosine: it needs embedder="),
    (dict(rerank_mode="cascade", embedder="e", rerank_cascade_k=0), "rerank_cascade_k must be an integer >= 1"),
    (dict(rerank_mode="cross-encoder"), "needs reranker=DIR"),
    (dict(rerank_mode="judge", reranker="/some/dir"), "leave one of them unset"),
])
def test_rerank_mode_errors_name_the_valid_choice(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**fields)


def test_engine_config_defaults_and_boundaries_are_valid():
    cfg = EngineConfig()
    assert cfg.dtype == "float32" and cfg.device == "cpu" and cfg.enable_prefix_caching
    for dtype in ("float32", "float16", "bfloat16"):
        assert EngineConfig(dtype=dtype).dtype == dtype
    assert EngineConfig(scoring_share=1.0).scoring_share == 1.0
    assert EngineConfig(num_kv_blocks=1).num_kv_blocks == 1
    assert EngineConfig(scheduling="static").scheduling == "static"
    assert EngineConfig(max_num_batched_tokens=1, max_num_seqs=1, block_size=1).block_size == 1


def test_the_step_budget_defaults_by_device_and_a_given_one_stands():
    assert EngineConfig().max_num_batched_tokens == 512
    assert EngineConfig(device="cuda", dtype="bfloat16").max_num_batched_tokens == 4096  # no GPU needed to build it
    assert EngineConfig(device="cuda:1").max_num_batched_tokens == 4096
    assert EngineConfig(device="cuda", max_num_batched_tokens=256).max_num_batched_tokens == 256


@pytest.mark.parametrize("value", [0, -1])
def test_engine_config_rejects_non_positive_max_model_len(value):
    """max_model_len is not validated: -1 makes every request fail later with a confusing message,
    and 0 silently means 'the model's own length' (the engine does `max_model_len or ...`)."""
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=value)


# ---- RerankParams ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("truncate", "start"),
    ("truncate", ""),
])
def test_rerank_params_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        RerankParams(**{field: value})


def test_rerank_params_valid():
    assert RerankParams(truncate="none").truncate == "none"


def test_rerank_share_is_the_deprecated_name_of_scoring_share():
    with pytest.warns(DeprecationWarning, match="scoring_share"):
        cfg = EngineConfig(rerank_share=0.25)
    assert cfg.scoring_share == 0.25
