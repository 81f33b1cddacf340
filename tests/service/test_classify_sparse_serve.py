"""Classification and sparse embeddings served beside a streaming chat (tiny random models built in the tests): TEI
/predict (single and batch, raw_scores), vLLM /classify, TEI /embed_sparse and gRPC Classify / EmbedSparse answer
with what the engine computes; their rows ride the same steps as the chat's decodes; bad input is 400 /
INVALID_ARGUMENT, and a server without the model names the flag that loads it."""
from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
import torch

from engine import LLM, EmbedParams, EngineConfig
from engine.config import PoolingTask
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.engine.test_classify_sparse import PAIRS, TEXTS, splade_reference, tiny_classifier, tiny_splade
from tests.service.harness import ServerThread

MAX_INPUTS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("pooling_serve")
    (base / "clf").mkdir()
    (base / "splade").mkdir()
    refs = {"clf": tiny_classifier(base / "clf"), "splade": tiny_splade(base / "splade")}
    llm = LLM(EngineConfig(classifier=str(base / "clf"), sparse_embedder=str(base / "splade"), num_kv_blocks=256,
                           max_embed_inputs=MAX_INPUTS, max_num_batched_tokens=256))
    records, decoding = [], threading.Event()

    def observe(record) -> None:
        records.append(record)
        if record.decode_tokens:
            decoding.set()  # a chat decodes: the state the route test waits on

    llm.engine.add_observer(observe)
    server = ServerThread(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    door = server.add_http(server.server.config)
    yield {"url": door.url, "grpc": server.address, "refs": refs, "dirs": base, "records": records,
           "recorder": server.recorder, "decoding": decoding}
    server.close()


def _probs(setup, texts, raw=False):
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(str(setup["dirs"] / "clf"))(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = setup["refs"]["clf"](**enc).logits
    return logits if raw else logits.softmax(-1)


def _chat(url: str, done: threading.Event) -> None:
    body = {"prompt": "Tell me about bees.", "max_tokens": 96, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for _ in r.iter_lines():
            pass
    done.set()


def test_every_route_answers_beside_a_streaming_chat_in_the_same_steps(setup):
    url, records = setup["url"], setup["records"]
    done = threading.Event()
    chat = threading.Thread(target=_chat, args=(url, done))
    chat.start()
    try:
        assert setup["decoding"].wait(120)  # the chat decodes before the others arrive (a hang guard)
        start = len(records)
        batch = httpx.post(f"{url}/predict", json={"inputs": [[t] for t in TEXTS]}, timeout=60).json()
        single = httpx.post(f"{url}/predict", json={"inputs": TEXTS[0], "raw_scores": True}, timeout=60).json()
        vllm = httpx.post(f"{url}/classify", json={"model": "", "input": TEXTS}, timeout=60).json()
        sparse = httpx.post(f"{url}/embed_sparse", json={"inputs": TEXTS}, timeout=60).json()
        with grpc.insecure_channel(setup["grpc"]) as ch:
            stub = pb_grpc.TandemStub(ch)
            gclf = stub.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=60)
            gsparse = stub.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS), timeout=60)
        during = records[start:]
    finally:
        chat.join(120)
    probs = _probs(setup, TEXTS)
    labels = ["negative", "neutral", "positive"]
    for got, p in zip(batch, probs):  # TEI: every label, highest score first
        assert [x["score"] for x in got] == sorted((x["score"] for x in got), reverse=True)
        assert all(abs(x["score"] - p[labels.index(x["label"])].item()) <= 1e-5 for x in got)
    raw = _probs(setup, TEXTS[:1], raw=True)[0]
    assert all(abs(x["score"] - raw[labels.index(x["label"])].item()) <= 1e-5 for x in single)
    assert [d["index"] for d in vllm["data"]] == list(range(len(TEXTS)))
    assert all(d["num_classes"] == 3 and d["label"] == labels[int(p.argmax())] for d, p in zip(vllm["data"], probs))
    assert max(abs(a - b) for d, p in zip(vllm["data"], probs) for a, b in zip(d["probs"], p.tolist())) <= 1e-5
    assert vllm["usage"]["prompt_tokens"] > 0
    from transformers import AutoTokenizer

    ref = splade_reference(setup["refs"]["splade"], AutoTokenizer.from_pretrained(str(setup["dirs"] / "splade")),
                           TEXTS)
    for got, r in zip(sparse, ref):
        assert [x["index"] for x in got] == sorted(r)
        assert max(abs(x["value"] - r[x["index"]]) for x in got) <= 1e-5
    assert [[s.label for s in c.scores] for c in gclf.results] == [labels] * len(TEXTS)
    assert max(abs(s.score - p[i].item()) for c, p in zip(gclf.results, probs)
               for i, s in enumerate(c.scores)) <= 1e-5
    assert [list(e.indices) for e in gsparse.embeddings] == [x for x in ([x["index"] for x in g] for g in sparse)]
    # their rows ran in steps that also decoded the chat
    assert any(r.embed_rows and r.decode_tokens for r in during)
    assert done.is_set()


