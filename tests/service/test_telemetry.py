"""Traces to a real OTLP receiver, Prometheus metrics over HTTP, and serving with the collector down."""
from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, EngineConfig
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.metrics import Metrics
from service.server import ServerConfig
from service.tracing import TracingHooks, tracer_provider_from_env
from tests.service.harness import ServerThread

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
DOCS = [f"Document {i}: bees collect nectar and {'flowers ' * (i % 5)}make honey." for i in range(24)]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC TraceService endpoint that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list:
        with self._lock:
            return [s for s in self.spans if s.name == name]


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = {"int_value": v.int_value, "double_value": v.double_value,
                       "string_value": v.string_value, "bool_value": v.bool_value}[v.WhichOneof("value")]
    return out


@pytest.fixture(scope="module")
def engine():
    return LLM(EngineConfig(num_kv_blocks=256)).engine


async def _generate_and_rerank(address: str, metadata=()):
    """A generation that cannot end on its own (EOS ignored, the whole context to fill) is decoding when the rerank
    arrives, and the test cancels it once the rerank is answered: its final message says "abort"."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        long = (await stub.ModelInfo(pb.ModelInfoRequest())).max_model_len - 64
        outgoing: asyncio.Queue = asyncio.Queue()
        await outgoing.put(pb.GenerateClientMessage(request=pb.GenerateRequest(
            request_id="traced", prompt="Tell me about honey bees.",
            params=pb.SamplingParams(max_tokens=long, temperature=0.0, ignore_eos=True))))

        async def requests():
            while (message := await outgoing.get()) is not None:
                yield message

        call = stub.Generate(requests(), metadata=metadata)
        messages = [await call.read()]
        assert messages[0].WhichOneof("kind") == "delta"  # decoding now
        rerank = await stub.Rerank(pb.RerankRequest(query="How do bees make honey?", documents=DOCS),
                                   metadata=metadata)
        await outgoing.put(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id="traced")))
        while messages[-1].WhichOneof("kind") == "delta":
            messages.append(await call.read())
        await outgoing.put(None)
        assert messages[-1].WhichOneof("kind") == "final", messages[-1]
        assert messages[-1].final.finish_reason == pb.FINISH_REASON_ABORT
        assert 0 < messages[-1].final.usage.completion_tokens < long
        return messages, rerank


def test_spans_reach_an_otlp_receiver_and_metrics_are_scraped(engine, monkeypatch):
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tandem-test")
    provider = tracer_provider_from_env()
    assert provider is not None
    tracing, metrics = TracingHooks(provider), Metrics()
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    server.bridge.hooks += [tracing, metrics]
    http, _ = metrics.serve("127.0.0.1", 0)
    steps_before = engine.stats()["num_steps"]
    try:
        traceparent = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
        messages, rerank = asyncio.run(_generate_and_rerank(server.address, traceparent))
        assert messages[-1].WhichOneof("kind") == "final" and len(rerank.results) == len(DOCS)
        idle = server.idle_stats
        assert asyncio.run(idle())["num_steps"] - steps_before == server.recorder.steps  # no step record lost
        assert provider.force_flush(timeout_millis=600_000)  # returns once the receiver has answered the export

        gen_span, = receiver.named("tandem.generate")
        rerank_span, = receiver.named("tandem.rerank")
        gen_attrs, rerank_attrs = _attrs(gen_span), _attrs(rerank_span)
        assert gen_attrs["tandem.request.kind"] == "generate" and gen_attrs["tandem.request.id"] == "traced"
        assert gen_attrs["tandem.completion_tokens"] == messages[-1].final.usage.completion_tokens
        assert gen_attrs["tandem.finish_reason"] == "abort"
        assert gen_attrs["tandem.prompt_tokens"] > 0 and gen_attrs["tandem.ttft_s"] > 0
        assert "tandem.queue_time_s" in gen_attrs
        assert rerank_attrs["tandem.request.kind"] == "rerank" and rerank_attrs["tandem.finish_reason"] == "stop"
        assert rerank_attrs["tandem.rerank.pairs"] == len(DOCS) and rerank_attrs["tandem.prompt_tokens"] > 0
        # The client's trace continues into the server.
        assert gen_span.trace_id.hex() == TRACE_ID and gen_span.parent_span_id.hex() == PARENT_SPAN_ID

        steps = receiver.named("tandem.step")
        assert steps
        linked = lambda s: {link.span_id for link in s.links}  # noqa: E731
        assert any(gen_span.span_id in linked(s) for s in steps)
        assert any(rerank_span.span_id in linked(s) for s in steps)
        mixed = [s for s in steps if _attrs(s)["tandem.step.decode_tokens"] > 0
                 and _attrs(s)["tandem.step.rerank_pairs"] > 0]
        assert mixed, "no step span held decode tokens and rerank pairs together"
        assert {gen_span.span_id, rerank_span.span_id} <= linked(mixed[0])
        assert all(_attrs(s)["tandem.step.budget_used"] <= _attrs(s)["tandem.step.budget"] for s in steps)
        # the CPU path of the quantized matmuls (the embedded GGUF model on CPU): the one ModelInfo names
        assert {_attrs(s)["tandem.step.cpu_kernels"] for s in steps} == {engine.model_info()["cpu_kernels"]}

        port = http.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        ttft_count = [s.value for s in families["tandem_time_to_first_token_seconds"].samples
                      if s.name.endswith("_count")]
        assert ttft_count and ttft_count[0] >= 1
        assert sum(s.value for s in families["tandem_generation_tokens"].samples
                   if s.name.endswith("_total")) >= messages[-1].final.usage.completion_tokens
        assert sum(s.value for s in families["tandem_prompt_tokens"].samples if s.name.endswith("_total")) > 0
        assert sum(s.value for s in families["tandem_rerank_pairs"].samples if s.name.endswith("_total")) == len(DOCS)
        assert "tandem_kv_cache_usage_ratio" in families
    finally:
        http.shutdown()
        server.close()
        tracing.shutdown()
        receiver.server.stop(None)


def test_serving_continues_with_the_collector_down(engine, monkeypatch):
    with socket_closed_port() as port:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        # The exporter retries a refused export with backoff until its timeout (10 s by default) and the test's end
        # (tracing.shutdown) waited for that loop: 10 s of the test's 15 were that wait. What is asserted is the
        # serving, whatever the exporter does meanwhile; 1 s still makes it fail and retry.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
        provider = tracer_provider_from_env()
        tracing = TracingHooks(provider)
        server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
        server.bridge.hooks.append(tracing)
        try:
            messages, rerank = asyncio.run(_generate_and_rerank(server.address))
            assert messages[-1].WhichOneof("kind") == "final"  # and the abort it was asked for (the helper)
            assert len(rerank.results) == len(DOCS)
        finally:
            server.close()
            tracing.shutdown(timeout_s=1.0)


class socket_closed_port:
    """A localhost port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


