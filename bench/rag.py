"""Whole RAG requests against one `tandem serve` and against the split deployment on the same cores: goodput under a
TTFT and a TPOT SLO (issue #70).

One RAG request, as a retrieval service's client sends it:

1. `/v1/embeddings` of the question;
2. cosine top --candidates (20) of --docs (400) documents of --doc-words (120) words, computed here, against the
   corpus vectors the same system embedded once before the phases (through its own embedding endpoint, not timed);
3. a rerank of those candidates (tandem: `/v2/rerank`; the split: its embedding server's), keeping the top --keep (3);
4. a streamed `/v1/chat/completions` answer: --max-tokens (64) tokens, greedy, `ignore_eos` (fixed lengths), the
   prompt holding the kept documents and the question (about 550 tokens).

Requests arrive open-loop, as a Poisson process (seeded: the same arrivals and questions on every system), --requests
at each of --rates, each request an asyncio task of its own (one HTTP connection a request). Per request: the time of
each stage (embed, retrieve, rerank, the answer's first token from its own send), TTFT from arrival, the answer's
gaps between tokens (TPOT), and any failure.

Systems (the same requests on each):

* `tandem`: `tandem serve`, default flags (plus `--reranker DIR` and --tandem-flags), all four stages in one process.
* `split_pinned`: a chat server on the first half of the cores with that many threads (on 2 cores: core 0, one
  thread) beside an embedding/rerank server on the other half (core 1, one thread), pinned with `taskset`.
* `split_shared`: the same two servers, each with every core's threads; the OS shares the cores.

The split's chat server is llama.cpp's `llama-server` when a build is in the cache (bench/peers/llama_server.py), else
`tandem serve` serving the chats alone; its embedding server is Infinity when its peer venv exists
(bench/peers/venvs.py) or --infinity names its command, else bench/peers/st_server.py (sentence-transformers). The JSON
names which ran. Both rerank modes: dense (the default: tandem's default mode; st_server's cosine; Infinity's
embeddings ranked here), or a cross-encoder with `--reranker DIR` (`--reranker minilm` builds the MiniLM-L6 one of
bench/models.py: a seeded random head, timing only) served by every system.

SLOs (the same for every system): before the phases, tandem answers --idle-requests requests one at a time (after one
warm-up); TTFT SLO = --ttft-factor (2.5) x their median TTFT, TPOT SLO = --tpot-factor (3) x their median gap
(--ttft-slo-s / --tpot-slo-ms give them instead). Every system's own idle figures are recorded too.

Goodput: a rate is met when at least --attainment (90%) of its requests got their first answer token within the TTFT
SLO (a request that failed or was dropped is a miss) and every answer that started kept its p99 gap within the TPOT SLO
(an answer cut off mid-stream misses). A run's goodput is the highest rate met with every lower rate measured met too
(0 when the lowest misses); reported per run, median and spread over --runs. Beside it, the goodput under vLLM's reading
of the TPOT SLO (its benchmark's `--goodput tpot:`): every answer's mean time per token after its first within the SLO,
where one long gap among 64 tokens does not miss the rate by itself. A token is a streamed chunk as vLLM's benchmark
counts them (`token_chunk`): a token whose text is held back (a special token, half a character) still ends a gap.

Optional load beside the RAG requests: --background-chats streams in a loop, and --ingest-batch texts a request sent
back to back to the embedding endpoint (tandem: at `priority` --ingest-priority, lower runs first, so 1 is behind the
RAG requests' 0).

    python -m bench.rag                                   # all systems, 3 runs (see docs/benchmarks.md for the time)
    python -m bench.rag --systems tandem --rates 0.05 --requests 4 --runs 1
    python -m bench.rag --reranker minilm                 # the cross-encoder mode (writes rag_xenc.json)

Writes bench/results/rag.json (or --out): the CPU's flags, the commit, the load, the SLOs, every request's record, the
per-rate summaries and goodput per run, and the printed table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace

from bench.host import cpu_identity
from bench.rag_steps import Stage, Stamps, explain, read_steps, summary_line, within
from bench.report import RESULTS, percentile, rotated, rounded

DEFAULT_RATES = (0.05, 0.1, 0.2, 0.3)
SLOT_CONTEXT = 1024  # llama-server's context a slot: the ~550-token prompt, the answer and the chat template


class System(StrEnum):
    TANDEM = "tandem"
    SPLIT_PINNED = "split_pinned"
    SPLIT_SHARED = "split_shared"


class ChatServer(StrEnum):
    """What serves the split's chats."""
    LLAMA_SERVER = "llama-server"
    TANDEM_CHATS_ONLY = "tandem serve, chats alone"  # no llama-server build in the cache


class EmbedServer(StrEnum):
    """What serves the split's embeddings and reranks."""
    INFINITY = "infinity-emb"
    SENTENCE_TRANSFORMERS = "sentence-transformers (bench/peers/st_server.py)"


