"""Models by Hugging Face Hub id through `LLM(...)` (issue 63 item 1), against a local stand-in for the Hub
(tests/hub.py) and the cache huggingface_hub fills, then under HF_HUB_OFFLINE=1. Nothing reaches the internet.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported; in this process they
are set on its `constants` module (what its functions read at call time). tests/service/test_hub_serve.py sets the
real variables for `tandem serve`.
"""
from __future__ import annotations

import re
import shlex

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.models import hub
from engine.models.hub import HubError
from tests.hub import GGUF_Q4, GGUF_Q8, GGUF_REPO, MINILM, TINY_BERT, TINY_LLAMA, TOKEN, FakeHub, build_repos

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
QUERY = "how do lighthouses warn ships at night"
DOCS = ["a lighthouse lamp flashes at night", "bananas are yellow", "fog horns sound in the fog"]


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    repos = tmp_path_factory.mktemp("repos")
    fake = FakeHub(build_repos(repos))
    fake.root = repos
    yield fake
    fake.close()


def _use(monkeypatch, fake: FakeHub, cache, offline: bool = False) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def online_cache(fake_hub, tmp_path_factory):
    """The Hub cache after an online LLM(...) by Hub ids; that LLM's outputs beside one built from the local
    folders."""
    cache = tmp_path_factory.mktemp("hf-cache")
    with pytest.MonkeyPatch.context() as mp:
        _use(mp, fake_hub, cache)
        # num_kv_blocks: a small KV pool for short prompts; the default 1 GiB is zero-filled at every build (~0.6 s of a core)
        by_id = LLM(EngineConfig(model=TINY_LLAMA, reranker=TINY_BERT, embedder=MINILM, tpot_target_ms=None,
                                 num_kv_blocks=64))
        got = (by_id.generate(["Hello there"], GREEDY)[0].token_ids, by_id.rerank(QUERY, DOCS),
               by_id.engine.model_info())
        del by_id
    local = {r: str(fake_hub.repos[r].folder) for r in (TINY_LLAMA, TINY_BERT, MINILM)}
    by_path = LLM(EngineConfig(model=local[TINY_LLAMA], reranker=local[TINY_BERT], embedder=local[MINILM],
                               tpot_target_ms=None, num_kv_blocks=64))
    want = (by_path.generate(["Hello there"], GREEDY)[0].token_ids, by_path.rerank(QUERY, DOCS))
    return cache, got, want


def test_hub_ids_load_the_same_models_as_their_folders(online_cache, fake_hub) -> None:
    _, (tokens, scores, info), (want_tokens, want_scores) = online_cache
    assert tokens == want_tokens
    assert scores == pytest.approx(want_scores, abs=1e-6)
    assert info["model"] == TINY_LLAMA and info["embedder"] == MINILM  # named as given, not by the cache's hash
    fetched = fake_hub.fetched()
    assert f"{MINILM}/1_Pooling/config.json" in fetched  # a nested file of the repository
    assert f"{TINY_LLAMA}/model.safetensors" in fetched and f"{TINY_BERT}/model.safetensors" in fetched
    # the private reranker was fetched with the HF_TOKEN the environment holds
    assert {auth for _, path, auth in fake_hub.requests if TINY_BERT in path} == {f"Bearer {TOKEN}"}


def test_offline_the_cache_serves_and_nothing_is_asked(online_cache, fake_hub, monkeypatch) -> None:
    cache, (tokens, _, _), _ = online_cache
    _use(monkeypatch, fake_hub, cache, offline=True)
    asked = len(fake_hub.requests)
    llm = LLM(EngineConfig(model=TINY_LLAMA, tpot_target_ms=None, num_kv_blocks=64))
    assert llm.generate(["Hello there"], GREEDY)[0].token_ids == tokens
    assert len(fake_hub.requests) == asked
    with pytest.raises(HubError) as caught:  # cached nowhere: one line, what to run, and the local alternative
        LLM(EngineConfig(model=GGUF_REPO + ":Q4_1"))
    message = str(caught.value)
    assert "\n" not in message and "HF_HUB_OFFLINE=1" in message
    assert f"hf download {GGUF_REPO} --include '*Q4_1.gguf'" in message and "local path" in message
    # what the operator gave is quoted: the suggested command, pasted into a shell, runs only itself
    with pytest.raises(HubError) as caught:
        LLM(EngineConfig(model=GGUF_REPO, revision="main; touch /tmp/x", gguf_file="a b$(id).gguf"))
    command = re.search(r"run `([^`]*)`", str(caught.value)).group(1)
    assert shlex.split(command) == ["hf", "download", GGUF_REPO, "a b$(id).gguf", "--revision", "main; touch /tmp/x"]
    assert len(fake_hub.requests) == asked


