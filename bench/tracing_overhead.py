"""Step-time overhead of tracing: the same workload through the engine bridge with span hooks off and on.

Spans go through the real SDK pipeline (BatchSpanProcessor) into an in-memory exporter, so the cost
measured is creating, linking and exporting them, not network I/O. Rounds alternate off/on to cancel
drift on a shared machine; the figure is the ratio of mean step durations (from StepRecords) and of
wall time. Writes bench/results/tracing_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
import uvloop
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.report import RESULTS, write_result
from engine import EngineConfig, GenerateSpec, LLMEngine, RerankParams, RerankSpec, SamplingParams
from service.bridge import EngineBridge
from service.tracing import TracingHooks, tracer_provider_from_env



async def _round(engine: LLMEngine, tracing: bool, requests: int, tokens: int) -> tuple[list[float], float, int]:
    exporter = InMemorySpanExporter()
    hooks = [TracingHooks(tracer_provider_from_env(exporter))] if tracing else []
    bridge = EngineBridge(engine, max_waiting=10_000, hooks=hooks)
    steps: list[float] = []

    def collect(record) -> None:
        steps.append(record.duration_s)

    engine.add_observer(collect)
    bridge.start()
    loop = asyncio.get_running_loop()
    pending = []
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(requests):
        done = loop.create_future()
        sink = _resolve_when_finished(done)
        if i % 8 == 7:
            spec = RerankSpec(f"r{i}", "how do bees make honey",
                              [f"doc {j} about bees and honey" for j in range(16)], RerankParams())
        else:
            spec = GenerateSpec(f"g{i}", f"Tell me fact number {i} about bees.", params)
        bridge.submit(spec, spec.request_id, sink)
        pending.append(done)
    await asyncio.gather(*pending)
    wall = time.perf_counter() - start
    await bridge.stop()  # also stops the bridge observing the engine
    engine.remove_observer(collect)
    if tracing:
        hooks[0].shutdown()  # flushes the batch processor into the exporter
    return steps, wall, len(exporter.get_finished_spans())


def _resolve_when_finished(future: asyncio.Future):
    """A bridge sink that completes `future` with a request's final output (or its error)."""
    def deliver(event) -> None:
        if not future.done() and getattr(event, "finished", True):
            future.set_result(event)
    return deliver


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(num_kv_blocks=1024))
    uvloop.run(_round(engine, True, 8, 4))  # warm-up, not counted: first-touch allocations, SDK start
    results = {False: ([], []), True: ([], [])}
    spans = 0
    for _ in range(args.rounds):
        for tracing in (False, True):
            steps, wall, n = uvloop.run(_round(engine, tracing, args.requests, args.tokens))
            results[tracing][0].extend(steps)
            results[tracing][1].append(wall)
            spans = max(spans, n)
    off_step, on_step = statistics.mean(results[False][0]), statistics.mean(results[True][0])
    off_wall, on_wall = sum(results[False][1]), sum(results[True][1])
    out = {"requests": args.requests, "tokens": args.tokens, "rounds": args.rounds, "spans_per_round": spans,
           "mean_step_s_off": round(off_step, 5), "mean_step_s_on": round(on_step, 5),
           "step_time_overhead": round(on_step / off_step - 1, 4), "wall_overhead": round(on_wall / off_wall - 1, 4)}
    write_result(out, RESULTS / "tracing_overhead.json")
    return out


if __name__ == "__main__":
    main()
