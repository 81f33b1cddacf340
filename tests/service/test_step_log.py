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
