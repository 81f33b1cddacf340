"""bench/step_shares.py's arithmetic on a made-up step log (no server started)."""
import json

from bench.step_shares import decode_only_times, main, phase_windows, summarize, windows


def _step(start: float, duration: float, decodes: int, embed_rows: int = 0, predicted: float | None = None,
          owed: tuple = ()) -> dict:
    return {"start_time": start, "duration_s": duration, "decode_tokens": decodes, "prefill_tokens": 0,
            "rerank_tokens": 0, "embed_rows": embed_rows, "embed_rows_done": embed_rows, "num_seqs": decodes + embed_rows,
            "rerank_pairs_scored": 0, "predicted_s": predicted, "owed": list(owed)}


def _log() -> list[dict]:
    """Ten decode-only steps of 8 rows at 40 ms, then (after a 5 s pause) ten mixed ones at 80 ms predicted 64 ms."""
    alone = [_step(100 + 0.05 * i, 0.04, 8) for i in range(10)]
    mixed = [_step(106 + 0.1 * i, 0.08, 8, embed_rows=4, predicted=0.064,
                   owed=({"kind": "embed_tokens", "seconds": 0.016, "unit_s": 0.002},)) for i in range(10)]
    return alone + mixed


def test_a_mixed_steps_decode_share_is_the_decode_only_time_over_its_time():
    log = _log()
    cut = windows(log, gap_s=1.0)
    assert [len(w) for w in cut] == [10, 10]
    s = summarize(cut[1], decode_only_times(log))
    assert s["decode_share_in_mixed"] == 0.5  # 40 ms of decodes in an 80 ms step
    assert s["mixed_measured_over_predicted"] == 1.25
    assert s["owed_share_of_mixed_time"] == {"embed_tokens": 0.2}
    assert s["served_per_s"]["embed_rows_done"] > 0 and s["mixed_steps"] == 10 and s["decode_only_steps"] == 0
    alone = summarize(cut[0], decode_only_times(log))
    assert alone["decode_only_step_ms"] == 40.0 and "decode_share_in_mixed" not in alone


def test_phases_of_a_pipeline_result_cut_the_log_on_the_same_clock(tmp_path):
    log = _log()
    result = {"runs": {"tandem": [{"phases": {"chats_alone": {"window_mono_ms": [100_000, 100_500]},
                                              "W2": {"window_mono_ms": [106_000, 107_000]}}}],
                       "split_pinned": [{"phases": {"W2": {"window_mono_ms": [0, 10**9]}}}]}}
    named = phase_windows(log, result)
    assert [(name, len(w)) for name, w in named] == [("tandem run 0 chats_alone", 10), ("tandem run 0 W2", 10)]
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(json.dumps(r) for r in log) + "\n")
    phases = tmp_path / "pipeline.json"
    phases.write_text(json.dumps(result) + "\n")
    got = main([str(steps), "--phases", str(phases), "--json"])
    assert [g["window"] for g in got] == ["tandem run 0 chats_alone", "tandem run 0 W2"]
    assert got[1]["decode_share_in_mixed"] == 0.5