def _pair_probs(setup, pairs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup["dirs"] / "clf"))
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.inference_mode():
        return setup["refs"]["clf"](**enc).logits.softmax(-1)


def test_tei_predict_reads_inputs_as_tei_does_text_pairs_included(setup):
    """TEI's /predict grammar: a list of strings is ONE input, ["text"] or the pair ["text", "text_pair"] (answered
    with one list of labels); a list of lists is a batch of texts and pairs; three strings are refused. gRPC Classify
    takes `pairs`, the Python client (text, text_pair) tuples. Each pair is what transformers gives for
    tokenizer(text, text_pair)."""
    from clients import Client

    url, labels = setup["url"], ["negative", "neutral", "positive"]
    want = _pair_probs(setup, PAIRS)
    single = _probs(setup, TEXTS[:1])[0]

    def by_label(ranked):
        assert [x["score"] for x in ranked] == sorted((x["score"] for x in ranked), reverse=True)
        return torch.tensor([next(x["score"] for x in ranked if x["label"] == label) for label in labels])

    one_pair = httpx.post(f"{url}/predict", json={"inputs": list(PAIRS[0])}, timeout=60)
    one_text = httpx.post(f"{url}/predict", json={"inputs": [TEXTS[0]]}, timeout=60)
    batch = httpx.post(f"{url}/predict", json={"inputs": [list(PAIRS[1]), [TEXTS[0]], list(PAIRS[2])]}, timeout=60)
    three = httpx.post(f"{url}/predict", json={"inputs": TEXTS[:3]}, timeout=60)
    assert (one_pair.status_code, one_text.status_code, batch.status_code) == (200, 200, 200), one_pair.text
    assert isinstance(one_pair.json()[0], dict) and isinstance(one_text.json()[0], dict)  # one input: one list
    assert (by_label(one_pair.json()) - want[0]).abs().max().item() <= 1e-5
    assert (by_label(one_text.json()) - single).abs().max().item() <= 1e-5
    got = torch.stack([by_label(r) for r in batch.json()])
    assert (got[[0, 2]] - want[1:]).abs().max().item() <= 1e-5 and (got[1] - single).abs().max().item() <= 1e-5
    assert three.status_code == 400 and "pair" in three.text
    with grpc.insecure_channel(setup["grpc"]) as ch:
        stub = pb_grpc.TandemStub(ch)
        gclf = stub.Classify(pb.ClassifyRequest(pairs=[pb.TextPair(text=a, text_pair=b) for a, b in PAIRS]),
                             timeout=60)
        with pytest.raises(grpc.RpcError) as both:
            stub.Classify(pb.ClassifyRequest(texts=["a"], pairs=[pb.TextPair(text="a", text_pair="b")]), timeout=60)
    assert both.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert max(abs(s.score - w[i].item()) for c, w in zip(gclf.results, want) for i, s in enumerate(c.scores)) <= 1e-5
    with Client(setup["grpc"]) as client:
        (probs,) = client.classify([PAIRS[0]])
    assert max(abs(probs[label] - want[0][i].item()) for i, label in enumerate(labels)) <= 1e-5


