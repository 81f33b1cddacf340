"""Space as well as time (issue #70 item 3): how the decoder and the encoder scale from 1 to 2 threads on this host, and
what two kinds of work do side by side on disjoint cores against taking turns on all of them.

Each measurement runs in its own process (torch's thread count is per process), through the engine itself:

* `decode`: 8 chats decoding (after their prompts), tokens/s;
* `prefill`: fresh 512-token prompts, one at a time under a 512-token budget, prompt tokens/s;
* `embed`: the embedded embedder over batches of 32 texts of ~100 tokens, texts/s.

Then **side by side**: a `decode` process pinned to core 0 and an `embed` process pinned to core 1, one thread each,
started together, each timing its own window. Taking turns with 2 threads gets, per second, a fraction f of the 2-thread
decode rate and 1 - f of the 2-thread embed rate; side by side gets both 1-thread rates at once (less what they take
from each other's memory bandwidth). `side_by_side_gain` is the mix's throughput side by side over taking turns at the
same mix (f chosen so that both do the same share of their own alone-work): > 1 means disjoint cores pay.

    python -m bench.thread_scaling              # ~2-3 minutes on an idle 2-core host
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.report import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("decode", "prefill", "embed")
SENTENCE = "The harvest was late this year, and the roads to the village were muddy for weeks. "


def _engine(threads: int):
    from engine import EngineConfig, LLMEngine
    from engine.config import EMBEDDED_EMBEDDER

    return LLMEngine(EngineConfig(embedder=EMBEDDED_EMBEDDER, tpot_target_ms=None, num_threads=threads, max_num_batched_tokens=512,
                                  enable_prefix_caching=False))


def measure(kind: str, threads: int, seconds: float) -> dict:
    """Run `kind` for about `seconds` of timed work after a warm-up; its rate per timed second (tokens, or texts for
    embed). Decode times only the steps in which the 8 chats all decode."""
    from engine.config import SamplingParams

    engine = _engine(threads)
    ids = engine.tokenizer(SENTENCE * 40, add_special_tokens=False)["input_ids"]
    n = 0

    def run() -> None:
        while engine.has_unfinished():
            engine.step()

    def work() -> tuple[int, float]:
        nonlocal n
        n += 1
        if kind == "embed":
            t = time.perf_counter()
            engine.add_embed(f"e{n}", [f"{n}-{i} " + SENTENCE * 4 for i in range(32)])
            run()
            return 32, time.perf_counter() - t
        if kind == "prefill":
            t = time.perf_counter()
            engine.add_request(f"p{n}", [n % 1000 + 1] + ids[:511], SamplingParams(max_tokens=1))
            run()
            return 512, time.perf_counter() - t
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"d{n}-{i}", [n * 8 + i + 1] + ids[:31], params)
        while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()
        t, steps = time.perf_counter(), 0
        while len(engine.scheduler.running) == 8:
            engine.step()
            steps += 1
        spent = time.perf_counter() - t
        run()
        return 8 * steps, spent

    work()  # warm-up
    done, spent = 0, 0.0
    while spent < seconds:
        units, t = work()
        done, spent = done + units, spent + t
    return {"kind": kind, "threads": threads, "rate_per_s": done / spent, "seconds": spent}


def _child(kind: str, threads: int, seconds: float, core: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.thread_scaling", "--one", kind, "--threads", str(threads),
           "--seconds", str(seconds)] + (["--core", str(core)] if core is not None else [])
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"a measuring process failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def side_by_side_gain(alone_2t: dict[str, float], together_1t: dict[str, float]) -> float:
    """Throughput of the decode + embed mix on disjoint cores over taking turns with both threads. Side by side, in a
    second, each kind does together_1t[k] / alone_2t[k] of what it would do with the whole machine; taking turns, the
    two fractions add up to 1. The gain is their sum (same mix: each kind keeps its share)."""
    return sum(together_1t[k] / alone_2t[k] for k in together_1t)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "thread_scaling.json")
    args = ap.parse_args(argv)
    if args.one:
        if args.core is not None:
            os.sched_setaffinity(0, {args.core})
        print(json.dumps(measure(args.one, args.threads, args.seconds)))
        return None
    alone = {}
    for kind in KINDS:
        for threads in (1, 2):
            alone[f"{kind}_{threads}t"] = _result(_child(kind, threads, args.seconds, None))["rate_per_s"]
            print(f"{kind} {threads} thread(s): {alone[f'{kind}_{threads}t']:.1f}/s", flush=True)
    procs = {"decode": _child("decode", 1, args.seconds, 0), "embed": _child("embed", 1, args.seconds, 1)}
    together = {k: _result(p)["rate_per_s"] for k, p in procs.items()}
    scaling = {kind: alone[f"{kind}_2t"] / alone[f"{kind}_1t"] for kind in KINDS}
    gain = side_by_side_gain({k: alone[f"{k}_2t"] for k in together}, together)
    result = {"alone_per_s": alone, "scaling_1_to_2_threads": scaling, "side_by_side_1t_per_s": together,
              "side_by_side_vs_alone_1t": {k: together[k] / alone[f"{k}_1t"] for k in together},
              "side_by_side_gain": gain}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
