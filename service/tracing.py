"""OpenTelemetry traces: a span per request and a span per engine step, linked to the requests it served.

Configured by the standard OTEL_* variables, read by the SDK's own configuration where it provides it:
OTEL_TRACES_EXPORTER (`console`, `otlp`, `none`, or any exporter registered under the SDK's
`opentelemetry_traces_exporter` entry points; comma-separated for several), OTEL_EXPORTER_OTLP_PROTOCOL (`grpc`, the
default, or `http/protobuf`), OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*. With
OTEL_TRACES_EXPORTER unset, spans go over OTLP when an endpoint is set and nowhere otherwise (no collector, no error
every few seconds). Spans are exported by a BatchSpanProcessor from its own thread, so neither the event loop nor
the engine thread ever waits for the collector (or the console).
"""
from __future__ import annotations

import os
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.outputs import COUNT_NAMES
from service import kinds
from service.lifecycle import Hooks, RequestLifecycle

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# Monotonic engine timestamps to the epoch nanoseconds spans carry.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


# What each exporter entry point installs from, for the error when one is named and missing.
_PACKAGE_OF_EXPORTER = {"otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
                        "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http"}
_WHERE = {"console": "to the console (stdout)", "otlp_proto_grpc": "over OTLP/gRPC to {endpoint}",
          "otlp_proto_http": "over OTLP/HTTP to {endpoint}"}


def exporter_names() -> list[str]:
    """The trace exporters the environment asks for, as the SDK's configuration names their entry points (`otlp`
    becomes otlp_proto_grpc or otlp_proto_http by OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL); [] for none or
    OTEL_SDK_DISABLED. With OTEL_TRACES_EXPORTER unset: OTLP when an endpoint is configured, else none."""
    # The SDK's own reading of the variables (opentelemetry-sdk is pinned: these live in its _configuration module).
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _get_exporter_names

    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    try:
        if not os.environ.get("OTEL_TRACES_EXPORTER", "").strip():
            has_endpoint = any(os.environ.get(v) for v in _ENDPOINT_VARS)
            return [_get_exporter_entry_point("otlp", "traces")] if has_endpoint else []
        return _get_exporter_names("traces")
    except RuntimeError as exc:  # an OTLP protocol the SDK does not know
        raise ValueError(f"{exc} (OTEL_EXPORTER_OTLP_PROTOCOL: grpc or http/protobuf)") from None


def _exporter(name: str) -> SpanExporter:
    """The exporter registered under `name` in the SDK's opentelemetry_traces_exporter entry points, built from the
    environment (endpoint, headers, TLS from OTEL_EXPORTER_OTLP_*). ValueError naming what to install when none is."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        package = _PACKAGE_OF_EXPORTER.get(name)
        hint = f"pip install {package}" if package else "console, otlp or none"
        raise ValueError(f"OTEL_TRACES_EXPORTER: no trace exporter {name!r} is installed ({hint})")
    return found[0].load()()


def tracer_provider_from_env(exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A provider exporting to what the OTEL_* variables name (or to `exporter` when given), else None."""
    exporters = [exporter] if exporter is not None else [_exporter(name) for name in exporter_names()]
    if not exporters:
        return None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tandem")})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for each in exporters:
        provider.add_span_processor(BatchSpanProcessor(each))
    return provider


def describe_tracing(provider: TracerProvider | None) -> str:
    """Where spans go, for the start-up log."""
    if provider is None:
        return ("tracing off: set OTEL_TRACES_EXPORTER=console to print a span per request and per engine step, or "
                "OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://localhost:4317, Jaeger all-in-one) to export them")
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), "the default endpoint")
    where = [_WHERE.get(name, f"to the {name} exporter").format(endpoint=endpoint) for name in exporter_names()]
    return "tracing: spans exported " + (" and ".join(where) or "to the configured exporter")


