"""The dense and cascade rerank modes through both doors (the gRPC client, HTTP /v1/rerank): dense ranks as
sentence-transformers' cosine of all-MiniLM-L6-v2 does; the cascade has the LLM score only k pairs (the engine's step
records count them) and keeps the other documents in dense order; each response names the mode that scored it."""
from __future__ import annotations

import io
import json
import logging

import grpc
import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from engine import LLM, EngineConfig
from engine.config import EMBEDDED_EMBEDDER
from engine.embed.embedder import embedded_embedder_dir
from engine.rerank.cascade import top_k
from service import cli
from service.access_log import AccessLog
from service.metrics import Metrics
from service.server import ServerConfig
from tests.service.harness import ServerThread

K = 3
QUERY = "How do bees make honey?"
DOCUMENTS = ["Bees collect nectar from flowers and store it in their honey stomach.",
             "The stock market fell three percent on Tuesday.",
             "Worker bees fan their wings to evaporate water from nectar, turning it into honey.",
             "A recipe for tomato soup with basil.",
             "Honeybees live in colonies with a single queen.",
             "Beekeepers harvest honey from the frames of a hive in late summer.",
             "The train to Lyon leaves at nine."]


class Served:
    def __init__(self, mode: str) -> None:
        config = EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode=mode, rerank_cascade_k=K, num_kv_blocks=256)
        self.engine = LLM(config).engine
        self.records: list = []
        self.engine.add_observer(self.records.append)  # called on the engine thread, once per step
        self.server = ServerThread(self.engine, ServerConfig(host="127.0.0.1", port=0))
        self.metrics = Metrics()  # first, so it has counted a request by the time the recorder hears of it
        self.server.bridge.hooks.insert(0, self.metrics)
        self.http_url = self.server.add_http(self.server.server.config).url

    def pairs_scored(self) -> int:
        return sum(r.rerank_pairs_scored for r in list(self.records))


@pytest.fixture(scope="module", params=["dense", "cascade"])
def served_mode(request):
    s = Served(request.param)
    yield request.param, s
    s.server.close()


@pytest.fixture(scope="module")
def st_cosines() -> list[float]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    q, *d = st.encode([QUERY, *DOCUMENTS], normalize_embeddings=True)
    return [float(q @ v) for v in d]


def _dense_order(cosines: list[float]) -> list[int]:
    return sorted(range(len(cosines)), key=lambda i: (-cosines[i], i))


def _grpc(s: Served) -> tuple[list[tuple[int, float]], str]:
    with Client(s.server.address) as c:
        results = c.rerank(QUERY, DOCUMENTS)
    return [(r.index, r.score) for r in results], results.mode


def _http(s: Served) -> tuple[list[tuple[int, float]], str]:
    with httpx.Client(base_url=s.http_url, timeout=1800) as h:
        r = h.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    return [(x["index"], x["relevance_score"]) for x in r.json()["results"]], r.headers["x-tandem-rerank-mode"]


@pytest.mark.parametrize("door", [_grpc, _http], ids=["grpc", "http"])
def test_each_door_ranks_by_the_mode_and_says_which(served_mode, st_cosines, door):
    mode, s = served_mode
    before = s.pairs_scored()
    ranked, said = door(s)
    assert said == mode
    order = [i for i, _ in ranked]
    dense = _dense_order(st_cosines)
    if mode == "dense":  # the embedder's own cosine ranking, and its cosine in the score, with no LLM pair
        assert order == dense
        assert dict(ranked) == pytest.approx({i: (1 + c) / 2 for i, c in enumerate(st_cosines)}, abs=1e-5)
        assert s.pairs_scored() == before
    else:  # the LLM re-scored the dense top k only; the rest follow in dense order, below them
        assert s.pairs_scored() - before == K  # records are emitted inside the step, before its outputs leave
        assert set(order[:K]) == set(top_k(st_cosines, K))
        assert order[K:] == [i for i in dense if i not in order[:K]]
        assert min(score for _, score in ranked[:K]) > max(score for _, score in ranked[K:])


