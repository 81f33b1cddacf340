"""One real engine and one in-process server shared by the service tests; offline references computed first."""
from __future__ import annotations

import os

# On a busy 2-core box, OpenMP's spinning workers starve each other: the same step ran 20x slower in the
# main thread. Only effective when torch is not loaded yet (running tests/service alone).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.config import EMBEDDED_EMBEDDER  # noqa: E402
from service.server import ServerConfig  # noqa: E402
from tests.service.harness import ServerThread  # noqa: E402

_TOPICS = ["the ocean", "a lighthouse keeper", "prime numbers", "bread baking", "the Roman empire",
           "a robot learning to paint", "volcanoes", "chess openings"]
# Thirty-two prompts of different lengths (2 to ~60 tokens), so batches mix prefill and decode.
PROMPTS = [f"{lead} {topic}." + " Please be specific." * (i % 5)
           for i, (lead, topic) in enumerate((lead, topic) for lead in
                                             ("Tell me about", "Write a poem on", "Explain", "A fact about")
                                             for topic in _TOPICS)]
GREEDY_8 = SamplingParams(max_tokens=8, temperature=0.0)
LONG_12 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.",
             "Bananas are rich in potassium.",
             "The Eiffel Tower is in Paris.",
             "Berlin is the capital of Germany.",
             "France is a country in Western Europe."]
MAX_DOCUMENTS = 8
# An HTTP client's timeout in these tests: a guard against a hang, never a speed bound (httpx's default 5 s failed
# on a loaded host).
GUARD_S = 300.0
# More than MAX_DOCUMENTS: an embedding of MAX_DOCUMENTS + 1 inputs passes where a rerank of as many documents does not
MAX_EMBED_INPUTS = 12
MAX_MESSAGE_BYTES = 256 * 1024
NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 8192  # the embedded SmolLM2's context (NUM_KV_BLOCKS * 16 tokens hold it); `served` checks it
# max_tokens of a generation (EOS ignored) that cannot end before the event a test waits for (a cancel, a disconnect,
# a deadline, a kill): thousands of decode steps on any machine; the test itself ends it. The prompts are shorter
# than the 256 tokens left over.
UNENDING = MAX_MODEL_LEN - 256


@dataclass
class Offline:
    """Outputs of the offline LLM on the same engine, computed before the server takes the engine over."""
    llm: LLM
    greedy: list  # RequestOutput per PROMPTS entry, GREEDY_8
    long: object  # PROMPTS[1] with LONG_12
    chat: object  # CHAT with GREEDY_8
    scores: list[float]  # DOCUMENTS against QUERY


def _offline() -> Offline:
    # fusion, not the default (dense): the shared server's rerank tests are about LLM pairs (their limit, chunks, a
    # cancel mid-flight) as well as embedder rows; the default is served in test_rerank_modes.py
    llm = LLM(EngineConfig(num_kv_blocks=NUM_KV_BLOCKS, max_rerank_documents=MAX_DOCUMENTS,
                           max_embed_inputs=MAX_EMBED_INPUTS,
                           embedder=EMBEDDED_EMBEDDER, rerank_mode="fusion"))
    return Offline(llm=llm, greedy=llm.generate(PROMPTS, GREEDY_8), long=llm.generate(PROMPTS[1], LONG_12)[0],
                   chat=llm.chat(CHAT, GREEDY_8)[0], scores=llm.rerank(QUERY, DOCUMENTS))


@pytest.fixture(scope="session")
def offline() -> Offline:
    # Computed on a worker thread, as the server's engine thread runs it: with OpenMP's default spin policy
    # the main thread was ~20x slower on a loaded 2-core machine when torch was imported before this file.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_offline).result()


@pytest.fixture(scope="session")
def served(offline: Offline) -> ServerThread:
    """A server on an ephemeral localhost port over the offline LLM's engine (the LLM is not used after this)."""
    assert offline.llm.engine.max_model_len == MAX_MODEL_LEN
    server = ServerThread(offline.llm.engine, ServerConfig(host="127.0.0.1", port=0,
                                                           max_message_bytes=MAX_MESSAGE_BYTES))
    yield server
    server.close()


@pytest.fixture(scope="session")
def http_url(served: ServerThread) -> str:
    """The HTTP door on the shared server's bridge: its base URL (http://127.0.0.1:PORT)."""
    door = served.add_http(served.server.config)
    return door.url
