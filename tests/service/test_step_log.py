"""`tandem serve --step-log FILE`: every step the engine runs becomes one JSON line holding its record."""
from __future__ import annotations

import json

from engine import LLM, EngineConfig, SamplingParams
from service.step_log import StepLog


def test_each_engine_step_is_one_json_line_with_its_record(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    llm = LLM(EngineConfig(max_num_batched_tokens=64, kv_cache_bytes=32 * 2**20))
    records = []
    llm.engine.add_observer(records.append)
    llm.engine.add_observer(log.on_step)
    llm.generate(["Tell me about bees."], SamplingParams(max_tokens=3, ignore_eos=True))
    llm.rerank("bees", ["Bees make honey.", "Trains run on rails."])
    log.close()
    log.on_step(records[0])  # after close: ignored, nothing raised
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [json.loads(json.dumps(r.flat())) for r in records] and len(lines) >= 4
    assert sum(line["decode_tokens"] for line in lines) >= 2 and sum(line["rerank_pairs_scored"] for line in lines) == 2


def test_a_step_with_owed_shares_and_per_kind_counts_is_one_flat_json_line(tmp_path):
    """The latency objective's owed shares are dataclasses and the counts are maps keyed by kind: the line holds the
    shares as objects and the counts by their names (what bench.rag_steps and bench.step_shares read)."""
    from engine.batch import Owed
    from engine.outputs import StepRecord
    from engine.step_time import TokenKind

    record = StepRecord(step=1, start_time=0.0, duration_s=0.01, decode_tokens=4, cached_tokens=0, num_seqs=6,
                        budget=64, kv_blocks_total=8, kv_blocks_free=4, kv_blocks_cached=0, preempted=0,
                        num_running=5, num_waiting=0, request_ids=["c", "e"],
                        tokens={TokenKind.EMBED: 30, TokenKind.LLM_RERANK: 8}, rows={TokenKind.EMBED: 2,
                                                                                     TokenKind.LLM_RERANK: 1},
                        rows_done={TokenKind.EMBED: 2}, owed=(Owed(TokenKind.EMBED, 0.002, 0.001),))
    log = StepLog(tmp_path / "steps.jsonl")
    log.on_step(record)
    log.close()
    (line,) = [json.loads(text) for text in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert (line["embed_rows"], line["embed_rows_done"], line["embed_tokens"]) == (2, 2, 30)
    assert (line["rerank_pairs"], line["rerank_tokens"], line["rerank_pairs_scored"]) == (1, 8, 0)
    assert line["owed"] == [{"kind": "embed_tokens", "seconds": 0.002, "unit_s": 0.001}] and "tokens" not in line
