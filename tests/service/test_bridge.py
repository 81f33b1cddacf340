"""EngineBridge against a scripted fake engine: ordering, admission, timeouts, draining, lifecycle hooks."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engine import GenerateSpec, RerankSpec, SamplingParams
from engine.outputs import StepOutput, StepRecord, TokenDelta
from engine.request import FinishReason
from service.bridge import EngineBridge
from service.errors import ErrorKind, ServiceError
from tests.service.harness import Recorder


def _record(**values) -> StepRecord:
    """A StepRecord with zeros wherever the test has nothing to say (robust to fields added later)."""
    required = {f.name: [] if f.name.endswith("_ids") else 0 for f in dataclasses.fields(StepRecord)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return StepRecord(**{**required, **values})


@dataclasses.dataclass(frozen=True, slots=True)
class FakeJob:
    """What the fake engine queues: a request emitting `tokens` tokens, one a step."""
    request_id: str
    tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class CountdownSpec:
    """A kind of work the bridge has never heard of: it implements engine/specs.py's JobSpec and nothing else."""
    request_id: str
    steps: int
    kind = "countdown"
    completions = 3
    num_inputs = 5


class FakeEngine:
    """Emits one token "t" per step for every admitted request until max_tokens (a CountdownSpec: its steps); steps
    only while `running` is set."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}  # id -> tokens left
        self.pending: list[StepOutput] = []
        self.observers = []
        self.running = threading.Event()
        self.running.set()
        self.steps = 0
        self.thread_ids: set[int] = set()
        self.intake_thread_ids: set[int] = set()

    def add_observer(self, fn) -> None:
        self.observers.append(fn)

    def remove_observer(self, fn) -> None:
        self.observers.remove(fn)

    def prepare(self, spec) -> FakeJob:
        """Called on the bridge's intake thread, never the engine's."""
        self.intake_thread_ids.add(threading.get_ident())
        if isinstance(spec, CountdownSpec):
            return FakeJob(spec.request_id, spec.steps)
        if isinstance(spec, RerankSpec):
            raise ValueError("this fake engine does not rerank")
        if not spec.prompt:
            raise ValueError("prompt must not be empty")
        return FakeJob(spec.request_id, spec.params.max_tokens)

    def add(self, job: FakeJob) -> None:
        self.thread_ids.add(threading.get_ident())
        assert isinstance(job, FakeJob), "the bridge hands the engine the job prepared off its thread"
        self.live[job.request_id] = job.tokens

    def abort(self, request_id: str) -> bool:
        if self.live.pop(request_id, None) is None:
            return False
        self.pending.append(TokenDelta(request_id, finished=True, finish_reason=FinishReason.ABORT))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.live or self.pending)

    def step(self) -> list[StepOutput]:
        self.thread_ids.add(threading.get_ident())
        outputs, self.pending = self.pending, []
        served = []
        if self.running.wait(0.01):
            for rid in list(self.live):
                self.live[rid] -= 1
                served.append(rid)
                done = self.live[rid] == 0
                outputs.append(TokenDelta(rid, [7], "t", finished=done,
                                          finish_reason=FinishReason.LENGTH if done else None, first_token_time=1.0))
                if done:
                    del self.live[rid]
        record = _record(step=self.steps, decode_tokens=len(served), num_seqs=len(served), request_ids=served)
        self.steps += 1
        for fn in self.observers:
            fn(record)
        return outputs

    def stats(self) -> dict:
        return {"live": len(self.live)}


@pytest.fixture
async def bridge():
    engine = FakeEngine()
    recorder = Recorder()
    b = EngineBridge(engine, max_waiting=2, hooks=[recorder])
    b.start()
    b.recorder = recorder
    yield b
    engine.running.set()
    await b.stop()


def _collect(events: list, done: asyncio.Event):
    def sink(event) -> None:
        events.append(event)
        if isinstance(event, ServiceError) or event.finished:
            done.set()
    return sink


async def _generate(bridge: EngineBridge, client_id: str, max_tokens: int = 3, prompt: str = "hi", **kw):
    events, done = [], asyncio.Event()
    lc = bridge.submit(GenerateSpec(f"id-{client_id}", prompt, SamplingParams(max_tokens=max_tokens)), client_id,
                       _collect(events, done), **kw)
    return lc, events, done


async def test_outputs_arrive_in_order_on_the_loop_and_the_engine_stays_on_one_thread(bridge):
    lc, events, done = await _generate(bridge, "a", max_tokens=3)
    await done.wait()
    assert [e.text for e in events] == ["t", "t", "t"] and events[-1].finish_reason == "length"
    assert len(bridge.engine.thread_ids) == 1 and threading.get_ident() not in bridge.engine.thread_ids
    assert len(bridge.engine.intake_thread_ids) == 1 and not bridge.engine.intake_thread_ids & bridge.engine.thread_ids
    assert await bridge.stats() == {"live": 0, "bridge_live": 0, "bridge_waiting": 0}
    assert lc.finish_reason == "length"
    assert lc.arrival <= lc.finished and lc.scheduled is not None and lc.first_token == 1.0


async def test_value_error_becomes_invalid_argument(bridge):
    lc, events, done = await _generate(bridge, "bad", prompt="")
    await done.wait()
    assert events[0].kind is ErrorKind.INVALID_ARGUMENT and events[0].message == "prompt must not be empty"
    assert lc.finish_reason == "error" and lc.error == "INVALID_ARGUMENT"
    assert bridge.recorder.finished["bad"] == [lc]


async def test_waiting_queue_full_is_resource_exhausted_until_it_drains(bridge):
    bridge.engine.running.clear()  # nothing gets served: everything admitted waits
    first = [await _generate(bridge, f"w{i}") for i in range(2)]
    with pytest.raises(ServiceError) as info:
        await _generate(bridge, "over")
    assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "--max-waiting" in info.value.message
    bridge.engine.running.set()
    for _, _, done in first:
        await done.wait()
    _, events, done = await _generate(bridge, "again")
    await done.wait()
    assert events[-1].finish_reason == "length"


async def test_an_owner_holds_at_most_its_share_and_a_newcomer_is_still_admitted():
    """max_waiting 6: a lone owner may hold 6 // 2 = 3; with one other owner waiting each share is 6 // 3 = 2, so the
    flooder (holding 3) is refused while the newcomer is admitted; once served, the flooder's share is back."""
    engine = FakeEngine()
    b = EngineBridge(engine, max_waiting=6)
    b.start()
    engine.running.clear()  # nothing gets served: everything admitted waits
    try:
        flood = [await _generate(b, f"f{i}", owner="flood") for i in range(3)]
        with pytest.raises(ServiceError) as info:
            await _generate(b, "f3", owner="flood")
        assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "over its share" in info.value.message
        assert "its share is 3 of --max-waiting 6" in info.value.message
        newcomer = [await _generate(b, f"n{i}", owner="newcomer") for i in range(2)]
        with pytest.raises(ServiceError):
            await _generate(b, "n2", owner="newcomer")  # its share is 6 // 3 = 2 while the flood waits
        third = await _generate(b, "t0", owner="third")  # 6 // 4 = 1, and 5 of 6 places are taken
        with pytest.raises(ServiceError) as full:
            await _generate(b, "t1", owner="fourth")  # its share would be 1, but all 6 places are taken
        assert "server is at capacity" in full.value.message
        engine.running.set()
        for _, _, done in flood + newcomer + [third]:
            await done.wait()
        assert b.num_waiting == 0 and b.fair_share("flood") == 3 and not b._owners
    finally:
        engine.running.set()
        await b.stop()


