"""A cross-encoder and an embedder that are one encoder (issue #37: "their rows share one forward"): the same
directory, or a classifier on top of the embedder's own encoder weights (the MiniLM cross-encoder of bench/models.py
beside the embedded all-MiniLM-L6-v2). One copy of the weights serves both, a step's pairs and embedding inputs run
in one packed forward per stage, and both kinds of results equal what each model gives alone."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, RerankParams, SamplingParams
from engine.config import EMBEDDED_EMBEDDER, EmbedParams
from engine.embed import Embedder, embedded_embedder_dir
from engine.models.encoder_loader import same_encoder
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_cross_encoder import _tiny_bert
from tests.models.test_modernbert_reranker import _build as build_modernbert

QUERY = "how do lighthouses warn ships at night"
DOCS = ["A lighthouse keeper trims the wick and winds the clockwork that turns the lens every night of the year.",
        "Fog horns sound when the light cannot be seen.", "Bananas.",
        "Ships read the light's pattern of flashes on their charts to know which lighthouse they are passing by."]
TEXTS = ["The lens turns all night.", "A storm hides the coast.", "Keepers kept logbooks of every ship they saw."]



def _llm(**kw) -> LLM:
    """An engine with a small KV pool: these tests run short chats beside their encoder work, and the default 1 GiB
    pool (1,456 blocks, zero-filled at every build: ~0.6 s of a core) held none of it."""
    return LLM(EngineConfig(num_kv_blocks=64, **kw))

def _as_embedder(directory: Path, pooling: str = "mean") -> Path:
    """Give a cross-encoder directory a sentence-transformers pooling config: it is also an embedding model."""
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"}))
    return directory


@pytest.fixture(scope="module", params=["bert", "modernbert"])
def both_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"shared_{request.param}")
    if request.param == "bert":
        _tiny_bert(directory)
    else:
        build_modernbert(directory, "mean")
    return _as_embedder(directory)


@pytest.fixture(scope="module")
def alone(both_dir: Path) -> tuple[list[float], torch.Tensor]:
    """Each model loaded on its own (two copies, two forwards): the reference scores and normalised vectors."""
    llm = _llm(reranker=str(both_dir))
    assert not llm.engine.runner.shared_encoder
    scores = llm.rerank(QUERY, DOCS)
    emb = Embedder.load(str(both_dir))
    rows = [r.token_ids for r in emb.rows(TEXTS, None, EmbedParams())]
    return scores, torch.nn.functional.normalize(emb.embed(rows), dim=-1)


def _embedding_calls(llm: LLM) -> list[int]:
    """A counter of the encoder's token-embedding calls: one per packed group that starts at its first stage."""
    model = llm.engine.scorer.encoder.model
    module = model.model.embeddings.tok_embeddings if hasattr(model, "model") else model.bert.embeddings
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_one_encoder_serves_both_in_one_forward_with_the_results_of_each_alone(both_dir: Path, alone) -> None:
    want_scores, want = alone
    llm = _llm(reranker=str(both_dir), embedder=str(both_dir), max_num_batched_tokens=512)
    engine = llm.engine
    assert engine.runner.shared_encoder and engine.embedder.staged is engine.scorer.staged  # one forward
    calls = _embedding_calls(llm)
    records = []
    engine.add_observer(records.append)
    engine.add_rerank("r", QUERY, DOCS)
    engine.add_embed("e", TEXTS)
    outs = {}
    while engine.has_unfinished():
        before = calls[0]
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        r = records[-1]
        if r.rerank_tokens and r.embed_rows:  # both kinds ran their first stage in this step: one packed forward
            assert calls[0] - before == 1, (calls[0] - before, r)
    assert any(r.rerank_tokens and r.embed_rows for r in records), "no step carried pairs and embedding rows"
    assert outs["r"].scores == pytest.approx(want_scores, abs=1e-5)
    assert (torch.tensor(outs["e"].embeddings) - want).abs().max().item() <= 1e-5
    assert len(engine.staged) == 0 and engine.staged.num_bytes == 0
    assert_no_leaks(llm)


def test_pairs_and_rows_in_stages_beside_a_chat_share_each_stage(both_dir: Path, alone) -> None:
    """A small budget: rows and pairs run a few layers a step beside a decode; their kept states live in the
    engine's one StagedStates, and an abort part-way drops them."""
    want_scores, want = alone
    llm = _llm(reranker=str(both_dir), embedder=str(both_dir), max_num_batched_tokens=48)
    engine = llm.engine
    engine.add_request("chat", "The capital of France is", SamplingParams(max_tokens=64, temperature=0.0,
                                                                       ignore_eos=True))
    engine.add_rerank("r", QUERY, DOCS, RerankParams())
    engine.add_embed("e", TEXTS)
    engine.add_embed("gone", TEXTS)
    records = []
    engine.add_observer(records.append)
    outs = {out.request_id: out for out in engine.step() if out.finished}
    assert engine.abort("gone")  # three rows behind a chat, four pairs and three rows: not done in one step
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["gone"].finish_reason == "abort"
    assert any(r.embed_rows > r.embed_rows_done for r in records), "no row was cut into stages"
    assert any(r.embed_rows and r.rerank_tokens for r in records), "no step carried pairs and embedding rows"
    assert outs["r"].scores == pytest.approx(want_scores, abs=1e-5)
    assert (torch.tensor(outs["e"].embeddings) - want).abs().max().item() <= 1e-5
    assert len(engine.staged) == 0 and engine.staged.num_bytes == 0
    assert_no_leaks(llm)


def test_a_classifier_on_the_embedders_own_weights_is_the_same_encoder(minilm_dir: Path, tmp_path: Path) -> None:
    """The MiniLM cross-encoder of the benchmarks is all-MiniLM-L6-v2's encoder under a new head: beside the embedded
    embedder it is one encoder. Change one weight and it is not."""
    assert same_encoder(minilm_dir, embedded_embedder_dir())
    llm = _llm(reranker=str(minilm_dir), embedder=EMBEDDED_EMBEDDER)
    assert llm.engine.runner.shared_encoder
    want = _llm(reranker=str(minilm_dir)).rerank(QUERY, DOCS)
    assert llm.rerank(QUERY, DOCS) == pytest.approx(want, abs=1e-5)
    ref = Embedder.load(EMBEDDED_EMBEDDER)
    rows = [r.token_ids for r in ref.rows(TEXTS, None, EmbedParams())]
    assert (torch.tensor(llm.embed(TEXTS)) - torch.nn.functional.normalize(ref.embed(rows), dim=-1)
            ).abs().max().item() <= 1e-5

    other = tmp_path / "other"
    shutil.copytree(minilm_dir, other)
    state = load_file(other / "model.safetensors")
    name = next(k for k in state if k.endswith("encoder.layer.3.output.dense.weight"))
    state[name][0, 0] += 1e-3
    save_file(state, other / "model.safetensors")
    assert not same_encoder(other, embedded_embedder_dir())
    assert not _llm(reranker=str(other), embedder=EMBEDDED_EMBEDDER).engine.runner.shared_encoder