class TracingHooks(Hooks):
    """Lifecycle hooks that open a request span on arrival and close it on finish (called on the loop)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tandem")
        self._propagator = TraceContextTextMapPropagator()
        self._spans: dict[str, trace.Span] = {}

    def on_arrival(self, lc: RequestLifecycle) -> None:
        parent = self._propagator.extract(carrier=lc.metadata)  # the client's traceparent, if any
        self._spans[lc.engine_id] = self.tracer.start_span(
            f"tandem.{lc.kind}", context=parent, kind=SpanKind.SERVER, start_time=_ns(lc.arrival),
            attributes={"tandem.request.kind": lc.kind, "tandem.request.id": lc.client_id,
                        "tandem.request.engine_id": lc.engine_id,
                        "tandem.stream": lc.metadata.get("stream", ""),
                        "tandem.door": lc.metadata.get("door", ""),
                        # the model that does the work (a rerank's scorer, the embedder, the LLM's served name), and
                        # the name the request gave where that was another
                        "tandem.model": lc.metadata.get("model", ""),
                        "tandem.model.requested": lc.metadata.get("requested_model", "")})

    def on_first_token(self, lc: RequestLifecycle) -> None:
        span = self._spans.get(lc.engine_id)
        if span is not None and lc.first_token is not None:
            span.add_event("first_token", timestamp=_ns(lc.first_token))

    def on_finish(self, lc: RequestLifecycle) -> None:
        span = self._spans.pop(lc.engine_id, None)
        if span is None:
            return
        attrs = {"tandem.prompt_tokens": lc.prompt_tokens, "tandem.cached_tokens": lc.cached_tokens,
                 "tandem.finish_reason": lc.finish_reason or ""}
        kind = kinds.by_label(lc.kind)
        if kind is not None and kind.decodes:
            attrs["tandem.completion_tokens"] = lc.completion_tokens
            attrs["tandem.n"] = lc.completions
            if lc.first_token is not None:
                attrs["tandem.ttft_s"] = lc.ttft_s
        else:  # its inputs, as its kind names them
            attrs[kind.inputs_attribute if kind is not None else "tandem.rerank.pairs"] = lc.documents
        if lc.scheduled is not None:
            attrs["tandem.queue_time_s"] = max(0.0, lc.scheduled - lc.arrival)
        span.set_attributes(attrs)
        if lc.error:
            span.set_status(Status(StatusCode.ERROR, lc.error))
        span.end(end_time=_ns(lc.finished) if lc.finished is not None else None)

    def on_step(self, record) -> None:
        links = [Link(self._spans[rid].get_span_context()) for rid in record.request_ids if rid in self._spans]
        used = record.kv_blocks_total - record.kv_blocks_free
        span = self.tracer.start_span(
            "tandem.step", kind=SpanKind.INTERNAL, links=links, start_time=_ns(record.start_time),
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root: it serves many traces
            attributes={"tandem.step": record.step, "tandem.step.decode_tokens": record.decode_tokens,
                        "tandem.step.cached_tokens": record.cached_tokens,
                        "tandem.step.num_seqs": record.num_seqs, "tandem.step.budget": record.budget,
                        "tandem.step.budget_used": record.budget_used,
                        "tandem.kv.blocks_used": used, "tandem.kv.blocks_free": record.kv_blocks_free,
                        "tandem.kv.blocks_cached": record.kv_blocks_cached,
                        "tandem.step.preempted": record.preempted,
                        "tandem.step.duration_s": record.duration_s,
                        "tandem.step.decode_context_tokens": record.decode_context_tokens,
                        # per kind of work, its counts (engine/outputs.py COUNT_NAMES)
                        **{f"tandem.step.{name}": getattr(record, name) for name in COUNT_NAMES}})
        if record.cpu_kernels:
            span.set_attribute("tandem.step.cpu_kernels", record.cpu_kernels)
        if record.predicted_s is not None:  # the latency objective's model priced this step
            span.set_attributes({"tandem.step.predicted_s": record.predicted_s,
                                 "tandem.step.prediction_error": record.prediction_error or 0.0,
                                 "tandem.step.planned": record.planned})
        if record.target_s is not None:  # the T its decodes were held to (none in a step without decodes, auto)
            span.set_attributes({"tandem.step.target_s": record.target_s, "tandem.step.limit_s": record.limit_s or 0.0})
        span.end(end_time=_ns(record.start_time + record.duration_s))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what is buffered (bounded: a dead collector must not hold up exit)."""
        self.provider.force_flush(timeout_millis=int(timeout_s * 1000))
        self.provider.shutdown()
