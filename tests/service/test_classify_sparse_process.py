"""Issue #72's done-when, through `tandem serve` as a user runs it: a classifier (`--classifier`) or a SPLADE model
(`--sparse-embedder`) served beside a streaming chat, and the chat's step log (`--step-log`) shows their rows in the
same steps as its decodes. `--embedder none`, so every embedding row a step counts is one of theirs. The test waits
on states (the chat's first token, the answer); its timeouts only turn a hang into a failure."""
from __future__ import annotations

import json
import threading

import pytest

from clients import Client
from tests.engine.test_classify_sparse import TEXTS, tiny_classifier, tiny_splade
from tests.service.process_harness import HANG, ServeProcess

KINDS = {"--classifier": tiny_classifier, "--sparse-embedder": tiny_splade}


@pytest.fixture(scope="module", params=sorted(KINDS))
def served(request, tmp_path_factory):
    flag = request.param
    directory = tmp_path_factory.mktemp(flag.strip("-"))
    KINDS[flag](directory)
    step_log = directory / "steps.jsonl"
    proc = ServeProcess("--host", "127.0.0.1", "--embedder", "none", flag, str(directory), "--step-log",
                        str(step_log))
    proc.flag, proc.step_log = flag, step_log
    yield proc
    proc.stop()


def test_their_rows_ride_the_steps_of_a_streaming_chat(served) -> None:
    first, stop, chat_error = threading.Event(), threading.Event(), []

    def chat() -> None:
        try:
            with Client(served.address) as client:
                for _ in client.generate("Tell me about lighthouses.", max_tokens=512, ignore_eos=True):
                    first.set()
                    if stop.is_set():
                        break  # leaving the stream cancels the rest of the chat
        except Exception as exc:  # noqa: BLE001  (reported below)
            chat_error.append(exc)
        finally:
            first.set()

    thread = threading.Thread(target=chat)
    thread.start()
    try:
        assert first.wait(HANG) and not chat_error, chat_error  # the chat decodes before the others arrive
        with Client(served.address) as client:
            out = client.classify(TEXTS) if served.flag == "--classifier" else client.embed_sparse(TEXTS)
    finally:
        stop.set()
        thread.join(HANG)
    assert len(out) == len(TEXTS) and all(out) and not chat_error, chat_error
    records = [json.loads(line) for line in served.step_log.read_text().splitlines()]
    assert sum(r["embed_rows_done"] for r in records) == len(TEXTS)  # theirs alone: no embedder is loaded
    both = [r for r in records if r["decode_tokens"] and r["embed_rows"]]
    assert both, [(r["decode_tokens"], r["embed_rows"]) for r in records]
