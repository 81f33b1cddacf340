"""Where benchmark results go: one JSON line, printed and written under bench/results/."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def rounded(obj):
    """Floats to 4 significant digits, through dicts and lists."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def write_result(result: dict, path: Path) -> None:
    """Print the result as one JSON line and write the same line to `path`."""
    line = json.dumps(rounded(result))
    print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line + "\n")


def rotated(names: list[str], i: int) -> list[str]:
    """The run order of round i: the list rotated by i, so each system goes first in turn."""
    k = i % len(names)
    return names[k:] + names[:k]


def percentile(values, q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default); nan if empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_series(records: list, t0: float, limit: int = 2000) -> dict:
    """Per-step batch composition as parallel lists (`t` relative to t0, same clock as StepRecord.start_time),
    at most `limit` steps: every `every`-th step is kept."""
    every = max(1, -(-len(records) // limit))
    rs = records[::every]
    return {"every": every, "t": [r.start_time - t0 for r in rs], "duration_s": [r.duration_s for r in rs],
            "decode_tokens": [r.decode_tokens for r in rs], "prefill_tokens": [r.prefill_tokens for r in rs],
            "rerank_tokens": [r.rerank_tokens for r in rs], "num_running": [r.num_running for r in rs],
            "num_waiting": [r.num_waiting for r in rs]}


def parse_bench_args(ap: argparse.ArgumentParser, argv: list[str] | None, name: str, quick: dict) -> argparse.Namespace:
    """Adds the options every benchmark shares (--threads, --seed, --quick, --out) and parses; --quick applies the
    benchmark's `quick` sizes, and torch gets --threads."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the wiring (figures mean nothing)")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    import torch  # here, so that clients of this module (bench.serve_load) stay free of torch

    torch.set_num_threads(args.threads)
    return args
