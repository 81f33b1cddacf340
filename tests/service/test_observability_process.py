"""Traces and the step log without a collector, as a user meets them: `tandem serve` with OTEL_TRACES_EXPORTER=console
prints the request spans (tandem.generate, tandem.embed) and step spans on its output, and `--step-log FILE` holds a
line for a step while the server is still running. The OTEL_* variables are read as the SDK reads them."""
from __future__ import annotations

import json
import queue

import pytest

from clients import Client
from service import tracing
from tests.service.test_process import ServeProcess


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


def _wait_for(proc: ServeProcess, found) -> list[str]:
    """Lines the server prints until `found(lines)` holds (a hang guard, not a time the test relies on)."""
    seen = []
    while not found(seen):
        try:
            line = proc.lines.get(timeout=300)
        except queue.Empty:
            raise AssertionError("the server printed no more lines:\n" + "".join(seen[-40:])) from None
        if line is None:
            raise AssertionError("tandem serve exited:\n" + "".join(seen[-40:]))
        seen.append(line)
    return seen


def test_console_spans_and_a_step_log_written_as_steps_end(tmp_path) -> None:
    step_log = tmp_path / "steps.jsonl"
    proc = ServeProcess("--host", "127.0.0.1", "--step-log", str(step_log),
                        env={"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "rag-dev",
                             "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        assert any("tracing: spans exported to the console (stdout)" in line for line in proc.output), proc.output
        with Client(proc.address) as client:
            text = "".join(d.text for d in client.generate("Hello", max_tokens=4, request_id="traced"))
            vectors = client.embed(["a passage to embed"])
        assert text and len(vectors) == 1
        # The server is still running: the steps it served are in the file already.
        records = [json.loads(line) for line in step_log.read_text().splitlines()]
        assert any(r["decode_tokens"] > 0 for r in records) and any(r["embed_rows"] > 0 for r in records)
        assert proc.proc.poll() is None
        spans = "".join(_wait_for(proc, lambda lines: all(f'"name": "{n}"' in "".join(lines)
                                                           for n in ("tandem.generate", "tandem.embed", "tandem.step"))))
        assert '"tandem.request.id": "traced"' in spans and '"service.name": "rag-dev"' in spans
    finally:
        proc.stop()
