"""--max-documents bounds the documents of one rerank request, --max-embed-inputs the inputs of one embedding request,
each apart from the other: through both doors, a request over its own limit is refused naming its flag, while the same
count of the other kind, under that kind's limit, passes. (The shared server of conftest.py has the embedding limit the
larger; this one has it the smaller.)"""
from __future__ import annotations

import grpc
import httpx
import pytest

from engine import LLM, EngineConfig
from engine.config import EMBEDDED_EMBEDDER
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.service.harness import ServerThread
from tests.service.conftest import GUARD_S

MAX_DOCUMENTS, MAX_EMBED_INPUTS = 6, 3
N = MAX_EMBED_INPUTS + 1  # over the embedding limit, under the rerank one


@pytest.fixture(scope="module")
def served():
    # the default rerank mode beside an embedder (dense): documents are embedder rows, no LLM pair
    engine = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, num_kv_blocks=64, max_rerank_documents=MAX_DOCUMENTS,
                              max_embed_inputs=MAX_EMBED_INPUTS)).engine
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    server.http_url = server.add_http(server.server.config).url
    yield server
    server.close()


def test_http_an_embedding_over_max_embed_inputs_is_refused_naming_it_and_a_rerank_of_as_many_passes(served):
    with httpx.Client(base_url=served.http_url, timeout=GUARD_S) as h:
        refused = h.post("/v1/embeddings", json={"input": ["a"] * N})
        tei = h.post("/embed", json={"inputs": ["a"] * N})
        reranked = h.post("/v1/rerank", json={"query": "q", "documents": [f"d {i}" for i in range(N)]})
        at_limit = h.post("/v1/embeddings", json={"input": ["a"] * MAX_EMBED_INPUTS})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert f"input has {N} items" in message and f"at most {MAX_EMBED_INPUTS}" in message
    assert "--max-embed-inputs" in message and "--max-documents" not in message
    assert tei.status_code == 400 and "--max-embed-inputs" in tei.json()["error"], tei.text
    assert reranked.status_code == 200 and len(reranked.json()["results"]) == N, reranked.text
    assert at_limit.status_code == 200 and len(at_limit.json()["data"]) == MAX_EMBED_INPUTS


def test_grpc_an_embedding_over_max_embed_inputs_is_invalid_argument_and_a_rerank_of_as_many_passes(served):
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(texts=["a"] * N))
        reranked = stub.Rerank(pb.RerankRequest(query="q", documents=[f"d {i}" for i in range(N)]))
        limits = stub.ModelInfo(pb.ModelInfoRequest()).limits
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-embed-inputs" in err.value.details() and f"at most {MAX_EMBED_INPUTS}" in err.value.details()
    assert len(reranked.results) == N
    assert (limits.max_documents, limits.max_embed_inputs) == (MAX_DOCUMENTS, MAX_EMBED_INPUTS)


def test_the_engine_bounds_each_kind_by_its_own_limit(served):
    engine = served.bridge.engine
    with pytest.raises(ValueError, match="at most 3 per request .--max-embed-inputs"):
        engine.prepare_embed("e", ["a"] * N)
    assert len(engine.prepare_rerank("r", "q", ["d"] * N).documents) == N
    with pytest.raises(ValueError, match="at most 6 per request .--max-documents"):
        engine.prepare_rerank("r", "q", ["d"] * (MAX_DOCUMENTS + 1))