def test_a_gguf_repository_by_quant_fetches_that_file_only(fake_hub, tmp_path, monkeypatch) -> None:
    _use(monkeypatch, fake_hub, tmp_path / "cache")
    # the quant's case does not matter
    llm = LLM(EngineConfig(model=GGUF_REPO + ":q4_1", tpot_target_ms=None, num_kv_blocks=64))
    assert llm.engine.quantization == "gguf"  # its blocks, as a local .gguf file is served
    assert llm.generate(["Hello"], GREEDY)[0].token_ids
    fetched = fake_hub.fetched()
    assert f"{GGUF_REPO}/{GGUF_Q4}" in fetched and f"{GGUF_REPO}/{GGUF_Q8}" not in fetched
    path = hub.local_path(GGUF_REPO, gguf_file=GGUF_Q4)  # --gguf-file names the same file
    assert path.endswith(GGUF_Q4) and str(tmp_path / "cache") in path


def test_a_gguf_repository_of_several_quants_asks_for_one(fake_hub, tmp_path, monkeypatch) -> None:
    _use(monkeypatch, fake_hub, tmp_path / "cache")
    asked = len(fake_hub.requests)
    with pytest.raises(HubError, match=rf"holds 2 GGUF files: pick one with {GGUF_REPO}:QUANT \(one of Q4_1, Q8_0\) "
                                       r"or --gguf-file FILE"):
        LLM(EngineConfig(model=GGUF_REPO))
    assert [method for method, *_ in fake_hub.requests[asked:]] == ["GET"]  # the listing only, no file


def test_hub_errors_say_what_to_do_in_one_line(fake_hub, tmp_path, monkeypatch) -> None:
    _use(monkeypatch, fake_hub, tmp_path / "cache")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match=r"--reranker tandem-test/tiny-bert-reranker: no such model repository .*\(a "
                                       r"private or gated one needs HF_TOKEN") as caught:
        hub.local_path(TINY_BERT, "--reranker")
    # a reranker (an embedder) is a Hugging Face directory, never a GGUF file: the way out says so
    assert str(caught.value).endswith("or give a local path (a Hugging Face model directory)"), caught.value
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(HubError, match=r"the Hub has no revision 'v9'"):
        LLM(EngineConfig(model=TINY_LLAMA, revision="v9"))
    with pytest.raises(HubError, match=r"--model nobody/nothing: no such model repository.*local path \(a GGUF "
                                       r"file or a Hugging Face model directory\)"):
        LLM(EngineConfig(model="nobody/nothing"))


def test_the_embedded_defaults_fetch_nothing_and_convert_nothing(fake_hub, tmp_path, monkeypatch) -> None:
    """`LLM()` serves the embedded model's GGUF blocks: no Hub request, and no float32 copy of it (~540 MB) in
    TANDEM_CACHE_DIR, only its config + tokenizer and its blocks (issue 63 item 3)."""
    _use(monkeypatch, fake_hub, tmp_path / "hf")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tandem"))
    asked = len(fake_hub.requests)
    llm = LLM(EngineConfig(embedder="all-MiniLM-L6-v2", tpot_target_ms=None, num_kv_blocks=64))
    assert llm.generate(["Hello"], GREEDY)[0].token_ids
    assert len(fake_hub.requests) == asked and not (tmp_path / "hf").exists()
    written = sorted(p.name for p in (tmp_path / "tandem").iterdir())
    assert "SmolLM2-135M-Instruct" not in written, written  # the dense conversion's folder
    size = sum(p.stat().st_size for p in (tmp_path / "tandem").rglob("*") if p.is_file())
    assert size < 200e6, written  # the blocks as stored (~100 MB) and small metadata
