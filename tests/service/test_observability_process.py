"""Traces and the step log without a collector, as a user meets them: `tandem serve` with OTEL_TRACES_EXPORTER=console
prints the request spans (tandem.generate, tandem.embed) and step spans on its output, and `--step-log FILE` holds a
line for a step while the server is still running. The OTEL_* variables are read as the SDK reads them."""
from __future__ import annotations

import json
import re
import socket

import pytest

from clients import Client
from service import tracing
from tests.service.process_harness import ServeProcess


@pytest.mark.parametrize(("env", "names"), [
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, []),
    ({}, []),  # no exporter named and no endpoint: off, not an error every few seconds
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, ["otlp_proto_grpc"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc", "console"]),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_the_standard_variables_name_the_exporters(monkeypatch, env, names) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tracing.exporter_names() == names
    provider = tracing.tracer_provider_from_env()
    assert (provider is None) == (not names)
    if provider is not None:
        assert provider.resource.attributes["service.name"] == "tandem"
        provider.shutdown()


def test_a_bad_setting_says_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json.*grpc or http/protobuf"):
        tracing.tracer_provider_from_env()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="no trace exporter 'zipkin' is installed \\(console, otlp or none\\)"):
        tracing.tracer_provider_from_env()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tandem serve` as a user with no collector starts it: console spans, a step log, the HTTP door."""
    http_port = _free_port()
    step_log = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    proc = ServeProcess("--host", "127.0.0.1", "--step-log", str(step_log), "--http-port", str(http_port),
                        env={"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "rag-dev",
                             "OTEL_BSP_SCHEDULE_DELAY": "100"})
    proc.step_log = step_log
    proc.http = f"http://127.0.0.1:{http_port}"
    yield proc
    proc.stop()


def test_start_up_says_device_threads_kernels_rerank_mode_and_context(served) -> None:
    said = "".join(served.output)
    # the embedder's dtype: float32, as tests/conftest.py's TANDEM_NATIVE_BF16=0 resolves --encoder-dtype auto
    assert re.search(r"tandem.engine: device cpu, \d+ threads, CPU kernels (avx512|avx2|portable), embedder in "
                     r"float32; rerank: dense "
                     r"\(all-MiniLM-L6-v2's cosine: documents retrieved by this embedder come back in their "
                     r"retrieval order; a trained cross-encoder is --reranker BAAI/bge-reranker-v2-m3\); context 8,192 "
                     r"tokens \(the model's context, max_position_embeddings\)", said), said


def test_console_spans_and_a_step_log_written_as_steps_end(served) -> None:
    assert "tracing: spans exported to the console (stdout)" in "".join(served.output), served.output
    with Client(served.address) as client:
        text = "".join(d.text for d in client.generate("Hello", max_tokens=4, request_id="traced"))
        vectors = client.embed(["a passage to embed"])
    assert text and len(vectors) == 1
    # The server is still running: the steps it served are in the file already.
    records = [json.loads(line) for line in served.step_log.read_text().splitlines()]
    assert any(r["decode_tokens"] > 0 for r in records) and any(r["embed_rows"] > 0 for r in records)
    assert served.proc.poll() is None
    spans = served.wait_until(lambda out: all(f'"name": "{n}"' in out
                                              for n in ("tandem.generate", "tandem.embed", "tandem.step")))
    assert '"tandem.request.id": "traced"' in spans and '"service.name": "rag-dev"' in spans


def test_the_access_log_names_the_model_asked_for_and_why_a_request_failed(served) -> None:
    """An embedding logs the embedder, a refused name the name; a 400 and a 404 say why; a long input does not
    print transformers' "Token indices sequence length" warning (the engine checks lengths itself)."""
    import openai

    client = openai.OpenAI(base_url=served.http + "/v1", api_key="x", max_retries=0)
    long_text = "a passage about lighthouses and the sea " * 80  # ~640 tokens: over the embedder's 256, cut
    assert len(client.embeddings.create(model="all-MiniLM-L6-v2", input=[long_text]).data) == 1
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prompt token ids must be integers"):
        client.completions.create(model="", prompt=[10**7], max_tokens=4)
    out = served.wait_until(lambda out: "/v1/completions model=" in out)
    lines = {line.split(" model=")[0].split()[-1]: line for line in out.splitlines() if "tandem.access" in line}
    assert "model=all-MiniLM-L6-v2 status=200 finish=stop" in lines["/v1/embeddings"], lines
    assert "model=gpt-4o status=404 finish=rejected reason=\"model 'gpt-4o' is not served" in \
        lines["/v1/chat/completions"], lines
    assert 'status=400 finish=error reason="prompt token ids must be integers in [0, ' in lines["/v1/completions"]
    assert "Token indices sequence length" not in out
