"""The HTTP door's operator endpoints (/version, TEI /info, vLLM /tokenize and /detokenize, /openapi.json, /docs,
/healthz), its model ids, chat roles, JSON-only bodies and special tokens, against the shared SmolLM2 server."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.service.conftest import CHAT, DOCUMENTS, GUARD_S, QUERY

NAME = "SmolLM2-135M-Instruct"


@pytest.fixture
async def http(http_url):
    async with httpx.AsyncClient(base_url=http_url, timeout=120) as client:
        yield client


async def test_the_embedded_model_has_one_short_id_and_answers_to_it(http, served):
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [NAME, "all-MiniLM-L6-v2"]  # the LLM (and reranker), the embedder
    client = openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="x")
    out = await client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert out.model == NAME
    with pytest.raises(openai.NotFoundError, match=f"it serves \\['{NAME}'\\]"):
        await client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)


async def test_a_rerank_naming_another_model_is_scored_by_the_one_reranker(http, offline, served):
    body = {"model": "rerank-v3.5", "query": QUERY, "documents": DOCUMENTS}
    r = await http.post("/v2/rerank", json=body)
    # the response names what scored it (the shared server's fusion: the embedder and the LLM), not the name given
    assert r.status_code == 200 and r.json()["model"] == served.core.rerank_name == f"all-MiniLM-L6-v2+{NAME}"
    scores = sorted(((x["index"], x["relevance_score"]) for x in r.json()["results"]))
    assert [s for _, s in scores] == pytest.approx(offline.scores, abs=1e-5)


async def test_version_info_openapi_and_docs(http, served):
    assert (await http.get("/version")).json()["version"]
    info = (await http.get("/info")).json()
    # the shared server reranks by fusion: the embedder's cosine and the LLM's likelihood, each in its own dtype
    assert info["model_id"] == f"all-MiniLM-L6-v2+{NAME}" and "reranker" in info["model_type"]
    assert info["rerank_mode"] == "fusion"
    assert info["model_dtype"] == " + ".join(dict.fromkeys([served.core.info.embedder_dtype, "float32"]))
    assert info["max_client_batch_size"] == served.core.info.max_documents
    document = (await http.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v2/rerank", "/rerank", "/tokenize", "/info"):
        assert path in document["paths"], path
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "messages" in document["components"]["schemas"][chat["schema"]["$ref"].rsplit("/", 1)[-1]]["properties"]
    page = await http.get("/docs")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "text/html" in page.headers["content-type"]


async def test_tokenize_and_detokenize_as_the_tokenizer_does(http, offline):
    tokenizer = offline.llm.engine.tokenizer
    r = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert r["tokens"] == tokenizer("Hello world").input_ids and r["count"] == len(r["tokens"])
    chat = (await http.post("/tokenize", json={"messages": CHAT})).json()
    assert chat["tokens"] == offline.llm.engine.chat_token_ids(CHAT)
    text = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()["prompt"]
    assert text == tokenizer.decode(r["tokens"])
    bad = await http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens must be token ids" in bad.json()["error"]["message"]
    both = await http.post("/tokenize", json={"prompt": "x", "messages": CHAT})
    assert both.status_code == 400


async def test_a_body_that_is_not_json_is_415_and_no_content_type_reads_as_json(http):
    for content_type in ("text/plain", "application/xml", "multipart/form-data; boundary=x"):
        r = await http.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": content_type})
        assert r.status_code == 415 and "must be JSON" in r.json()["error"]["message"]
    # no Content-Type reads as JSON (a body that is not JSON is then a 400 saying where)
    r = await http.post("/tokenize", content=b"prompt=hi")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = await http.post("/rerank", content=b"query=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error_type"]  # TEI's own error shape
    r = await http.post("/tokenize", content=b'{"prompt": "hi"}')
    assert r.status_code == 200


async def test_health_paths_on_the_http_port(http):
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/healthz")).text == "SERVING\n"
    assert (await http.get("/ready")).text == "SERVING\n"


async def test_an_unknown_chat_role_is_400(http):
    r = await http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400
    assert "role must be one of system, user, assistant, tool, developer; got 'wizard'" in r.json()["error"]["message"]


async def test_special_tokens_stay_out_of_the_text_unless_asked_for(http, offline):
    eos = offline.llm.engine.tokenizer.eos_token
    body = {"messages": CHAT, "max_tokens": 64, "temperature": 0}
    plain = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    raw = (await http.post("/v1/chat/completions", json={**body, "skip_special_tokens": False})).json()["choices"][0]
    assert plain["finish_reason"] == raw["finish_reason"] == "stop"  # ended by EOS
    assert eos not in plain["message"]["content"]
    assert raw["message"]["content"] == plain["message"]["content"] + eos


async def test_each_refused_request_reaches_the_lifecycle_hooks_once_whichever_door(http, served):
    """What the access log writes a line from: refusals before admission, by the core API or by a door itself."""
    import grpc

    from proto import tandem_pb2 as pb
    from proto import tandem_pb2_grpc as pb_grpc

    refused = served.recorder.refused
    before = len(refused)
    r = await http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT})  # core: unknown model
    assert r.status_code == 404
    r = await http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})  # door
    assert r.status_code == 400
    r = await http.post("/v2/rerank", content=b"{}", headers={"content-type": "text/plain"})  # door: 415
    assert r.status_code == 415
    async with grpc.aio.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            # core: the chat model's name does not embed (too many documents is the engine's, after admission)
            await pb_grpc.TandemStub(channel).Embed(pb.EmbedRequest(texts=["a"], model=served.core.info.model))
    new = refused[before:]
    got = [(lc.metadata.get("door"), lc.metadata.get("route", lc.kind), lc.metadata.get("status", lc.error))
           for lc in new]
    assert got == [("http", "/v1/chat/completions", "NOT_FOUND"), ("http", "/v1/chat/completions", "400"),
                   ("http", "/v2/rerank", "415"), ("grpc", "embed", "INVALID_ARGUMENT")]
    assert all(lc.finish_reason == "rejected" for lc in new)


def test_one_request_id_names_an_http_request_in_its_response_the_engine_and_the_spans(served, http_url):
    """The core mints one id per request; the HTTP responses' ids are it (chatcmpl-<id>, a rerank's id), and so are
    the engine's request id and the lifecycle the spans and step links read. No id of the door's own."""
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        chat = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        rerank = h.post("/v2/rerank", json={"query": "bees", "documents": ["honey", "stone"]})
    assert chat.status_code == 200 and rerank.status_code == 200, (chat.text, rerank.text)
    chat_id = chat.json()["id"].removeprefix("chatcmpl-")
    (generated,) = served.recorder.wait_finished(lambda lc: lc.engine_id == chat_id)
    (reranked,) = served.recorder.wait_finished(lambda lc: lc.engine_id == rerank.json()["id"])
    assert (generated.kind, generated.client_id) == ("generate", "")
    assert (reranked.kind, reranked.client_id) == ("rerank", "")
    assert chat_id != rerank.json()["id"]
