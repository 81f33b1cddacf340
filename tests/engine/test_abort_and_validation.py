"""Aborts anywhere free every block; bad input is rejected with a clear error and harms nobody else."""
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import EngineConfig, GenerateSpec, RerankSpec, SamplingParams
from engine.request import SeqKind, SequenceStatus
from tests.engine.conftest import assert_no_leaks, make_llm

LONG = "Tell me everything you know about the history of mathematics, from Babylon to today. " * 6


def _step_until(engine, cond, limit=200):
    outs = []
    for _ in range(limit):
        if cond():
            return outs
        outs.extend(engine.step())
    raise AssertionError("condition never reached")


def _drain(engine):
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def _seq(engine, rid):
    sched = engine.scheduler
    return next(s for s in [*sched.running, *sched.queues[SeqKind.GENERATE]] if s.request_id == rid)


def test_aborts_everywhere_free_all_blocks():
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=3, num_kv_blocks=40)
    eng = llm.engine
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    eng.add_request("decoding", "Count slowly from one to one hundred:", p)
    _step_until(eng, lambda: _seq(eng, "decoding").num_output_tokens >= 2)
    eng.add_request("prefilling", LONG, p)
    eng.step()
    pre = _seq(eng, "prefilling")
    assert 0 < pre.num_computed_tokens < pre.num_prompt_tokens  # mid-prefill
    eng.add_request("filler", "Name three colours.", p)
    eng.add_request("waiting", "Name three animals.", p)
    eng.step()
    assert _seq(eng, "waiting").status is SequenceStatus.WAITING  # max_num_seqs keeps it out
    for rid in ("decoding", "prefilling", "waiting"):
        assert eng.abort(rid)
    outs = _drain(eng)
    finals = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert finals == {"decoding": "abort", "prefilling": "abort", "waiting": "abort", "filler": "length"}
    assert not eng.abort("decoding")  # already gone
    assert_no_leaks(llm)


def test_abort_while_preempted_frees_all_blocks():
    llm = make_llm(num_kv_blocks=12, enable_prefix_caching=False)
    eng = llm.engine
    p = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"r{i}", f"Story number {i}: once upon a time", p)
    preempted = lambda: [rid for rid, r in eng._requests.items()  # noqa: E731
                         if r.seq.status is SequenceStatus.PREEMPTED]
    _step_until(eng, preempted)
    victim = preempted()[0]
    assert not _seq(eng, victim).block_table
    assert eng.abort(victim)
    outs = _drain(eng)
    assert [o.finish_reason for o in outs if o.request_id == victim and o.finished] == ["abort"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_rejected_while_others_keep_running(llm):
    eng = llm.engine
    good = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.add_request("good", "The sky is", good)
    eng.step()
    too_long = [1] * (eng.max_model_len + 5)
    cases = [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=too_long), "max_model_len"),
        (dict(prompt=[0, 10**9]), "token ids"),
        (dict(prompt=None, messages=[{"role": "user"}]), "content"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.add_request("bad", params=good, **kwargs)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("good", "again", good)
    outs = _drain(eng)
    final = [o for o in outs if o.request_id == "good" and o.finished]
    assert final and final[0].finish_reason == "length" and final[0].completion_tokens == 6
    assert_no_leaks(llm)


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        make_llm(model=str(missing))


def test_bad_engine_config_names_the_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_final_outputs_report_usage_and_timings(llm):
    eng = llm.engine
    eng.add_request("timed", "Hello there", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    eng.add_rerank("scored", "greeting", ["hello", "goodbye"])
    outs = _drain(eng)
    gen = next(o for o in outs if o.request_id == "timed" and o.finished)
    job = next(o for o in outs if o.request_id == "scored")
    assert gen.completion_tokens == 3 and gen.prompt_tokens == len(llm.tokenizer("Hello there").input_ids)
    assert gen.queue_time_s is not None and gen.queue_time_s >= 0
    assert gen.first_token_time is not None and gen.first_token_time >= gen.arrival_time
    assert job.queue_time_s is not None and job.queue_time_s >= 0 and job.prompt_tokens > 0
    assert_no_leaks(llm)


@dataclasses.dataclass(frozen=True)
class _UnknownSpec:
    request_id: str
    kind = "unknown"
    completions = 1
    num_inputs = 0


def test_prepare_checks_off_thread_and_add_queues_every_kind_once(llm):
    """One path for every kind: prepare(spec) checks and tokenizes on any thread and queues nothing; add(job) queues
    the job, once; a spec the intake has no builder for is a TypeError naming it."""
    eng = llm.engine
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    specs = [GenerateSpec("g", "The sky is", p), RerankSpec("r", "greeting", ["hello", "goodbye"])]
    with ThreadPoolExecutor(1) as pool:  # as the service's intake thread does
        gen, job = pool.map(eng.prepare, specs)
    assert not eng.has_unfinished()  # prepared, not queued
    assert gen.sequences[0].token_ids == llm.tokenizer("The sky is").input_ids and len(job.sequences) == 2
    with pytest.raises(ValueError, match="prompt must not be empty"):
        eng.prepare(GenerateSpec("bad", "", p))
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        eng.prepare(RerankSpec("bad", " ", ["d"]))
    with pytest.raises(TypeError, match="_UnknownSpec"):
        eng.prepare(_UnknownSpec("u"))
    eng.add(gen)
    eng.add(job)
    with pytest.raises(ValueError, match="already in use"):
        eng.add(job)
    finals = {o.request_id: o for o in _drain(eng) if o.finished}
    assert finals["g"].completion_tokens == 2 and len(finals["r"].scores) == 2
    assert eng.add_request("again", "The sky is", p) == gen.sequences[0].token_ids[:gen.sequences[0].num_prompt_tokens]
    _drain(eng)
    assert_no_leaks(llm)
