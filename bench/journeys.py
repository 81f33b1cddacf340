"""How many of tandem's files and functions one request crosses: a Cohere `/v2/rerank` call and a gRPC `Generate`
chat, each served by a real in-process server (both doors over one engine), counted with a profiler.

Every Python function of the repository (engine/, service/, proto/, kernels/, clients/ excluded: the client is not
the server) called while the request is in flight is recorded with the thread it ran on. The journey a maintainer
follows is the door-to-engine path and back: what runs on the event loop and the intake thread (`service path`).
The engine thread's step (scheduler, runner, model, kernels) is counted beside it (`engine step`), since every
request rides it alike. Run: `python -m bench.journeys` (writes bench/results/journeys.json).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "service", "proto", "kernels")
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are rich in potassium.",
             "The Eiffel Tower is in Paris.", "Berlin is the capital of Germany."]


class Calls:
    """A profile function recording (thread, file, function) for repository code while `on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.seen: dict[str, set[tuple[str, str]]] = defaultdict(set)

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(ROOT)):
            return
        rel = os.path.relpath(path, ROOT)
        if rel.split(os.sep, 1)[0] not in PACKAGES:
            return
        self.seen[threading.current_thread().name].add((rel, frame.f_code.co_qualname))

    def take(self) -> dict:
        by_part: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for thread, calls in self.seen.items():
            by_part["engine step" if thread == "tandem-engine" else "service path"] |= calls
        self.seen = defaultdict(set)
        out = {}
        for part, calls in sorted(by_part.items()):
            files = sorted({f for f, _ in calls})
            out[part] = {"files": len(files), "functions": len(calls), "file_list": files}
        every = set().union(*by_part.values()) if by_part else set()
        out["total"] = {"files": len({f for f, _ in every}), "functions": len(every)}
        return out


def main() -> None:
    calls = Calls()
    threading.setprofile(calls)  # threads started from here on (engine, intake, the server's loop)
    sys.setprofile(calls)

    import grpc
    import httpx

    from proto import tandem_pb2 as pb
    from proto import tandem_pb2_grpc
    from engine import EngineConfig, LLMEngine
    from service.server import ServerConfig
    from tests.service.harness import ServerThread

    engine = LLMEngine(EngineConfig(num_kv_blocks=256))
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))
    http = server.add_http(server.server.config)
    results = {}
    try:
        with httpx.Client(base_url=http.url, timeout=120) as client:
            client.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS})  # warm
            calls.on = True
            response = client.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS, "model": ""})
            calls.on = False
            response.raise_for_status()
        results["/v2/rerank (HTTP)"] = calls.take()

        async def chat() -> None:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = tandem_pb2_grpc.TandemStub(channel)
                req = pb.GenerateRequest(request_id="c", messages=pb.ChatMessages(
                    messages=[pb.ChatMessage(role="user", content="Hi")]),
                    params=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                calls.on = True
                async for _ in stub.Generate(iter([pb.GenerateClientMessage(request=req)])):
                    pass
                calls.on = False
                results["chat request (gRPC Generate)"] = calls.take()
                # One token in steady state: from after the 2nd token's message to the 3rd's (no admission, no end).
                seen = 0
                async for _ in stub.Generate(iter([pb.GenerateClientMessage(request=req)])):
                    seen += 1
                    calls.on = seen == 2
                calls.on = False
                results["chat token (gRPC Generate)"] = calls.take()

        asyncio.run(chat())
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        server.close()
    out = ROOT / "bench" / "results" / "journeys.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for journey, parts in results.items():
        print(journey, {part: (v["files"], v["functions"]) for part, v in parts.items()})


if __name__ == "__main__":
    main()