class _Counting:
    """Wraps a tokenizer: records every text it is called on (one call may take a batch)."""

    def __init__(self, inner) -> None:
        self.inner, self.texts = inner, []

    def __call__(self, text, *args, **kw):
        self.texts.extend([text] if isinstance(text, str) else list(text))
        return self.inner(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def times(self, document: str) -> int:
        """Calls on the document or on a cut of it."""
        return sum(1 for t in self.texts if t.strip() and document.startswith(t.strip()))


def test_max_tokens_per_doc_tokenizes_each_document_once_per_model(served_mode):
    """Cohere's max_tokens_per_doc cuts each document where the engine tokenizes it anyway: once by the LLM's
    tokenizer (a cascade's pairs) and once by the embedder's, never first in the service and again in the engine."""
    mode, s = served_mode
    core, scorer, embedder = s.server.core, s.engine.scorer, s.engine.embedder
    saved = core._tokenizer, getattr(scorer, "tokenizer", None), embedder.tokenizer
    llm_tok, emb_tok = _Counting(saved[0]), _Counting(saved[2])
    core._tokenizer = llm_tok
    if saved[1] is not None:
        scorer.tokenizer = llm_tok
    embedder.tokenizer = emb_tok
    try:
        with httpx.Client(base_url=s.http_url, timeout=1800) as h:
            r = h.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS, "max_tokens_per_doc": 5})
    finally:
        core._tokenizer, embedder.tokenizer = saved[0], saved[2]
        if saved[1] is not None:
            scorer.tokenizer = saved[1]
    assert r.status_code == 200, r.text
    assert [emb_tok.times(d) for d in DOCUMENTS] == [1] * len(DOCUMENTS)
    assert [llm_tok.times(d) for d in DOCUMENTS] == [1 if mode == "cascade" else 0] * len(DOCUMENTS)


def _pairs_counted(s: Served) -> float:
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(s.metrics.registry).decode())}
    return sum(x.value for x in families["tandem_rerank_pairs"].samples if x.name.endswith("_total"))


def test_every_report_names_the_model_mode_and_dtype_that_scored(served_mode, caplog):
    """The dense mode is the embedder's work (the cascade's the embedder's, then the LLM's): TEI /info, `tandem info`,
    the rerank responses and the access log say so, with the dtype the embedder really ran in, and
    tandem_rerank_pairs counts every document scored, the embedder's too (it stayed 0 under dense)."""
    mode, s = served_mode
    embedder = s.engine.embedder.dtype  # --encoder-dtype auto as resolved here (bfloat16 on a CPU with native bf16)
    name = {"dense": EMBEDDED_EMBEDDER, "cascade": f"{EMBEDDED_EMBEDDER}+SmolLM2-135M-Instruct"}[mode]
    dtype = {"dense": embedder, "cascade": " + ".join(dict.fromkeys([embedder, "float32"]))}[mode]
    before = _pairs_counted(s)
    with httpx.Client(base_url=s.http_url, timeout=1800) as h:
        info = h.get("/info").json()
        cohere = h.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        tei = h.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS[:3]})
    assert (info["model_id"], info["model_dtype"], info["rerank_mode"]) == (name, dtype, mode)
    assert cohere.status_code == 200 and cohere.json()["model"] == name
    assert tei.status_code == 200

    out = io.StringIO()
    assert cli.client_cli.run(cli.build_parser().parse_args(["info", "--target", s.server.address]), out) == 0
    said = json.loads(out.getvalue())
    assert said["rerankMode"] == mode and said["reranker"] != "llm"
    assert said["reranker"] == {"dense": EMBEDDED_EMBEDDER,
                                "cascade": f"{EMBEDDED_EMBEDDER} + SmolLM2-135M-Instruct (embedded)"}[mode]
    assert said["rerankDtype"] == dtype and said["embedderDtype"] == embedder

    reranks = s.server.recorder.wait_finished(lambda lc: lc.kind == "rerank" and lc.metadata.get("route") == "/rerank")
    log = logging.getLogger("test.access")
    with caplog.at_level(logging.INFO, logger="test.access"):
        AccessLog("SmolLM2-135M-Instruct", log).on_finish(reranks[-1])
    assert f" model={name} " in caplog.records[-1].getMessage()
    assert _pairs_counted(s) - before == len(DOCUMENTS) + 3


