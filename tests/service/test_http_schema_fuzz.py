"""schemathesis against the HTTP door's own OpenAPI description (GET /openapi.json), every route, on a live server
over the tiny model: bodies generated from the request schemas (valid and invalid), and every answer is below 500
and, when an error, in its API's error shape. Afterwards a normal chat is served and no request is left in the
engine. `make test` runs a bounded number of examples per route; `make soak` (TANDEM_SCHEMA_FUZZ_EXAMPLES) more.
The strict-model-names switch is checked on the same server, which runs with it."""
from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings

from service.http.app import VERSION
from service.http.openapi import openapi_document
from service.server import ServerConfig
from tests.engine.test_classify_sparse import tiny_classifier, tiny_splade
from tests.reliability.grammars import GRAMMARS
from tests.reliability.tiny import make_tiny_model_dir, tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

EXAMPLES = int(os.environ.get("TANDEM_SCHEMA_FUZZ_EXAMPLES", "25"))
SHAPES = {"openai": lambda b: set(b) == {"error"} and {"message", "type"} <= set(b["error"]),
          "cohere": lambda b: set(b) == {"message"},
          "tei": lambda b: set(b) == {"error", "error_type"}}


def _shape(path: str) -> str:
    """The error shape the description gives the route (its 400's schema: `#/components/schemas/<shape>_error`)."""
    operation = next(iter(DOCUMENT["paths"][path].values()))
    return operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1][:-6]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # Its own tiny model and server (not the shared SmolLM2 one): thousands of generated requests, cheaply. It lives
    # here rather than in tests/reliability so the soak there measures its resident memory before this module's
    # hypothesis and schemathesis state is in the process (it left a one-time step of 10-18 MiB in the soak's RSS).
    # With a tiny classifier and a tiny SPLADE model, so /predict, /classify and /embed_sparse are fuzzed down to
    # their encoders, not only to the refusal a server without them answers.
    base = tmp_path_factory.mktemp("tiny-fuzz")
    tiny_classifier(base / "clf")
    tiny_splade(base / "sp")
    engine = tiny_engine(make_tiny_model_dir(base / "llm"), num_kv_blocks=256, block_size=16,
                         max_num_batched_tokens=256, max_num_seqs=32, max_model_len=96, max_rerank_documents=16,
                         classifier=str(base / "clf"), sparse_embedder=str(base / "sp"))
    config = ServerConfig(host="127.0.0.1", port=0, max_message_bytes=64 * 1024,
                          served_model_names=("tiny",), strict_model_names=True)
    server = ServerThread(engine, config, max_waiting=512)
    http = server.add_http(config)
    yield server, http
    server.close()


DOCUMENT = openapi_document(VERSION)
OPERATIONS = {op.label: op for op in (result.ok() for result in
                                      schemathesis.openapi.from_dict(DOCUMENT).get_all_operations())}


def test_the_served_description_is_the_one_fuzzed(live):
    _, http = live
    assert httpx.get(http.url + "/openapi.json").json() == DOCUMENT


# Valid bodies for every route; bodies that break the schema (wrong types, missing fields) where there is a body.
CASES = [(label, GenerationMode.POSITIVE) for label in sorted(OPERATIONS)] + \
    [(label, GenerationMode.NEGATIVE) for label in sorted(OPERATIONS) if OPERATIONS[label].method == "post"]


@pytest.mark.parametrize("label, mode", CASES, ids=[f"{label} {mode.value}" for label, mode in CASES])
def test_every_route_answers_below_500_in_its_own_error_shape(label, mode, live):
    _, http = live
    operation = OPERATIONS[label]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=http.url, timeout=120)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
        if response.status_code >= 400:
            body = json.loads(response.text)
            assert SHAPES[_shape(case.path)](body), (case.path, response.status_code, body)

    run()


def _grammar_bodies() -> list[tuple[str, dict]]:
    """Explicit examples next to the generated ones: the hostile schemas and regexes (tests/reliability/grammars.py)
    in every place the HTTP door takes one, and a stop token's text as a choice."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 8}
    bodies = []
    for text in GRAMMARS["json_schema"]:
        schema = json.loads(text)
        bodies += [
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": schema}}}),
            ("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": schema}}]}),
            ("/v1/completions", {**completion, "structured_outputs": {"json": schema}}),
            ("/v1/completions", {**completion, "guided_json": text}),
        ]
    for regex in GRAMMARS["regex"]:
        bodies += [("/v1/completions", {**completion, "structured_outputs": {"regex": regex}}),
                   ("/v1/chat/completions", {**chat, "guided_regex": regex, "stream": True})]
    bodies += [("/v1/completions", {**completion, "structured_outputs": {"choice": ["<|im_end|>", "yes"]}}),
               ("/v1/completions", {**completion, "structured_outputs": {"choice": ["<|im_end|>"]}})]
    return bodies


GRAMMAR_BODIES = _grammar_bodies()


@pytest.mark.parametrize("path, body", GRAMMAR_BODIES, ids=[f"{i} {p}" for i, (p, _) in enumerate(GRAMMAR_BODIES)])
def test_hostile_schemas_and_regexes_are_served_or_refused_never_5xx(live, path, body):
    _, http = live
    response = httpx.post(http.url + path, json=body, timeout=120)
    assert response.status_code in (200, 400), (path, body, response.text[:300])
    if response.status_code == 400:
        assert SHAPES["openai"](response.json()), response.text[:300]
    elif body.get("stream"):
        assert "data: [DONE]" in response.text and '"error"' not in response.text, response.text[-300:]


def test_strict_model_names_refuse_a_rerank_naming_another_model(live):
    _, http = live
    r = httpx.post(http.url + "/v2/rerank", json={"model": "rerank-v3.5", "query": "q", "documents": ["a"]})
    assert r.status_code == 404 and "it serves ['tiny']" in r.json()["message"]
    r = httpx.post(http.url + "/v2/rerank", json={"model": "tiny", "query": "q", "documents": ["a"]})
    assert r.status_code == 200


async def test_afterwards_a_chat_is_served_and_nothing_is_left(live):
    server, http = live
    async with httpx.AsyncClient(base_url=http.url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert_all_blocks_free(await server.idle_stats())
