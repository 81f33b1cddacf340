"""The metric names vLLM exports, beside tandem's own, so dashboards built for vLLM and the Gateway API Inference
Extension's endpoint picker (its "model server protocol": vllm:num_requests_waiting, vllm:num_requests_running,
vllm:kv_cache_usage_perc) read a tandem replica as they read a vLLM one. Every series has vLLM's `model_name`
label, the name the replica serves. Same sources as service/metrics.py: request lifecycles and step records.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.lifecycle import Hooks, RequestLifecycle

# vLLM's own buckets for these histograms (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
_LABELS = ["model_name"]


class VllmMetrics(Hooks):
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, m = registry, model_name
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's running batch", _LABELS,
                             registry=r).labels(m)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the engine", _LABELS,
                             registry=r).labels(m)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", _LABELS,
                              registry=r).labels(m)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", _LABELS,
                              buckets=_TTFT, registry=r).labels(m)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (after the first)",
                              _LABELS, buckets=_TPOT, registry=r).labels(m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish, every request", _LABELS,
                             buckets=_E2E, registry=r).labels(m)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to the first engine step serving it",
                               _LABELS, buckets=_E2E, registry=r).labels(m)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", _LABELS,
                                     registry=r).labels(m)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", _LABELS,
                                         registry=r).labels(m)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               [*_LABELS, "finished_reason"], registry=r)
        self.model_name = m

    def on_finish(self, lc: RequestLifecycle) -> None:
        self.e2e.observe(lc.duration_s)
        self.success.labels(self.model_name, str(lc.finish_reason or "unknown")).inc()
        if lc.scheduled is not None:
            self.queue.observe(max(0.0, lc.scheduled - lc.arrival))
        self.prompt_tokens.inc(lc.prompt_tokens)
        self.generation_tokens.inc(lc.completion_tokens)
        if lc.first_token is None:
            return
        self.ttft.observe(lc.ttft_s)
        per_completion = lc.completion_tokens / max(1, lc.completions)
        if per_completion > 1 and lc.finished is not None:
            self.tpot.observe((lc.finished - lc.first_token) / (per_completion - 1))

    def on_step(self, record) -> None:
        self.running.set(record.num_running)
        self.waiting.set(record.num_waiting)
        self.kv_usage.set(1.0 - record.kv_blocks_free / record.kv_blocks_total)