def test_each_surface_names_the_model_that_scored_whatever_the_request_named(served_mode, caplog):
    """/v1/models and gRPC ModelInfo list the embedder as a reranker (it scores in both modes) and the LLM as one only
    where it scores (the cascade); a rerank naming the embedder is served, one naming the LLM too (as before issue
    72, when /v1/models listed the LLM as the reranker), and the responses of both doors, the access log and the
    request's span name the model that scored, not the name given (issue 72: a rerank naming the embedder was
    refused, and one naming the LLM was reported as the LLM's in the dense mode)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from proto import tandem_pb2 as pb
    from proto import tandem_pb2_grpc as pb_grpc
    from service.tracing import TracingHooks, tracer_provider_from_env

    mode, s = served_mode
    llm = s.server.core.info.model
    scorer = {"dense": EMBEDDED_EMBEDDER, "cascade": f"{EMBEDDED_EMBEDDER}+{llm}"}[mode]
    with httpx.Client(base_url=s.http_url, timeout=1800) as h:
        cards = {m["id"]: m["capabilities"] for m in h.get("/v1/models").json()["data"]}
        assert cards == {llm: ["generate", "rerank"] if mode == "cascade" else ["generate"],
                         EMBEDDED_EMBEDDER: ["embed", "rerank"]}
        for named in (EMBEDDED_EMBEDDER, llm, "rerank-english-v3.0", ""):
            r = h.post("/v2/rerank", json={"model": named, "query": QUERY, "documents": DOCUMENTS[:2]})
            assert r.status_code == 200 and r.json()["model"] == scorer, (named, r.text)
        # a chat may not name the embedder: 400 in OpenAI's shape naming the model that generates
        chat = h.post("/v1/chat/completions", json={"model": EMBEDDED_EMBEDDER, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 400 and repr(llm) in chat.json()["error"]["message"], chat.text

    with grpc.insecure_channel(s.server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        ranked = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS[:2], model=llm))
        listed = {m.name: list(m.tasks) for m in stub.ModelInfo(pb.ModelInfoRequest()).models}
    assert ranked.model == scorer and listed == cards

    named_llm = s.server.recorder.wait_finished(
        lambda lc: lc.kind == "rerank" and lc.metadata.get("door") == "http" and lc.metadata.get("requested_model") == llm)
    log = logging.getLogger("test.access")
    with caplog.at_level(logging.INFO, logger="test.access"):
        AccessLog(llm, log).on_finish(named_llm[-1])
    assert f" model={scorer} requested={llm} " in caplog.records[-1].getMessage()
    exporter = InMemorySpanExporter()
    tracing = TracingHooks(tracer_provider_from_env(exporter))
    tracing.on_arrival(named_llm[-1])
    tracing.on_finish(named_llm[-1])
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert (span.attributes["tandem.model"], span.attributes["tandem.model.requested"]) == (scorer, llm)


def test_strict_names_refuse_a_rerank_naming_a_model_that_does_not_score(served_mode, monkeypatch):
    """--strict-model-names: a rerank naming the LLM where the LLM does not score (dense) is a 400 naming the models
    that rerank, and an unknown name a 404 naming them; where the LLM scores (the cascade) it is served."""
    mode, s = served_mode
    monkeypatch.setattr(s.server.core, "_strict", True)
    llm = s.server.core.info.model
    with httpx.Client(base_url=s.http_url, timeout=1800) as h:
        named_llm = h.post("/v2/rerank", json={"model": llm, "query": QUERY, "documents": DOCUMENTS[:2]})
        other = h.post("/v1/rerank", json={"model": "rerank-english-v3.0", "query": QUERY,
                                            "documents": DOCUMENTS[:2]})
    if mode == "dense":
        assert named_llm.status_code == 400 and "does not rerank" in named_llm.json()["message"], named_llm.text
        assert repr(EMBEDDED_EMBEDDER) in named_llm.json()["message"]
    else:
        assert named_llm.status_code == 200, named_llm.text
    assert other.status_code == 404 and EMBEDDED_EMBEDDER in other.json()["message"], other.text
