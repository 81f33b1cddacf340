"""The encoder dtype the host serves by default (`--encoder-dtype auto`: bf16 on a CPU with native bf16, float32
elsewhere), and bf16 by name where that is not the host's default (so bf16 runs on any CPU), through both doors: the
default dense rerank (gRPC client, HTTP /v2/rerank) and embeddings (gRPC client, the `openai` SDK) against
sentence-transformers' float32 all-MiniLM-L6-v2, within docs/embeddings.md "Precision", and one text alone and in a
batch within the batching bound docs/embeddings.md states for that dtype."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from clients import Client
from engine import LLM, EngineConfig
from engine.config import EMBEDDED_EMBEDDER
from service.server import ServerConfig
from tests.engine.test_encoder_dtype import (BATCH_TEXTS, BATCHING_ATOL, DOCUMENTS, HOST_ENCODER_DTYPE, MIN_COSINE,
                                             QUERY, SCORE_ATOL)
from tests.service.harness import ServerThread

# the host's default first; bf16 by name too where the host's default is float32
DTYPES = [HOST_ENCODER_DTYPE] + (["bfloat16"] if HOST_ENCODER_DTYPE != "bfloat16" else [])


@pytest.fixture(scope="module", params=DTYPES)
def server(request):
    engine = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, encoder_dtype=request.param, num_kv_blocks=256)).engine
    assert engine.embedder.dtype == request.param
    s = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    s.http_url = s.add_http(s.server.config).url
    s.dtype = request.param
    yield s
    s.close()


@pytest.fixture(scope="module")
def st_vectors() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    from engine.embed.embedder import embedded_embedder_dir

    st = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    return st.encode([QUERY, *DOCUMENTS], normalize_embeddings=True)


def _order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def test_the_default_dense_rerank_in_bf16_through_both_doors(server, st_vectors) -> None:
    want = [(1 + float(st_vectors[0] @ v)) / 2 for v in st_vectors[1:]]
    with Client(server.address) as c:
        results = c.rerank(QUERY, DOCUMENTS)
    grpc_scores = dict((r.index, r.score) for r in results)
    with httpx.Client(base_url=server.http_url, timeout=600) as h:
        r = h.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS, "model": "any"})
    assert r.status_code == 200, r.text
    assert results.mode == r.headers["x-tandem-rerank-mode"] == "dense"  # the default with an embedder
    http_scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    for got in (grpc_scores, http_scores):
        assert [got[i] for i in range(len(DOCUMENTS))] == pytest.approx(want, abs=SCORE_ATOL)
    assert grpc_scores == pytest.approx(http_scores, abs=1e-6)  # one engine, one answer
    assert _order([grpc_scores[i] for i in range(len(DOCUMENTS))])[:2] == _order(want)[:2]  # the two bee answers


def test_embeddings_in_bf16_through_both_doors(server, st_vectors) -> None:
    texts = [QUERY, *DOCUMENTS]
    with Client(server.address) as c:
        grpc_vectors = np.asarray(c.embed(texts))
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused") as oa:
        http_vectors = np.asarray([d.embedding for d in oa.embeddings.create(model=EMBEDDED_EMBEDDER,
                                                                            input=texts).data])
    for got in (grpc_vectors, http_vectors):
        assert (got * st_vectors).sum(axis=1).min() >= MIN_COSINE
    assert np.abs(grpc_vectors - http_vectors).max() < 1e-6


def test_one_text_alone_and_in_a_batch_through_both_doors_within_the_dtypes_batching_bound(server) -> None:
    bound = BATCHING_ATOL[server.dtype]
    text = BATCH_TEXTS[0]
    with Client(server.address) as c:
        grpc_alone = np.asarray(c.embed([text])[0])
        grpc_packed = np.asarray(c.embed([*BATCH_TEXTS[1:], text])[-1])
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused") as oa:
        http_alone = np.asarray(oa.embeddings.create(model=EMBEDDED_EMBEDDER, input=[text]).data[0].embedding)
        http_packed = np.asarray(oa.embeddings.create(model=EMBEDDED_EMBEDDER,
                                                      input=[text, *BATCH_TEXTS[1:]]).data[0].embedding)
    for packed in (grpc_packed, http_alone, http_packed):
        assert np.abs(packed - grpc_alone).max() < bound
        assert float(packed @ grpc_alone) >= MIN_COSINE
