"""The HTTP door against the gRPC door, same server, same run (issue #26).

Starts `tandem serve` in a subprocess (gRPC on an ephemeral port, HTTP on a free one) and, in rounds whose
order alternates, sends through each door:
* chat: the same 32 streaming chat requests at once (greedy, EOS ignored, --max-tokens each), through the
  `openai` package's AsyncOpenAI against /v1/chat/completions and through tandem's own AsyncClient over gRPC:
  useful tokens/s (completion tokens over the batch's wall time) and TTFT p50 (request sent to first token);
* rerank: --queries rerank requests of --documents documents, 4 in flight, through the `cohere` package's
  AsyncClientV2 against /v2/rerank and through AsyncClient.rerank: pairs/s.
Figures are the median over rounds; ratios are HTTP / gRPC. The clients of both doors run in this process, so
client-side parsing (openai's and cohere's pydantic models, protobuf) counts against its door.

    python -m bench.http_load            # writes bench/results/http_load.json
    python -m bench.http_load --quick    # tiny sizes, checks the wiring
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import uvloop

from bench.report import RESULTS, percentile, rotated, write_result
from bench.servers import Spawned
from service.cluster import free_port
from clients import AsyncClient

_TOPICS = ["the ocean", "a lighthouse", "prime numbers", "bread", "the Roman empire", "a robot painter",
           "volcanoes", "chess", "bees", "the moon landing", "jazz", "glaciers", "origami", "trains", "tea", "owls"]
_FILLER = "Please be specific and give examples. "


def chat_prompts(n: int) -> list[str]:
    return [f"Tell me about {_TOPICS[i % len(_TOPICS)]}. " + _FILLER * (i % 4) for i in range(n)]


def rerank_jobs(n: int, documents: int) -> list[tuple[str, list[str]]]:
    return [(f"What is known about {_TOPICS[q % len(_TOPICS)]}?",
             [f"A note on {_TOPICS[(q + d) % len(_TOPICS)]}. " + _FILLER * (d % 3) for d in range(documents)])
            for q in range(n)]


# ---- chat ------------------------------------------------------------------------------------------

async def _grpc_chat(client: AsyncClient, prompt: str, max_tokens: int, start: float) -> tuple[float, int]:
    first, tokens = None, 0
    async for delta in client.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
                                   ignore_eos=True):
        if delta.token_ids:
            first = first or time.perf_counter()
            tokens += len(delta.token_ids)
    return (first or time.perf_counter()) - start, tokens


async def _http_chat(client, prompt: str, max_tokens: int, start: float) -> tuple[float, int]:
    first, tokens = None, 0
    stream = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (first or time.perf_counter()) - start, tokens


async def chat_round(door: str, clients: dict, prompts: list[str], max_tokens: int) -> dict:
    run = _grpc_chat if door == "grpc" else _http_chat
    start = time.perf_counter()
    results = await asyncio.gather(*(run(clients[door], p, max_tokens, start) for p in prompts))
    wall = time.perf_counter() - start
    tokens = sum(t for _, t in results)
    return {"tok_s": tokens / wall, "ttft_p50_s": percentile([t for t, _ in results], 50), "tokens": tokens,
            "wall_s": wall}


# ---- rerank ----------------------------------------------------------------------------------------

async def rerank_round(door: str, clients: dict, jobs: list[tuple[str, list[str]]], concurrency: int = 4) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def one(query: str, documents: list[str]) -> int:
        async with sem:
            if door == "grpc":
                results = await clients["grpc"].rerank(query, documents)
            else:
                results = (await clients["http_rerank"].rerank(model="", query=query, documents=documents)).results
        assert len(results) == len(documents)
        return len(results)

    start = time.perf_counter()
    pairs = sum(await asyncio.gather(*(one(q, d) for q, d in jobs)))
    wall = time.perf_counter() - start
    return {"pairs_s": pairs / wall, "pairs": pairs, "wall_s": wall}


async def measure(address: str, http_url: str, args) -> dict:
    import cohere
    import openai

    prompts = chat_prompts(args.requests)
    jobs = rerank_jobs(args.queries, args.documents)
    async with AsyncClient(address) as grpc_client, \
            openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=600) as oai:
        co = cohere.AsyncClientV2(base_url=http_url, api_key="unused", timeout=600)
        clients = {"grpc": grpc_client, "http": oai, "http_rerank": co}
        # Warm both paths (first-call costs stay out of the figures) and put every prompt and query in the
        # prefix cache, so neither door finds it warmer than the other.
        for door in ("grpc", "http"):
            await chat_round(door, clients, prompts, 2)
            await rerank_round(door, clients, jobs)
        chat: dict[str, list] = {"grpc": [], "http": []}
        rerank: dict[str, list] = {"grpc": [], "http": []}
        for i in range(args.rounds):
            for door in rotated(["grpc", "http"], i):
                chat[door].append(await chat_round(door, clients, prompts, args.max_tokens))
            for door in rotated(["http", "grpc"], i):
                rerank[door].append(await rerank_round(door, clients, jobs))
    return {"chat": chat, "rerank": rerank}


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the wiring, figures mean nothing")
    ap.add_argument("--requests", type=int, default=32, help="concurrent streaming chats per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--queries", type=int, default=16, help="rerank requests per round")
    ap.add_argument("--documents", type=int, default=32, help="documents per rerank request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "http_load.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.queries, args.documents, args.rounds = 4, 4, 2, 4, 1
    port = free_port()
    server = Spawned(["--http-port", str(port), "--metrics-port", "-1", "--num-threads", str(args.threads)])
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs = runner.run(measure(server.address, f"http://127.0.0.1:{port}", args))
    finally:
        exit_code = server.stop()
    chat = {door: {"tok_s": _median(r, "tok_s"), "ttft_p50_s": _median(r, "ttft_p50_s")}
            for door, r in runs["chat"].items()}
    rerank = {door: {"pairs_s": _median(r, "pairs_s")} for door, r in runs["rerank"].items()}
    result = {
        "bench": "http_load", "quick": args.quick, "threads": args.threads,
        "workload": {"chat_requests": args.requests, "max_tokens": args.max_tokens, "rerank_queries": args.queries,
                     "documents": args.documents, "rounds": args.rounds},
        "chat": chat, "rerank": rerank,
        "ratios": {"chat_tok_s_http_vs_grpc": chat["http"]["tok_s"] / chat["grpc"]["tok_s"],
                   "ttft_p50_http_vs_grpc": chat["http"]["ttft_p50_s"] / chat["grpc"]["ttft_p50_s"],
                   "rerank_pairs_s_http_vs_grpc": rerank["http"]["pairs_s"] / rerank["grpc"]["pairs_s"]},
        "rounds": runs, "spawned_server_exit_code": exit_code,
        "note": "client and server share the host; the host is shared with other work (ratios, not absolutes)",
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
