"""`tandem serve --model gemma-3-270m-q4_k_m.gguf` as a real process: greedy continuations through gRPC equal
transformers' on the same file (the shared session reference of tests/gemma.py), and the model's info names it."""
from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clients import AsyncClient
from tests.gemma import MAX_TOKENS, check_greedy

ROOT = Path(__file__).resolve().parents[2]


class _Serve:
    """`python -m service.cli serve --port 0 ...` from this checkout; address from its 'tandem listening on' line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--http-port", "off",
                                      "--metrics-port", "off", *args], cwd=ROOT,
                                     env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        output = []
        while True:
            line = lines.get(timeout=900)
            if line is None:
                raise RuntimeError("tandem serve exited early:\n" + "".join(output))
            output.append(line)
            if line.startswith("tandem listening on "):
                self.address = line.split()[-1]
                return

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def gemma_server(gemma_gguf):
    server = _Serve("--model", str(gemma_gguf), "--host", "127.0.0.1")
    yield server
    server.stop()


async def test_greedy_through_grpc_matches_transformers(gemma_server, gemma_prompts, gemma_reference) -> None:
    async with AsyncClient(gemma_server.address) as client:
        info = await client.model_info()
        assert info.architecture == "Gemma3ForCausalLM"
        outs = await asyncio.gather(*(client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0)
                                      for p in gemma_prompts))
    check_greedy([o.token_ids for o in outs], gemma_reference.greedy)
