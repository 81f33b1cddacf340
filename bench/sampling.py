"""Sampler cost vs transformers' sampling path on the same logits, every figure a ratio against a baseline timed
in the same run.

tandem: `engine.sampling.sample(logits [N, V] fp32, [SamplingParams] * N, [None] * N)` (unseeded rows), which
returns the N token ids as a list. Baseline: what transformers' `generate(do_sample=True)` does per step for the
same settings, built the way `GenerationMixin._get_logits_processor` builds it: a LogitsProcessorList of
TemperatureLogitsWarper (when temperature != 1), TopKLogitsWarper (when top_k), TopPLogitsWarper (when top_p < 1),
min_tokens_to_keep=1, then softmax and `torch.multinomial(probs, num_samples=1)`.

Logits, two sources:
* real: the embedded SmolLM2's own next-token logits at decode steps: --prompts AlpacaEval chat prompts, each
  continued greedily for --steps tokens by transformers `generate(output_logits=True)`; rows are shuffled (seeded)
  and cycled to N. Top-p nuclei are as wide as the model's real distributions make them (mostly narrow).
* random: N(0, 3) logits, seeded. Flat distributions with nuclei of thousands of tokens: the hard case for a
  sampler that looks at a few top candidates first (tandem starts with 256 and widens).
Cases: both sources x N in --ns (16, 128) x settings (temperature 1.0), (temperature 0.8, top_p 0.95),
(temperature 0.7, top_k 50, top_p 0.9). Per case, after one warm-up call each, --calls rounds, each timing one
call of each system on the same logits, the order alternating; ms per call is the median over rounds;
ratio = transformers_ms / tandem_ms (above 1: tandem is faster). Same torch threads for both (--threads).

Sanity: every draw of both systems (each timed call's N tokens) must lie in the row's allowed set, computed apart
in float64 (the top_k most likely tokens, then the smallest prefix of those whose renormalised mass reaches top_p,
with a 1e-4 slack at the top_p edge); `outside_allowed` counts the misses and the run fails after writing its
JSON if any. The allowed sets' sizes are recorded as `nucleus` (how peaked the logits are). The JSON records the
1-minute load average and `contended` (above --threads + 1). Prints one JSON line and writes
bench/results/sampling.json (or --out).

Generation API (#20), key `generation_api`: tokens/s through LLMEngine (LLM.generate) of --engine-seqs AlpacaEval
chat prompts, each generating exactly --engine-tokens tokens (ignore_eos), two ways on one engine: plain greedy,
and sampled with repetition_penalty 1.1, presence_penalty 0.5, frequency_penalty 0.5, top_p 0.9 and logprobs 5
(unseeded). Prefix caching is off so every run prefills the same prompts. --engine-rounds rounds, the order
alternating; a system's rate is its tokens over its summed wall time; ratio = sampled / greedy (goal >= 0.85).
Also per system the median engine overhead (step time outside the model forward, where the sampler runs) of
full-width decode steps, and how many raw log-probability dicts the runner computed (they reach outputs once the
engine delivers them). --skip-sampler-cases runs only this part, keeping the other keys of an existing --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch

from bench.report import parse_bench_args, rotated, write_result
from engine.config import SamplingParams
from engine.sampling import sample

QUICK = dict(ns=[4, 16], calls=2, prompts=2, steps=4, engine_seqs=8, engine_tokens=6, engine_rounds=2)
PENALISED = dict(temperature=1.0, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                 logprobs=5)
SETTINGS = (
    ("t1.0", dict(temperature=1.0)),
    ("t0.8_p0.95", dict(temperature=0.8, top_p=0.95)),
    ("t0.7_k50_p0.9", dict(temperature=0.7, top_k=50, top_p=0.9)),
)
SOURCES = ("real", "random_n3")


def cases(sources, ns, settings=SETTINGS) -> list[dict]:
    """Every (source, N, setting) as a dict with a name, in that nesting order."""
    return [{"name": f"{src}_n{n}_{label}", "source": src, "n": n, "setting": label, **params}
            for src, n, (label, params) in itertools.product(sources, ns, settings)]


def hf_warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The warpers transformers' generate applies for do_sample with these settings, in its order."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def hf_sample(warpers, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """One token per row, as generate's sampling step draws it."""
    probs = torch.nn.functional.softmax(warpers(input_ids, logits), dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def allowed_mask(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 slack: float = 1e-4) -> torch.Tensor:
    """[N, V] bool: the tokens a sampler with these settings may draw, in float64. Top-k keeps every token whose
    probability reaches the k-th largest (ties kept); top-p then keeps a token when the renormalised mass of the
    kept tokens more likely than it is below top_p (+ slack), so the most likely token always stays."""
    probs = (logits.double() / temperature).softmax(dim=-1)
    values, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    if 0 < top_k < vocab:
        keep = values >= values[:, top_k - 1:top_k]
    else:
        keep = torch.ones_like(values, dtype=torch.bool)
    if top_p < 1.0:
        kept = values * keep
        before = kept.cumsum(dim=-1) - kept
        keep &= before < (top_p + slack) * kept.sum(dim=-1, keepdim=True)
    keep &= values > 0
    return torch.zeros_like(keep).scatter(-1, order, keep)


def outside_allowed(tokens, mask: torch.Tensor) -> int:
    """How many of the drawn tokens (one per row of mask) are not allowed in their row."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1, 1)
    return int((~mask.gather(-1, tokens)).sum())


def tile_rows(rows: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n rows of `rows`, shuffled (seeded) and cycled when there are fewer than n."""
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    return rows[perm[torch.arange(n) % rows.shape[0]]].contiguous()


@torch.inference_mode()
def model_logits(prompts: int, steps: int, seed: int) -> torch.Tensor:
    """[prompts * steps, V] fp32 next-token logits of the embedded model at greedy decode steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.workloads import alpaca_eval_chat
    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    model_dir = default_model_dir(Settings.from_env().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for req in alpaca_eval_chat(tokenizer, prompts, steps, seed):
        out = model.generate(torch.tensor([req.prompt_token_ids]), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.eos_token_id)
        rows.extend(step[0].float() for step in out.logits)
    return torch.stack(rows)


def run_case(case: dict, logits: torch.Tensor, calls: int) -> dict:
    """Both samplers on the same logits, `calls` interleaved rounds; ms per call (median) and the draws' check."""
    n = logits.shape[0]
    knobs = {k: case[k] for k in ("temperature", "top_k", "top_p") if k in case}
    params, generators = [SamplingParams(max_tokens=1, **knobs)] * n, [None] * n
    warpers, input_ids = hf_warpers(**knobs), torch.zeros(n, 1, dtype=torch.int64)
    systems = {"tandem": lambda: sample(logits, params, generators),
               "transformers": lambda: hf_sample(warpers, input_ids, logits)}
    names = list(systems)
    for fn in systems.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    draws: dict[str, list] = {name: [] for name in names}
    for i in range(calls):
        for name in rotated(names, i):
            t = time.perf_counter()
            out = systems[name]()
            seconds[name].append(time.perf_counter() - t)
            draws[name].append(out)
    mask = allowed_mask(logits, **knobs)
    width = mask.sum(dim=-1).double()
    ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
    return {"tandem_ms": ms["tandem"], "transformers_ms": ms["transformers"],
            "ratio": ms["transformers"] / ms["tandem"],
            "outside_allowed": {name: sum(outside_allowed(d, mask) for d in draws[name]) for name in names},
            "draws": calls * n,
            "nucleus": {"median": int(width.median()), "max": int(width.max()), "mean": float(width.mean())}}


def generation_api(seqs: int, tokens: int, rounds: int, seed: int) -> dict:
    """Engine throughput of `seqs` sequences of `tokens` tokens each: greedy vs PENALISED (see the docstring)."""
    from bench.workloads import alpaca_eval_chat
    from engine import LLM, EngineConfig

    llm = LLM(EngineConfig(enable_prefix_caching=False, max_num_seqs=max(seqs, 1)))
    prompts = [r.prompt_token_ids for r in alpaca_eval_chat(llm.tokenizer, seqs, tokens, seed)]
    params = {"greedy": SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
              "sampled": SamplingParams(max_tokens=tokens, ignore_eos=True, **PENALISED)}
    logprob_dicts = _count_runner_logprobs(llm)
    records: list = []
    llm.engine.add_observer(records.append)
    seconds = {name: 0.0 for name in params}
    overhead: dict[str, list[float]] = {name: [] for name in params}
    computed = {name: 0 for name in params}
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True, **PENALISED))  # warm-up
    for i in range(rounds):
        for name in rotated(list(params), i):
            records.clear()
            before = logprob_dicts[0]
            t = time.perf_counter()
            outs = llm.generate(prompts, params[name])
            seconds[name] += time.perf_counter() - t
            assert all(len(o.token_ids) == tokens for o in outs)
            computed[name] += logprob_dicts[0] - before
            overhead[name] += [r.duration_s - r.forward_s for r in records if r.decode_tokens == seqs]
    rates = {name: rounds * seqs * tokens / s for name, s in seconds.items()}
    return {"seqs": seqs, "tokens_per_seq": tokens, "rounds": rounds, "sampled_params": PENALISED,
            "prefix_caching": False, "tokens_per_s": rates, "ratio": rates["sampled"] / rates["greedy"],
            "goal": 0.85,
            "decode_step_overhead_ms": {n: 1e3 * statistics.median(v) if v else None for n, v in overhead.items()},
            "runner_logprob_dicts": computed}


