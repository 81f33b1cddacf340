"""EngineBridge: the engine runs in its own thread; the event loop talks to it through a command queue.

The engine is synchronous and not thread-safe, so exactly one thread (started
here) ever changes it. The loop side submits requests and aborts as commands on
a thread-safe queue, one dataclass per command (AddJob, Abort, Query, Stop); the
engine thread applies them between steps, runs `step()`, and hands each step's
outputs back with one `loop.call_soon_threadsafe`. Nothing here blocks the loop.

Every kind of request is one path: the core builds its spec (engine/specs.py:
GenerateSpec, RerankSpec, EmbedSpec), `submit(spec, ...)` admits it, and the
engine's `prepare(spec)` / `add(job)` do the rest; nothing here names a kind.
Commands pass through an intake thread first, in order: it prepares every
request's job (`LLMEngine.prepare`: it reads the tokenizers and touches no
engine state) so that rendering and tokenizing (40 documents: ~50 ms on a CPU)
happens while the engine steps, never on the engine thread between two steps
that running chats wait for (measured by bench/mixed_serve.py as
`tandem_step_gap_seconds`).

A generation with n > 1 sends the outputs of all its completions (TokenDelta.index) to its sink; only the one
with finished=True ends it, and an abort stops all n.

Admission: `max_waiting` bounds the requests that are admitted but not yet
served by any engine step (RESOURCE_EXHAUSTED beyond it); running work is
bounded by the engine itself (max_num_seqs, the KV pool). Each request has an
owner (the client as its door knows it: a gRPC stream, a connection), and an
owner may hold at most its share of those places (`fair_share`), so one client
that writes without reading cannot take the queue from the others.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Iterable

from engine.errors import InputTooLong, NotLoaded
from engine.outputs import TokenDelta
from engine.request import FinishReason
from service.errors import ErrorKind, ServiceError, draining
from service.lifecycle import LifecycleHooks, RequestLifecycle

if TYPE_CHECKING:
    from engine import LLMEngine
    from engine.jobs import Job
    from engine.outputs import StepOutput, StepRecord
    from engine.specs import JobSpec

log = logging.getLogger("tandem.bridge")

Event = Any  # a StepOutput (TokenDelta, RerankOutput, EmbedOutput) | ServiceError: what a request's sink receives
Sink = Callable[[Event], None]


@dataclass(slots=True, eq=False)
class _Handle:
    """Loop-side state of one admitted request."""
    lifecycle: RequestLifecycle
    sink: Sink
    timer: asyncio.TimerHandle | None = None
    timeout_ms: int = 0
    expired: bool = False
    server_aborted: bool = False  # by abort_all (the drain's timeout), not by its client


# ---- commands: what the loop asks of the engine thread, one type per command ----------------------------------

@dataclass(frozen=True, slots=True)
class AddJob:
    """Queue a request of any kind: its spec, and what the intake thread made of it (LLMEngine.prepare)."""
    spec: "JobSpec"
    prepared: "Job | Exception | None" = None  # set by the intake thread: the job, or the exception that refused it


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Query:
    """Ask the engine between steps (its stats or model info); the answer (or exception) resolves future."""
    kind: "QueryKind"
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class Stop:
    """End the engine thread after the commands taken with this one."""


Command = AddJob | Abort | Query | Stop


class EngineBridge:
    def __init__(self, engine: "LLMEngine", *, max_waiting: int = 256,
                 hooks: Iterable[LifecycleHooks] = ()) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.hooks: list[LifecycleHooks] = list(hooks)
        self.draining = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # to the engine thread, from the intake thread
        self._intake: queue.SimpleQueue = queue.SimpleQueue()  # every command, in order, from the loop
        self._intake_thread: threading.Thread | None = None
        self._handles: dict[str, _Handle] = {}  # loop only
        self._waiting: dict[str, str] = {}  # loop only: admitted, not yet served by a step -> its owner
        self._owners: Counter[str] = Counter()  # loop only: each owner's requests in _waiting
        self._records: list["StepRecord"] = []  # engine thread only
        self._live: set[str] = set()  # engine thread only: ids the engine accepted and has not finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle: asyncio.Event | None = None

    # ---- lifecycle of the bridge -----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs go to `loop` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self.engine.add_observer(self._on_record)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()
        self._intake_thread = threading.Thread(target=self._run_intake, name="tandem-intake", daemon=True)
        self._intake_thread.start()

    async def stop(self) -> None:
        """Fail what is still live with UNAVAILABLE, end the engine thread and stop observing the engine's steps."""
        if self._thread is None:
            return
        for engine_id in list(self._handles):
            self._intake.put(Abort(engine_id))
            self._finish_error(engine_id, draining())
        self._intake.put(Stop())
        await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self._intake_thread.join)
        self._thread = None
        self.engine.remove_observer(self._on_record)

    @property
    def num_live(self) -> int:
        return len(self._handles)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def wait_idle(self) -> None:
        """Return once no admitted request is live."""
        await self._idle.wait()

    async def _query(self, kind: "QueryKind") -> Any:
        future = self._loop.create_future()
        self._intake.put(Query(kind, future))
        return await future

    async def stats(self) -> dict:
        """The engine's stats (read on the engine thread between steps) plus the bridge's own counts."""
        stats = await self._query(QueryKind.STATS)
        return {**stats, "bridge_live": self.num_live, "bridge_waiting": self.num_waiting}

    async def prompt_token_ids(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        """What the engine would make of a prompt or chat, computed on a worker thread (it reads the tokenizer
        only, as the intake thread does). Raises ValueError naming the field."""
        return await asyncio.to_thread(self.engine.prompt_token_ids, prompt, messages)

    async def model_info(self) -> dict:
        """The engine's model_info(), read on the engine thread between steps."""
        return await self._query(QueryKind.MODEL_INFO)

    # ---- requests (loop side) --------------------------------------------------------------------

    def submit(self, spec: "JobSpec", client_id: str, sink: Sink, *, timeout_ms: int = 0,
               metadata: dict[str, str] | None = None, owner: str | None = None) -> RequestLifecycle:
        """Admit a request of any kind under `spec.request_id` (the core API's, unique in the process); its outputs
        (a generation's token deltas, a rerank's or embedding's one final output) or a ServiceError go to sink on
        the loop. `owner`: the client it counts against for its share of the waiting places (the core API always
        names one; None: only max_waiting bounds it, for a caller that owns the bridge alone). Raises ServiceError."""
        self._check_room(owner)
        lc = RequestLifecycle(engine_id=spec.request_id, client_id=client_id, kind=str(spec.kind),
                              metadata=dict(metadata or {}), completions=spec.completions,
                              documents=spec.num_inputs)
        engine_id = spec.request_id
        handle = _Handle(lc, sink, timeout_ms=timeout_ms)
        if timeout_ms > 0:
            handle.timer = self._loop.call_later(timeout_ms / 1000, self._expire, engine_id)
        self._handles[engine_id] = handle
        self._waiting[engine_id] = owner
        if owner is not None:
            self._owners[owner] += 1
        self._idle.clear()
        self._emit("on_arrival", lc)
        self._intake.put(AddJob(spec))
        return lc

    def refused(self, client_id: str, kind: str, metadata: dict[str, str], error: str | None,
                message: str | None = None) -> None:
        """Tell the hooks of a request answered with an error before admission (`error`: its status code name;
        None when the door's own status is in metadata["status"]; `message`: what the client was told)."""
        now = time.monotonic()
        lc = RequestLifecycle(engine_id="", client_id=client_id, kind=kind, arrival=now, finished=now,
                              finish_reason="rejected", error=error, error_message=message, metadata=dict(metadata))
        self._emit("on_refused", lc)

    def abort(self, engine_id: str) -> None:
        """Ask the engine to stop a request; its final output (finish reason "abort") still reaches its sink."""
        if engine_id in self._handles:
            self._intake.put(Abort(engine_id))

    def abort_all(self) -> None:
        """Abort everything live (the drain's timeout). A generation ends with finish reason abort; a job with no
        partial answer (a rerank, an embedding) ends with UNAVAILABLE, which is what its client receives, so the
        lifecycle hooks (the access log) record that, not the engine's abort."""
        for engine_id, handle in list(self._handles.items()):
            handle.server_aborted = True
            self.abort(engine_id)

    def fair_share(self, owner: str) -> int:
        """The waiting places `owner` may hold now: max_waiting split among the owners with requests waiting
        (this one counted) plus one share kept for a client that has none waiting yet, at least 1. A lone client
        may hold half; each owner that starts waiting shrinks every share, and an owner over a smaller share keeps
        what it holds but is admitted nothing more until it is back under it."""
        others = len(self._owners) - (owner in self._owners)
        return max(1, self.max_waiting // (others + 2))

    def _check_room(self, owner: str | None) -> None:
        """Whether the bridge may admit a request of `owner` now. Raises ServiceError."""
        if self.draining or self._thread is None:
            raise draining()
        if owner is not None:
            self._check_share(owner)
        if len(self._waiting) >= self.max_waiting:
            raise ServiceError(ErrorKind.RESOURCE_EXHAUSTED,
                               f"server is at capacity: {len(self._waiting)} requests are waiting for the engine "
                               f"(limit {self.max_waiting}, --max-waiting); retry with backoff or use another replica")

    def _check_share(self, owner: str) -> None:
        held, share = self._owners.get(owner, 0), self.fair_share(owner)
        if held >= share:
            raise ServiceError(ErrorKind.RESOURCE_EXHAUSTED,
                               f"this client is over its share of the waiting queue: {held} of its requests are "
                               f"waiting for the engine, its share is {share} of --max-waiting {self.max_waiting} "
                               f"while {len(self._owners)} clients wait; read its answers, or retry with backoff")

    def _served(self, engine_id: str) -> None:
        """The request no longer waits (a step served it, or it ended): its place and its owner's are free."""
        if engine_id not in self._waiting:
            return
        owner = self._waiting.pop(engine_id)
        if owner is not None:
            self._owners[owner] -= 1
            if not self._owners[owner]:
                del self._owners[owner]

    def _expire(self, engine_id: str) -> None:
        handle = self._handles.get(engine_id)
        if handle is not None:
            handle.expired = True
            self.abort(engine_id)

    # ---- the engine thread -----------------------------------------------------------------------

    def _run_intake(self) -> None:
        """Forward every command to the engine thread in order, preparing requests' jobs on the way."""
        engine = self.engine
        while True:
            command = self._intake.get()
            if isinstance(command, AddJob):
                try:
                    command = replace(command, prepared=engine.prepare(command.spec))
                except Exception as exc:  # refused (ValueError) or a bug: the engine thread fails the request
                    command = replace(command, prepared=exc)
            self._commands.put(command)
            if isinstance(command, Stop):
                return

    def _run(self) -> None:
        engine = self.engine
        idle_step = False  # the last step served nothing: wait a little for commands instead of spinning
        while True:
            commands = []
            if not engine.has_unfinished():
                commands.append(self._commands.get())
            elif idle_step:
                try:
                    commands.append(self._commands.get(timeout=0.005))
                except queue.Empty:
                    pass
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            failures: list[tuple[str, ServiceError]] = []
            stop = False
            for command in commands:
                stop = self._apply(command, failures) or stop
            outputs: list = []
            if not stop and engine.has_unfinished():
                outputs = self._step(failures)
            records, self._records = self._records, []
            idle_step = not outputs and all(r.num_seqs == 0 for r in records)
            if outputs or failures or records:
                self._post(self._dispatch, outputs, failures, records)
            if stop:
                return

    def _on_record(self, record: "StepRecord") -> None:
        # Not bound to one list's append: the loop below swaps in a fresh list after every step.
        self._records.append(record)

    def _apply(self, command: Command, failures: list[tuple[str, ServiceError]]) -> bool:
        """Carry out one command on the engine thread; True for Stop."""
        engine = self.engine
        match command:
            case AddJob():
                self._add(command, failures)
            case Abort():
                engine.abort(command.request_id)
            case Query():
                try:
                    result = engine.stats() if command.kind is QueryKind.STATS else engine.model_info()
                    error = None
                except Exception as exc:
                    result, error = None, exc
                self._post(settle, command.future, result, error)
            case Stop():
                return True
            case _:
                raise TypeError(f"unknown bridge command {command!r}")
        return False

    def _add(self, command: AddJob, failures: list[tuple[str, ServiceError]]) -> None:
        """Queue the command's prepared job (engine.add), or fail its request with what refused it: a ValueError (bad
        input) with INVALID_ARGUMENT, NotLoaded (no embedder) with FAILED_PRECONDITION, anything else with
        INTERNAL."""
        request_id = command.spec.request_id
        try:
            self.engine.add(_prepared(command))
            self._live.add(request_id)
        except NotLoaded as exc:
            failures.append((request_id, ServiceError(ErrorKind.FAILED_PRECONDITION, str(exc))))
        except ValueError as exc:
            failures.append((request_id, ServiceError(ErrorKind.INVALID_ARGUMENT, str(exc),
                                                      too_long=isinstance(exc, InputTooLong))))
        except Exception as exc:  # a bug, not bad input: fail this request, keep serving
            log.exception("add %s failed", request_id)
            failures.append((request_id, ServiceError(ErrorKind.INTERNAL, f"could not admit: {exc!r}")))

    def _step(self, failures: list[tuple[str, ServiceError]]) -> list:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine catches model errors itself; this is a last resort
            log.exception("engine step raised")
            for engine_id in list(self._live):
                self.engine.abort(engine_id)
                failures.append((engine_id, ServiceError(ErrorKind.INTERNAL, f"engine step failed: {exc!r}")))
            self._live.clear()
            return []
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    # ---- back on the loop ------------------------------------------------------------------------

    def _dispatch(self, outputs: list["StepOutput"], failures: list[tuple[str, ServiceError]],
                  records: list["StepRecord"]) -> None:
        for record in records:
            for engine_id in record.request_ids:
                self._mark_scheduled(engine_id, record.start_time)
            self._emit("on_step", record)
        for engine_id, error in failures:
            self._finish_error(engine_id, error)
        for out in outputs:
            self._deliver(out)

    def _mark_scheduled(self, engine_id: str, when: float) -> None:
        self._served(engine_id)
        handle = self._handles.get(engine_id)
        if handle is not None and handle.lifecycle.scheduled is None:
            handle.lifecycle.scheduled = when

    def _deliver(self, out: "StepOutput") -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return
        lc = handle.lifecycle
        if handle.timer is not None and not handle.expired and self._loop.time() >= handle.timer.when():
            # Its deadline passed before the loop ran the timer (the loop had ready callbacks, these outputs among
            # them): the request ends in DEADLINE_EXCEEDED all the same, as a gRPC deadline would.
            handle.timer.cancel()
            self._expire(out.request_id)
        self._served(out.request_id)
        lc.prompt_tokens, lc.cached_tokens = out.prompt_tokens, out.cached_tokens
        lc.embedder_scored = getattr(out, "embedder_scored", 0)
        if isinstance(out, TokenDelta):
            lc.completion_tokens = max(lc.completion_tokens, out.completion_tokens)
            if out.first_token_time is not None and lc.first_token is None:
                lc.first_token = out.first_token_time
                self._emit("on_first_token", lc)
        if not out.finished:
            if not handle.expired:  # past its deadline, its request ends in DEADLINE_EXCEEDED: no more tokens
                self._send(handle, out)
            return
        if handle.expired:  # aborted by its timer, or finished after its deadline before the timer ran
            self._finish_error(out.request_id, ServiceError(
                ErrorKind.DEADLINE_EXCEEDED, f"request exceeded its timeout_ms of {handle.timeout_ms} ms"))
        elif out.finish_reason is FinishReason.ERROR:
            self._finish_error(out.request_id, ServiceError(ErrorKind.INTERNAL, out.error or "engine error"))
        elif handle.server_aborted and out.finish_reason is FinishReason.ABORT and not isinstance(out, TokenDelta):
            self._finish_error(out.request_id, ServiceError(
                ErrorKind.UNAVAILABLE, f"{lc.kind} aborted: the server is shutting down; retry"))
        else:
            self._close(out.request_id, out.finish_reason)
            self._send(handle, out)

    def _finish_error(self, engine_id: str, error: ServiceError) -> None:
        handle = self._handles.get(engine_id)
        if handle is None:
            return
        reason = "deadline" if error.kind is ErrorKind.DEADLINE_EXCEEDED else "error"
        self._close(engine_id, reason, error.kind.name, error.message)
        self._send(handle, error)

    def _close(self, engine_id: str, reason: str, error: str | None = None, message: str | None = None) -> None:
        handle = self._handles.pop(engine_id)
        self._served(engine_id)
        if handle.timer is not None:
            handle.timer.cancel()
        lc = handle.lifecycle
        lc.finished, lc.finish_reason, lc.error, lc.error_message = time.monotonic(), reason, error, message
        if not self._handles:
            self._idle.set()
        self._emit("on_finish", lc)

    @staticmethod
    def _send(handle: _Handle, event: Event) -> None:
        try:
            handle.sink(event)
        except Exception:
            log.exception("sink of %s raised", handle.lifecycle.engine_id)

    def _emit(self, name: str, arg) -> None:
        for hooks in self.hooks:
            try:
                getattr(hooks, name)(arg)
            except Exception:
                log.exception("lifecycle hook %s raised", name)


def _prepared(command: AddJob) -> "Job":
    """What the intake thread made of the command (the request's job), or the refusal it met, raised."""
    if isinstance(command.prepared, Exception):
        raise command.prepared
    return command.prepared


class QueryKind(Enum):
    STATS = "stats"
    MODEL_INFO = "model_info"


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve `future` (on its loop) with a result or an error, unless it was cancelled meanwhile."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
