"""Why a RAG request missed its SLO, from tandem's step log (`tandem serve --step-log FILE`) beside the client's own
stamps of the same run (both on the monotonic clock; issue #70: "a missed target is reported as missed, with the step
log's reason").

* A gap between two of an answer's tokens over the TPOT SLO is put down to the steps that ran in it: the longest one
  ran over the SLO and the objective predicted it so (`ADMITTED_OVER`: the planner chose a step that long) or did not
  (`OVERRAN`: the step-time model's miss, or the host's); no step over the SLO, but the stream's token waited out
  more than one step (`SKIPPED`: steps that did not advance it, e.g. it was preempted or a step held no decodes); or
  neither (`BETWEEN_STEPS`: the time was outside the steps: the engine thread or the door busy elsewhere).
* A first token later than the TTFT SLO is put down to the stage that ran furthest over its idle median (the question's
  embedding, the rerank, or the answer's own time to its first token), with what the steps in that stage's window did:
  how busy the engine was and how its step time went to each kind of token.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

# the step log's token counts, per kind of work, as one step record names them
KINDS = ("decode_tokens", "prefill_tokens", "rerank_tokens", "embed_tokens")


class GapReason(StrEnum):
    ADMITTED_OVER = "admitted_over"  # a step in the gap was predicted over the SLO: the planner made it that long
    OVERRAN = "overran"  # a step ran over the SLO though predicted within it
    SKIPPED = "skipped"  # no step over the SLO, but the token waited out several steps
    BETWEEN_STEPS = "between_steps"  # the time went outside the steps


class Stage(StrEnum):
    EMBED = "embed_s"
    RERANK = "rerank_s"
    ANSWER = "answer_ttft_s"


@dataclass
class Stamps:
    """One request's client-side times on the monotonic clock (None: the stage never started)."""
    arrival: float
    embed_sent: float | None = None
    rerank_sent: float | None = None
    answer_sent: float | None = None
    tokens: list[float] = field(default_factory=list)  # each answer token's arrival

    def window(self, stage: Stage) -> tuple[float, float] | None:
        """When `stage` ran: from its send to the next stage's send (the answer: to its first token)."""
        ends = {Stage.EMBED: (self.embed_sent, self.rerank_sent), Stage.RERANK: (self.rerank_sent, self.answer_sent),
                Stage.ANSWER: (self.answer_sent, self.tokens[0] if self.tokens else None)}[stage]
        return None if None in ends else ends


def read_steps(path: Path, since: float = float("-inf"), until: float = float("inf")) -> list[dict]:
    """The step records of a step log that started in [since, until], in order (a torn last line is skipped)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append(r)
    return within(sorted(out, key=lambda r: r["start_time"]), since, until)


def _end(r: dict) -> float:
    return r["start_time"] + r["duration_s"]


def _overlapping(steps: list[dict], t0: float, t1: float) -> list[dict]:
    return [r for r in steps if r["start_time"] < t1 and _end(r) > t0]


def _busy(steps: list[dict], t0: float, t1: float) -> float:
    """Seconds of (t0, t1) the given steps ran."""
    return sum(min(_end(r), t1) - max(r["start_time"], t0) for r in steps)


def within(steps: list[dict], since: float, until: float) -> list[dict]:
    """The records of `steps` (in order) that started in [since, until]."""
    return [r for r in steps if since <= r["start_time"] <= until]


def _shape(r: dict) -> dict:
    return {"duration_ms": 1e3 * r["duration_s"],
            "predicted_ms": None if r.get("predicted_s") is None else 1e3 * r["predicted_s"],
            "limit_ms": None if r.get("limit_s") is None else 1e3 * r["limit_s"],
            **{k: r.get(k, 0) for k in KINDS}, "cross_encoder_tokens": r.get("cross_encoder_tokens", 0),
            "embed_rows": r.get("embed_rows", 0), "num_waiting": r.get("num_waiting", 0)}


def gap_reason(steps: list[dict], t0: float, t1: float, slo_s: float) -> tuple[GapReason, dict | None]:
    """Why the gap (t0, t1) between two tokens of one answer was long, and the longest step in it (its shape)."""
    inside = _overlapping(steps, t0, t1)
    if not inside:
        return GapReason.BETWEEN_STEPS, None
    longest = max(inside, key=lambda r: r["duration_s"])
    shape = _shape(longest)
    if longest["duration_s"] > slo_s:
        predicted = longest.get("predicted_s")
        over = predicted is not None and predicted > slo_s
        return (GapReason.ADMITTED_OVER if over else GapReason.OVERRAN), shape
    ended = [r for r in inside if t0 < _end(r) <= t1]
    if len(ended) >= 2 and _busy(inside, t0, t1) > slo_s:
        return GapReason.SKIPPED, shape
    return GapReason.BETWEEN_STEPS, shape


def stage_mix(steps: list[dict], window: tuple[float, float]) -> dict:
    """What the engine did in `window`: the share of it spent in steps, and each kind's tokens in those steps."""
    t0, t1 = window
    inside = _overlapping(steps, t0, t1)
    return {"steps": len(inside), "busy_share": _busy(inside, t0, t1) / (t1 - t0) if t1 > t0 else None,
            **{k: sum(r.get(k, 0) for r in inside) for k in KINDS},
            "waiting_max": max((r.get("num_waiting", 0) for r in inside), default=0)}


