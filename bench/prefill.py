"""Long-prompt prefill (time to first token) vs transformers, every figure a ratio against a baseline timed in the
same run.

Guards the prefill path (issue #71: the quantized model's prefill against transformers float32, at 512 and 2,048
tokens by default; the attention once ran through SDPA's math path and made a 4,000-token prompt 2.5x slower than
transformers). Prompts are random token ids (seeded, special tokens left out), --lengths long (512 and 2048),
one new prompt per length and repetition, so tandem's prefix cache never hits (prefix caching stays on, the
engine's default; every output's `cached_tokens` is recorded and must be 0).

Systems, same model (the embedded SmolLM2, fp32) and torch threads (--threads):
* tandem: `LLM(EngineConfig())` defaults (max_num_batched_tokens 512, so a long prompt is prefilled in chunks),
  `generate(ids, SamplingParams(max_tokens=1, temperature=0))`, timed around the call (scheduling, forward, greedy
  sampling, detokenizing one token).
* tandem_one_chunk: the same with max_num_batched_tokens = the longest length, so the prompt is one chunk.
* tandem_int8: the defaults with cpu_activations="int8" (llama.cpp's precision: activations rounded to 8 bits per
  block of 32), whose prefill chunks multiply with the wide int8 GEMM on the AVX2 path (kernels/README.md "Prefill
  on CPU"); only where the CPU path has int8 kernels. Its first token is checked like the others', but a mismatch
  is recorded, not failed (a precision choice, not a bug).
* transformers: `AutoModelForCausalLM` (default_model_dir(), float32, its default attention implementation,
  recorded as `transformers_attn_implementation`), one forward over the same ids under torch.inference_mode with
  `logits_to_keep=1` (what `generate` does for its first token), then argmax of the last position. A bare forward
  is a lower bound on `generate`'s time to first token, so it favours the baseline.

Per repetition (--reps per length) every system runs the same prompt, the order rotating from one repetition to
the next. Seconds per system (wall, or with --clock cpu this process's CPU time) are the minimum over repetitions
(the median is recorded too); ratio = transformers_s / tandem_s (above 1: tandem is faster). Correctness beside
speed: tandem's first token must equal transformers' argmax of the last position (or be within --logit-tol of its
logit, a near tie); the run fails after writing its JSON if not. The JSON records the 1-minute load average and
`contended` (above --threads + 1), the CPU's model and vector flags, and each engine's CPU path and prefill path
(what its start-up line names).
Prints one JSON line and writes bench/results/prefill.json (or --out).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bench.report import parse_bench_args, rotated, write_result
from engine import LLM, EngineConfig, SamplingParams

QUICK = dict(lengths=[32, 128], reps=2)
BASELINE = "transformers"
INT8 = "tandem_int8"  # a precision choice: its first token is compared, a mismatch recorded but not failed
# --clock: wall seconds, or the CPU seconds of this process, which a loaded host disturbs far less with --threads 1
# (docs/benchmarks.md "Prefill on the AVX2 path": other sessions' load halved the wall-clock rates)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def prompt_ids(length: int, rep: int, seed: int, vocab: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`length` random token ids in [0, vocab) outside `exclude`, one fixed prompt per (seed, length, rep)."""
    rng = random.Random(f"prefill:{seed}:{length}:{rep}")
    out: list[int] = []
    while len(out) < length:
        t = rng.randrange(vocab)
        if t not in exclude:
            out.append(t)
    return out


def summarize(seconds: dict[str, list[float]], baseline: str = BASELINE) -> dict:
    """Min and median seconds per system, and baseline / system for each other system (of minima and of medians)."""
    mins = {n: min(s) for n, s in seconds.items()}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    others = [n for n in seconds if n != baseline]
    return {"seconds": seconds, "min_s": mins, "median_s": medians,
            "ratio": {n: mins[baseline] / mins[n] for n in others},
            "ratio_of_medians": {n: medians[baseline] / medians[n] for n in others}}


def first_token_check(last_logits: torch.Tensor, token: int, tol: float) -> dict:
    """Compare a first token with the argmax of the reference's last-position logits [V]. `ok` when equal, or when
    the token's logit is within `tol` of the maximum (a near tie that rounding may break either way)."""
    top = torch.topk(last_logits.float(), 2)
    best = int(top.indices[0])
    gap = float(top.values[0] - last_logits[token])
    return {"token": token, "reference_argmax": best, "match": token == best, "logit_gap": gap,
            "reference_top2_margin": float(top.values[0] - top.values[1]), "ok": token == best or gap <= tol}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per length (distinct prompts)")
    ap.add_argument("--logit-tol", type=float, default=1e-3)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="what a system's seconds are: wall clock, or this process's CPU time (with --threads 1, "
                         "one core's time: usable on a shared host)")
    return parse_bench_args(ap, argv, "prefill", QUICK)


@dataclass
class Systems:
    """The systems under test, each a function of prompt ids: tandem ones return (first token, cached tokens),
    the baseline (first token, last-position logits)."""
    run: dict[str, Callable[[list[int]], tuple]]
    engines: dict[str, LLM]
    hf: Any  # the transformers model
    exclude: frozenset[int]  # special token ids, left out of prompts

    @property
    def vocab(self) -> int:
        return self.hf.config.vocab_size


