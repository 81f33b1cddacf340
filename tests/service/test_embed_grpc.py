"""Embeddings over the gRPC door against a real server: Client.embed (sync and async) and `tandem embed` give the
offline engine's vectors, ModelInfo names the embedder, and bad input is refused with INVALID_ARGUMENT."""
from __future__ import annotations

import io
import json

import grpc
import numpy as np
import pytest

from clients import AsyncClient, Client
from clients.cli import run
from engine.config import EMBEDDED_EMBEDDER
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.cli import build_parser
from tests.service.conftest import DOCUMENTS, MAX_DOCUMENTS, MAX_EMBED_INPUTS


@pytest.fixture(scope="module")
def reference(offline) -> np.ndarray:
    return np.asarray(offline.llm.embed(DOCUMENTS), dtype=np.float32)


def test_client_embed_sync_and_async_equal_the_offline_vectors(served, reference):
    with Client(served.address) as c:
        vectors = c.embed(DOCUMENTS)
        one = c.embed(DOCUMENTS[0])
        raw = c.embed(DOCUMENTS[:1], normalize=False)
        info = c.model_info()
    assert np.abs(np.asarray(vectors) - reference).max() < 1e-6  # float32 on the wire, as computed
    assert np.abs(np.asarray(one[0]) - reference[0]).max() < 1e-6
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-3
    assert (info.embedder, info.embedding_dimensions, info.embedder_max_tokens) == (EMBEDDED_EMBEDDER, 384, 256)
    assert not info.embedder_matryoshka


async def test_async_client_embed(served, reference):
    async with AsyncClient(served.address) as c:
        vectors = await c.embed(DOCUMENTS)
    assert np.abs(np.asarray(vectors) - reference).max() < 1e-6


def test_the_cli_prints_one_vector_per_line(served, reference):
    out = io.StringIO()
    assert run(build_parser().parse_args(["embed", "--target", served.address, *DOCUMENTS[:2]]), out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and np.abs(np.asarray([json.loads(x) for x in lines]) - reference[:2]).max() < 1e-6


@pytest.mark.parametrize("request_, message", [
    (pb.EmbedRequest(), "input must not be empty"),
    (pb.EmbedRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[1])]), "either texts or token_ids"),
    (pb.EmbedRequest(texts=["a"] * (MAX_EMBED_INPUTS + 1)), "--max-embed-inputs"),
    (pb.EmbedRequest(texts=["a"], dimensions=8), "not trained for shortened vectors"),
    (pb.EmbedRequest(texts=[""]), "empty strings"),
    (pb.EmbedRequest(texts=[" ".join(DOCUMENTS * 12)], truncate=pb.TRUNCATE_NONE), "takes at most 256"),
])
def test_bad_input_is_invalid_argument(served, request_, message):
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.TandemStub(channel).Embed(request_)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_token_ids_over_grpc_are_the_models_exact_input(served, offline, reference):
    tok = offline.llm.engine.embedder.tokenizer
    ids = list(tok(DOCUMENTS[0]).input_ids)  # as the tokenizer returns them: [CLS] ... [SEP]
    with grpc.insecure_channel(served.address) as channel:
        r = pb_grpc.TandemStub(channel).Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=ids)]))
    assert np.abs(np.asarray(r.embeddings[0].values) - reference[0]).max() < 1e-6
    assert r.model == EMBEDDED_EMBEDDER and r.usage.prompt_tokens == len(ids)  # nothing added


def test_an_embedding_of_more_inputs_than_max_documents_passes_while_a_rerank_of_as_many_does_not(served):
    # --max-documents bounds rerank documents only; embedding inputs have --max-embed-inputs (here larger)
    n = MAX_DOCUMENTS + 1
    assert n <= MAX_EMBED_INPUTS
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        assert len(stub.Embed(pb.EmbedRequest(texts=["a"] * n)).embeddings) == n
        with pytest.raises(grpc.RpcError) as err:
            stub.Rerank(pb.RerankRequest(query="q", documents=["d"] * n))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "--max-documents" in err.value.details()