def _record(**overrides):
    from engine.outputs import StepRecord

    from engine.step_time import TokenKind

    fields = dict(step=3, start_time=time.monotonic(), duration_s=0.05, decode_tokens=4,
                  cached_tokens=0, tokens={TokenKind.CROSS_ENCODER: 60}, rows={TokenKind.CROSS_ENCODER: 2},
                  num_seqs=6, budget=512, kv_blocks_total=10,
                  kv_blocks_free=5, kv_blocks_cached=1, preempted=0, num_running=4, num_waiting=9, request_ids=[],
                  decode_context_tokens=400)
    return StepRecord(**(fields | overrides))


def test_a_step_sized_by_the_latency_objective_shows_predicted_vs_actual_in_its_span_and_the_error_metric():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing, metrics = TracingHooks(tracer_provider_from_env(exporter)), Metrics()
    tracing.on_step(_record(predicted_s=0.04, target_s=0.045, limit_s=0.0375))  # ran 10 ms longer than predicted
    tracing.on_step(_record())  # no objective: no prediction
    metrics.on_step(_record(predicted_s=0.04, target_s=0.045))
    metrics.on_step(_record())
    tracing.shutdown()
    objective, plain = (dict(s.attributes) for s in exporter.get_finished_spans())
    assert objective["tandem.step.predicted_s"] == 0.04 and objective["tandem.step.target_s"] == 0.045
    assert objective["tandem.step.limit_s"] == 0.0375
    assert objective["tandem.step.prediction_error"] == pytest.approx(0.2)
    assert objective["tandem.step.decode_context_tokens"] == 400
    assert objective["tandem.step.cross_encoder_tokens"] == 60
    assert "tandem.step.predicted_s" not in plain and "tandem.step.prediction_error" not in plain
    count = metrics.registry.get_sample_value("tandem_step_time_prediction_error_ratio_count")
    assert count == 1  # only the predicted step
    assert metrics.registry.get_sample_value("tandem_step_time_prediction_error_ratio_bucket", {"le": "0.25"}) == 1
    assert metrics.registry.get_sample_value("tandem_step_time_prediction_error_ratio_bucket", {"le": "0.15"}) == 0


def test_a_step_span_and_the_step_tokens_metric_count_embedding_rows_and_tokens():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.step_time import TokenKind

    exporter = InMemorySpanExporter()
    tracing, metrics = TracingHooks(tracer_provider_from_env(exporter)), Metrics()
    tracing.on_step(_record(tokens={TokenKind.CROSS_ENCODER: 60, TokenKind.EMBED: 90}, rows={TokenKind.CROSS_ENCODER: 2, TokenKind.EMBED: 3}))
    metrics.on_step(_record(tokens={TokenKind.CROSS_ENCODER: 60, TokenKind.EMBED: 90}, rows={TokenKind.CROSS_ENCODER: 2, TokenKind.EMBED: 3}))
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert (span.attributes["tandem.step.embed_rows"], span.attributes["tandem.step.embed_tokens"]) == (3, 90)
    assert span.attributes["tandem.step.budget_used"] == 4 + 60 + 90
    assert metrics.registry.get_sample_value("tandem_step_tokens_sum", {"part": "embed"}) == 90
