"""The whole pipeline on one machine: one `tandem serve` against the split deployment users would run instead
(issue #62).

Systems, each fed over HTTP by client processes of their own (this process only starts and stops things):

* `tandem`: one `tandem serve` of this checkout, default flags (the automatic objective), chats, reranks and
  embeddings through its one scheduler; `tandem_T` (W4) the same with `--tpot-target-ms T`, T = --t-factor x the
  chats' solo p50 time per token on `tandem`.
* `split_shared`: llama.cpp's `llama-server` (the avx512 build when built, else avx2: bench/peers/llama_server.py) serving
  the chats from the same GGUF file with `-np` = the chats, beside an embedding server for the embeddings and the
  reranks (Infinity when `--infinity CMD` names its `infinity_emb` command, else bench/peers/st_server.py:
  sentence-transformers behind a minimal HTTP server, dense cosine reranks like tandem's default), each with every
  core (the OS shares them).
* `split_pinned`: the same two servers, each pinned to half the cores (`taskset`) with that many threads.

Workloads (the same requests on every system):

* chats: --chats streams in a loop, --max-tokens tokens each (greedy, EOS ignored), `/v1/completions` streamed; the
  client stamps every token; TPOT = the gap between two tokens of one stream.
* W1: the chats, and beside them --reranks sequential reranks of --docs documents (~--doc-tokens tokens each) to the
  TEI-shaped `/rerank` (tandem's, or the embedding server's); the window is the reranks' run.
* W2: the chats, and --embed-clients processes each sending `/v1/embeddings` of --batch texts back to back for
  --seconds; texts/s over that window.
* W5 (--w5, or --only-w5 without W1/W2): one chat in a loop beside one rerank of --w5-docs documents, and beside
  one --w5-long-words-word document with max_chunks_per_doc --w5-chunks (Cohere's `/v1/rerank`; the split's client
  cuts it into as many runs of words and takes the best); W6: the whole run with --model a Q4_K_M
  GGUF file (Gemma 3 270M), served by tandem and llama-server alike.
* Each kind also runs alone on the same system (chats alone, reranks alone, embeddings alone): every figure is a ratio
  to that.

Targets (issue #62): W1 chats' p99 TPOT <= 1.5x alone and rerank p50 <= 4x alone; W2 chats >= 0.7x their tokens/s
alone, p99 <= 1.5x, embeddings >= 0.25x their rate alone; W3 tandem ahead of each split variant on both the chats'
p99 TPOT and the scoring figure; W4 (tandem_T) chats' p99 <= max(1.25 T, 1.1x solo p99) and rerank p50 <= 4x alone;
W5 the chat's p90 <= 2x alone and each rerank <= 1.3x alone; W6 W1's and W2's targets on the --model file.
Results on a 2-core AVX2 host: docs/latency-objective.md "Every workload against both splits".

    python -m bench.pipeline                 # every system, --runs 3 (about 30 minutes on 2 idle cores)
    python -m bench.pipeline --quick         # small sizes, one run: checks the wiring
    python -m bench.pipeline --systems tandem tandem_T
    python -m bench.pipeline --systems tandem --tandem-flags=--step-log=/tmp/steps.jsonl
    python -m bench.step_shares /tmp/steps.jsonl --phases bench/results/pipeline.json   # where each phase's time went

Writes bench/results/pipeline.json (one JSON line: per system, run and phase the raw figures, and the medians over
runs of the ratios), with the CPU's flags, the commit and the 1-minute load average beside them, and prints the table:
each median against its target (MISS where missed), W4's bound per run, and W3's figures against each split.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.host import cpu_identity
from bench.report import RESULTS, percentile, write_result
from bench.servers import ROOT, Proc, tandem_proc
from service.cluster import free_port

SYSTEMS = ("tandem", "split_shared", "split_pinned", "tandem_T")


# ---- clients (each in its own process) ------------------------------------------------------------------------------


def _orphaned() -> bool:
    """True once the bench that started this client is gone (killed): the client stops instead of retrying a dead
    server in a loop on a core of its own (a killed run left one spinning under the next run)."""
    parent = mp.parent_process()
    return parent is not None and not parent.is_alive()


def _chat_client(url: str, prompts: list[str], max_tokens: int, ready, stop, out) -> None:
    """len(prompts) streams in a loop until `stop`; sets `ready` once every stream has had a token; puts the token
    arrival times (time.monotonic, one list a request) on `out`."""
    import threading

    import httpx

    requests: list[list[float]] = []
    dropped = [0]  # requests whose connection the server dropped (retried)
    lock = threading.Lock()
    started = [False] * len(prompts)

    def loop(i: int) -> None:
        while not stop.is_set() and not _orphaned():
            try:
                one(i)
            except httpx.TransportError:  # a server that dropped the connection (llama-server under load): again
                with lock:
                    dropped[0] += 1

    def one(i: int) -> None:
        # a connection a request: llama-server may close a kept-alive one under load ("Server disconnected")
        with httpx.Client(timeout=600, headers={"Connection": "close"}) as http:
            if not stop.is_set():
                stamps: list[float] = []
                body = {"prompt": prompts[i], "max_tokens": max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}
                with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        raise RuntimeError(f"{url}/v1/completions: {r.status_code} {r.text[:300]}")
                    for line in r.iter_lines():
                        if stop.is_set():  # whatever the line (a peer's stream seen trickling non-token lines)
                            break
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if choices[0].get("text"):
                            stamps.append(time.monotonic())
                            if not started[i]:
                                started[i] = True
                                if all(started):
                                    ready.set()
                        if stop.is_set():
                            break
                with lock:
                    requests.append(stamps)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("chats", requests))
    if dropped[0]:
        print(f"chat client: {dropped[0]} requests dropped by the server and sent again", file=sys.stderr, flush=True)


def chunk_words(doc: str, chunks: int) -> list[str]:
    """`doc` cut into `chunks` runs of whole words, as even as words allow (the split's client-side windows)."""
    words = doc.split()
    step = -(-len(words) // chunks)
    return [" ".join(words[i:i + step]) for i in range(0, len(words), step)]


def _rerank_client(url: str, embed_path: str | None, jobs: list[tuple[str, list[str]]], wait, out,
                   max_chunks: int | None = None) -> None:
    """The reranks one after another (after `wait`, when given): (start, end) of each. `embed_path` None: TEI's
    `/rerank` (with `max_chunks`: Cohere's `/v1/rerank` with `max_chunks_per_doc`, a long document scored as its best
    window); else the server only embeds (Infinity with an embedding model): the query and documents are embedded in
    one request there and ranked by cosine here, as a split deployment's client would (with `max_chunks`: each
    document cut into that many runs of words here, scored as its best run)."""
    import httpx
    import numpy as np

    if wait is not None:
        wait.wait()
    spans = []
    with httpx.Client(timeout=600) as http:
        for query, docs in jobs:
            t0 = time.monotonic()
            if embed_path is None and max_chunks is None:
                r = http.post(f"{url}/rerank", json={"query": query, "texts": docs})
                r.raise_for_status()
                assert len(r.json()) == len(docs)
            elif embed_path is None:
                r = http.post(f"{url}/v1/rerank", json={"query": query, "documents": docs,
                                                        "max_chunks_per_doc": max_chunks})
                r.raise_for_status()
                assert len(r.json()["results"]) == len(docs)
            else:
                pieces = [chunk_words(d, max_chunks) if max_chunks else [d] for d in docs]
                flat = [p for ps in pieces for p in ps]
                r = http.post(f"{url}{embed_path}", json={"input": [query, *flat]})
                r.raise_for_status()
                v = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
                v /= np.linalg.norm(v, axis=1, keepdims=True)
                sims, scores, at = v[1:] @ v[0], [], 0
                for ps in pieces:
                    scores.append(float(sims[at:at + len(ps)].max()))
                    at += len(ps)
                order = np.argsort(-np.array(scores))
                assert len(order) == len(docs)
            spans.append((t0, time.monotonic()))
    out.put(("reranks", spans))


def _embed_client(url: str, embed_path: str, texts: list[str], batch: int, wait, stop, out) -> None:
    """`embed_path` (OpenAI's shape) of `batch` texts back to back until `stop`: (send time, end time, texts) of each
    response."""
    import httpx

    if wait is not None:
        wait.wait()
    done, i = [], 0
    with httpx.Client(timeout=600) as http:
        while not stop.is_set() and not _orphaned():
            chunk = [texts[(i + k) % len(texts)] for k in range(batch)]
            i += batch
            sent = time.monotonic()
            r = http.post(f"{url}{embed_path}", json={"input": chunk})
            r.raise_for_status()
            done.append((sent, time.monotonic(), len(r.json()["data"])))
    out.put(("embeds", done))


def texts_in_window(responses: list[tuple[float, float, int]], window: tuple[float, float]) -> float:
    """The texts embedded inside `window`: each response's texts spread evenly over its time in flight (send to
    answer), the part inside the window counted. Counting only the responses answered inside the window loses the
    ones still in flight at its end: with 2 clients of 32 texts at W2's rates (~5 texts/s) that was one response in
    two, so the figure moved in steps of 0.08x and read low."""
    n = 0.0
    for sent, end, k in responses:
        inside = min(end, window[1]) - max(sent, window[0])
        if inside > 0:
            n += k * inside / (end - sent)
    return n


def long_document(texts: list[str], words: int) -> str:
    """A document of `words` words, the bench's texts one after another (repeated as needed)."""
    out: list[str] = []
    i = 0
    while len(out) < words:
        out += texts[i % len(texts)].split()
        i += 1
    return " ".join(out[:words])


# ---- servers ----------------------------------------------------------------------------------------------------------


def _llama_server(args, cores: str | None, threads: int, ctx: int | None = None) -> tuple[Proc, str]:
    """llama-server with `args.chats` slots; `ctx` its whole context (default: --max-tokens + 128 a slot)."""
    from bench.peers.llama_server import Build, tool_path
    from engine.models.loader import embedded_gguf_path

    builds = [b for b in (Build.AVX512, Build.AVX2) if tool_path(b).is_file()]
    if not builds:
        raise RuntimeError("no llama-server build in the cache: python -m bench.peers.llama_server --build avx512")
    port = free_port()
    ctx = ctx or args.chats * (args.max_tokens + 128)
    cmd = [str(tool_path(builds[0])), "-m", str(args.model or embedded_gguf_path()), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(args.chats), "-c", str(ctx), "--no-warmup"]
    return Proc(cmd, port, cores), f"llama-server ({builds[0].value} build)"


def _embed_server(args, cores: str | None, threads: int) -> tuple[Proc, str]:
    """The split's embedding server; with `args.reranker` (a cross-encoder directory; bench/rag.py's option) it
    serves that cross-encoder's /rerank beside the embedder."""
    port = free_port()
    reranker = getattr(args, "reranker", None)
    if args.infinity:
        from engine.embed.embedder import embedded_embedder_dir

        cmd = [args.infinity, "v2", "--model-id", str(embedded_embedder_dir()), *(["--model-id", reranker] if reranker
                                                                                   else []),
               "--port", str(port), "--url-prefix", "", "--engine", "torch", "--device", "cpu"]
        proc = Proc(cmd, port, cores, {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})
        proc.embed_path = "/embeddings"
        if reranker:
            proc.rerank_model = reranker
            return proc, "infinity-emb (bi-encoder + the cross-encoder on its /rerank)"
        proc.rerank_by_embedding = True
        return proc, "infinity-emb (reranks: its embeddings' cosine, ranked by the client)"
    cmd = [sys.executable, "-m", "bench.peers.st_server", "--port", str(port), "--threads", str(threads),
           *(["--reranker", reranker] if reranker else [])]
    return Proc(cmd, port, cores), ("sentence-transformers behind bench/peers/st_server.py"
                                    + (" (bi-encoder + CrossEncoder)" if reranker else ""))


# ---- phases -----------------------------------------------------------------------------------------------------------


class ClientDied(RuntimeError):
    """A client process exited without its report (its traceback is on stderr)."""


def _next_report(out, procs: list) -> tuple:
    """The next (kind, data) a client put on `out`; a client that died without putting its report (a request that
    raised: a peer's 4xx/5xx, a dropped connection) fails the phase instead of leaving it waiting for ever."""
    import queue

    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            _check_alive(procs)


def _check_alive(procs: list) -> None:
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise ClientDied(f"client process(es) {[p.name for p in dead]} exited with {[p.exitcode for p in dead]} "
                         f"before reporting (the traceback is above)")


def _phase(chat_url: str | None, scorer: Proc, args, prompts, jobs, texts, *, reranks: bool = False,
           embeds: bool = False, max_chunks: int | None = None) -> dict:
    """One phase: chats (if chat_url), and reranks or an embedding flood beside them (or alone); the figures."""
    ctx = mp.get_context("spawn")
    out, ready, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = []
    if chat_url:
        procs.append(ctx.Process(target=_chat_client, args=(chat_url, prompts, args.max_tokens, ready, stop, out)))
    wait = ready if chat_url else None
    if reranks:
        procs.append(ctx.Process(target=_rerank_client, args=(
            scorer.url, scorer.embed_path if scorer.rerank_by_embedding else None, jobs, wait, out, max_chunks)))
    if embeds:
        procs += [ctx.Process(target=_embed_client, args=(scorer.url, scorer.embed_path, texts, args.batch, wait, stop,
                                                          out))
                  for _ in range(args.embed_clients)]
    for p in procs:
        p.start()
    if chat_url:
        while not ready.wait(1.0):
            _check_alive(procs)
    t0 = time.monotonic()
    results: dict[str, list] = {"embeds": []}
    if reranks:
        kind, spans = _next_report(out, procs)
        while kind != "reranks":  # (only the reranks report before stop)
            kind, spans = _next_report(out, procs)
        results["reranks"] = spans
    else:
        time.sleep(args.seconds)  # a fixed window of chats and/or an embedding flood (a benchmark, not a test)
    t1 = time.monotonic()
    stop.set()
    for _ in range(len(procs) - (1 if reranks else 0)):
        kind, data = _next_report(out, procs)
        results[kind] = data if kind != "embeds" else results["embeds"] + data
    for p in procs:
        p.join()
    window = (results["reranks"][0][0], results["reranks"][-1][1]) if reranks else (t0, t1)
    # window_mono_ms: the window on the monotonic clock the server's step log uses (bench/step_shares.py cuts it
    # there), whole milliseconds (ints: the result's floats are rounded to 4 digits)
    figures: dict = {"window_s": window[1] - window[0], "window_mono_ms": [round(1e3 * t) for t in window]}
    if chat_url:
        gaps = [b - a for req in results["chats"] for a, b in zip(req, req[1:]) if window[0] <= b <= window[1]]
        tokens = sum(window[0] <= t <= window[1] for req in results["chats"] for t in req)
        figures |= {"tpot_p50_ms": 1e3 * percentile(gaps, 50), "tpot_p90_ms": 1e3 * percentile(gaps, 90),
                    "tpot_p99_ms": 1e3 * percentile(gaps, 99),
                    "chat_tokens_per_s": tokens / (window[1] - window[0])}
    if reranks:
        latencies = [b - a for a, b in results["reranks"]]
        figures |= {"rerank_p50_s": percentile(latencies, 50), "rerank_p90_s": percentile(latencies, 90)}
    if embeds:
        figures |= {"texts_per_s": texts_in_window(results["embeds"], window) / (window[1] - window[0]),
                    "whole_responses_texts_per_s": sum(k for _, t, k in results["embeds"] if window[0] <= t <= window[1])
                    / (window[1] - window[0])}
    return figures


def _system_phases(name: str, args, prompts, jobs, texts, t_ms: float | None) -> dict:
    """Start `name`'s servers, run its phases, stop them."""
    procs: list[Proc] = []
    info: dict = {}
    try:
        if name in ("tandem", "tandem_T"):
            extra = [] if name == "tandem" else ["--tpot-target-ms", f"{t_ms:.1f}"]
            extra += ["--model", args.model] if args.model else []
            server = tandem_proc(extra + args.tandem_flags)
            procs.append(server)
            chat_url, scorer = server.url, server
            info["servers"] = f"tandem serve {' '.join(extra + args.tandem_flags)}".strip()
        else:
            cores = os.cpu_count() or 2
            pinned = name == "split_pinned"
            half = max(1, cores // 2)
            chat, chat_name = _llama_server(args, f"0-{half - 1}" if pinned else None, half if pinned else cores)
            procs.append(chat)
            embed, embed_name = _embed_server(args, f"{half}-{cores - 1}" if pinned else None,
                                              cores - half if pinned else cores)
            procs.append(embed)
            chat_url, scorer = chat.url, embed
            info["servers"] = f"{chat_name} + {embed_name}" + (" (pinned half and half)" if pinned else "")
        phases = {}
        if not args.only_w5:
            phases = {"chats_alone": _phase(chat_url, scorer, args, prompts, jobs, texts),
                      "reranks_alone": _phase(None, scorer, args, prompts, jobs, texts, reranks=True),
                      "embeds_alone": _phase(None, scorer, args, prompts, jobs, texts, embeds=True),
                      "W1": _phase(chat_url, scorer, args, prompts, jobs, texts, reranks=True),
                      "W2": _phase(chat_url, scorer, args, prompts, jobs, texts, embeds=True)}
        if args.w5 or args.only_w5:  # one chat beside one big rerank, each also alone
            one, big = prompts[:1], [(jobs[0][0], [texts[i % len(texts)] for i in range(args.w5_docs)])]
            # and beside a long document (--w5-long-words words) cut into up to --w5-chunks windows, sent
            # --w5-long-reranks times one after another (one request a time, as W5 says; several for a median)
            long = [(jobs[0][0], [long_document(texts, args.w5_long_words)])] * args.w5_long_reranks
            phases |= {"W5_chat_alone": _phase(chat_url, scorer, args, one, big, texts),
                       "W5_rerank_alone": _phase(None, scorer, args, one, big, texts, reranks=True),
                       "W5": _phase(chat_url, scorer, args, one, big, texts, reranks=True),
                       "W5_long_rerank_alone": _phase(None, scorer, args, one, long, texts, reranks=True,
                                                      max_chunks=args.w5_chunks),
                       "W5_long": _phase(chat_url, scorer, args, one, long, texts, reranks=True,
                                         max_chunks=args.w5_chunks)}
        if name == "tandem_T":
            info["T_ms"] = t_ms
        return info | {"phases": phases}
    finally:
        for p in reversed(procs):
            p.stop()


def ratios(phases: dict) -> dict:
    """Each kind beside the others as a ratio to itself alone on the same system."""
    out = {}
    if "W1" in phases:
        solo, w1, w2 = phases["chats_alone"], phases["W1"], phases["W2"]
        out = {"W1_chat_p99_x": w1["tpot_p99_ms"] / solo["tpot_p99_ms"],
               "W1_rerank_p50_x": w1["rerank_p50_s"] / phases["reranks_alone"]["rerank_p50_s"],
               "W2_chat_tokens_x": w2["chat_tokens_per_s"] / solo["chat_tokens_per_s"],
               "W2_chat_p99_x": w2["tpot_p99_ms"] / solo["tpot_p99_ms"],
               "W2_embed_rate_x": w2["texts_per_s"] / phases["embeds_alone"]["texts_per_s"]}
    if "W5" in phases:
        out |= {"W5_chat_p90_x": phases["W5"]["tpot_p90_ms"] / phases["W5_chat_alone"]["tpot_p90_ms"],
                "W5_rerank_x": phases["W5"]["rerank_p50_s"] / phases["W5_rerank_alone"]["rerank_p50_s"]}
    if "W5_long" in phases:
        out |= {"W5_long_chat_p90_x": phases["W5_long"]["tpot_p90_ms"] / phases["W5_chat_alone"]["tpot_p90_ms"],
                "W5_long_rerank_x": phases["W5_long"]["rerank_p50_s"]
                / phases["W5_long_rerank_alone"]["rerank_p50_s"]}
    return out


# Each ratio's target (issue #62): (">=" or "<=", bound). W4's p99 bound is absolute (table() checks it per run).
TARGETS = {"W1_chat_p99_x": ("<=", 1.5), "W1_rerank_p50_x": ("<=", 4.0), "W2_chat_tokens_x": (">=", 0.7),
           "W2_chat_p99_x": ("<=", 1.5), "W2_embed_rate_x": (">=", 0.25), "W5_chat_p90_x": ("<=", 2.0),
           "W5_rerank_x": ("<=", 1.3), "W5_long_chat_p90_x": ("<=", 2.0), "W5_long_rerank_x": ("<=", 1.3)}
# W3: the absolute figures tandem must be ahead on against each split, and which way is ahead.
W3_FIGURES = {("W1", "tpot_p99_ms"): "lower", ("W1", "rerank_p50_s"): "lower", ("W2", "tpot_p99_ms"): "lower",
              ("W2", "texts_per_s"): "higher"}


def _median_phase(runs: list[dict], phase: str, key: str) -> float | None:
    vals = [r["phases"][phase][key] for r in runs if key in r["phases"].get(phase, {})]
    return statistics.median(vals) if vals else None


def table(result: dict) -> str:
    """The medians of every ratio per system beside its target, W4's bound per run and W3's comparison, as text."""
    systems = list(result["runs"])
    keys = [k for k in TARGETS if any(k in result["median"][s] for s in systems)]
    lines = ["target".ljust(28) + "".join(s.rjust(14) for s in systems)]
    for k in keys:
        op, bound = TARGETS[k]
        cells = []
        for s in systems:
            v = result["median"][s].get(k)
            met = v is not None and (v <= bound if op == "<=" else v >= bound)
            cells.append("" if v is None else f"{v:.2f}x{'' if met else ' MISS'}")
        lines.append(f"{k} {op} {bound}".ljust(28) + "".join(c.rjust(14) for c in cells))
    for run in result["runs"].get("tandem_T", []):
        if "W1" in run["phases"]:
            bound = max(1.25 * run["T_ms"], 1.1 * run["phases"]["chats_alone"]["tpot_p99_ms"])
            got = run["phases"]["W1"]["tpot_p99_ms"]
            lines.append(f"W4 run: W1 chats' p99 {got:.0f} ms <= {bound:.0f} ms: {'met' if got <= bound else 'MISS'}")
    tandem = result["runs"].get("tandem")
    for split in (s for s in systems if s.startswith("split") and tandem):
        parts = []
        for (phase, key), better in W3_FIGURES.items():
            ours, theirs = _median_phase(tandem, phase, key), _median_phase(result["runs"][split], phase, key)
            if ours is not None and theirs is not None:
                ahead = ours < theirs if better == "lower" else ours > theirs
                parts.append(f"{phase} {key} {ours:.3g} vs {theirs:.3g} ({'ahead' if ahead else 'behind'})")
        if parts:
            lines.append(f"W3 tandem vs {split}: " + "; ".join(parts))
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reranks", type=int, default=10)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--doc-tokens", type=int, default=200, help="~150 words")
    ap.add_argument("--embed-clients", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0, help="the window of the chats-alone and embedding phases")
    ap.add_argument("--t-factor", type=float, default=1.5, help="W4: T = this x the chats' solo p50 on tandem")
    ap.add_argument("--t-ms", type=float, default=None, help="W4: T itself (e.g. from an earlier run's tandem "
                    "chats-alone p50), so tandem_T runs without the tandem system first")
    ap.add_argument("--infinity", default=None, help="the infinity_emb command of a venv where Infinity runs (e.g. "
                    "one made with `pip install torch==2.13.0 'infinity-emb[server,torch]==0.0.78'`)")
    ap.add_argument("--tandem-flags", nargs="*", default=[], help="more `tandem serve` flags")
    ap.add_argument("--model", default=None, help="W6: a GGUF file both tandem and llama-server serve (default: the "
                    "embedded SmolLM2)")
    ap.add_argument("--w5", action="store_true", help="W5 too: one chat beside one --w5-docs-document rerank")
    ap.add_argument("--only-w5", action="store_true", help="W5 alone (its phases only; tandem_T then skips: it "
                    "takes T from the chats-alone phase)")
    ap.add_argument("--w5-docs", type=int, default=1000)
    ap.add_argument("--w5-long-words", type=int, default=6000, help="W5's long document, in words")
    ap.add_argument("--w5-chunks", type=int, default=32, help="its max_chunks_per_doc")
    ap.add_argument("--w5-long-reranks", type=int, default=3, help="how many times it is sent, one after another")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.chats, args.max_tokens, args.reranks, args.docs, args.seconds = 1, 2, 8, 2, 4, 3.0
        args.w5_docs, args.w5_long_words, args.w5_chunks, args.w5_long_reranks = 20, 600, 4, 1
    from bench.http_load import chat_prompts
    from bench.mixed_serve import _documents

    prompts = chat_prompts(args.chats)
    jobs = _documents(args.reranks, args.docs, args.doc_tokens, seed=0)
    texts = [d for _, docs in jobs for d in docs]
    result: dict = {"bench": "pipeline", "host": cpu_identity(), "commit": _commit(), "nproc": os.cpu_count(),
                    "load_1m_start": os.getloadavg()[0], "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": {}, "skipped": {}}
    t_ms = args.t_ms  # W4's T: given, else from the tandem system's chats-alone phase below
    for run in range(args.runs):
        for name in args.systems:
            if name == "tandem_T" and t_ms is None:
                result["skipped"][name] = "needs the tandem system's chats-alone p50 first (--systems tandem ...)"
                continue
            try:
                got = _system_phases(name, args, prompts, jobs, texts, t_ms)
            except RuntimeError as exc:
                result["skipped"][name] = str(exc)
                continue
            got["ratios"] = ratios(got["phases"])
            result["runs"].setdefault(name, []).append(got)
            if name == "tandem" and "chats_alone" in got["phases"]:
                t_ms = args.t_factor * got["phases"]["chats_alone"]["tpot_p50_ms"]
            print(f"run {run} {name}: {json.dumps(got['ratios'])}", file=sys.stderr, flush=True)
    result["median"] = {name: {k: statistics.median(r["ratios"][k] for r in runs) for k in runs[0]["ratios"]}
                        for name, runs in result["runs"].items()}
    result["load_1m_end"] = os.getloadavg()[0]
    write_result(result, args.out)
    if result["runs"]:
        print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
