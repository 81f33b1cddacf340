"""Where a served workload's time went, read from a `tandem serve --step-log FILE` (issue #62: the reason for a missed
target is found in the step log, not guessed).

The log is cut into windows: the phases of a `bench.pipeline` result (`--phases FILE`: each phase's `window_mono_ms`, on
the monotonic clock the step log uses), else at idle gaps (no step for --gap seconds). For each window it prints:

* wall time, the share of it inside engine steps (`busy`) and between them (the service's own work: the doors, the
  intake's tokenizing, streaming, JSON, on the same cores);
* steps per second and their mean time, split into decode-only steps and mixed steps (decodes beside other work);
* in mixed steps, the decodes' part: the mean decode-only step time of the window with the same number of decode rows
  (or the model's prediction) over the mixed step's time, i.e. the share the decodes really got, beside the share the
  planner owed the other kinds (the records' `owed`);
* the planner's prediction error on mixed steps (measured / predicted);
* per kind, what was served per second (decode tokens, prompt tokens, rerank pairs scored, embedding rows done).

    python -m bench.step_shares /tmp/steps.jsonl
    python -m bench.step_shares /tmp/steps.jsonl --phases bench/results/pipeline.json
    python -m bench.step_shares /tmp/steps.jsonl --json    # one JSON object per window
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def windows(records: list[dict], gap_s: float) -> list[list[dict]]:
    """Records cut at idle gaps longer than gap_s (end of one step to the start of the next)."""
    out: list[list[dict]] = []
    for r in sorted(records, key=lambda r: r["start_time"]):
        if r["num_seqs"] == 0:
            continue
        if out and r["start_time"] - (out[-1][-1]["start_time"] + out[-1][-1]["duration_s"]) <= gap_s:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def phase_windows(records: list[dict], result: dict) -> list[tuple[str, list[dict]]]:
    """The steps inside each phase of a bench.pipeline result that ran on tandem (its windows are on the same clock)."""
    out = []
    for system, runs in result.get("runs", {}).items():
        if not system.startswith("tandem"):
            continue
        for i, run in enumerate(runs):
            for phase, figures in run["phases"].items():
                if "window_mono_ms" not in figures:
                    continue
                lo, hi = (t / 1e3 for t in figures["window_mono_ms"])
                got = [r for r in records if lo <= r["start_time"] <= hi and r["num_seqs"] > 0]
                if got:
                    out.append((f"{system} run {i} {phase}", got))
    return out


def _mixed(r: dict) -> bool:
    return r["decode_tokens"] > 0 and (r["prefill_tokens"] or r["rerank_tokens"] or r["embed_rows"]) > 0


def _decode_only(r: dict) -> bool:
    return r["decode_tokens"] > 0 and not _mixed(r)


def summarize(window: list[dict], decode_only_by_rows: dict[int, float]) -> dict:
    """One window's figures. decode_only_by_rows: the median decode-only step time by decode rows, over the whole log
    (a workload window may hold no decode-only step of its own)."""
    start = window[0]["start_time"]
    end = window[-1]["start_time"] + window[-1]["duration_s"]
    wall = max(end - start, 1e-9)
    busy = sum(r["duration_s"] for r in window)
    mixed = [r for r in window if _mixed(r)]
    alone = [r for r in window if _decode_only(r)]
    out: dict = {
        "wall_s": round(wall, 3), "steps": len(window), "busy": round(busy / wall, 3),
        "steps_per_s": round(len(window) / wall, 2),
        "decode_only_steps": len(alone), "mixed_steps": len(mixed),
        "decode_only_step_ms": round(1000 * statistics.mean(r["duration_s"] for r in alone), 2) if alone else None,
        "mixed_step_ms": round(1000 * statistics.mean(r["duration_s"] for r in mixed), 2) if mixed else None,
        "decode_rows_mean": round(statistics.mean(r["decode_tokens"] for r in window if r["decode_tokens"]), 2)
        if any(r["decode_tokens"] for r in window) else 0,
        "served_per_s": {
            "decode_tokens": round(sum(r["decode_tokens"] for r in window) / wall, 1),
            "prefill_tokens": round(sum(r["prefill_tokens"] for r in window) / wall, 1),
            "rerank_pairs_scored": round(sum(r.get("rerank_pairs_scored", 0) for r in window) / wall, 1),
            "embed_rows_done": round(sum(r.get("embed_rows_done", 0) for r in window) / wall, 1),
        },
    }
    if mixed:
        shares = [decode_only_by_rows[r["decode_tokens"]] / r["duration_s"] for r in mixed
                  if r["decode_tokens"] in decode_only_by_rows and r["duration_s"] > 0]
        out["decode_share_in_mixed"] = round(statistics.median(shares), 3) if shares else None
        ratio = [r["duration_s"] / r["predicted_s"] for r in mixed if r.get("predicted_s")]
        out["mixed_measured_over_predicted"] = round(statistics.median(ratio), 3) if ratio else None
        owed: dict[str, float] = defaultdict(float)
        for r in mixed:
            for o in r.get("owed") or ():
                owed[str(o["kind"])] += o["seconds"]
        total = sum(r["duration_s"] for r in mixed)
        out["owed_share_of_mixed_time"] = {k: round(v / total, 3) for k, v in sorted(owed.items())}
    # where the decodes' time went: step time spent on decode rows (their decode-only price) against the wall
    decode_time = sum(decode_only_by_rows.get(r["decode_tokens"], 0.0) for r in window if r["decode_tokens"])
    out["decode_time_share_of_wall"] = round(decode_time / wall, 3)
    return out


def decode_only_times(records: list[dict]) -> dict[int, float]:
    by_rows: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if _decode_only(r):
            by_rows[r["decode_tokens"]].append(r["duration_s"])
    return {rows: statistics.median(ts) for rows, ts in by_rows.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step_log", type=Path)
    ap.add_argument("--phases", type=Path, default=None, help="a bench.pipeline result: cut the log at its phases")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds without a step that end a window")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    records = load(args.step_log)
    by_rows = decode_only_times(records)
    if args.phases is not None:
        named = phase_windows(records, json.loads(args.phases.read_text(encoding="utf-8").splitlines()[-1]))
    else:
        named = [(f"window {i}", w) for i, w in enumerate(windows(records, args.gap))]
    got = []
    for name, w in named:
        s = summarize(w, by_rows)
        got.append({"window": name, **s})
        if args.json:
            print(json.dumps(got[-1]))
        else:
            print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in s.items()), file=sys.stdout)
    return got


if __name__ == "__main__":
    main()