class RerankApi(StrEnum):
    """How a system's rerank is asked for."""
    COHERE_V2 = "cohere_v2"  # tandem's /v2/rerank: query, documents, top_n
    TEI = "tei"  # bench/peers/st_server.py's /rerank: query, texts -> [{index, score}]
    INFINITY = "infinity"  # Infinity's /rerank with a cross-encoder: query, documents, model -> {results}
    CLIENT_COSINE = "client_cosine"  # the server only embeds: query and candidates embedded, ranked here


# ---- records and bookkeeping ------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One RAG request. Times in seconds; `arrival` from the phase's start; None where the stage never ran."""
    index: int
    arrival: float
    send_lag_s: float | None = None  # the task's start after its arrival (the client's own delay)
    embed_s: float | None = None
    retrieve_s: float | None = None
    rerank_s: float | None = None
    answer_ttft_s: float | None = None  # the answer's first token from the answer's own send
    ttft_s: float | None = None  # the answer's first token from arrival
    e2e_s: float | None = None  # the answer's last token from arrival
    gaps_s: list[float] = field(default_factory=list)  # between the answer's consecutive token chunks
    tokens: int = 0  # answer token chunks (`token_chunk`: text, or a token whose text is empty so far)
    completion_tokens: int | None = None  # the server's usage, when it sends one
    prompt_tokens: int | None = None
    error: str | None = None
    stamps: Stamps | None = None  # the monotonic times of each stage's send and each token (bench/rag_steps.py)

    @property
    def started(self) -> bool:
        return self.ttft_s is not None

    @property
    def tpot_p99_s(self) -> float:
        return percentile(self.gaps_s, 99) if self.gaps_s else 0.0

    @property
    def tpot_mean_s(self) -> float:
        """vLLM's TPOT (benchmarks/benchmark_serving.py): the answer's time after its first token over its tokens
        after the first (the server's count where it sent usage, else the token chunks seen); 0.0 without two."""
        n = self.completion_tokens or self.tokens
        if self.ttft_s is None or self.e2e_s is None or n < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (n - 1)

    def summary(self) -> dict:
        """The record for the JSON: the gaps as p50 / p99 / max, not every one."""
        out = {k: v for k, v in asdict(self).items() if k not in ("gaps_s", "stamps")}
        gaps = self.gaps_s
        out |= {"tpot_p50_s": percentile(gaps, 50) if gaps else None, "tpot_p99_s": self.tpot_p99_s if gaps else None,
                "tpot_max_s": max(gaps) if gaps else None, "tpot_mean_s": self.tpot_mean_s if self.started else None}
        return out


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    source: str  # where the figures came from


def derive_slo(idle: list[RequestRecord], ttft_factor: float, tpot_factor: float) -> Slo:
    """TTFT SLO = ttft_factor x the idle requests' median TTFT; TPOT SLO = tpot_factor x their median gap."""
    done = [r for r in idle if r.started and r.error is None]
    gaps = [g for r in done for g in r.gaps_s]
    if not done or not gaps:
        raise RuntimeError(f"no idle request completed with two tokens: {[r.error for r in idle]}")
    ttft = statistics.median(r.ttft_s for r in done)
    tpot = statistics.median(gaps)
    return Slo(ttft_factor * ttft, tpot_factor * tpot,
               f"{ttft_factor:g}x tandem's idle median TTFT ({ttft:.3f} s), {tpot_factor:g}x its idle median "
               f"gap ({1e3 * tpot:.2f} ms), {len(done)} requests one at a time")


@dataclass(frozen=True)
class RateVerdict:
    """One rate of one run against the SLOs."""
    rate: float
    n: int
    failed: int
    ttft_attainment: float  # share of all n with a first token within the TTFT SLO
    tpot_met: bool  # every answer that started kept its p99 gap within the TPOT SLO and finished
    met: bool
    # vLLM's reading of the same SLO (its benchmark's --goodput tpot): every answer's mean time per token after the
    # first (`RequestRecord.tpot_mean_s`) within the TPOT SLO, instead of its p99 gap; the TTFT condition unchanged
    tpot_mean_met: bool = False
    met_mean: bool = False


def judge(rate: float, records: list[RequestRecord], slo: Slo, attainment: float) -> RateVerdict:
    n = len(records)
    within = sum(r.started and r.ttft_s <= slo.ttft_s for r in records)
    answers = [r for r in records if r.started]
    tpot_met = all(r.error is None and r.tpot_p99_s <= slo.tpot_s for r in answers)
    tpot_mean_met = all(r.error is None and r.tpot_mean_s <= slo.tpot_s for r in answers)
    share = within / n if n else 0.0
    ttft_met = n > 0 and share >= attainment
    return RateVerdict(rate, n, sum(r.error is not None for r in records), share, tpot_met, ttft_met and tpot_met,
                       tpot_mean_met, ttft_met and tpot_mean_met)


