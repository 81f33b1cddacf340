"""Offline generation throughput: our engine vs HF `generate` (static batches) vs HF continuous batching.

Same model, prompts, dtype and threads, in one process. Prints one JSON line and writes it to
bench/results/throughput.json. Output lengths are fixed (EOS ignored) so every system does the same work.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.report import RESULTS, write_result
from bench.workloads import GenerationRequest, synthetic_chat
from engine import LLM, EngineConfig, SamplingParams



def run_ours(llm: LLM, reqs: list[GenerationRequest]) -> float:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    dt = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == sum(r.max_tokens for r in reqs)
    return dt


def run_hf_static(model, reqs: list[GenerationRequest], batch_size: int, pad_id: int) -> float:
    """HF generate on fixed batches: left padding, every batch runs to its longest request."""
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            chunk = reqs[i:i + batch_size]
            width = max(len(r.prompt_token_ids) for r in chunk)
            ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in chunk])
            mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                 for r in chunk])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in chunk),
                           min_new_tokens=max(r.max_tokens for r in chunk), do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


def run_hf_continuous(model, reqs: list[GenerationRequest]) -> float:
    from transformers import GenerationConfig

    assert len({r.max_tokens for r in reqs}) == 1, "generate_batch takes one max_new_tokens for all"
    gc = GenerationConfig(max_new_tokens=reqs[0].max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    out = model.generate_batch(inputs=[r.prompt_token_ids for r in reqs], generation_config=gc, progress_bar=False)
    dt = time.perf_counter() - t
    assert sum(len(o.generated_tokens) for o in out.values()) == sum(r.max_tokens for r in reqs)
    return dt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512, help="our max_num_batched_tokens")
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf_static", "hf_continuous"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    llm = LLM(EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=256))
    reqs = synthetic_chat(llm.tokenizer, args.requests, args.output_tokens)
    useful = sum(r.max_tokens for r in reqs)
    run_ours(llm, reqs[:4])  # warm-up
    result = {"requests": len(reqs), "output_tokens": useful,
              "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs), "threads": args.threads,
              "tandem_tok_s": useful / run_ours(llm, reqs)}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    if "hf_static" not in args.skip:
        result["hf_static8_tok_s"] = useful / run_hf_static(hf, reqs, 8, llm.tokenizer.eos_token_id)
        result["ratio_vs_hf_static8"] = result["tandem_tok_s"] / result["hf_static8_tok_s"]
    if "hf_continuous" not in args.skip:
        result["hf_continuous_tok_s"] = useful / run_hf_continuous(hf, reqs)
        result["ratio_vs_hf_continuous"] = result["tandem_tok_s"] / result["hf_continuous_tok_s"]
    write_result(result, RESULTS / "throughput.json")
    return result


if __name__ == "__main__":
    main()
