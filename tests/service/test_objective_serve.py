"""The latency objective where users meet it: `tandem serve` with the objective's default flags keeps a chat's pace
beside a long rerank (issue #45). States, not timings: a chat that asks for more tokens than the rerank would need
steps at plain budget filling finishes while the rerank is still running. The rerank is scored by the LLM
(`--rerank-mode likelihood`): the default mode, dense, runs no LLM pair, and an 8,000-token document is cut to the
embedder's 256 tokens."""
from __future__ import annotations

import asyncio

from clients import AsyncClient
from tests.service.process_harness import ServeProcess

CHAT_TOKENS = 48
# ~6,000 words: cut to the embedded model's 8,192-token context, one LLM-scored pair of ~8,000 tokens. Plain budget
# filling (512 tokens a step, half of them to the pair beside a chat) computes it in at most 32 steps, fewer than the
# chat's 47 tokens after its first; under the objective it gets only the headroom beside the chat's decode.
LONG_DOCUMENT = " ".join(f"Section {i}: the keeper logged the weather, trimmed the wick and counted the ships that "
                         f"passed the northern reef before dawn." for i in range(330))


async def _chat_beside_a_long_rerank(address: str) -> tuple[int, bool, list[str]]:
    async with AsyncClient(address) as client:
        stream = client.generate("Tell me a long story about a lighthouse keeper.", max_tokens=CHAT_TOKENS,
                                 temperature=0.0, ignore_eos=True)
        first = await anext(stream)  # the chat decodes before the rerank arrives
        rerank = asyncio.create_task(client.rerank("what did the keeper count", [LONG_DOCUMENT]))
        last, texts, rerank_ran_throughout = first, [first.text], True
        async for delta in stream:
            await asyncio.sleep(0)  # let the rerank call start (and, were it done, finish) between tokens
            rerank_ran_throughout = rerank_ran_throughout and not rerank.done()
            last = delta
            texts.append(delta.text)
        tokens = last.usage.completion_tokens
        still_running = not rerank.done()
        rerank.cancel()
        try:
            await rerank
        except (asyncio.CancelledError, Exception):
            pass
        return tokens, still_running and rerank_ran_throughout, texts


def test_default_flags_keep_a_chat_going_while_a_long_rerank_runs():
    proc = ServeProcess("--rerank-mode", "likelihood", env={})
    try:
        log = "".join(proc.output)
        assert "step-time model (" in log  # calibrated (or read from its cache) before the first request
        tokens, rerank_still_running, _ = asyncio.run(_chat_beside_a_long_rerank(proc.address))
        assert tokens >= CHAT_TOKENS
        assert rerank_still_running  # every chat token arrived while the rerank was still being computed
        # the server is still healthy after the cancelled rerank: a short one answers
        async def short() -> int:
            async with AsyncClient(proc.address) as client:
                return len(await client.rerank("bees", ["Bees make honey.", "Stocks fell."]))
        assert asyncio.run(short()) == 2
    finally:
        proc.stop()