def goodput(verdicts: list[RateVerdict], mean_tpot: bool = False) -> float:
    """The highest rate met with every lower rate measured met too; 0.0 when the lowest rate misses. `mean_tpot`: met
    as vLLM reads the TPOT SLO (`RateVerdict.met_mean`)."""
    best = 0.0
    for v in sorted(verdicts, key=lambda v: v.rate):
        if not (v.met_mean if mean_tpot else v.met):
            break
        best = v.rate
    return best


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """n arrival times (s from the start) of a Poisson process of `rate` per second: seeded, so every system gets the
    same ones."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def top_k(query, corpus, k: int) -> list[int]:
    """Indices of the k rows of `corpus` with the highest cosine to `query`, best first."""
    import numpy as np

    q = np.asarray(query, dtype=np.float32)
    m = np.asarray(corpus, dtype=np.float32)
    sims = (m @ q) / (np.linalg.norm(m, axis=1) * np.linalg.norm(q) + 1e-12)
    k = min(k, len(sims))
    best = np.argpartition(-sims, k - 1)[:k]
    return [int(i) for i in best[np.argsort(-sims[best], kind="stable")]]


def stage_p50s(records: list[RequestRecord]) -> dict:
    def p50(key: str) -> float | None:
        vals = [getattr(r, key) for r in records if getattr(r, key) is not None]
        return percentile(vals, 50) if vals else None

    gaps = [g for r in records for g in r.gaps_s]
    return {"embed_s": p50("embed_s"), "retrieve_s": p50("retrieve_s"), "rerank_s": p50("rerank_s"),
            "answer_ttft_s": p50("answer_ttft_s"), "tpot_p50_s": percentile(gaps, 50) if gaps else None}


def rate_summary(records: list[RequestRecord], verdict: RateVerdict) -> dict:
    ttfts = [r.ttft_s for r in records if r.started]
    return {"n": verdict.n, "failed": verdict.failed, "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
            "tpot_p99_worst_s": max((r.tpot_p99_s for r in records if r.started), default=None),
            "stages_p50": stage_p50s(records), **asdict(verdict)}


# ---- the workload -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    questions: tuple[str, ...]
    documents: tuple[str, ...]


def build_workload(n_docs: int, doc_words: int, seed: int) -> Workload:
    """AlpacaEval's instructions as the questions; the corpus: n_docs windows of doc_words whole words cut from its
    reference answers (each answer's consecutive windows, the short tails left out), drawn seeded."""
    from bench.datasets import alpaca_eval

    rows = alpaca_eval()
    windows = []
    for r in rows:
        words = r["output"].split()
        windows += [" ".join(words[i:i + doc_words]) for i in range(0, len(words) - doc_words + 1, doc_words)]
    rng = random.Random(seed)
    if len(windows) < n_docs:
        raise ValueError(f"only {len(windows)} windows of {doc_words} words; ask for fewer --docs")
    questions = [r["instruction"].strip() for r in rows]
    rng.shuffle(questions)
    return Workload(tuple(questions), tuple(rng.sample(windows, n_docs)))


def answer_messages(question: str, documents: list[str]) -> list[dict]:
    context = "\n\n".join(f"Document {i + 1}: {d}" for i, d in enumerate(documents))
    return [{"role": "user", "content": f"Answer the question using these documents.\n\n{context}\n\n"
                                        f"Question: {question}"}]


# ---- one system's endpoints -------------------------------------------------------------------------------------------


@dataclass
class Endpoints:
    """Where a system answers each stage."""
    chat_url: str
    embed_url: str
    embed_path: str
    rerank_api: RerankApi
    rerank_model: str | None = None
    embed_model: str | None = None  # named in each embedding request (Infinity serving two models)
    priority: bool = False  # the embedding endpoint takes tandem's `priority` field


async def embed(http, ep: Endpoints, texts: list[str], priority: int | None = None) -> list[list[float]]:
    body: dict = {"input": texts, **({"model": ep.embed_model} if ep.embed_model else {})}
    if priority is not None and ep.priority:
        body["priority"] = priority
    r = await http.post(f"{ep.embed_url}{ep.embed_path}", json=body)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return [d["embedding"] for d in data]


async def rerank(http, ep: Endpoints, query: str, docs: list[str], keep: int) -> list[int]:
    """The indices (into docs) of the `keep` best documents by the system's reranker."""
    if ep.rerank_api is RerankApi.CLIENT_COSINE:
        vectors = await embed(http, ep, [query, *docs])
        return top_k(vectors[0], vectors[1:], keep)
    if ep.rerank_api is RerankApi.COHERE_V2:
        r = await http.post(f"{ep.embed_url}/v2/rerank", json={"query": query, "documents": docs, "top_n": keep})
        r.raise_for_status()
        return [x["index"] for x in r.json()["results"]][:keep]
    if ep.rerank_api is RerankApi.INFINITY:
        r = await http.post(f"{ep.embed_url}/rerank", json={"query": query, "documents": docs,
                                                            "model": ep.rerank_model})
        r.raise_for_status()
        ranked = sorted(r.json()["results"], key=lambda x: -x["relevance_score"])
        return [x["index"] for x in ranked][:keep]
    r = await http.post(f"{ep.embed_url}/rerank", json={"query": query, "texts": docs})
    r.raise_for_status()
    return [x["index"] for x in sorted(r.json(), key=lambda x: -x["score"])][:keep]


def token_chunk(chunk: dict, started: bool) -> bool:
    """Whether a streamed chat chunk stands for a token, as vLLM's benchmark counts them (every chunk with a choice
    after the first): before the first, a chunk with text; after it, any chunk whose delta has a content string, ""
    included: a token whose text is held back (a special token the reply skips, half a UTF-8 character) was still
    generated at the stream's pace, so its gap is not folded into the next token's. A delta with no content (a
    role-only or a finish-only chunk, tool-call deltas) or no choice (the usage chunk) is not a token."""
    choices = chunk.get("choices") or [{}]
    content = (choices[0].get("delta") or {}).get("content")
    return bool(content) if not started else isinstance(content, str)


async def stream_answer(http, ep: Endpoints, messages: list[dict], max_tokens: int, rec: RequestRecord,
                        arrival: float) -> None:
    """Streams the answer into `rec`: its first token's times, the gaps, the usage when the server sends one."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    if rec.stamps is not None:
        rec.stamps.answer_sent = sent
    last = None
    async with http.stream("POST", f"{ep.chat_url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"chat {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                rec.completion_tokens = chunk["usage"].get("completion_tokens")
                rec.prompt_tokens = chunk["usage"].get("prompt_tokens")
            if not token_chunk(chunk, started=last is not None):
                continue
            now = time.monotonic()
            if rec.stamps is not None:
                rec.stamps.tokens.append(now)
            if last is None:
                rec.answer_ttft_s, rec.ttft_s = now - sent, now - arrival
            else:
                rec.gaps_s.append(now - last)
            last = now
            rec.tokens += 1
    if last is None:
        raise RuntimeError("the answer streamed no token")
    rec.e2e_s = last - arrival


async def rag_request(http, ep: Endpoints, corpus_vectors, wl: Workload, question: str, args, rec: RequestRecord,
                      arrival: float) -> RequestRecord:
    """The four stages of one request into `rec`; a failure is recorded, never raised."""
    rec.send_lag_s = time.monotonic() - arrival
    rec.stamps = Stamps(arrival)
    try:
        t = rec.stamps.embed_sent = time.monotonic()
        qv = (await embed(http, ep, [question]))[0]
        rec.embed_s = time.monotonic() - t
        t = time.monotonic()
        candidates = top_k(qv, corpus_vectors, args.candidates)
        rec.retrieve_s = time.monotonic() - t
        docs = [wl.documents[i] for i in candidates]
        t = rec.stamps.rerank_sent = time.monotonic()
        kept = await rerank(http, ep, question, docs, args.keep)
        rec.rerank_s = time.monotonic() - t
        await stream_answer(http, ep, answer_messages(question, [docs[i] for i in kept]), args.max_tokens, rec,
                            arrival)
    except Exception as exc:  # noqa: BLE001 - a failed request is a miss, recorded with its reason
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    return rec


# ---- phases -----------------------------------------------------------------------------------------------------------


def _client():
    import httpx

    # one connection a request (no keep-alive): llama-server may close a kept-alive one under load
    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


async def embed_corpus(ep: Endpoints, wl: Workload, batch: int = 32) -> list[list[float]]:
    """The corpus embedded once through the system's own endpoint (not timed)."""
    async with _client() as http:
        out: list[list[float]] = []
        for i in range(0, len(wl.documents), batch):
            out += await embed(http, ep, list(wl.documents[i:i + batch]))
        return out


async def idle_requests(ep: Endpoints, corpus_vectors, wl: Workload, args) -> list[RequestRecord]:
    """One warm-up request, then --idle-requests one at a time (the last questions, not the phases' first ones)."""
    out = []
    async with _client() as http:
        for i in range(args.idle_requests + 1):
            rec = RequestRecord(i, 0.0)
            question = wl.questions[-1 - i]
            await _bounded(rag_request(http, ep, corpus_vectors, wl, question, args, rec, time.monotonic()), rec,
                           args.timeout_s)
            if i:
                out.append(rec)
    return out


async def _background_chats(ep: Endpoints, wl: Workload, args, stop: asyncio.Event, counts: dict) -> None:
    async def loop(k: int) -> None:
        async with _client() as http:
            while not stop.is_set():
                rec = RequestRecord(-1, 0.0)
                try:
                    messages = [{"role": "user", "content": wl.questions[k]}]
                    await stream_answer(http, ep, messages, args.background_tokens, rec, time.monotonic())
                except Exception:  # noqa: BLE001 - background load: counted, not judged
                    counts["chat_errors"] += 1
                counts["chat_tokens"] += rec.tokens

    await asyncio.gather(*(loop(k) for k in range(args.background_chats)))


async def _background_ingest(ep: Endpoints, wl: Workload, args, stop: asyncio.Event, counts: dict) -> None:
    async with _client() as http:
        i = 0
        while not stop.is_set():
            texts = [wl.documents[(i + j) % len(wl.documents)] for j in range(args.ingest_batch)]
            i += args.ingest_batch
            try:
                await embed(http, ep, texts, priority=args.ingest_priority)
                counts["ingest_texts"] += len(texts)
            except Exception:  # noqa: BLE001
                counts["ingest_errors"] += 1


async def run_rate(ep: Endpoints, corpus_vectors, wl: Workload, args, rate: float, seed: int) -> tuple[list, dict]:
    """--requests RAG requests arriving as a Poisson process of `rate` (seeded), beside the background load; their
    records once every one has finished, failed or timed out, and the background load's counts."""
    arrivals = poisson_arrivals(rate, args.requests, seed)
    questions = random.Random(seed).sample(range(len(wl.questions) - args.idle_requests - 1), args.requests)
    stop, counts = asyncio.Event(), {"chat_tokens": 0, "chat_errors": 0, "ingest_texts": 0, "ingest_errors": 0}
    background = []
    if args.background_chats:
        background.append(asyncio.create_task(_background_chats(ep, wl, args, stop, counts)))
    if args.ingest_batch:
        background.append(asyncio.create_task(_background_ingest(ep, wl, args, stop, counts)))
    async with _client() as http:
        t0 = time.monotonic() + (1.0 if background else 0.1)
        tasks = []
        for i, (offset, q) in enumerate(zip(arrivals, questions)):
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            rec = RequestRecord(i, offset)
            tasks.append(asyncio.create_task(_bounded(rag_request(http, ep, corpus_vectors, wl, wl.questions[q], args,
                                                                  rec, t0 + offset), rec, args.timeout_s)))
        records = await asyncio.gather(*tasks)
    stop.set()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    return list(records), counts


async def _bounded(coro, rec: RequestRecord, timeout_s: float) -> RequestRecord:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"dropped: no answer within {timeout_s:g} s"
        return rec


# ---- systems ----------------------------------------------------------------------------------------------------------


def _halves(cores: int) -> tuple[str, int, str, int]:
    """(chat cores, chat threads, embed cores, embed threads) of the pinned split: half and half."""
    if cores < 2:
        raise RuntimeError("the pinned split needs 2 cores or more")
    half = cores // 2
    return f"0-{half - 1}", half, f"{half}-{max(half, cores - 1)}", max(1, cores - half)


def infinity_command(given: str | None) -> str | None:
    """--infinity's command, else infinity_emb of bench/embed_speed.py's peer venv when it was made, else None."""
    if given:
        return given
    from bench.peers.venvs import VENVS

    path = VENVS / "infinity" / "bin" / "infinity_emb"
    return str(path) if path.is_file() and (VENVS / "infinity" / ".tandem-installed").is_file() else None


def _split_chat(args, cores: str | None, threads: int) -> tuple:
    """(process, kind, description): llama-server when a build is cached, else `tandem serve` serving the chats
    alone."""
    from bench.pipeline import _llama_server
    from bench.servers import tandem_proc

    slots = SimpleNamespace(chats=args.slots, max_tokens=args.max_tokens, model=None)
    try:
        proc, name = _llama_server(slots, cores, threads, ctx=args.slots * SLOT_CONTEXT)
    except RuntimeError as exc:
        proc = tandem_proc(["--num-threads", str(threads)], cores)
        return proc, ChatServer.TANDEM_CHATS_ONLY, f"tandem serve --num-threads {threads}, chats alone ({exc})"
    return proc, ChatServer.LLAMA_SERVER, f"{name}, {threads} threads, -np {args.slots}"


def _infinity_embedder(scorer) -> str | None:
    """The embedder's model id when Infinity serves a cross-encoder beside it (two models: requests name theirs)."""
    if not scorer.rerank_model:
        return None
    from engine.embed.embedder import embedded_embedder_dir

    return str(embedded_embedder_dir())


def _flag_value(flags: list[str], name: str) -> Path | None:
    """The value `flags` give option `name` (`--name VALUE` or `--name=VALUE`, the last one), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return None if value is None else Path(value)


def start_system(system: System, args) -> tuple[list, Endpoints, dict]:
    """The system's server processes (started; the caller stops them), its endpoints, and what they are."""
    from bench.pipeline import _embed_server
    from bench.servers import tandem_proc

    if system is System.TANDEM:
        flags = [*(["--reranker", args.reranker] if args.reranker else []), *args.tandem_flags]
        # The step log the why-lines read: the user's own where --tandem-flags names one (kept after the run), else a
        # temporary file (two --step-log flags would leave the user's file unwritten: the last one wins)
        step_log = _flag_value(flags, "--step-log")
        if step_log is None:
            step_log = Path(tempfile.mkdtemp(prefix="rag_steps_")) / "steps.jsonl"
            flags_run = [*flags, "--step-log", str(step_log)]
        else:
            flags_run = flags
        proc = tandem_proc(flags_run)
        ep = Endpoints(proc.url, proc.url, "/v1/embeddings", RerankApi.COHERE_V2, priority=True)
        return [proc], ep, {"servers": f"tandem serve {' '.join(flags)}".strip(), "step_log": str(step_log)}
    cores = os.cpu_count() or 2
    if system is System.SPLIT_PINNED:
        chat_cores, chat_threads, embed_cores, embed_threads = _halves(cores)
    else:
        chat_cores, chat_threads, embed_cores, embed_threads = None, cores, None, cores
    procs = []
    try:
        chat, chat_kind, chat_name = _split_chat(args, chat_cores, chat_threads)
        procs.append(chat)
        scorer, scorer_name = _embed_server(SimpleNamespace(infinity=args.infinity, reranker=args.reranker),
                                            embed_cores, embed_threads)
        procs.append(scorer)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    api = (RerankApi.CLIENT_COSINE if scorer.rerank_by_embedding else
           RerankApi.INFINITY if scorer.rerank_model else RerankApi.TEI)
    ep = Endpoints(chat.url, scorer.url, scorer.embed_path, api, scorer.rerank_model, _infinity_embedder(scorer))
    embed_kind = EmbedServer.INFINITY if args.infinity else EmbedServer.SENTENCE_TRANSFORMERS
    info = {"chat_server_kind": chat_kind.value, "chat_server": chat_name, "embed_server_kind": embed_kind.value,
            "embed_server": scorer_name, "rerank_api": api.value,
            "cores": {"chat": chat_cores or "all", "chat_threads": chat_threads, "embed": embed_cores or "all",
                      "embed_threads": embed_threads}}
    return procs, ep, info


async def session(system: System, args, wl: Workload, run: int) -> dict:
    """Start `system`, embed the corpus, measure it idle, run every rate, stop it."""
    procs, ep, info = start_system(system, args)
    try:
        vectors = await embed_corpus(ep, wl)
        idle = await idle_requests(ep, vectors, wl, args)
        rates = {}
        for i, rate in enumerate(args.rates):
            start = time.monotonic()
            records, counts = await run_rate(ep, vectors, wl, args, rate, seed=args.seed + 1000 * run + i)
            rates[rate] = {"records": records, "background": counts, "window": (start, time.monotonic())}
            print(f"run {run} {system.value} {rate:g} req/s: {sum(r.error is None for r in records)}/{len(records)} "
                  f"answered", file=sys.stderr, flush=True)
        return info | {"idle": idle, "rates": rates}
    finally:
        for p in reversed(procs):
            p.stop()


# ---- results ----------------------------------------------------------------------------------------------------------


def judge_session(got: dict, slo: Slo, attainment: float) -> dict:
    """A session's records judged against the SLOs: per rate a summary, and the run's goodput."""
    verdicts, rates = [], {}
    idle = got["idle"]
    idle_stages = {s: statistics.median(getattr(r, s.value) for r in idle if getattr(r, s.value) is not None)
                   for s in Stage if any(getattr(r, s.value) is not None for r in idle)}
    step_log = read_steps(Path(got["step_log"])) if got.get("step_log") else None  # tandem: read once a session
    for rate, phase in got["rates"].items():
        v = judge(rate, phase["records"], slo, attainment)
        verdicts.append(v)
        summaries = [r.summary() for r in phase["records"]]
        rates[f"{rate:g}"] = {"summary": rate_summary(phase["records"], v), "background": phase["background"],
                              "records": summaries}
        if step_log is not None:  # tandem: the step log's reasons for each miss
            steps = within(step_log, *phase["window"])
            stamps = [r.stamps or Stamps(float("nan")) for r in phase["records"]]
            rates[f"{rate:g}"]["why"] = explain(summaries, stamps, steps, slo.ttft_s, slo.tpot_s, idle_stages)
    idle_ttfts = [r.ttft_s for r in idle if r.started]
    idle_gaps = [g for r in idle for g in r.gaps_s]
    out = {k: v for k, v in got.items() if k not in ("idle", "rates")}
    return out | {"idle": {"ttft_p50_s": percentile(idle_ttfts, 50) if idle_ttfts else None,
                           "tpot_p50_s": percentile(idle_gaps, 50) if idle_gaps else None,
                           "records": [r.summary() for r in idle]},
                  "rates": rates, "goodput_req_s": goodput(verdicts),
                  "goodput_mean_tpot_req_s": goodput(verdicts, mean_tpot=True)}


def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _spread(vals: list) -> str:
    vals = [v for v in vals if v is not None]
    return f"{min(vals):.3g}-{max(vals):.3g}" if len(vals) > 1 else ""


def table_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Per system and rate: the medians over runs of each run's figures, the p90 TTFT's spread, runs met."""
    rows = []
    for system, sessions in runs.items():
        for rate in sessions[0]["rates"]:
            ss = [s["rates"][rate]["summary"] for s in sessions if rate in s["rates"]]
            stage = {k: _median([s["stages_p50"][k] for s in ss]) for k in ss[0]["stages_p50"]}
            rows.append({"system": system, "rate": float(rate), "runs": len(ss), "n": sum(s["n"] for s in ss),
                         "failed": sum(s["failed"] for s in ss),
                         "ttft_p50_s": _median([s["ttft_p50_s"] for s in ss]),
                         "ttft_p90_s": _median([s["ttft_p90_s"] for s in ss]),
                         "ttft_p90_spread_s": _spread([s["ttft_p90_s"] for s in ss]),
                         "stages_p50": stage, "ttft_attainment": _median([s["ttft_attainment"] for s in ss]),
                         "tpot_met_runs": sum(s["tpot_met"] for s in ss), "met_runs": sum(s["met"] for s in ss),
                         "met_mean_runs": sum(s["met_mean"] for s in ss)})
    return rows


def goodputs(runs: dict[str, list[dict]], key: str = "goodput_req_s") -> dict:
    """Per system: each run's goodput (`key`: the issue's p99-gap reading, or "goodput_mean_tpot_req_s", vLLM's),
    their median and range."""
    out = {}
    for system, sessions in runs.items():
        vals = [s[key] for s in sessions]
        out[system] = {"per_run": vals, "median": _median(vals), "min": min(vals), "max": max(vals)}
    return out


def issue_targets(runs: dict[str, list[dict]], good: dict) -> dict:
    """Issue #70's figures: tandem's goodput over the best split's (medians over runs; None with a note when every
    split missed the lowest rate: no bound), and tandem's p90 TTFT at 0.2 and 0.3 req/s over its idle p50 TTFT (the
    median of each run's ratio), where those rates ran."""
    out: dict = {}
    splits = [g["median"] for name, g in good.items() if name != System.TANDEM.value]
    if System.TANDEM.value in good and splits:
        best = max(splits)
        out["goodput_vs_best_split"] = good[System.TANDEM.value]["median"] / best if best > 0 else None
        if best == 0:
            out["goodput_vs_best_split_note"] = "every split missed the lowest rate: no bound; measure lower rates"
    for rate in (0.2, 0.3):
        ratios = [s["rates"][f"{rate:g}"]["summary"]["ttft_p90_s"] / s["idle"]["ttft_p50_s"]
                  for s in runs.get(System.TANDEM.value, [])
                  if f"{rate:g}" in s["rates"] and s["rates"][f"{rate:g}"]["summary"]["ttft_p90_s"] is not None
                  and s["idle"]["ttft_p50_s"]]
        if ratios:
            out[f"p90_ttft_at_{rate:g}_over_idle_p50"] = statistics.median(ratios)
    return out


