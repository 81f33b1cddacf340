"""The HTTP door's OpenAPI 3.1 description (GET /openapi.json) and a Swagger UI page for it (GET /docs).

The request schemas are the pydantic models the routes parse with (so the description cannot drift from what is
accepted); responses name their status codes and each API's error body. The routes stay Starlette's (not FastAPI's):
they parse bodies strictly into each API's own error shape (OpenAI, Cohere, TEI), where FastAPI's automatic
validation answers 422 in its own shape; only the description is generated. /docs is a plain page rendered here
from the same description (no script, nothing fetched from elsewhere: it works offline); any OpenAPI viewer reads
/openapi.json for more.
"""
from __future__ import annotations

import html

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service import kinds
from service.http import embed_schema, openai_schema, rerank_schema, tokens_schema
from service.http.kind_routes import kind_routes

_REF = "#/components/schemas/{model}"
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_COHERE_ERROR = {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}
_TEI_ERROR = {"type": "object", "required": ["error", "error_type"],
              "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}
ERROR_SHAPES = {"openai": _OPENAI_ERROR, "cohere": _COHERE_ERROR, "tei": _TEI_ERROR}

# (path, method, request model or None, error shape, summary)
_POSTS: list[tuple[str, type[BaseModel], str, str]] = [
    ("/v1/chat/completions", openai_schema.ChatRequest, "openai", "OpenAI chat completion (SSE with stream)"),
    ("/v1/completions", openai_schema.CompletionRequest, "openai", "OpenAI completion (SSE with stream)"),
    ("/v1/rerank", rerank_schema.CohereRerank, "cohere", "Cohere v1 / Jina rerank"),
    ("/v2/rerank", rerank_schema.CohereRerank, "cohere", "Cohere v2 rerank"),
    ("/rerank", rerank_schema.TeiRerank, "tei", "TEI rerank"),
    ("/v1/embeddings", embed_schema.OpenAIEmbed, "openai", "OpenAI embeddings"),
    ("/embed", embed_schema.TeiEmbed, "tei", "TEI embed"),
    ("/embed_all", embed_schema.TeiEmbedAll, "tei", "TEI embed_all: every token's hidden state, no pooling"),
    ("/v2/embed", embed_schema.CohereEmbed, "cohere", "Cohere v2 embed"),
    ("/tokenize", tokens_schema.TokenizeRequest, "openai", "vLLM: a prompt's or chat's token ids"),
    ("/detokenize", tokens_schema.DetokenizeRequest, "openai", "vLLM: token ids to text"),
]
# Each pooled kind's routes (classification, sparse embeddings), read from service/kinds.py and its door schema's
# ROUTES, as the door registers them: answered on every server (a 400 naming the flag when its model is not loaded).
_POSTS += [(path, route.body, route.shape.value, f"{kind.task.value}: {kind.flag} serves it")
           for kind in kinds.pooled() for path, route in kind_routes(kind).items()]
_GETS: list[tuple[str, str, str]] = [
    ("/v1/models", "openai", "OpenAI: the served models"),
    ("/version", "openai", "tandem's version"),
    ("/info", "tei", "TEI: what is served and its limits"),
    ("/health", "openai", "liveness: 200 while the process serves HTTP"),
    ("/healthz", "openai", "readiness: 200 SERVING, 503 while draining"),
    ("/ready", "openai", "readiness: 200 SERVING, 503 while draining"),
    ("/metrics", "openai", "Prometheus metrics"),
]
_ERRORS = {"400": "bad input", "401": "missing or wrong bearer token", "403": "token not scoped for this route",
           "404": "no such model", "409": "conflict", "413": "body too large", "415": "body is not JSON",
           "429": "server at capacity (--max-waiting)", "499": "client went away",
           "503": "draining", "504": "x-tandem-timeout-ms passed"}


def _responses(shape: str) -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}_error"}}}}
    out = {"200": {"description": "OK"}}
    out.update({code: {"description": why, **error} for code, why in _ERRORS.items()})
    return out


def openapi_document(version: str) -> dict:
    models = list(dict.fromkeys(model for _, model, _, _ in _POSTS))
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = dict(definitions.get("$defs", {}))
    schemas.update({f"{shape}_error": body for shape, body in ERROR_SHAPES.items()})
    paths: dict[str, dict] = {}
    for path, model, shape, summary in _POSTS:
        paths[path] = {"post": {
            "summary": summary, "operationId": "post" + path.replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}},
            "responses": _responses(shape)}}
    for path, shape, summary in _GETS:
        paths[path] = {"get": {"summary": summary, "operationId": "get" + path.replace("/", "_"),
                               "responses": _responses(shape)}}
    return {"openapi": "3.1.0", "info": {"title": "tandem", "version": version,
                                         "description": "OpenAI, Cohere/Jina, TEI and vLLM-shaped routes over one "
                                                        "engine (docs/http.md)"},
            "paths": paths, "components": {"schemas": schemas}}


def docs_page(document: dict) -> str:
    """The routes of `document`, one row each, as a small HTML page."""
    rows = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            schema = body.get("$ref", "").rsplit("/", 1)[-1]
            rows.append(f"<tr><td>{method.upper()}</td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(op.get('summary', ''))}</td><td>{html.escape(schema)}</td></tr>")
    info = document["info"]
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(info['title'])} HTTP API</title>"
            f"</head><body><h1>{html.escape(info['title'])} {html.escape(info['version'])}</h1>"
            f"<p>{html.escape(info['description'])}. The full description: <a href=\"/openapi.json\">/openapi.json"
            "</a>.</p><table><tr><th>method</th><th>path</th><th>what</th><th>body schema</th></tr>"
            + "".join(rows) + "</table></body></html>")
