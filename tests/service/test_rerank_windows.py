"""Long documents scored in overlapping windows (max pooling), in the dense mode (the embedder's 256-token window)
and the cross-encoder mode (512 positions): a document whose relevant passage is only in its second half gets the
score of its best window, as the reference libraries compute each window (sentence-transformers' forward of the
window's ids for the embedder, transformers' sequence classifier for the cross-encoder); the window count is right
offline and through both doors (gRPC max_windows / RerankResult.windows; HTTP Cohere max_chunks_per_doc and TEI
max_windows, "windows" on each result); without windows the document is cut as before. The cascade (as fusion)
windows its embedder rows only."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from tests.models_built import minilm_cross_encoder_dir
from clients import Client, TandemError
from engine import LLM, EngineConfig, RerankParams
from engine.config import EMBEDDED_EMBEDDER
from engine.embed.embedder import embedded_embedder_dir
from service.server import ServerConfig
from tests.service.harness import ServerThread

QUERY = "How do bees make honey?"
FILLER = ("The committee reviewed the annual budget for road maintenance and agreed to repaint the bridge railings "
          "before winter. ")
PASSAGE = ("Bees make honey by collecting nectar from flowers, storing it in their honey stomach, and fanning it "
           "with their wings in the hive until the water evaporates and it thickens into honey.")
OVERLAP = 80  # the engine's default rerank_window_overlap


def long_document(filler_repeats: int) -> str:
    """Filler first, the one relevant passage at the end: beyond the first window."""
    return FILLER * filler_repeats + PASSAGE


def window_ids(ids: list[int], room: int, overlap: int = OVERLAP) -> list[list[int]]:
    """Windows of `room` tokens every `room - overlap` tokens until the document's end (the documented rule)."""
    stride = room - overlap
    count = 1 if len(ids) <= room else 1 + math.ceil((len(ids) - room) / stride)
    return [ids[k * stride:k * stride + room] for k in range(count)]


# ---- dense: the embedded all-MiniLM-L6-v2, 256 tokens ------------------------------------------------------------


@pytest.fixture(scope="module")
def st():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedded_embedder_dir()), device="cpu")


def st_dense_scores(st, doc: str) -> list[float]:
    """Each window's (1 + cos) / 2 with the query, sentence-transformers' forward over [CLS] window [SEP]."""
    tok = st.tokenizer
    room = st.max_seq_length - 2
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    q = st.encode([QUERY], normalize_embeddings=True, convert_to_tensor=True)[0]
    out = []
    with torch.inference_mode():
        for w in window_ids(ids, room):
            full = torch.tensor([[tok.cls_token_id, *w, tok.sep_token_id]])
            v = st({"input_ids": full, "attention_mask": torch.ones_like(full),
                    "token_type_ids": torch.zeros_like(full)})["sentence_embedding"][0]
            out.append((1 + torch.nn.functional.normalize(v, dim=-1) @ q).item() / 2)
    return out


