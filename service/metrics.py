"""Prometheus metrics from request lifecycles and step records, served over HTTP for scraping.

The same HTTP server answers the health paths of the HTTP door, for load balancers that check over plain HTTP
(HAProxy's `option httpchk`) and probes that know vLLM's or TEI's paths: `/ready` and `/healthz` say what the gRPC
health service reports, 200 while SERVING, 503 otherwise (from the moment a drain starts, while the server still
takes work for its --drain-grace); `/health` says the process is up (200 until it exits), as on the HTTP port.
The registry also holds prometheus_client's `process_*` metrics (CPU seconds, resident memory, open files) and,
from service/vllm_metrics.py, vLLM's metric names.
"""
from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app

from service.http.hosts import host_allowed
from service import kinds
from service.lifecycle import Hooks, RequestLifecycle

log = logging.getLogger("tandem.metrics")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# (actual - predicted) / actual of a step's time: < 0 the step ran faster than predicted, > 0 slower.
_ERROR = (-1.0, -0.5, -0.25, -0.15, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 0.9)


class Metrics(Hooks):
    """Histograms, gauges and counters on their own registry (so several servers can share a process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("tandem_time_per_output_token_seconds", "Mean gap between generated tokens",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tandem_request_latency_seconds", "Arrival to finish", ["kind"],
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("tandem_queue_time_seconds", "Arrival to the first engine step serving it",
                               ["kind"], buckets=_LATENCY, registry=r)
        self.rerank_latency = Histogram("tandem_rerank_latency_seconds", "Rerank request latency",
                                        buckets=_LATENCY, registry=r)
        self.step_duration = Histogram("tandem_step_duration_seconds", "Engine step duration",
                                       buckets=_LATENCY, registry=r)
        # Time the engine thread spends between two steps that both served work: applying commands (tokenizing new
        # requests, aborts) and handing outputs to the loop. Decodes wait for it as they wait for a step.
        self.step_gap = Histogram("tandem_step_gap_seconds", "Engine-thread time between consecutive busy steps",
                                  buckets=_LATENCY, registry=r)
        self._last_step_end: float | None = None
        self.step_tokens = Histogram("tandem_step_tokens", "Tokens per engine step by part of the batch",
                                     ["part"], buckets=_TOKENS, registry=r)
        self.prediction_error = Histogram(
            "tandem_step_time_prediction_error_ratio",
            "Latency objective: (actual - predicted) / actual step time; > 0: the step ran longer than predicted",
            buckets=_ERROR, registry=r)
        self.kv_usage = Gauge("tandem_kv_cache_usage_ratio", "Share of KV blocks held by live sequences",
                              registry=r)
        self.kv_cached = Gauge("tandem_kv_cache_cached_blocks", "KV blocks holding reusable prefixes", registry=r)
        self.running = Gauge("tandem_num_requests_running", "Sequences running in the engine", registry=r)
        self.waiting = Gauge("tandem_num_requests_waiting", "Sequences waiting for the engine", registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", ["kind"],
                                     registry=r)
        self.completion_tokens = Counter("tandem_generation_tokens", "Generated tokens", registry=r)
        self.cache_hits = Counter("tandem_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  ["kind"], registry=r)
        # Every (query, document) pair scored, whatever scored it: a pair an LLM or cross-encoder forward scores when
        # its last chunk runs (step records), a document the embedder's cosine alone scores (dense, a cascade's
        # documents below its top k) when its request finishes.
        self.rerank_pairs = Counter("tandem_rerank_pairs", "Rerank (query, document) pairs scored, by any mode",
                                    registry=r)
        self.preemptions = Counter("tandem_preemptions", "Sequences preempted for recompute", registry=r)
        # door: "grpc" or "http", the front door the request came through (each door names it in the request metadata)
        self.requests = Counter("tandem_requests", "Finished requests", ["kind", "finish_reason", "door"],
                                registry=r)

    def on_finish(self, lc: RequestLifecycle) -> None:
        self.requests.labels(lc.kind, lc.finish_reason or "unknown", lc.metadata.get("door", "none")).inc()
        self.e2e.labels(lc.kind).observe(lc.duration_s)
        if lc.scheduled is not None:
            self.queue.labels(lc.kind).observe(max(0.0, lc.scheduled - lc.arrival))
        self.prompt_tokens.labels(lc.kind).inc(lc.prompt_tokens)
        self.cache_hits.labels(lc.kind).inc(lc.cached_tokens)
        kind = kinds.by_label(lc.kind)
        if kind is not None and kind.scores_pairs:
            self.rerank_latency.observe(lc.duration_s)
            self.rerank_pairs.inc(lc.embedder_scored)  # the pairs no step record counted
            return
        self.completion_tokens.inc(lc.completion_tokens)
        if lc.first_token is not None:
            self.ttft.observe(lc.ttft_s)
            per_completion = lc.completion_tokens / max(1, lc.completions)  # n completions decode side by side
            if per_completion > 1 and lc.finished is not None:
                self.tpot.observe((lc.finished - lc.first_token) / (per_completion - 1))

    def on_step(self, record) -> None:
        self.step_duration.observe(record.duration_s)
        if record.num_seqs:
            if self._last_step_end is not None:
                self.step_gap.observe(max(0.0, record.start_time - self._last_step_end))
            self._last_step_end = record.start_time + record.duration_s
        else:
            self._last_step_end = None
        error = record.prediction_error
        if error is not None:
            self.prediction_error.observe(error)
        for part, n in (("decode", record.decode_tokens), *record.tokens_by_request().items()):
            if n:
                self.step_tokens.labels(part).observe(n)
        self.rerank_pairs.inc(getattr(record, "rerank_pairs_scored", record.rerank_pairs))  # a chunked pair once
        self.preemptions.inc(record.preempted)
        self.kv_usage.set(1.0 - record.kv_blocks_free / record.kv_blocks_total)
        self.kv_cached.set(record.kv_blocks_cached)
        self.running.set(record.num_running)
        self.waiting.set(record.num_waiting)

    def serve(self, host: str, port: int, healthy: Callable[[], bool] = lambda: True,
              hosts: tuple[str, ...] | None = None):
        """Expose /metrics and /healthz on host:port from a daemon thread; returns (http server, thread).

        `healthy()` decides /ready and /healthz: 200 "SERVING" when true, 503 "NOT_SERVING" when false; /health is
        200 "OK" while the process answers at all. /metrics answers the metrics; any other path is 404. `hosts`: the
        Host header patterns answered, as the HTTP door's (service/http/hosts.py, --allowed-hosts; None: any): a
        page in a browser that rebinds its own name to 127.0.0.1 reads neither door; another Host gets 400.
        """
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO")
            header = environ.get("HTTP_HOST")
            if not host_allowed(header, hosts):
                log.warning("metrics request refused: Host %r is not allowed (--allowed-hosts)", header)
                start_response("400 Bad Request", [("Content-Type", "text/plain")])
                return [f"Host {header!r} is not allowed: this server answers {', '.join(hosts or ())} (tandem serve "
                        "--allowed-hosts adds names)\n".encode("latin-1", "replace")]
            if path in ("/ready", "/healthz"):
                ok = healthy()
                start_response("200 OK" if ok else "503 Service Unavailable", _no_store())
                return [b"SERVING\n" if ok else b"NOT_SERVING\n"]
            if path == "/health":
                start_response("200 OK", _no_store())
                return [b"OK\n"]
            if path == "/metrics":
                return metrics_app(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: this port serves /metrics, /health, /ready and /healthz only (gRPC and the APIs "
                    b"are on --port and --http-port)\n"]

        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_Server", (_ThreadingServer,), {"address_family": family})  # "::" binds IPv6
        http = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        thread = threading.Thread(target=http.serve_forever, name="tandem-metrics", daemon=True)
        thread.start()
        return http, thread


def _no_store() -> list[tuple[str, str]]:
    """Fresh each time: wsgiref appends Content-Length to the list it is given."""
    return [("Content-Type", "text/plain"), ("Cache-Control", "no-store")]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # socketserver's default listen backlog is 5: a burst of health checks and scrapes on a loaded host (a test
    # polling /healthz in a loop beside two CPU hogs) overflowed it and one check was reset instead of answered
    request_queue_size = 128


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # health checks every 500 ms would flood the log
        pass