def test_the_python_clients_classify_and_embed_sparse(setup):
    """Client and AsyncClient: Classify per text {label: probability} (the logits with raw_scores), EmbedSparse
    {vocabulary id: weight}, as transformers computes them."""
    import asyncio

    from transformers import AutoTokenizer

    from clients import AsyncClient, Client

    labels = ["negative", "neutral", "positive"]
    with Client(setup["grpc"]) as client:
        probs = client.classify(TEXTS)
        raw = client.classify(TEXTS[0], raw_scores=True)
        sparse = client.embed_sparse(TEXTS[:2])

    async def both():
        async with AsyncClient(setup["grpc"]) as client:
            return await client.classify(TEXTS[1:2]), await client.embed_sparse(TEXTS[1])

    aprobs, asparse = asyncio.run(both())
    ref = _probs(setup, TEXTS)
    assert [list(p) for p in probs] == [labels] * len(TEXTS)
    assert max(abs(p[label] - r[i].item()) for p, r in zip(probs, ref) for i, label in enumerate(labels)) <= 1e-5
    assert max(abs(raw[0][label] - _probs(setup, TEXTS[:1], raw=True)[0][i].item())
               for i, label in enumerate(labels)) <= 1e-5
    assert aprobs[0] == pytest.approx(probs[1], abs=1e-5)  # packed with other inputs or alone: float rounding
    want = splade_reference(setup["refs"]["splade"], AutoTokenizer.from_pretrained(str(setup["dirs"] / "splade")),
                            TEXTS[:2])
    assert [sorted(v) for v in sparse] == [sorted(w) for w in want]
    assert max(abs(v[i] - w[i]) for v, w in zip(sparse, want) for i in w) <= 1e-5
    assert sorted(asparse[0]) == sorted(sparse[1]) and asparse[0] == pytest.approx(sparse[1], abs=1e-5)


def test_the_access_log_names_classify_and_embed_sparse_and_the_model_asked_for(setup, caplog):
    """gRPC Classify and EmbedSparse run as embedding jobs; their access-log lines name their RPC (not Embed), the
    model that did the work and the one the request named."""
    import logging

    from service.access_log import AccessLog

    with grpc.insecure_channel(setup["grpc"]) as ch:
        stub = pb_grpc.TandemStub(ch)
        stub.Classify(pb.ClassifyRequest(texts=TEXTS[:1], model="some-classifier"), timeout=60)
        stub.EmbedSparse(pb.EmbedSparseRequest(texts=TEXTS[:1]), timeout=60)
    caplog.set_level(logging.INFO, logger="tandem.access")
    recorder = setup["recorder"]
    for method in ("Classify", "EmbedSparse"):
        lc = recorder.wait_finished(lambda lc: lc.metadata.get("method") == method)[-1]
        AccessLog("smol").on_finish(lc)
    clf, sparse = (r.getMessage() for r in caplog.records[-2:])
    assert clf.startswith("grpc Classify model=clf requested=some-classifier status=OK finish=stop prompt_tokens="), clf
    assert sparse.startswith("grpc EmbedSparse model=splade status=OK finish=stop prompt_tokens="), sparse


def test_bad_input_is_400_and_invalid_argument(setup):
    url = setup["url"]
    for path, body in (("/predict", {"inputs": []}), ("/classify", {"input": []}),
                       ("/embed_sparse", {"inputs": []}), ("/predict", {"inputs": [["a"]] * (MAX_INPUTS + 1)}),
                       ("/predict", {"inputs": ["a", "b", "c"]}), ("/predict", {"inputs": [["a", "b", "c"]]}),
                       ("/predict", {"inputs": [["a", ""]]}), ("/embed_sparse", {"inputs": [["a", "b"]]}),
                       ("/embed_sparse", {"inputs": ["a"] * (MAX_INPUTS + 1)})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
    with grpc.insecure_channel(setup["grpc"]) as ch:
        stub = pb_grpc.TandemStub(ch)
        for call, req in ((stub.Classify, pb.ClassifyRequest()), (stub.EmbedSparse, pb.EmbedSparseRequest(
                texts=["a"] * (MAX_INPUTS + 1)))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=60)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_models_lists_them_with_their_tasks(setup):
    models = httpx.get(f"{setup['url']}/v1/models", timeout=60).json()["data"]
    tasks = {m["id"]: m.get("task") for m in models}
    assert "clf" in tasks and "splade" in tasks, json.dumps(models)


def test_a_server_without_them_names_the_flag(served, http_url):
    for path, body, flag in (("/predict", {"inputs": "a"}, "--classifier"),
                             ("/classify", {"input": "a"}, "--classifier"),
                             ("/embed_sparse", {"inputs": "a"}, "--sparse-embedder")):
        r = httpx.post(f"{http_url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and flag in r.text, (path, r.text)
    with grpc.insecure_channel(served.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.TandemStub(ch).Classify(pb.ClassifyRequest(texts=["a"]), timeout=60)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "--classifier" in err.value.details()


def test_engine_params_name_the_task():
    assert EmbedParams(task="classify").task is PoolingTask.CLASSIFY
