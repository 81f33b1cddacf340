"""`python -m bench` (`make bench`): every benchmark of #9 in one run, then plots and the targets table.

Each benchmark writes its own JSON under bench/results/; this runner adds summary.json (every target with its
measured ratio and whether it was met) and prints the same table as Markdown, the one docs/benchmarks.md
shows. Benchmarks with no goal (prefill, sampling) add FIGURES: their ratios, listed after the targets.
`--quick` runs tiny sizes to check the wiring (its figures mean nothing); `--only` picks benchmarks.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.report import RESULTS, write_result

BENCHMARKS = ("throughput", "rerank", "mixed", "latency", "prefill", "sampling", "rerank_quality", "single", "structured",
              "http_load", "cpu_peer", "mixed_serve", "activations", "embed_speed")
# Results loaded beside them, written by a benchmark run with other options (see each Target's comment).
EXTRA_RESULTS = ("mixed_serve_xenc", "rag")


@dataclass(frozen=True)
class Target:
    name: str
    source: str  # results file stem
    path: tuple[str, ...]  # keys into that JSON
    goal: float
    higher_is_better: bool = True
    unit: str = "x"

    def measured(self, results: dict[str, dict]) -> float | None:
        node = results.get(self.source)
        for key in self.path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node if isinstance(node, (int, float)) else None

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.goal if self.higher_is_better else value <= self.goal


TARGETS = (
    Target("Generation throughput vs transformers continuous batching", "throughput",
           ("ratios", "vs_hf_continuous"), 4.0),
    Target("Generation throughput vs HF generate, static batches of 8", "throughput", ("ratios", "vs_hf_static8"), 8.0),
    Target("Generation outputs token-identical to transformers greedy (share of requests)", "throughput",
           ("agreement_vs_hf_continuous", "identical_share"), 1.0, unit=""),
    Target("Cross-encoder rerank pairs/s vs sentence-transformers CrossEncoder (AlpacaEval 64 x 50)", "rerank",
           ("cross_encoder", "ratio_vs_sentence_transformers"), 2.0),
    Target("Cross-encoder rerank p90 per-query latency vs sentence-transformers CrossEncoder", "rerank",
           ("cross_encoder", "p90_latency_ratio_vs_sentence_transformers"), 0.5, higher_is_better=False),
    Target("LLM reranker pairs/s, prefix cache on vs off", "rerank", ("llm_judge", "ratio_cache_on_vs_off"), 3.0),
    # Gaps across steps that also prefilled prompts are left out of both sides: decode alone has a few (its own
    # start-up), and they made its p99 larger than the mixed run's, flattering the ratio.
    Target("Mixed: decode p99 TPOT during a rerank flood vs decode alone", "mixed", ("steady_tpot_p99_ratio",), 1.5,
           higher_is_better=False),
    Target("Mixed: rerank throughput during decode vs rerank alone", "mixed", ("rerank_throughput_ratio",), 0.8),
    Target("Engine overhead (outside model forward) at the widest steps", "throughput",
           ("efficiency", "overhead_share"), 0.05, higher_is_better=False, unit=""),
    Target("Large-batch decode FLOP utilisation vs fp32 matmul peak (same run)", "throughput", ("efficiency", "mfu"),
           0.6, unit=""),
    # Issue #37: on every corpus and first-stage depth K of bench/rerank_quality.py at RAG lengths (worst case of
    # each), the default rerank mode (then fusion, with the embedded embedder as tandem serve loads it) ranks at least
    # 0.03 nDCG@10 above BM25's own order and 0.01 above the dense MiniLM bi-encoder (paired, same queries).
    Target("Rerank quality: default reranker nDCG@10 minus first-stage BM25 (worst corpus, K)",
           "rerank_quality", ("targets", "vs_bm25_min"), 0.03, unit=""),
    Target("Rerank quality: default reranker nDCG@10 minus the dense MiniLM bi-encoder (worst corpus, K)",
           "rerank_quality", ("targets", "minus_dense_min"), 0.01, unit=""),
    # Issue #47: the default (dense since then) ranks no worse than fusion (the default before it) minus one standard
    # error of fusion's nDCG@10, on every corpus and K: (default - fusion) / fusion's standard error, worst case.
    Target("Rerank quality: default nDCG@10 minus fusion's, in fusion's standard errors (worst corpus, K)",
           "rerank_quality", ("targets", "default_vs_fusion_stderrs"), -1.0, unit=""),
    # issue #19: one chat at a time, on the embedded model's own 4-bit blocks, against llama.cpp on the same file.
    Target("Batch-1 decode tok/s, tandem (GGUF 4-bit) vs llama.cpp on the same file and threads", "single",
           ("ratios", "gguf_vs_llama_cpp"), 1.0),
    Target("Batch-1 greedy tokens (4-bit path) identical to transformers on the same file", "single",
           ("systems", "tandem_gguf", "vs_transformers", "same_position_share"), 1.0, unit=""),
    # Issue #25: through tandem serve, 8 chats under a flood of 4 clients x 40 documents, T = 1.5x solo TPOT p50.
    Target("Mixed through the service: chat p99 TPOT during a rerank flood / T (objective, likelihood pairs)",
           "mixed_serve", ("objective_p99_over_target",), 1.25, higher_is_better=False),
    Target("Mixed through the service: rerank pairs/s under the objective vs the best fixed share under T",
           "mixed_serve", ("objective_pairs_vs_best_share",), 0.8),
    # `python -m bench.mixed_serve --cross-encoder minilm --out bench/results/mixed_serve_xenc.json`
    Target("Mixed through the service: chat p99 TPOT / T with the MiniLM cross-encoder as --reranker",
           "mixed_serve_xenc", ("cross_encoder_p99_over_target",), 1.25, higher_is_better=False),
    # Issue #37: `python -m bench.mixed_serve --runs 3 --shares --out bench/results/mixed_serve_embed.json`: 8 chats
    # under --tpot-target-ms while 2 clients flood Rerank (the default mode) and 2 flood Embed; runs with p99 <= 1.25 T.
    Target("Mixed through the service: objective runs (of 3) with chat p99 TPOT <= 1.25 T under a rerank + embed flood",
           "mixed_serve_embed", ("objective_runs_met",), 3, unit=""),
    # Issue #28: through the service, tandem serve vs llama.cpp's own llama-server on the same GGUF file and threads.
    Target("CPU batch 1, tok/s incl. prefill, tandem serve vs llama-server (same file, threads, prompts)", "cpu_peer",
           ("ratios", "batch1_vs_llama_cpp"), 1.0),
    Target("CPU prefill of one 512-token prompt, tok/s, tandem serve vs llama-server", "cpu_peer",
           ("ratios", "prefill_vs_llama_cpp"), 1.3),
    Target("CPU 32 concurrent requests, useful tok/s, tandem serve vs llama-server -np 32", "cpu_peer",
           ("ratios", "concurrent32_vs_llama_cpp"), 1.5),
    Target("CPU 128 concurrent requests, useful tok/s, tandem serve vs llama-server -np 128", "cpu_peer",
           ("ratios", "concurrent128_vs_llama_cpp"), 2.0),
    Target("CPU batch-1 greedy tokens identical to transformers on the same file (share of prompts)", "cpu_peer",
           ("vs_transformers", "tandem", "identical_share"), 1.0, unit=""),
    # Issue #20: the generation parameters cost little next to plain greedy decoding.
    Target("Throughput, 128 sampled sequences with penalties + top_p + logprobs=5 vs plain greedy (same run)",
           "sampling", ("generation_api", "ratio"), 0.85),
    # Issue #26: the HTTP door costs little next to gRPC (same server, same run, 32 streaming chats; rerank).
    Target("HTTP door: streaming chat useful tok/s, OpenAI endpoint vs gRPC (32 requests)", "http_load",
           ("ratios", "chat_tok_s_http_vs_grpc"), 0.9),
    Target("HTTP door: TTFT p50, OpenAI endpoint / gRPC (32 streaming requests)", "http_load",
           ("ratios", "ttft_p50_http_vs_grpc"), 1.1, higher_is_better=False),
    Target("HTTP door: rerank pairs/s, Cohere /v2/rerank vs gRPC Rerank", "http_load",
           ("ratios", "rerank_pairs_s_http_vs_grpc"), 0.9),
    # Issue #37: embeddings on CPU, tandem serve over /v1/embeddings (32 requests x 32 texts at once) vs the peers.
    Target("Embeddings texts/s, tandem serve vs sentence-transformers encode (torch, batch 32)", "embed_speed",
           ("ratios", "texts_s_vs_st_torch"), 2.0),
    Target("Embeddings texts/s, tandem serve vs sentence-transformers encode (ONNX Runtime, batch 32)", "embed_speed",
           ("ratios", "texts_s_vs_st_onnx"), 1.0),
    Target("Embeddings texts/s, tandem serve vs Infinity (32 concurrent requests of 32 texts)", "embed_speed",
           ("ratios", "texts_s_vs_infinity"), 1.5),
    Target("Embeddings p50 of one 32-text request alone, tandem / Infinity", "embed_speed",
           ("ratios", "alone_batch_p50_vs_infinity"), 1.0, higher_is_better=False),
    Target("Embeddings: min cosine of tandem's vectors to sentence-transformers' (same texts)", "embed_speed",
           ("targets", "min_cosine_tandem_vs_st_torch", "measured"), 0.9999, unit=""),
    # Issue #70: `python -m bench.rag` (hours: not one of BENCHMARKS), whole RAG requests arriving open-loop, against
    # the split deployment on the same cores (llama-server or tandem serving chats alone, beside Infinity or
    # sentence-transformers), the same TTFT and TPOT SLOs for every system (docs/benchmarks.md "RAG goodput").
    Target("RAG goodput (req/s within the TTFT and TPOT SLOs), tandem / the best split", "rag",
           ("targets", "goodput_vs_best_split"), 3.0),
    Target("RAG: tandem's p90 TTFT at 0.2 req/s / its idle p50 TTFT", "rag", ("targets", "p90_ttft_at_0.2_over_idle_p50"),
           2.5, higher_is_better=False),
    Target("RAG: tandem's p90 TTFT at 0.3 req/s / its idle p50 TTFT", "rag", ("targets", "p90_ttft_at_0.3_over_idle_p50"),
           4.0, higher_is_better=False),
)


# Figures without a goal: shown after the targets (ratio against a baseline of the same run, above 1: tandem faster).
FIGURES = (
    ("Prefill 1024 tokens (TTFT), transformers / tandem", "prefill", ("ratios", "tandem_1024")),
    ("Prefill 4096 tokens (TTFT), transformers / tandem", "prefill", ("ratios", "tandem_4096")),
    ("Prefill 4096 tokens in one chunk (TTFT), transformers / tandem", "prefill",
     ("ratios", "tandem_one_chunk_4096")),
    ("Batch-1 decode tok/s, tandem 4-bit / transformers generate (fp32)", "single", ("ratios", "gguf_vs_hf_generate")),
    ("Batch-1 decode tok/s, tandem 4-bit / tandem dense fp32", "single", ("ratios", "gguf_vs_tandem_fp32")),
    ("Sampler, real logits, slowest case: transformers / tandem", "sampling", ("min_ratio", "real")),
    ("Sampler, random N(0, 3) logits, slowest case: transformers / tandem", "sampling", ("min_ratio", "random_n3")),
)


def figures_table(results: dict[str, dict]) -> tuple[list[dict], str]:
    """The FIGURES that were measured (a figure whose benchmark did not run is left out)."""
    rows, lines = [], ["| Figure | Measured |", "|---|---|"]
    for name, source, path in FIGURES:
        value = Target(name, source, path, goal=0.0).measured(results)
        if value is None:
            continue
        rows.append({"figure": name, "measured": value, "source": f"bench/results/{source}.json"})
        lines.append(f"| {name} | {value:.3g}x |")
    return rows, "\n".join(lines) if rows else ""


def targets_table(results: dict[str, dict]) -> tuple[list[dict], str]:
    rows, lines = [], ["| Target | Goal | Measured | Met |", "|---|---|---|---|"]
    for t in TARGETS:
        value = t.measured(results)
        met = t.met(value)
        rows.append({"target": t.name, "goal": t.goal, "higher_is_better": t.higher_is_better, "measured": value,
                     "met": met, "source": f"bench/results/{t.source}.json"})
        goal = f"{'>=' if t.higher_is_better else '<='} {t.goal:g}{t.unit}"
        shown = "not run" if value is None else f"{value:.3g}{t.unit}"
        lines.append(f"| {t.name} | {goal} | {shown} | {'-' if met is None else ('yes' if met else 'no')} |")
    return rows, "\n".join(lines)


def load_results(directory: Path = RESULTS) -> dict[str, dict]:
    out = {}
    for name in (*BENCHMARKS, *EXTRA_RESULTS):
        path = directory / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the wiring, figures mean nothing")
    ap.add_argument("--only", nargs="*", choices=BENCHMARKS, default=list(BENCHMARKS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSON and PNG files go")
    args = ap.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    for name in args.only:
        run: Callable[[list[str]], dict] = importlib.import_module(f"bench.{name}").main
        extra = ["--quick"] if args.quick else []
        start = time.perf_counter()
        run([*extra, "--threads", str(args.threads), "--out", str(args.results / f"{name}.json")])
        wall[name] = time.perf_counter() - start
    from bench.plots import plot_all

    plots = [str(p) for p in plot_all(args.results)]
    results = load_results(args.results)
    rows, table = targets_table(results)
    figures, figures_md = figures_table(results)
    summary = {"quick": args.quick, "threads": args.threads, "wall_s": wall, "targets": rows, "figures": figures,
               "plots": plots}
    write_result(summary, args.results / "summary.json")
    print(table)
    if figures_md:
        print()
        print(figures_md)
    return summary


if __name__ == "__main__":
    main()