@pytest.fixture(scope="module")
def dense():
    llm = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="dense", tpot_target_ms=None, num_kv_blocks=64))
    server = ServerThread(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    url = server.add_http(server.server.config).url
    yield llm, server, url
    server.close()


def test_dense_long_document_scores_as_its_best_window(dense, st):
    llm, _, _ = dense
    doc = long_document(30)
    ref = st_dense_scores(st, doc)
    assert len(ref) >= 2 and max(range(len(ref)), key=ref.__getitem__) > 0  # the best window is not the first
    short = "The train to Lyon leaves at nine."
    windowed = llm.rerank(QUERY, [short, doc], RerankParams(max_windows=8), ranked=True)
    by_index = {r.index: r for r in windowed}
    assert abs(by_index[1].score - max(ref)) <= 1e-4
    assert by_index[1].windows == len(ref) and not by_index[1].truncated
    assert by_index[0].windows == 1
    cut = {r.index: r for r in llm.rerank(QUERY, [short, doc], RerankParams(), ranked=True)}  # default: cut
    assert cut[1].windows == 1 and cut[1].truncated and abs(cut[1].score - ref[0]) <= 1e-4
    assert by_index[1].score > cut[1].score + 1e-3
    # fewer windows than it needs: the first ones scored, the rest cut; or refused with truncate="none"
    two = {r.index: r for r in llm.rerank(QUERY, [doc], RerankParams(max_windows=2), ranked=True)}
    assert two[0].windows == 2 and two[0].truncated and abs(two[0].score - max(ref[:2])) <= 1e-4
    with pytest.raises(ValueError, match="over 2 windows"):
        llm.rerank(QUERY, [doc], RerankParams(max_windows=2, truncate="none"))


def test_dense_windows_through_both_doors(dense, st):
    _, server, url = dense
    doc = long_document(30)
    ref = st_dense_scores(st, doc)
    docs = ["Bread rises because yeast makes gas.", doc]
    with Client(server.address) as c:
        results = c.rerank(QUERY, docs, max_windows=8)
        plain = c.rerank(QUERY, docs)
        with pytest.raises(TandemError, match="over 1 windows|shorten it"):
            c.rerank(QUERY, docs, truncate="none")
    got = {r.index: r for r in results}
    assert got[1].windows == len(ref) and abs(got[1].score - max(ref)) <= 1e-4 and got[0].windows == 1
    assert {r.index: r.windows for r in plain} == {0: 1, 1: 1}
    with httpx.Client(base_url=url, timeout=600) as h:
        cohere = h.post("/v2/rerank", json={"query": QUERY, "documents": docs, "max_chunks_per_doc": 8})
        tei = h.post("/rerank", json={"query": QUERY, "texts": docs, "max_windows": 8, "truncate": True})
        bad = h.post("/v2/rerank", json={"query": QUERY, "documents": docs, "max_chunks_per_doc": 0})
    assert cohere.status_code == 200 and tei.status_code == 200, (cohere.text, tei.text)
    for results, key in ((cohere.json()["results"], "relevance_score"), (tei.json(), "score")):
        by = {x["index"]: x for x in results}
        assert by[1]["windows"] == len(ref) and abs(by[1][key] - max(ref)) <= 1e-4 and by[0]["windows"] == 1
    assert bad.status_code == 400 and "max_chunks_per_doc must be >= 1" in bad.text


# ---- cross-encoder: MiniLM under a seeded classifier head, 512 positions -----------------------------------------


def test_cross_encoder_long_document_scores_as_its_best_window(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ce_dir = minilm_cross_encoder_dir(tmp_path / "ce")
    tok = AutoTokenizer.from_pretrained(ce_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(ce_dir, dtype=torch.float32).eval()
    doc = long_document(60)
    q = tok(QUERY, add_special_tokens=False)["input_ids"]
    room = 512 - len(q) - 3  # [CLS] query [SEP] window [SEP]
    ref = []
    with torch.inference_mode():
        for w in window_ids(tok(doc, add_special_tokens=False)["input_ids"], room):
            ids = [tok.cls_token_id, *q, tok.sep_token_id, *w, tok.sep_token_id]
            types = [0] * (len(q) + 2) + [1] * (len(w) + 1)
            ref.append(torch.sigmoid(hf(input_ids=torch.tensor([ids]),
                                        token_type_ids=torch.tensor([types])).logits[0, 0]).item())
    assert len(ref) >= 2
    llm = LLM(EngineConfig(reranker=str(ce_dir), tpot_target_ms=None, max_num_batched_tokens=1024,
                           num_kv_blocks=64))
    server = ServerThread(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    try:
        url = server.add_http(server.server.config).url
        offline = llm.rerank(QUERY, [doc], RerankParams(max_windows=8), ranked=True)[0]
        with Client(server.address) as c:
            grpc_result = c.rerank(QUERY, [doc], max_windows=8)[0]
        with httpx.Client(base_url=url, timeout=600) as h:
            r = h.post("/v1/rerank", json={"query": QUERY, "documents": [doc], "max_chunks_per_doc": 8})
        assert r.status_code == 200, r.text
        http_result = r.json()["results"][0]
        for score, windows in ((offline.score, offline.windows), (grpc_result.score, grpc_result.windows),
                               (http_result["relevance_score"], http_result["windows"])):
            assert windows == len(ref) and abs(score - max(ref)) <= 1e-4, (score, windows, ref)
        cut = llm.rerank(QUERY, [doc], RerankParams(), ranked=True)[0]
        assert cut.windows == 1 and cut.truncated and abs(cut.score - ref[0]) <= 1e-4
    finally:
        server.close()


def test_cascade_reads_the_best_windows_cosine_and_scores_one_llm_pair_a_document(st):
    """Fusion and cascade window the embedder's rows (their cosine is the best window's); the LLM pair reads the
    document whole. With k = 1 the documents the LLM does not re-score keep 0.499 x (1 + cos) / 2, so the long
    document's score shows the cosine it was given."""
    from engine.rerank.cascade import BELOW

    llm = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="cascade", rerank_cascade_k=1,
                           tpot_target_ms=None, num_kv_blocks=256))
    records = []
    llm.engine.add_observer(records.append)
    doc = long_document(30)
    ref = st_dense_scores(st, doc)
    docs = ["How do bees make honey? Bees make honey from flower nectar.", doc]
    got = {r.index: r for r in llm.rerank(QUERY, docs, RerankParams(max_windows=8), ranked=True)}
    assert got[0].score >= 0.5 > got[1].score  # the short document is the dense top 1, re-scored by the LLM
    assert got[1].windows == len(ref) and abs(got[1].score - BELOW * max(ref)) <= 1e-4
    assert sum(r.rerank_pairs_scored for r in records) == 1
    cut = {r.index: r for r in llm.rerank(QUERY, docs, RerankParams(), ranked=True)}
    assert cut[1].windows == 1 and abs(cut[1].score - BELOW * ref[0]) <= 1e-4
