"""Where one batch-1 decode step goes, per op, on CPU (#48 item 3): for the files of bench.big_model (`--model-size`).

In process, one sequence decoding after a prompt of --context tokens, --threads threads:

1. as served: --steps decode steps with the C++ layer walker (every layer in one call); the engine's StepRecords give
   the whole step and its model forward (the layers and the LM head);
2. per op: as many steps with the walker off (the Python layer loop calls the same C++ matmul kernels one projection
   at a time), each op timed where it is called (module hooks on the projections and the LM head; the layer's other
   ops wrapped): qkv, o, gate+up, down projections, the LM head, attention (KV write and paged attention), norms,
   rope, the activation, the embedding; "rest of the forward" is the loop's Python; "engine outside the forward" is
   scheduling, sampling and bookkeeping (Python). Matmul rows give the weight bytes they read and the GB/s;
3. with --service: one request through `tandem serve` (gRPC, token ids), whose time per decoded token less the
   in-process step (walker) is the service's share (event loop, gRPC, the bridge between threads).

OpenMP runs as `tandem serve` runs it (OMP_WAIT_POLICY=PASSIVE with a short GOMP_SPINCOUNT, docs/cli.md) unless
OMP_WAIT_POLICY is set. Per-op times are medians over the steps; the loop's ops sum close to the walker's forward, which the first row
shows beside them. Writes bench/results/decode_profile_<size>[_<quant>].json and .md (the Markdown table that
docs/benchmarks.md carries). About 2-4 minutes per model on 2 cores at 1.7B (loading included), seconds at 270M.

    python -m bench.decode_profile --model-size 1.7b gemma-270m [--quant q4_k_m] [--service]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import kernels
from bench.big_model import ModelSize, Quant, model_file
from bench.report import RESULTS, write_result
from engine import LLM, EngineConfig, SamplingParams

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
OP_LABELS = {"qkv_proj": "q/k/v projection", "o_proj": "o projection", "gate_up_proj": "gate + up projection",
             "down_proj": "down projection", "lm_head": "LM head", "attention": "attention (KV write + paged)",
             "norms": "RMS norms (+ residual adds)", "rope": "rope", "act": "activation x up", "embed": "embedding"}
_OPS_WRAPPED = {"add_rms_norm": "norms", "rms_norm": "norms", "rotary_": "rope", "act_mul": "act"}


class OpClock:
    """Seconds per op name, accumulated between `start_step()` calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def start_step(self) -> None:
        self.current = defaultdict(float)
        self.steps.append(self.current)

    def timed(self, name: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.current[name] += time.perf_counter() - t
        return wrapper

    def medians(self) -> dict[str, float]:
        names = {n for s in self.steps for n in s}
        return {n: statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


class _TimedOps:
    """The model's Ops object with its per-layer ops timed."""

    def __init__(self, ops, clock: OpClock) -> None:
        self._ops, self._clock = ops, clock

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        return self._clock.timed(_OPS_WRAPPED[name], fn) if name in _OPS_WRAPPED else fn


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes a forward of `module` reads of its weight: the stored blocks (and scales) of a quantized weight, the
    parameters of a dense one; a ConcatLinear sums its parts."""
    if hasattr(module, "parts"):
        return sum(weight_bytes(p) for p in module.parts)
    q = getattr(module, "qweight", None)
    if q is not None:
        return q.data.numel() * q.data.element_size() + (0 if q.scales is None else q.scales.numel() * 4)
    return sum(p.numel() * p.element_size() for p in module.parameters())


def instrument(model, clock: OpClock) -> tuple[dict[str, int], callable]:
    """Hooks that time the projections, the LM head and the embedding, and wrappers that time the rest; returns the
    weight bytes per op and an undo function."""
    handles, nbytes = [], defaultdict(int)

    def hook(name: str, module: torch.nn.Module) -> None:
        start: list[float] = []
        handles.append(module.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter())))

        def post(m, a, out):
            clock.current[name] += time.perf_counter() - start.pop()
        handles.append(module.register_forward_hook(post))

    for layer in model.model.layers:
        for name in PROJECTIONS:
            module = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
            hook(name, module)
            nbytes[name] += weight_bytes(module)
    hook("lm_head", model.lm_head)
    nbytes["lm_head"] = weight_bytes(model.lm_head)
    hook("embed", model.model.embed_tokens)
    ops, attend = model.ops, kernels.write_and_attend
    model.ops = _TimedOps(ops, clock)
    kernels.write_and_attend = clock.timed("attention", attend)

    def undo() -> None:
        for h in handles:
            h.remove()
        model.ops = ops
        kernels.write_and_attend = attend
    return dict(nbytes), undo


def decode_steps(llm: LLM, n: int, before_step=None) -> list:
    """Steps the engine n times (one sequence decoding); returns the steps' records."""
    records: list = []
    llm.engine.add_observer(records.append)
    try:
        for _ in range(n):
            if before_step is not None:
                before_step()
            llm.engine.step()
    finally:
        llm.engine.remove_observer(records.append)
    if not all(r.decode_tokens == 1 and r.prefill_tokens == 0 for r in records):
        raise RuntimeError("decode_profile: a step was not one sequence's decode")
    return records


def until_decoding(llm: LLM) -> None:
    """Steps the engine through the prompt's prefill, until a step is one decode."""
    records: list = []
    llm.engine.add_observer(records.append)
    try:
        while not records or records[-1].prefill_tokens or records[-1].decode_tokens != 1:
            llm.engine.step()
    finally:
        llm.engine.remove_observer(records.append)


def served_decode_s(path: Path, prompt: list[int], new_tokens: int, threads: int) -> float:
    """Seconds per decoded token of one request through `tandem serve` (after its first token)."""
    from bench.servers import Spawned
    from clients import AsyncClient
    from engine.models.loader import embedded_gguf_path

    serve_args = ["--num-threads", str(threads), "--metrics-port", "-1"]
    if path != embedded_gguf_path():
        serve_args += ["--model", str(path)]
    server = Spawned(serve_args)

    async def one() -> float:
        async with AsyncClient(server.address) as client:
            times = []
            async for delta in client.generate(token_ids=prompt, max_tokens=new_tokens, temperature=0.0,
                                               ignore_eos=True):
                times += [time.perf_counter()] * len(delta.token_ids)
        return (times[-1] - times[0]) / (len(times) - 1)

    try:
        return asyncio.run(one())
    finally:
        server.stop()


def profile(path: Path, context: int, steps: int, threads: int, service: bool) -> dict:
    llm = LLM(EngineConfig(model=str(path), num_threads=threads))
    model = llm.engine.runner.model
    prompt = [(17 * i + 5) % 1000 + 100 for i in range(context)]  # ordinary token ids, no specials
    llm.engine.add_request("p", prompt, SamplingParams(max_tokens=3 * steps + 8, temperature=0.0, ignore_eos=True))
    until_decoding(llm)
    decode_steps(llm, 3)  # warm
    served = decode_steps(llm, steps)
    walker = model.walker
    step_s = statistics.median(r.duration_s for r in served)
    forward_s = statistics.median(r.forward_s for r in served)
    clock = OpClock()
    nbytes, undo = instrument(model, clock)
    model.walker = None
    try:
        decode_steps(llm, 2)  # warm the loop
        clock.steps.clear()
        loop = decode_steps(llm, steps, before_step=clock.start_step)
    finally:
        model.walker = walker
        undo()
    ops = clock.medians()
    loop_step = statistics.median(r.duration_s for r in loop)
    loop_forward = statistics.median(r.forward_s for r in loop)
    out = {"model": path.name, "context": context, "steps": steps, "threads": threads,
           "walker": walker is not None, "cpu_kernels": served[-1].cpu_kernels,
           "step_s": step_s, "forward_s": forward_s, "loop_step_s": loop_step, "loop_forward_s": loop_forward,
           "ops_s": ops, "weight_bytes": nbytes,
           "rest_of_forward_s": max(0.0, loop_forward - sum(ops.values())),
           "engine_outside_forward_s": step_s - forward_s}
    if service:
        out["served_decode_s"] = served_decode_s(path, prompt, 2 * steps, threads)
    return out


def render(p: dict, title: str) -> str:
    """The per-op Markdown table of one profile."""
    step = p["loop_step_s"]
    lines = [f"{title}: one batch-1 decode step after {p['context']} tokens, {p['threads']} threads, CPU path "
             f"{p['cpu_kernels'] or 'none'}; as served (layer walker) a step takes {p['step_s'] * 1e3:.2f} ms, its "
             f"forward {p['forward_s'] * 1e3:.2f} ms; below, the Python layer loop "
             f"({step * 1e3:.2f} ms a step, forward {p['loop_forward_s'] * 1e3:.2f} ms), median of {p['steps']} steps",
             "", "| op | ms per step | share of the loop's step | weight MB read | GB/s |", "|---|---:|---:|---:|---:|"]
    ops = p["ops_s"]
    order = list(PROJECTIONS) + ["lm_head", "attention", "norms", "rope", "act", "embed"]
    for name in order + sorted(set(ops) - set(order)):
        if name not in ops:
            continue
        s, b = ops[name], p["weight_bytes"].get(name)
        lines.append(f"| {OP_LABELS.get(name, name)} | {s * 1e3:.2f} | {s / step:.0%} | "
                     + (f"{b / 1e6:.1f} | {b / s / 1e9:.1f} |" if b else " | |"))
    lines.append(f"| rest of the forward (the layer loop's Python) | {p['rest_of_forward_s'] * 1e3:.2f} | "
                 f"{p['rest_of_forward_s'] / step:.0%} | | |")
    outside = p["loop_step_s"] - p["loop_forward_s"]
    lines.append(f"| engine outside the forward (scheduling, sampling: Python) | {outside * 1e3:.2f} | "
                 f"{outside / step:.0%} | | |")
    total = sum(p["weight_bytes"].values())
    matmul_s = sum(ops.get(n, 0.0) for n in p["weight_bytes"])
    lines.append(f"| all matmuls | {matmul_s * 1e3:.2f} | {matmul_s / step:.0%} | {total / 1e6:.1f} | "
                 f"{total / matmul_s / 1e9:.1f} |")
    if "served_decode_s" in p:
        extra = p["served_decode_s"] - p["step_s"]
        lines.append(f"| through `tandem serve`: a decoded token takes {p['served_decode_s'] * 1e3:.2f} ms; the "
                     f"service beyond the in-process step (walker) | {extra * 1e3:.2f} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    if argv is None and "OMP_WAIT_POLICY" not in os.environ:
        # OpenMP reads its settings when torch loads: start again with the ones `tandem serve` sets for itself
        from service.cli import threading_environment

        env = dict(os.environ)
        threading_environment(None, env)
        os.execvpe(sys.executable, [sys.executable, "-m", "bench.decode_profile", *sys.argv[1:]], env)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", nargs="+", choices=[m.value for m in ModelSize],
                    default=[ModelSize.SMOLLM2_1P7B.value, ModelSize.GEMMA_270M.value])
    ap.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.Q4_K_M.value)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--service", action="store_true", help="also time decoding through `tandem serve`")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for size in args.model_size:
        path = model_file(size, args.quant)
        p = profile(path, args.context, args.steps, args.threads, args.service)
        name = f"decode_profile_{size}" + (f"_{args.quant}" if size == ModelSize.SMOLLM2_1P7B else "")
        p["table"] = render(p, f"{size} ({path.name})")
        print(p["table"] + "\n")
        p["openmp"] = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
        write_result({"benchmark": "decode_profile", "model_size": size, **p}, args.out_dir / f"{name}.json")
        (args.out_dir / f"{name}.md").write_text(p["table"] + "\n")
        results.append(p)
    return results


if __name__ == "__main__":
    main()
