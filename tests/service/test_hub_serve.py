"""`tandem serve --model org/name --reranker org/name` (issue 63 item 1) as a user runs it: the Hub named by
HF_ENDPOINT (a local stand-in, tests/hub.py), its cache in HF_HUB_CACHE, a private reranker read with HF_TOKEN; then
HF_HUB_OFFLINE=1 with an id that is not cached: one line saying what to run. Nothing reaches the internet."""
from __future__ import annotations

import pytest

from clients import Client
from tests.hub import GGUF_REPO, TINY_BERT, TINY_LLAMA, TOKEN, FakeHub, build_repos
from tests.service.process_harness import ServeProcess

FLAGS = ("--embedder", "none", "--tpot-target-ms", "off", "--num-kv-blocks", "64")


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    fake = FakeHub(build_repos(tmp_path_factory.mktemp("repos")))
    yield fake
    fake.close()


def test_serve_by_hub_ids_then_offline_without_the_cache(fake_hub, tmp_path) -> None:
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_TOKEN": TOKEN,
           "HF_HUB_OFFLINE": "0"}
    proc = ServeProcess("--model", TINY_LLAMA, "--reranker", TINY_BERT, *FLAGS, env=env)
    try:
        with Client(proc.address) as client:
            assert "".join(d.text for d in client.generate("Hello", max_tokens=4, ignore_eos=True))
            ranked = client.rerank("lighthouse at night", ["a lamp flashes at night", "bananas"])
            assert sorted(r.index for r in ranked) == [0, 1]
    finally:
        proc.stop()
    said = "".join(proc.output)
    assert "rerank: cross-encoder (the cross-encoder tiny-bert-reranker)" in said, said
    assert f"{TINY_BERT}/model.safetensors" in fake_hub.fetched()
    assert (tmp_path / "hf" / "models--tandem-test--tiny-llama" / "refs" / "main").is_file()  # the standard cache

    asked = len(fake_hub.requests)
    with pytest.raises(RuntimeError) as failed:
        ServeProcess("--model", GGUF_REPO + ":Q4_1", *FLAGS, env={**env, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in str(failed.value).splitlines() if line.startswith("tandem serve: cannot start")]
    assert len(lines) == 1, str(failed.value)
    assert (f'--model {GGUF_REPO}: not in the Hugging Face cache ({tmp_path / "hf"}) and HF_HUB_OFFLINE=1: run '
            f"`hf download {GGUF_REPO} --include '*Q4_1.gguf'` where there is a network, or give a local path") \
        in lines[0]
    assert len(fake_hub.requests) == asked
