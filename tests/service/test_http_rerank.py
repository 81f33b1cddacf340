"""Rerank over the HTTP door: the `cohere` package's ClientV2 with base_url, Cohere v1 / Jina fields and TEI's
/rerank over plain httpx; the same scores as the gRPC Rerank for the same input."""
from __future__ import annotations

import cohere
import httpx
import pytest

from clients import Client
from tests.service.conftest import DOCUMENTS, GUARD_S, MAX_DOCUMENTS, QUERY


@pytest.fixture(scope="module")
def co(http_url):
    with cohere.ClientV2(base_url=http_url, api_key="unused") as c:
        yield c


def _grpc_scores(address: str, documents: list[str]) -> dict[int, float]:
    with Client(address) as c:
        results = c.rerank(QUERY, documents)
    assert results.mode == "fusion"  # the shared server's mode (conftest), and the response says so
    return {r.index: r.score for r in results}


def test_http_scores_equal_grpc_rerank(served, http_url, co, offline):
    _grpc_scores(served.address, DOCUMENTS)  # both doors then find the query's prefix cached
    grpc_scores = _grpc_scores(served.address, DOCUMENTS)
    r = co.rerank(model=str(served.core.info.model), query=QUERY, documents=DOCUMENTS)
    assert {x.index: x.relevance_score for x in r.results} == pytest.approx(grpc_scores, abs=1e-6)
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        tei_r = h.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS})
        v1_r = h.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert tei_r.headers["x-tandem-rerank-mode"] == v1_r.headers["x-tandem-rerank-mode"] == "fusion"
    tei, v1 = tei_r.json(), v1_r.json()
    assert {x["index"]: x["score"] for x in tei} == pytest.approx(grpc_scores, abs=1e-6)
    assert {x["index"]: x["relevance_score"] for x in v1["results"]} == pytest.approx(grpc_scores, abs=1e-6)
    assert [grpc_scores[i] for i in range(len(DOCUMENTS))] == pytest.approx(offline.scores, rel=1e-4)


def test_cohere_v2_client_top_n_sorted(co):
    r = co.rerank(model="", query=QUERY, documents=DOCUMENTS, top_n=2)
    assert len(r.results) == 2 and r.results[0].relevance_score >= r.results[1].relevance_score
    assert r.id and r.meta.billed_units.search_units == 1
    cut = co.rerank(model="", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=2)
    assert len(cut.results) == len(DOCUMENTS)


def test_v1_shape_with_jina_fields(http_url):
    docs = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]]
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        body = h.post("/v1/rerank", json={"model": "", "query": QUERY, "documents": docs, "top_n": 3}).json()
        quiet = h.post("/v2/rerank", json={"query": QUERY, "documents": docs}).json()
    results = body["results"]
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]  # v1 default
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    assert body["usage"]["total_tokens"] > 0 and body["model"]
    assert all("document" not in r for r in quiet["results"])  # v2 default: no documents


def test_tei_shape(http_url):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        r = h.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True, "truncate": True})
        assert r.status_code == 200
        items = r.json()
        assert sorted(x["index"] for x in items) == list(range(len(DOCUMENTS)))
        assert all(x["text"] == DOCUMENTS[x["index"]] for x in items)
        assert [x["score"] for x in items] == sorted((x["score"] for x in items), reverse=True)
        long = h.post("/rerank", json={"query": QUERY, "texts": ["word " * 9000]})  # truncate defaults to false
        assert long.status_code == 400 and long.json()["error_type"] == "Validation"
        raw = h.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True})
        assert raw.status_code == 400 and "raw_scores" in raw.json()["error"]


def test_cohere_errors(http_url):
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        cases = [({"documents": DOCUMENTS}, 400, "query is required"),
                 ({"query": "", "documents": DOCUMENTS}, 400, "query must be a non-empty string"),
                 ({"query": QUERY, "documents": ["d"] * (MAX_DOCUMENTS + 1)}, 400, "--max-documents"),
                 ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, 400, "top_n must be >= 1"),
                 ({"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["title"]}, 400, "rank_fields")]
        for body, status, text in cases:
            r = h.post("/v2/rerank", json=body)
            assert r.status_code == status and text in r.json()["message"], (body, r.text)


def test_an_over_long_document_is_refused_naming_each_apis_own_truncate(served, http_url):
    """A document too long with truncation off: each API's refusal says how to ask for the cut in its own spelling
    (TEI's `truncate` is a boolean: `truncate: true`, never another API's `truncate='end'`)."""
    long = ["word " * 9000]
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        tei = h.post("/rerank", json={"query": QUERY, "texts": long})  # TEI's default: truncate false
        cohere_ = h.post("/v2/rerank", json={"query": QUERY, "documents": long, "truncate": False})
    assert tei.status_code == 400 and tei.json()["error_type"] == "Validation"
    assert "over the rerank pair limit" in tei.json()["error"]
    assert "send truncate: true" in tei.json()["error"] and "'end'" not in tei.json()["error"]
    assert cohere_.status_code == 400 and "send truncate: true (or leave it out)" in cohere_.json()["message"]
    with Client(served.address) as c, pytest.raises(Exception) as refused:
        c.rerank(QUERY, long, truncate="none")
    assert "TRUNCATE_END" in refused.value.message and "truncate: true" not in refused.value.message
