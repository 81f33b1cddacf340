"""One chat at a time: batch-1 greedy decode speed of the embedded model, tandem against its peers (issue #19).

Systems, same prompt token ids, same --threads, greedy, EOS ignored, --new-tokens generated after the prompt:
* tandem_gguf: the default engine, serving the GGUF file's own Q4_1 / Q8_0 blocks (kernels/quant.py);
* tandem_fp32: the same engine on the dense float32 expansion of that file (`quantization="none"`);
* hf_generate: transformers `generate` on the float32 expansion (what transformers loads from the GGUF file);
* llama_cpp: llama-cpp-python (llama.cpp) on the very same GGUF file, n_threads = --threads. A bench-only optional
  dependency (`pip install -e '.[peers]'`, which `make bench` does); when it is missing or fails to load, its row is
  skipped with the reason in the JSON.
Decode rate = (tokens after the first) / (time from the first token to the last), so prefill is not in it; TTFT is
reported beside it. Each system runs --rounds times in rotated order; its best round counts (the machine is shared,
so the best is the least disturbed). Quality beside speed: every system's tokens against transformers' greedy
tokens (the reference): identical share and the index of the first difference.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.report import parse_bench_args, rotated, write_result
from engine import LLM, EngineConfig, SamplingParams
from engine.models.loader import default_model_dir, embedded_gguf_path
from engine.settings import Settings

QUICK = dict(new_tokens=8, rounds=1)
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the storm, the "
          "bottle, what the message says and what the keeper decides to do.")


def tandem_runner(quantization: str, threads: int):
    llm = LLM(EngineConfig(quantization=quantization, num_threads=threads))
    eng = llm.engine
    counter = iter(range(10**9))

    def run(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        rid = f"r{next(counter)}"
        eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        tokens, times = [], []
        while eng.has_unfinished():
            for out in eng.step():
                now = time.perf_counter()
                tokens.extend(out.new_token_ids)
                times.extend([now] * len(out.new_token_ids))
        return tokens, times

    return run, {"weight_bytes": eng.weight_bytes, "weight_format": eng.weight_format}


def hf_runner(threads: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(Settings.from_env().cache_dir),
                                                 dtype=torch.float32).eval()

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def run(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        clock = Clock()
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, streamer=clock)
        return out[0, len(ids):].tolist(), clock.times

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return run, {"weight_bytes": weight_bytes, "weight_format": "float32"}


def llama_cpp_runner(threads: int, n_ctx: int):
    from llama_cpp import Llama  # bench-only optional dependency (the `peers` extra)

    model = Llama(model_path=str(embedded_gguf_path()), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                  n_batch=512, verbose=False)

    def run(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens, times = [], []
        for tok in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) == n:
                break
        return tokens, times

    return run, {"weight_bytes": embedded_gguf_path().stat().st_size, "weight_format": "gguf Q4_1 + Q8_0 (file)"}


def agreement(tokens: list[int], ref: list[int]) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    same = sum(a == b for a, b in zip(tokens, ref))
    return {"identical": tokens == ref, "first_difference": first, "same_position_share": same / max(1, len(ref))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", nargs="*", default=["tandem_gguf", "tandem_fp32", "hf_generate", "llama_cpp"])
    args = parse_bench_args(ap, argv, "single", QUICK)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    builders = {"tandem_gguf": lambda: tandem_runner("gguf", args.threads),
                "tandem_fp32": lambda: tandem_runner("none", args.threads),
                "hf_generate": lambda: hf_runner(args.threads),
                "llama_cpp": lambda: llama_cpp_runner(args.threads, len(ids) + args.new_tokens + 16)}
    runners, info, skipped = {}, {}, {}
    for name in args.systems:
        try:
            runners[name], info[name] = builders[name]()
        except Exception as exc:  # llama-cpp-python not installed or not loadable: say why, go on without it
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"single: skipping {name}: {skipped[name]}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name in rotated(list(runners), r):
            start = time.perf_counter()
            toks, times = runners[name](ids, args.new_tokens)
            assert len(toks) == args.new_tokens and len(times) == args.new_tokens, (name, len(toks), len(times))
            decode_s = times[-1] - times[0]
            runs[name].append({"ttft_s": times[0] - start, "decode_s": decode_s,
                               "decode_tok_s": (len(times) - 1) / decode_s if decode_s > 0 else float("nan")})
            tokens[name] = toks
    ref = tokens.get("hf_generate")
    systems = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda x: x["decode_tok_s"])
        systems[name] = {**info[name], "decode_tok_s": best["decode_tok_s"], "ttft_s": best["ttft_s"],
                         "rounds": rs, "vs_transformers": agreement(tokens[name], ref) if ref else None}
    rate = {n: s["decode_tok_s"] for n, s in systems.items()}
    ratios = {}
    if "tandem_gguf" in rate:
        for other in ("llama_cpp", "hf_generate", "tandem_fp32"):
            if other in rate:
                ratios[f"gguf_vs_{other}"] = rate["tandem_gguf"] / rate[other]
    result = {"benchmark": "single", "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "threads": args.threads,
              "rounds": args.rounds, "loadavg": os.getloadavg(), "contended": os.getloadavg()[0] > args.threads + 0.5,
              "systems": systems, "skipped": skipped, "ratios": ratios}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