def ttft_stage(record: dict, idle: dict[Stage, float]) -> Stage | None:
    """The stage furthest over its idle median (seconds over it), of a request that started its answer or not."""
    over = {s: record[s.value] - idle[s] for s in Stage if record.get(s.value) is not None and s in idle}
    if not over:
        return None
    return max(over, key=over.get)


def explain(records: list[dict], stamps: list[Stamps], steps: list[dict], ttft_slo_s: float, tpot_slo_s: float,
            idle: dict[Stage, float]) -> dict:
    """A rate's misses with their reasons: per TTFT miss the stage that ran furthest over its idle median and the
    steps in its window; per gap over the TPOT SLO the reason and the longest step in it; counts of each."""
    ttft_misses, gaps = [], []
    for rec, st in zip(records, stamps):
        if rec.get("ttft_s") is None or rec["ttft_s"] > ttft_slo_s:
            stage = ttft_stage(rec, idle)
            window = st.window(stage) if stage else None
            ttft_misses.append({"index": rec["index"], "ttft_s": rec.get("ttft_s"), "error": rec.get("error"),
                                "stage": stage.value if stage else None,
                                "stage_over_idle_s": None if stage is None else rec[stage.value] - idle[stage],
                                "steps": stage_mix(steps, window) if window else None})
        for t0, t1 in zip(st.tokens, st.tokens[1:]):
            if t1 - t0 > tpot_slo_s:
                reason, longest = gap_reason(steps, t0, t1, tpot_slo_s)
                gaps.append({"index": rec["index"], "gap_ms": 1e3 * (t1 - t0), "reason": reason.value,
                             "longest_step": longest})
    gaps.sort(key=lambda g: -g["gap_ms"])
    return {"steps": len(steps), "ttft_misses": ttft_misses, "ttft_stages": dict(Counter(m["stage"] for m in ttft_misses)),
            "long_gaps": len(gaps), "gap_reasons": dict(Counter(g["reason"] for g in gaps)), "worst_gaps": gaps[:5]}


def summary_line(rate: float, why: dict) -> str:
    """One printed line per rate: the misses' counts by stage and by reason, and the worst gap's step."""
    parts = [f"why at {rate:g} req/s: TTFT misses {len(why['ttft_misses'])}"]
    if why["ttft_stages"]:
        parts.append("(" + ", ".join(f"{k} {v}" for k, v in sorted(why["ttft_stages"].items(), key=str)) + ")")
    parts.append(f"; gaps over TPOT SLO {why['long_gaps']}")
    if why["gap_reasons"]:
        parts.append("(" + ", ".join(f"{k} {v}" for k, v in sorted(why["gap_reasons"].items())) + ")")
    if why["worst_gaps"] and why["worst_gaps"][0]["longest_step"]:
        g, s = why["worst_gaps"][0], why["worst_gaps"][0]["longest_step"]
        mix = ", ".join(f"{k.split('_')[0]} {s[k]}" for k in KINDS if s[k])
        pred = "-" if s["predicted_ms"] is None else f"{s['predicted_ms']:.1f}"
        parts.append(f"; worst gap {g['gap_ms']:.1f} ms: a step of {mix or 'nothing'} ran {s['duration_ms']:.1f} ms "
                     f"(predicted {pred})")
    return " ".join(parts)