def _count_runner_logprobs(llm) -> list[int]:
    """A one-item counter of the log-probability dicts the runner returns (wraps the engine's runner.run)."""
    count = [0]
    run = llm.engine.runner.run

    def counting(batch):
        out = run(batch)
        count[0] += sum(lp is not None for lp in (out.logprobs or []))
        return out

    llm.engine.runner.run = counting
    return count


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 128], help="rows per call")
    ap.add_argument("--calls", type=int, default=9, help="timed calls per system and case")
    ap.add_argument("--prompts", type=int, default=8, help="prompts behind the real logits")
    ap.add_argument("--steps", type=int, default=16, help="greedy decode steps per prompt behind the real logits")
    ap.add_argument("--engine-seqs", type=int, default=128, help="sequences of the generation-API throughput case")
    ap.add_argument("--engine-tokens", type=int, default=64, help="tokens each of them generates")
    ap.add_argument("--engine-rounds", type=int, default=2, help="timed runs per system, the order alternating")
    ap.add_argument("--skip-sampler-cases", action="store_true",
                    help="only the generation-API case; other keys are kept from an existing --out")
    args = parse_bench_args(ap, argv, "sampling", QUICK)
    if args.skip_sampler_cases:
        return _generation_api_only(args)
    load = [os.getloadavg()[0]]

    real = model_logits(args.prompts, args.steps, args.seed)
    vocab = real.shape[-1]
    rows = {"real": real,
            "random_n3": 3 * torch.randn(max(args.ns), vocab, generator=torch.Generator().manual_seed(args.seed))}
    results = {}
    for case in cases(SOURCES, args.ns):
        logits = tile_rows(rows[case["source"]], case["n"], args.seed)
        results[case["name"]] = {**{k: v for k, v in case.items() if k != "name"}, **run_case(case, logits, args.calls)}
        load.append(os.getloadavg()[0])

    ratios = {name: r["ratio"] for name, r in results.items()}
    misses = {name: r["outside_allowed"] for name, r in results.items() if any(r["outside_allowed"].values())}
    result = {
        "workload": {"real": f"SmolLM2 logits at greedy decode steps: {args.prompts} AlpacaEval chat prompts x "
                             f"{args.steps} steps ({real.shape[0]} rows), shuffled and cycled to N",
                     "random_n3": "N(0, 3) logits, seeded (flat: the hard case)", "vocab": vocab, "ns": args.ns,
                     "settings": [dict(label=label, **p) for label, p in SETTINGS], "generators": "none (unseeded)"},
        "baseline": "transformers LogitsProcessorList (Temperature, TopK, TopP warpers as generate builds them), "
                    "softmax, torch.multinomial(num_samples=1)",
        "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "seed": args.seed,
        "quick": args.quick, "calls": args.calls, "statistic": "median ms per call",
        "cases": results, "ratios": ratios,
        "min_ratio": {src: min(r["ratio"] for r in results.values() if r["source"] == src) for src in SOURCES},
        "all_draws_allowed": not misses,
        "load_avg_1min": load, "contended": max(load) > args.threads + 1,
        "generation_api": _with_load(args, lambda: generation_api(args.engine_seqs, args.engine_tokens,
                                                                  args.engine_rounds, args.seed)),
    }
    write_result(result, args.out)
    if misses:
        raise AssertionError(f"draws outside the allowed set: {misses}")
    return result


def _with_load(args, fn) -> dict:
    """fn()'s result with the 1-minute load average before and after and whether the host was contended."""
    before = os.getloadavg()[0]
    result = fn()
    load = [before, os.getloadavg()[0]]
    return {**result, "threads": args.threads, "load_avg_1min": load, "contended": max(load) > args.threads + 1}


def _generation_api_only(args) -> dict:
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result["generation_api"] = _with_load(args, lambda: generation_api(args.engine_seqs, args.engine_tokens,
                                                                       args.engine_rounds, args.seed))
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
