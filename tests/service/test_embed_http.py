"""Embeddings over the HTTP door against a real server: the `openai` SDK (base64 by default) and plain float, TEI's
/embed, the `cohere` SDK's embed (float and int8); the same vectors as the offline engine; every bad input in each
API's own error shape; /v1/models lists the embedder; a request cancelled or timed out mid-flight frees everything."""
from __future__ import annotations

import asyncio
import dataclasses

import cohere
import grpc
import httpx
import numpy as np
import openai
import pytest

from engine.config import EMBEDDED_EMBEDDER, EmbedParams
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.core import EmbedInput
from tests.service.conftest import DOCUMENTS, GUARD_S, MAX_DOCUMENTS, MAX_EMBED_INPUTS
from tests.service.harness import assert_all_blocks_free

LONG = " ".join(DOCUMENTS * 12)  # over all-MiniLM-L6-v2's 256 tokens
# What docs/embeddings.md promises for one input in differently packed steps: equal to 1e-5 per component.
BATCHING_ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(offline) -> np.ndarray:
    return np.asarray(offline.llm.embed(DOCUMENTS + [LONG]), dtype=np.float32)


@pytest.fixture(scope="module")
def oa(http_url):
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused") as c:
        yield c


def test_openai_sdk_base64_and_float_equal_the_offline_vectors(oa, reference):
    default = oa.embeddings.create(model=EMBEDDED_EMBEDDER, input=DOCUMENTS + [LONG])  # the SDK asks for base64
    floats = oa.embeddings.create(model="", input=DOCUMENTS, encoding_format="float")
    got = np.asarray([d.embedding for d in default.data], dtype=np.float32)
    assert np.abs(got - reference).max() < 1e-5
    assert np.abs(np.asarray([d.embedding for d in floats.data]) - reference[:len(DOCUMENTS)]).max() < 1e-5
    assert [d.index for d in default.data] == list(range(len(DOCUMENTS) + 1))
    assert default.model == EMBEDDED_EMBEDDER and default.usage.prompt_tokens == default.usage.total_tokens > 256


def test_openai_token_id_inputs_are_the_models_exact_input(oa, offline, reference):
    """The ids a tokenizer returns by default ([CLS] ... [SEP]) are taken as given, as vLLM takes them: the same
    vector as the text's (sentence-transformers'), with nothing added again."""
    tok = offline.llm.engine.embedder.tokenizer
    ids = [list(tok(d).input_ids) for d in DOCUMENTS[:2]]
    assert ids[0][0] == tok.cls_token_id and ids[0][-1] == tok.sep_token_id
    many = oa.embeddings.create(model="", input=ids, encoding_format="float")
    one = oa.embeddings.create(model="", input=ids[0], encoding_format="float")
    assert np.abs(np.asarray([d.embedding for d in many.data]) - reference[:2]).max() < 1e-5
    assert np.abs(np.asarray(one.data[0].embedding) - reference[0]).max() < 1e-5
    assert one.usage.prompt_tokens == len(ids[0])  # exactly the ids given


def test_models_lists_the_embedder_as_its_own_model(oa, served):
    ids = [m.id for m in oa.models.list().data]
    assert EMBEDDED_EMBEDDER in ids and served.core.info.model in ids
    card = oa.models.retrieve(EMBEDDED_EMBEDDER)
    assert card.id == EMBEDDED_EMBEDDER and card.max_model_len == 256  # the embedder's own input limit
    assert served.core.info.embedding_dimensions == 384


def test_tei_embed_and_cohere_embed(http_url, reference):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        tei = h.post("/embed", json={"inputs": DOCUMENTS}).json()
        single = h.post("/embed", json={"inputs": DOCUMENTS[0]}).json()
        raw = h.post("/embed", json={"inputs": DOCUMENTS[:1], "normalize": False}).json()
        left = h.post("/embed", json={"inputs": [LONG], "truncate": True, "truncation_direction": "Left"}).json()
    assert np.abs(np.asarray(tei) - reference[:len(DOCUMENTS)]).max() < 1e-5
    assert np.abs(np.asarray(single[0]) - reference[0]).max() < 1e-5
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # mean pooling is not unit length before normalisation
    assert np.abs(np.asarray(raw[0]) / np.linalg.norm(raw[0]) - reference[0]).max() < 1e-5
    assert np.abs(np.asarray(left[0]) - reference[-1]).max() > 1e-3  # the other end of the text
    with cohere.ClientV2(base_url=http_url, api_key="unused") as co:
        r = co.embed(texts=DOCUMENTS, model=EMBEDDED_EMBEDDER, input_type="search_document",
                     embedding_types=["float", "int8"])
    assert np.abs(np.asarray(r.embeddings.float_) - reference[:len(DOCUMENTS)]).max() < 1e-5
    assert np.array_equal(np.asarray(r.embeddings.int8), np.rint(reference[:len(DOCUMENTS)] * 127))


