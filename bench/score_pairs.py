"""Scores a rerank quality pair file with one of tandem's LLM rerank modes, on any device.

`python -m bench.rerank_quality ... --pairs-out P` writes the queries and candidate texts it would score (every
corpus, cut to its --doc-tokens / --query-tokens); this module scores them with `LLM.rerank`, one request per query,
exactly as rerank_quality does, and writes the scores with where they were computed; `rerank_quality --scores-in
MODE=S` then uses them instead of scoring that mode itself. It lets the costly ranker (query likelihood: a forward of
the LLM per pair) run on a GPU for all the queries while the rest of the benchmark (BM25, the dense bi-encoder, the
fusion computed from both, the metrics) runs where the corpora are. Only the engine, the embedded model and
transformers' tokenizer are needed here, not the corpora.

    python -m bench.score_pairs PAIRS.json.gz --mode likelihood --device cuda --out SCORES.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import time
from pathlib import Path


def read_json(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def write_json(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        json.dump(obj, f)


def corpus_digest(queries: list[str], docs: list[list[str]]) -> str:
    """What a corpus's pairs are, so scores are only ever used for the texts they were computed on."""
    return hashlib.sha256(json.dumps([queries, docs]).encode()).hexdigest()


def pair_lists(corpus: dict) -> list[list[str]]:
    """Each query's candidate texts, best BM25 first, from a pair file's corpus entry (texts stored once by id)."""
    texts = corpus["texts"]
    return [[texts[str(d)] for d in cands] for cands in corpus["candidates"]]


def prefix_cache_use(records: list) -> dict:
    """The pair tokens the engine computed and those it took from the prefix cache over its StepRecords `records`."""
    computed = sum(r.rerank_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    return {"computed_tokens": computed, "cached_tokens": cached, "cached_fraction": cached / max(1, computed + cached)}


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", type=Path, help="a pair file from rerank_quality --pairs-out")
    ap.add_argument("--mode", default="likelihood", choices=["likelihood", "judge"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the device's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="score only each corpus's first N queries")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import torch

    from engine import LLM, EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = read_json(args.pairs)
    llm = LLM(EngineConfig(rerank_mode=args.mode, device=args.device, dtype=args.dtype,
                           max_num_batched_tokens=args.budget, kv_cache_bytes=1 << 30, num_threads=args.threads))
    records = []
    llm.engine.add_observer(records.append)
    out = {"mode": args.mode, "device": args.device, "device_name": device_name(args.device), "dtype": args.dtype,
           "budget": llm.engine.config.max_num_batched_tokens, "torch": torch.__version__,
           "quantization": llm.engine.config.quantization, "setting": pairs["setting"], "corpora": {}}
    for name, corpus in pairs["corpora"].items():
        queries, docs = corpus["queries"], pair_lists(corpus)
        n = len(queries) if args.limit is None else min(args.limit, len(queries))
        records.clear()
        t = time.perf_counter()
        scores = [list(map(float, llm.rerank(queries[i], docs[i]))) for i in range(n)]
        seconds = time.perf_counter() - t
        num_pairs = sum(len(d) for d in docs[:n])
        out["corpora"][name] = {
            "digest": corpus_digest(queries[:n], docs[:n]), "queries": n, "scores": scores, "seconds": seconds,
            "pairs": num_pairs, "pairs_s": num_pairs / seconds, **prefix_cache_use(records), "steps": len(records)}
        print(json.dumps({k: v for k, v in out["corpora"][name].items() if k != "scores"} | {"corpus": name}),
              flush=True)
        write_json(out, args.out)  # after each corpus: a run cut short keeps what it scored
    return out


if __name__ == "__main__":
    main()
