"""What a few scoring tokens add to a decode step (issue #45 item 0): 8 decodes alone against 8 decodes + k LLM-scored
rerank pair tokens (k = 1..4, or --pair-tokens), on each CPU path and thread count, measured in the engine itself.

The step's make-up is pinned, not planned: the objective is off (plain budget filling) and the step's token budget
is 8 + k, so once the 8 chats decode, every step carries exactly 8 decode rows and k tokens of one long rerank
document (the likelihood mode: pair tokens are prompt-like rows of the LLM). Each setting runs in its own process
(the CPU path is chosen at import: TANDEM_CPU_ISA), warms up, then times --steps steps from the engine's own step
records (wall time of the step and the part in model forwards). Reported: the median step and forward time per k,
and what k tokens add over the decode-only step (ms and x). On a 2-core host the figures need an idle machine.

    python -m bench.narrow_steps                       # this CPU's paths x threads 1 and 2 (~1-2 minutes)
    python -m bench.narrow_steps --isas avx2 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.report import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]


def measure(threads: int, pair_tokens: list[int], steps: int) -> dict:
    """In this process (its CPU path already chosen): median step / forward seconds per k."""
    from engine import EngineConfig, LLMEngine
    from engine.config import RerankParams, SamplingParams

    out: dict = {"threads": threads, "rows": {}}
    for k in [0, *pair_tokens]:
        engine = LLMEngine(EngineConfig(rerank_mode="likelihood", tpot_target_ms=None, num_threads=threads,
                                        max_num_batched_tokens=8 + k, embedder=None))
        ids = engine.tokenizer("The harvest was late this year, and the roads were muddy. " * 3,
                               add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_tokens=steps * 3 + 64, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"chat{i}", [ids[i % len(ids)]] + ids[:15], params)
        while engine.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                   for s in engine.scheduler.running):
            engine.step()  # the 8 prompts in, so every later step decodes all 8
        if k:
            engine.add_rerank("long", "what happened to the harvest?", [" ".join(["harvest roads village"] * 900)],
                              RerankParams())
        records = []
        engine.add_observer(records.append)
        for _ in range(steps + 8):
            engine.step()
        timed = [r for r in records[8:] if r.decode_tokens == 8 and r.rerank_tokens == k]
        out["rows"][k] = {"steps": len(timed),
                          "step_ms": 1e3 * statistics.median(r.duration_s for r in timed) if timed else None,
                          "forward_ms": 1e3 * statistics.median(r.forward_s for r in timed) if timed else None}
    out["isa"] = engine.model.cpu_path.isa.label  # the path the engine's builder chose (TANDEM_CPU_ISA)
    base = out["rows"][0]["step_ms"]
    for k, row in out["rows"].items():
        if k and row["step_ms"] and base:
            row["added_ms"] = row["step_ms"] - base
            row["x_decode_only"] = row["step_ms"] / base
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isas", nargs="+", default=None, help="CPU paths (default: this CPU's best and avx2)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pair-tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure here, print JSON
    ap.add_argument("--out", type=Path, default=RESULTS / "narrow_steps.json")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.threads[0], args.pair_tokens, args.steps)))
        return
    from kernels import quant

    isas = args.isas or list(dict.fromkeys([quant.default_cpu_path().isa.label, "avx2"]))
    runs = []
    for isa in isas:
        for threads in args.threads:
            env = {**os.environ, "TANDEM_CPU_ISA": isa}
            cmd = [sys.executable, "-m", "bench.narrow_steps", "--one", "--threads", str(threads), "--steps",
                   str(args.steps), "--pair-tokens", *map(str, args.pair_tokens)]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                runs.append({"isa": isa, "threads": threads, "error": proc.stderr[-2000:]})
                continue
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            row = runs[-1]
            cells = "  ".join(f"k={k}: {v['step_ms']:.1f} ms" + (f" (+{v['added_ms']:.1f})" if "added_ms" in v else "")
                              for k, v in row["rows"].items() if v["step_ms"])
            print(f"{row['isa']:>8} t={threads}: {cells}", flush=True)
    write_result({"bench": "narrow_steps", "runs": runs, "load": os.getloadavg()[0]}, args.out)


if __name__ == "__main__":
    main()
