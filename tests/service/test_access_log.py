"""The access log's route and status for each door, and the shutdown tally, from lifecycles alone (no engine)."""
from __future__ import annotations

import logging

import pytest

from service.access_log import AccessLog, route, status
from service.lifecycle import RequestLifecycle
from service.shutdown import ShutdownTally


def lifecycle(kind: str = "generate", error: str | None = None, reason: str = "stop", **metadata) -> RequestLifecycle:
    lc = RequestLifecycle(engine_id="g0", client_id="c", kind=kind, metadata=metadata)
    lc.finished, lc.finish_reason, lc.error = lc.arrival + 0.25, reason, error
    return lc


@pytest.mark.parametrize("lc, expected", [
    (lifecycle(door="grpc", stream="generate-3"), ("Generate", "OK")),
    (lifecycle("rerank", door="grpc"), ("Rerank", "OK")),
    (lifecycle("rerank", door="grpc", stream="rerank-2"), ("RerankStream", "OK")),
    (lifecycle(door="grpc", error="INVALID_ARGUMENT", reason="error"), ("Generate", "INVALID_ARGUMENT")),
    (lifecycle(door="http", route="/v1/chat/completions"), ("/v1/chat/completions", "200")),
    (lifecycle("rerank", door="http", route="/rerank", error="UNAVAILABLE", reason="error"), ("/rerank", "503")),
    (lifecycle(door="http", route="/v1/completions", error="DEADLINE_EXCEEDED", reason="deadline"),
     ("/v1/completions", "504")),
])
def test_route_and_status_as_each_door_names_them(lc, expected):
    assert (route(lc), status(lc)) == expected


def test_one_line_per_finished_request(caplog):
    caplog.set_level(logging.INFO, logger="tandem.access")
    lc = lifecycle(door="grpc", peer="ipv4:127.0.0.1:5000")
    lc.prompt_tokens, lc.completion_tokens = 7, 3
    AccessLog("smol").on_finish(lc)
    (record,) = caplog.records
    assert record.getMessage().startswith("grpc Generate model=smol status=OK finish=stop prompt_tokens=7 "
                                          "completion_tokens=3 cached_tokens=0 ttft=0.000s latency=0.250s")


def test_a_refused_request_gets_its_line_with_the_status_its_door_answered(caplog):
    caplog.set_level(logging.INFO, logger="tandem.access")
    log = AccessLog("smol")
    log.on_refused(lifecycle(door="grpc", error="NOT_FOUND", reason="rejected", peer="p"))
    log.on_refused(lifecycle(door="http", route="/v2/rerank", error="INVALID_ARGUMENT", reason="rejected"))
    log.on_refused(lifecycle("/v1/chat/completions", door="http", route="/v1/chat/completions", status="415",
                             reason="rejected"))
    assert [r.getMessage() for r in caplog.records] == [
        "grpc Generate model=smol status=NOT_FOUND finish=rejected peer=p",
        "http /v2/rerank model=smol status=400 finish=rejected peer=-",
        "http /v1/chat/completions model=smol status=415 finish=rejected peer=-"]


def test_the_tally_counts_only_after_the_stop_signal():
    tally = ShutdownTally()
    tally.on_finish(lifecycle())  # before the signal: not counted
    tally.start()
    for reason in ("stop", "length", "abort", "error"):
        tally.on_finish(lifecycle(reason=reason))
    assert tally.summary("SIGTERM") == "tandem serve stopped (SIGTERM): drained 2 requests, aborted 2"


async def test_a_rerank_the_drain_aborts_is_logged_with_the_status_its_client_received(served):
    """The drain's timeout aborts a rerank: its client gets UNAVAILABLE (HTTP 503), and its access-log line says so,
    not `status=200 finish=abort`."""
    import asyncio

    from engine.config import RerankParams
    from service.core import RerankInput
    from service.errors import ErrorKind, ServiceError
    from tests.service.conftest import DOCUMENTS, MAX_DOCUMENTS, QUERY

    documents = [" ".join(DOCUMENTS) * 20] * MAX_DOCUMENTS  # several steps' work: the abort comes first

    async def rerank_then_abort() -> ServiceError | None:
        task = asyncio.ensure_future(served.core.rerank(
            RerankInput("drained", QUERY, documents, RerankParams(truncate="end")),
            {"door": "http", "route": "/v2/rerank"}))
        while not any(h.lifecycle.client_id == "drained" for h in served.bridge._handles.values()):
            await asyncio.sleep(0)  # until it is admitted
        served.core.abort_all()
        try:
            await task
        except ServiceError as exc:
            return exc
        return None

    error = await served.acall(rerank_then_abort())
    assert error is not None and error.kind is ErrorKind.UNAVAILABLE and "shutting down" in error.message
    (lc,) = served.recorder.wait_finished(lambda lc: lc.client_id == "drained")
    assert (status(lc), lc.finish_reason) == ("503", "error")