async def test_timeout_aborts_in_the_engine_and_reports_deadline_exceeded(bridge):
    bridge.engine.running.clear()
    lc, events, done = await _generate(bridge, "slow", max_tokens=100, timeout_ms=20)
    await done.wait()
    assert events[-1].kind is ErrorKind.DEADLINE_EXCEEDED and "timeout_ms of 20 ms" in events[-1].message
    assert lc.finish_reason == "deadline"
    assert (await bridge.stats())["live"] == 0  # the engine dropped it


async def test_a_result_that_reaches_the_loop_after_its_deadline_is_deadline_exceeded(bridge):
    """The engine finishes the request, but the loop runs its output before the deadline's timer (both ready at
    once: the loop was busy past the deadline). The client still gets DEADLINE_EXCEEDED, as from a gRPC deadline."""
    bridge.engine.running.clear()
    finished_posted = threading.Event()
    post = bridge._post

    def watching_post(fn, *args) -> None:
        post(fn, *args)
        if fn == bridge._dispatch and any(out.finished for out in args[0]):
            finished_posted.set()

    bridge._post = watching_post
    lc, events, done = await _generate(bridge, "late", max_tokens=1, timeout_ms=50)
    timer = bridge._handles[lc.engine_id].timer
    # The loop is held (no await) until the final output is queued on it and its deadline has passed.
    bridge.engine.running.set()
    assert finished_posted.wait(timeout=60)
    while asyncio.get_running_loop().time() < timer.when():
        threading.Event().wait(0.005)
    await done.wait()
    assert [type(e) for e in events] == [ServiceError], events  # no token after the deadline either
    assert events[0].kind is ErrorKind.DEADLINE_EXCEEDED and "timeout_ms of 50 ms" in events[0].message
    assert lc.finish_reason == "deadline" and not bridge._handles
    assert (await bridge.stats())["live"] == 0