def build_systems(args: argparse.Namespace) -> Systems:
    """tandem (default chunked prefill), tandem_one_chunk and transformers on the same model, each warmed up once."""
    from transformers import AutoModelForCausalLM

    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    from kernels import quant

    engines = {"tandem": LLM(EngineConfig(num_threads=args.threads)),
               "tandem_one_chunk": LLM(EngineConfig(max_num_batched_tokens=max(args.lengths),
                                                    num_threads=args.threads))}
    if quant.int8_activations_available():
        engines[INT8] = LLM(EngineConfig(num_threads=args.threads, cpu_activations="int8"))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(Settings.from_env().cache_dir),
                                              dtype=torch.float32).eval()
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)

    def tandem(name):
        def run(ids):
            out = engines[name].generate([ids], greedy_one)[0]
            return out.token_ids[0], out.cached_tokens
        return run

    @torch.inference_mode()
    def transformers(ids):
        logits = hf(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
        return int(logits.argmax()), logits

    systems = Systems({**{name: tandem(name) for name in engines}, BASELINE: transformers}, engines, hf,
                      frozenset(engines["tandem"].tokenizer.all_special_ids))
    warm = prompt_ids(min(args.lengths), -1, args.seed, systems.vocab, systems.exclude)
    for fn in systems.run.values():
        fn(warm)
    return systems


def time_lengths(args: argparse.Namespace, systems: Systems, load: list[float]) -> tuple[dict, list[dict], int]:
    """Every system on the same prompts, --reps per length in rotating order: per length the summary of seconds,
    every tandem first token checked against the baseline's logits, and the most prompt tokens the cache served."""
    names = list(systems.run)
    clock = CLOCKS[args.clock]
    lengths, checks, cached, rep_index = {}, [], 0, 0
    for length in args.lengths:
        seconds: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            ids = prompt_ids(length, rep, args.seed, systems.vocab, systems.exclude)
            outs = {}
            for name in rotated(names, rep_index):
                t = clock()
                outs[name] = systems.run[name](ids)
                seconds[name].append(clock() - t)
            rep_index += 1
            reference = outs[BASELINE][1]
            for name in names:
                if name != BASELINE:
                    token, cached_tokens = outs[name]
                    cached = max(cached, cached_tokens)
                    checks.append({"length": length, "rep": rep, "system": name,
                                   **first_token_check(reference, token, args.logit_tol)})
            load.append(os.getloadavg()[0])
        lengths[str(length)] = summarize(seconds)
    return lengths, checks, cached


def report(args: argparse.Namespace, systems: Systems, lengths: dict, checks: list[dict], cached: int,
           load: list[float]) -> dict:
    attn = systems.hf.config._attn_implementation
    ratios = {f"{n}_{length}": lengths[str(length)]["ratio"][n] for length in args.lengths
              for n in systems.run if n != BASELINE}
    from bench.host import cpu_identity
    from engine.models.quantized import layer_formats
    from kernels import quant

    paths = {}
    for n, llm in systems.engines.items():
        model = llm.engine.runner.model
        paths[n] = {"cpu_kernels": llm.engine.cpu_kernels,
                    "prefill": quant.prefill_path(model.cpu_path,
                                                  quant.Activations(llm.engine.config.cpu_activations),
                                                  layer_formats(model))}
    return {
        "cpu": cpu_identity(), "paths": paths,
        "workload": {"prompt": "random token ids, seeded, distinct per length and repetition", "lengths": args.lengths,
                     "reps": args.reps, "max_tokens": 1, "sampling": "greedy", "prefix_caching": "on, never hits",
                     "max_cached_tokens": cached},
        "systems": {**{n: {"max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                           "enable_prefix_caching": llm.engine.config.enable_prefix_caching}
                       for n, llm in systems.engines.items()},
                    BASELINE: {"attn_implementation": attn, "logits_to_keep": 1}},
        "transformers_attn_implementation": attn,
        "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "seed": args.seed,
        "quick": args.quick, "clock": args.clock, "statistic": "min over repetitions", "lengths": lengths,
        "ratios": ratios,
        "first_token": {"all_ok": all(c["ok"] for c in checks), "matches": sum(c["match"] for c in checks),
                        "compared": len(checks), "checks": checks},
        "load_avg_1min": load, "contended": max(load) > args.threads + 1,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load = [os.getloadavg()[0]]
    systems = build_systems(args)
    lengths, checks, cached = time_lengths(args, systems, load)
    result = report(args, systems, lengths, checks, cached, load)
    write_result(result, args.out)
    if cached:
        raise AssertionError(f"the prefix cache served {cached} prompt tokens: prompts were meant to be distinct")
    bad = [c for c in checks if not c["ok"] and c["system"] != INT8]
    if bad:
        raise AssertionError(f"tandem's first token differs from transformers' argmax: {bad}")
    return result


if __name__ == "__main__":
    main()