def test_another_tokenizers_ids_are_refused_naming_langchains_flag(oa):
    """LangChain's OpenAIEmbeddings sends tiktoken's ids (a 100k vocabulary) through the openai SDK unless given
    check_embedding_ctx_length=False: ids outside all-MiniLM-L6-v2's 30522 are a 400 that names the flag, never a
    vector of the wrong ids."""
    foreign = [[9906, 1917, 11, 1268, 656, 40016, 1304, 26828, 30, 100257]]
    with pytest.raises(openai.BadRequestError) as refused:
        oa.embeddings.create(model=EMBEDDED_EMBEDDER, input=foreign)
    error = refused.value.body
    assert error["type"] == "invalid_request_error"
    assert "check_embedding_ctx_length=False" in error["message"] and "token id 40016" in error["message"]
    assert "[0, 30522)" in error["message"]


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input must not be empty"),
    ({"input": ""}, "empty strings"),
    ({"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, "--max-embed-inputs"),
    ({"input": "a", "dimensions": 8}, "not trained for shortened vectors"),
    ({"input": [[10 ** 9]]}, "outside the embedder all-MiniLM-L6-v2's vocabulary [0, 30522)"),
    ({"input": LONG, "truncate": False}, "takes at most 256"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
])
def test_openai_bad_inputs_get_openai_errors(http_url, body, message):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        r = h.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


def test_tei_and_cohere_bad_inputs_get_their_own_error_shapes(http_url):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        too_long = h.post("/embed", json={"inputs": [LONG]})  # TEI's default: no truncation
        prompt = h.post("/embed", json={"inputs": ["a"], "prompt_name": "query"})
        empty = h.post("/embed", json={"inputs": []})
        cohere_type = h.post("/v2/embed", json={"texts": ["a"], "embedding_types": ["binary"]})
        cohere_many = h.post("/v2/embed", json={"texts": ["a"] * (MAX_EMBED_INPUTS + 1)})
        cohere_none = h.post("/v2/embed", json={"texts": [LONG], "truncate": "NONE"})
    assert "send truncate: true to cut it" in too_long.json()["error"]  # TEI's own spelling (a boolean)
    assert 'send truncate: "END"' in cohere_none.json()["message"]  # Cohere's
    for r, message in ((too_long, "takes at most 256"), (prompt, "prompt_name"), (empty, "must not be empty")):
        assert r.status_code == 400 and message in r.json()["error"], r.text
        assert r.json()["error_type"] == "Validation"
    for r, message in ((cohere_type, "binary"), (cohere_many, "--max-embed-inputs"), (cohere_none, "at most 256")):
        assert r.status_code == 400 and message in r.json()["message"], r.text


def test_an_unknown_model_is_embedded_by_the_one_embedder_unless_names_are_strict(http_url, served):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        r = h.post("/v1/embeddings", json={"input": "a", "model": "text-embedding-3-small"})
    assert r.status_code == 200 and r.json()["model"] == EMBEDDED_EMBEDDER  # the model that embedded it


async def test_an_embed_timed_out_mid_flight_frees_everything(served, http_url):
    """A 1 ms deadline on a job of several steps: 504 whether the loop runs the timer before the job's result or
    after it (tests/service/test_bridge.py holds the loop to make the second order certain)."""
    async with httpx.AsyncClient(base_url=http_url, timeout=None) as client:
        r = await client.post("/v1/embeddings", json={"input": [LONG] * MAX_DOCUMENTS},
                              headers={"x-tandem-timeout-ms": "1"})
    assert r.status_code == 504 and "timeout_ms" in r.json()["error"]["message"], r.text
    assert_all_blocks_free(await served.idle_stats())


async def test_an_embed_cancelled_mid_flight_is_aborted_and_frees_everything(served):
    """Cancelled one loop turn after its submission: its rows (8 x 256 tokens) need several steps at a 512-token
    budget, and the abort reaches the engine right behind the job (the intake thread keeps their order), so the job
    is always still running when the abort lands."""
    async def cancel_after_submit() -> None:
        task = asyncio.create_task(served.core.embed(EmbedInput("embed-cancel-me", [LONG] * MAX_DOCUMENTS, EmbedParams()),
                                                     {}))
        await asyncio.sleep(0)  # the task runs up to its await: the job is submitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await served.acall(cancel_after_submit())
    assert_all_blocks_free(await served.idle_stats())
    assert [lc.finish_reason for lc in served.recorder.finished["embed-cancel-me"]] == ["abort"]


def test_tei_embed_all_is_sentence_transformers_token_embeddings(http_url):
    from sentence_transformers import SentenceTransformer

    from engine.embed import embedded_embedder_dir

    ref = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    theirs = ref.encode(DOCUMENTS[:2] + [LONG], output_value="token_embeddings")
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        ours = h.post("/embed_all", json={"inputs": DOCUMENTS[:2]}).json()
        single = h.post("/embed_all", json={"inputs": DOCUMENTS[0]}).json()
        cut = h.post("/embed_all", json={"inputs": [LONG], "truncate": True}).json()
        refused = h.post("/embed_all", json={"inputs": [LONG]})  # TEI's default: truncate false
        extra = h.post("/embed_all", json={"inputs": "a", "normalize": True})
    for mine, st in zip(ours + cut, theirs):
        assert np.asarray(mine).shape == tuple(st.shape)  # [tokens][384], [CLS] and [SEP] included
        assert np.abs(np.asarray(mine) - st.numpy()).max() < 1e-4
    # One input alone and the same input in a batch of two ride differently packed steps: equal to float rounding
    # (docs/embeddings.md states the tolerance; TEI and vLLM promise no bit-identity across batchings either).
    assert np.abs(np.asarray(single[0]) - np.asarray(ours[0])).max() < BATCHING_ATOL
    assert refused.status_code == 400 and "at most 256" in refused.json()["error"]
    assert refused.json()["error_type"] == "Validation"
    assert extra.status_code == 400 and "normalize" in extra.json()["error"]


def test_the_openapi_description_has_the_embedding_routes(http_url):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        paths = h.get("/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/embed", "/embed_all", "/v2/embed"} <= set(paths)


def test_a_server_without_an_embedder_says_so_through_each_door(served, http_url, monkeypatch):
    monkeypatch.setattr(served.core, "info", dataclasses.replace(served.core.info, embedder=""))
    monkeypatch.setattr(served.bridge.engine.intake, "poolers", {})  # the engine's intake is what refuses
    monkeypatch.setattr(served.bridge.engine.intake, "poolers", {})  # ... by the task's encoder, the embedder's none
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        openai_ = h.post("/v1/embeddings", json={"input": "a"})
        tei = h.post("/embed", json={"inputs": "a"})
    assert openai_.status_code == 400 and "--embedder" in openai_.json()["error"]["message"]
    assert tei.status_code == 400 and "--embedder" in tei.json()["error"]
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.TandemStub(channel).Embed(pb.EmbedRequest(texts=["a"]))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_strict_model_names_refuse_another_model_for_embeddings(served, http_url, monkeypatch):
    monkeypatch.setattr(served.core, "_strict", True)
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        other = h.post("/v1/embeddings", json={"input": "a", "model": "text-embedding-3-small"})
        own = h.post("/v1/embeddings", json={"input": "a", "model": EMBEDDED_EMBEDDER})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert own.status_code == 200


def test_an_embedding_of_more_inputs_than_max_documents_passes_while_a_rerank_of_as_many_does_not(http_url):
    # --max-documents bounds rerank documents only; embedding inputs have --max-embed-inputs (here larger)
    n = MAX_DOCUMENTS + 1
    assert n <= MAX_EMBED_INPUTS
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        embedded = h.post("/v1/embeddings", json={"input": ["a"] * n})
        reranked = h.post("/v1/rerank", json={"query": "q", "documents": ["d"] * n})
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == n, embedded.text
    assert reranked.status_code == 400 and "--max-documents" in reranked.text, reranked.text