async def test_draining_refuses_new_work_and_wait_idle_returns_when_done(bridge):
    _, events, done = await _generate(bridge, "inflight", max_tokens=2)
    bridge.draining = True
    with pytest.raises(ServiceError) as info:
        await _generate(bridge, "late")
    assert info.value.kind is ErrorKind.UNAVAILABLE
    await bridge.wait_idle()
    assert done.is_set() and events[-1].finish_reason == "length"


async def test_a_stopped_bridge_no_longer_observes_the_engine():
    engine = FakeEngine()
    b = EngineBridge(engine)
    b.start()
    assert len(engine.observers) == 1
    await b.stop()
    assert engine.observers == []  # an engine outlives its bridges (tests, benchmarks): no records pile up


async def test_a_new_kind_of_work_rides_the_one_submit_path_unchanged(bridge):
    """The bridge reads a request only through its spec (JobSpec): a kind it has never heard of is admitted,
    prepared on the intake thread, queued on the engine thread and finished like any other, and its lifecycle
    carries the spec's own kind and counts."""
    events, done = [], asyncio.Event()
    lc = bridge.submit(CountdownSpec("id-new", steps=2), "new", _collect(events, done))
    await done.wait()
    assert [e.finished for e in events] == [False, True] and events[-1].finish_reason == "length"
    assert (lc.kind, lc.completions, lc.documents, lc.finish_reason) == ("countdown", 3, 5, "length")
    assert bridge.recorder.finished["new"] == [lc]
    assert not bridge.engine.intake_thread_ids & bridge.engine.thread_ids


async def test_the_lifecycle_counts_come_from_the_spec(bridge):
    """A rerank's documents, a generation's n: what the lifecycle (metrics, spans) records is the spec's."""
    events, done = [], asyncio.Event()
    lc = bridge.submit(RerankSpec("id-r", "q", ["a", "b", "c"]), "r", _collect(events, done))
    await done.wait()
    assert (lc.kind, lc.completions, lc.documents) == ("rerank", 1, 3)
    assert events[0].kind is ErrorKind.INVALID_ARGUMENT and events[0].message == "this fake engine does not rerank"
    gen = bridge.submit(GenerateSpec("id-g", "hi", SamplingParams(max_tokens=1, n=2)), "g", lambda event: None)
    assert (gen.kind, gen.completions, gen.documents) == ("generate", 2, 0)