def _fmt(x: float | None, scale: float = 1.0, digits: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(scale * x, digits)


def table_text(rows: list[dict], good: dict, slo: Slo, good_mean: dict | None = None) -> str:
    head = (f"{'system':<13}{'rate':>6}{'n':>5}{'fail':>5}{'TTFT p50':>10}{'TTFT p90':>10}{'(spread)':>14}"
            f"{'embed':>8}{'rerank':>8}{'ans.TTFT':>9}{'TPOT ms':>9}{'in SLO':>8}{'met':>6}{'vLLM':>6}")
    lines = [f"SLOs: TTFT <= {slo.ttft_s:.2f} s, p99 TPOT <= {1e3 * slo.tpot_s:.1f} ms ({slo.source})",
             "TTFT from arrival; stage columns are p50 s; TPOT the p50 gap; 'in SLO' the share with TTFT within its "
             "SLO; 'met' runs meeting both SLOs / runs (TPOT: every answer's p99 gap); 'vLLM' the same with vLLM's "
             "TPOT (every answer's mean time per token after the first)", head]
    for r in rows:
        st = r["stages_p50"]
        lines.append(f"{r['system']:<13}{r['rate']:>6g}{r['n']:>5}{r['failed']:>5}{_fmt(r['ttft_p50_s']):>10}"
                     f"{_fmt(r['ttft_p90_s']):>10}{r['ttft_p90_spread_s']:>14}{_fmt(st['embed_s']):>8}"
                     f"{_fmt(st['rerank_s']):>8}{_fmt(st['answer_ttft_s']):>9}{_fmt(st['tpot_p50_s'], 1e3, '.1f'):>9}"
                     f"{_fmt(r['ttft_attainment'], 100, '.0f') + '%':>8}{r['met_runs']:>4}/{r['runs']}"
                     f"{r['met_mean_runs']:>4}/{r['runs']}")
    for label, g_all in (("goodput", good), ("goodput, vLLM's TPOT", good_mean or {})):
        for system, g in g_all.items():
            spread = f" (runs: {', '.join(f'{v:g}' for v in g['per_run'])})" if len(g["per_run"]) > 1 else ""
            lines.append(f"{label} {system}: {g['median']:g} req/s{spread}")
    return "\n".join(lines)


def why_lines(runs: dict[str, list[dict]]) -> list[str]:
    """Per tandem run and rate, the step log's reasons for the misses (bench/rag_steps.py)."""
    return [f"run {i} tandem {summary_line(float(rate), phase['why'])}"
            for i, session in enumerate(runs.get(System.TANDEM.value, []))
            for rate, phase in session["rates"].items() if "why" in phase]


# ---- main -------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", choices=[s.value for s in System], default=[s.value for s in System])
    ap.add_argument("--rates", nargs="+", type=float, default=list(DEFAULT_RATES), help="requests/s")
    ap.add_argument("--requests", type=int, default=16, help="RAG requests at each rate")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--doc-words", type=int, default=120)
    ap.add_argument("--candidates", type=int, default=20, help="the first stage's top-k, reranked")
    ap.add_argument("--keep", type=int, default=3, help="documents kept for the answer's prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="the answer's tokens")
    ap.add_argument("--idle-requests", type=int, default=3, help="idle requests one at a time, after one warm-up")
    ap.add_argument("--reranker", default=None, help="a cross-encoder directory every system reranks with ('minilm': "
                    "build bench/models.py's MiniLM-L6 one); default: the dense mode")
    ap.add_argument("--infinity", default=None, help="Infinity's infinity_emb command (default: bench/peers/venvs.py's "
                    "peer venv when it exists, else bench/peers/st_server.py)")
    ap.add_argument("--slots", type=int, default=16, help="llama-server's -np")
    ap.add_argument("--tandem-flags", nargs="*", default=[], help="more `tandem serve` flags for the tandem system")
    ap.add_argument("--ttft-factor", type=float, default=2.5)
    ap.add_argument("--tpot-factor", type=float, default=3.0)
    ap.add_argument("--ttft-slo-s", type=float, default=None, help="the TTFT SLO itself (skips deriving it)")
    ap.add_argument("--tpot-slo-ms", type=float, default=None, help="the TPOT SLO itself")
    ap.add_argument("--attainment", type=float, default=0.9, help="share of requests within the TTFT SLO")
    ap.add_argument("--background-chats", type=int, default=0, help="chat streams in a loop beside the requests")
    ap.add_argument("--background-tokens", type=int, default=64)
    ap.add_argument("--ingest-batch", type=int, default=0, help="texts an ingest request (0: no ingest stream)")
    ap.add_argument("--ingest-priority", type=int, default=1, help="its `priority` on tandem (lower runs first)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="a request unanswered by then is dropped")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/rag.json (rag_xenc.json with "
                    "--reranker)")
    args = ap.parse_args(argv)
    args.systems = [System(s) for s in args.systems]
    if args.out is None:
        args.out = RESULTS / ("rag_xenc.json" if args.reranker else "rag.json")
    return args


def _reranker_dir(name: str | None) -> str | None:
    if name != "minilm":
        return name
    from bench.models import minilm_cross_encoder_dir

    return str(minilm_cross_encoder_dir(Path(tempfile.mkdtemp(prefix="rag_minilm_ce_"))))


def _dirty() -> bool:
    """Whether the checkout had changes beside the commit it names (figures then belong to no commit alone)."""
    import subprocess

    from bench.servers import ROOT

    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def _given_slo(args) -> Slo | None:
    if args.ttft_slo_s is None or args.tpot_slo_ms is None:
        return None
    return Slo(args.ttft_slo_s, args.tpot_slo_ms / 1e3, "given (--ttft-slo-s, --tpot-slo-ms)")


async def run_all(args, wl: Workload) -> tuple[dict[str, list[dict]], Slo, dict]:
    """Every run of every system (tandem first, so its idle figures set the SLOs); raw sessions, SLO, skipped."""
    slo = _given_slo(args)
    order = sorted(args.systems, key=lambda s: s is not System.TANDEM)
    raw: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    calibrate = slo is None and System.TANDEM not in order  # the SLOs come from tandem idle: one tandem session first
    for run in range(args.runs):
        # each system goes first in turn (a shared host's drift spreads over all); tandem first in run 0 for the SLOs
        for system in ([System.TANDEM, *order] if calibrate and run == 0 else rotated(order, run)):
            try:
                got = await session(system, args, wl, run)
            except RuntimeError as exc:
                skipped[system.value] = str(exc)
                continue
            if slo is None and system is System.TANDEM:
                slo = derive_slo(got["idle"], args.ttft_factor, args.tpot_factor)
            raw.setdefault(system.value, []).append(got)
    if slo is None:
        raise RuntimeError(f"no SLO: tandem did not run ({skipped})")
    return raw, slo, skipped


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.reranker = _reranker_dir(args.reranker)
    args.infinity = infinity_command(args.infinity)
    from bench.pipeline import _commit

    wl = build_workload(args.docs, args.doc_words, args.seed)
    result: dict = {"bench": "rag", "host": cpu_identity(), "commit": _commit(), "commit_dirty": _dirty(), "nproc": os.cpu_count(),
                    "load_1m_start": os.getloadavg()[0],
                    "args": {k: (v if isinstance(v, (int, float, list, type(None))) else str(v))
                             for k, v in vars(args).items()},
                    "rerank_mode": "cross-encoder" if args.reranker else "dense"}
    raw, slo, skipped = asyncio.run(run_all(args, wl))
    runs = {name: [judge_session(s, slo, args.attainment) for s in sessions] for name, sessions in raw.items()}
    rows, good = table_rows(runs), goodputs(runs)
    good_mean = goodputs(runs, "goodput_mean_tpot_req_s")
    text = "\n".join([table_text(rows, good, slo, good_mean), *why_lines(runs)])
    targets = issue_targets(runs, good) | {f"{k}_vllm_tpot": v for k, v in issue_targets(runs, good_mean).items()
                                           if k.startswith("goodput")}
    result |= {"slo": asdict(slo), "skipped": skipped, "runs": runs, "table": rows, "goodput": good,
               "goodput_vllm_tpot": good_mean, "targets": targets, "table_text": text,
               "load_1m_end": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rounded(result)) + "\n")
    print(text, flush=True)
    print(f"wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
