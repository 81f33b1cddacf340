"""Activation precision of the quantized CPU matmuls, speed beside quality (issue #28 item 2).

The same GGUF file served twice by the engine, `cpu_activations="float32"` (the default) and `"int8"` (each
activation row rounded to 8 bits per block of 32, integer dot products, as llama.cpp does), and transformers on the
file's float32 expansion as the reference nobody here wrote:

* speed: batch-1 greedy decode rate (tokens after the first / time from the first to the last), median of the
  prompts, and each prompt's decode alone;
* tokens: each setting's greedy tokens against transformers' greedy tokens on the same prompts (identical share and
  first difference);
* logprobs on a fixed text (AlpacaEval instructions and answers, `--text-tokens`, in prompts of `--chunk` tokens):
  each position's log-probability of the text's next token, mean |tandem - transformers| and perplexity. The int8
  path lives in the small-M kernel that decode steps use; a prompt is wide, so this pass raises the CPU path's
  small M (what TANDEM_QUANT_SMALL_M sets) above the chunk length, putting every matmul of the text through the
  small-M kernel (the arithmetic a decode step does, position by position); `--prefill-path` leaves it, so the
  text takes the engine's prefill path (on the avx2 path with int8 activations the wide int8 GEMM: what an int8
  prefill would cost in prompt logprobs).

`--paired ROUNDS` is the speed figure to quote on a shared host: both settings' engines in one process, each
decoding one batch-1 request per round (ROUNDS rounds, `--paired-steps` decode steps after a 64-token prompt), their
steps interleaved one by one (the order flipped every step), every decode-only step timed (`LLMEngine.step`, and
inside it the model's forward and LM head): medians per setting and the median ratio of adjacent steps. Load on the
host moves on a scale of seconds and slows two adjacent steps alike, which a sequential run (one setting after the
other) does not. It skips the quality passes (transformers is not loaded).

`--isa avx2` forces the AVX2 path (TANDEM_CPU_ISA=avx2: its float32 kernels and its maddubs int8 kernel) on a CPU
with more; the JSON records the CPU path, the int8 kernel, the CPU's vector flags and the load average before and
after (other work on a shared host makes absolute rates noisy: compare the two settings of one run).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import random
import statistics
import time
from pathlib import Path

from bench.cpu_peer import agreement, cpu_identity, hf_greedy
from bench.datasets import token_pool, windows
from bench.report import parse_bench_args, write_result

QUICK = dict(text_tokens=64, chunk=32, new_tokens=8, prompts=1)
SETTINGS = ("float32", "int8")


def tandem_pass(model: Path | None, activations: str, threads: int, prompts: list[list[int]], n: int,
                chunks: list[list[int]], prefill_path: bool = False) -> dict:
    from engine import LLM, EngineConfig, SamplingParams

    llm = LLM(EngineConfig(model=str(model) if model else None, num_threads=threads, cpu_activations=activations))
    eng = llm.engine
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    tokens, rates = [], []
    for i, ids in enumerate(prompts):
        eng.add_request(f"p{i}", ids, greedy)
        out, times = [], []
        while eng.has_unfinished():
            for step in eng.step():
                out += step.new_token_ids
                times += [time.perf_counter()] * len(step.new_token_ids)
        tokens.append(out)
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    # every row through the small-M kernel (see the docstring), or with prefill_path the engine's own wide path
    with contextlib.nullcontext() if prefill_path else _small_m(eng.model, 10**9):
        logprobs = []
        for chunk in chunks:
            res = llm.generate(chunk, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
            logprobs += [entry[tok] for entry, tok in zip(res.prompt_logprobs[1:], chunk[1:])]
    return {"cpu_kernels": eng.model_info()["cpu_kernels"], "tokens": tokens,
            "decode_tok_s": round(statistics.median(rates), 2), "decode_tok_s_each": [round(r, 2) for r in rates],
            "logprobs": logprobs}


@contextlib.contextmanager
def _small_m(model, rows: int):
    """Inside the block, every quantized linear of `model` multiplies on its CPU path with `small_m=rows` (what
    TANDEM_QUANT_SMALL_M sets at start-up): prompts of up to `rows` tokens take the small-M kernels."""
    from engine.models.quantized import QuantizedLinear
    from kernels import quant

    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    previous = [m.path for m in linears]
    for m in linears:
        m.path = dataclasses.replace(m.path or quant.default_cpu_path(), small_m=rows)
    try:
        yield
    finally:
        for m, path in zip(linears, previous):
            m.path = path


class _Timed:
    """Wall time of each call of a function (a model's forward, its LM head), appended to `times`."""

    def __init__(self, fn, times: list[float]) -> None:
        self.fn, self.times = fn, times

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - t0)


def paired_pass(model: Path | None, threads: int, prompts: list[list[int]], rounds: int, steps: int) -> dict:
    """Both settings in one process, one batch-1 request each at a time, their decode steps interleaved (the order
    flipped every step): per setting the median decode-only step, forward and LM head time (ms), and the median of
    float32's step / int8's over adjacent pairs of steps (and over the rounds' medians)."""
    from engine import LLM, EngineConfig, SamplingParams
    from kernels import quant

    engines, timers = {}, {}
    for setting in SETTINGS:
        llm = LLM(EngineConfig(model=str(model) if model else None, num_threads=threads, cpu_activations=setting))
        m = llm.engine.model
        timers[setting] = {"step": [], "forward": [], "lm_head": [], "rounds": []}
        m.forward = _Timed(m.forward, timers[setting]["forward"])
        m.compute_logits = _Timed(m.compute_logits, timers[setting]["lm_head"])
        engines[setting] = llm
    greedy = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm-up, untimed
        llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for t in timers.values():
        t["forward"].clear(), t["lm_head"].clear()
    pair_ratios: list[float] = []
    for r in range(rounds):  # both engines decode a request at once, their steps interleaved one by one
        for setting in SETTINGS:
            engines[setting].engine.add_request(f"r{r}", prompts[r % len(prompts)], greedy)
        step_times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        for i in itertools.count():
            live = [s for s in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]) if engines[s].engine.has_unfinished()]
            if not live:
                break
            for setting in live:
                eng, t = engines[setting].engine, timers[setting]
                n_fwd, n_head = len(t["forward"]), len(t["lm_head"])
                t0 = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t0
                if i == 0:  # the prefill step: its forward and head times are not a decode step's
                    del t["forward"][n_fwd:], t["lm_head"][n_head:]
                else:
                    step_times[setting].append(dt)
        for setting in SETTINGS:
            timers[setting]["step"] += step_times[setting]
            timers[setting]["rounds"].append(statistics.median(step_times[setting]))
        pair_ratios += [a / b for a, b in zip(step_times["float32"], step_times["int8"])]
    ms = lambda xs: round(1e3 * statistics.median(xs), 2)  # noqa: E731
    out: dict = {"rounds": rounds, "decode_steps_per_request": steps, "settings": {}}
    for setting, t in timers.items():
        out["settings"][setting] = {
            "cpu_kernels": engines[setting].engine.model_info()["cpu_kernels"],
            "walker": engines[setting].engine.model.walker is not None,
            "step_ms": ms(t["step"]), "forward_ms": ms(t["forward"]), "lm_head_ms": ms(t["lm_head"]),
            # the fastest tenth: steps the host's load did not starve (nice'd runs on a shared host)
            "step_ms_p10": round(1e3 * statistics.quantiles(t["step"], n=10)[0], 2),
            "step_ms_per_round": [round(1e3 * x, 2) for x in t["rounds"]]}
    out["float32_over_int8_step"] = round(statistics.median(pair_ratios), 3)  # adjacent steps, paired
    f32, i8 = timers["float32"]["rounds"], timers["int8"]["rounds"]
    out["float32_over_int8_step_by_round"] = round(statistics.median(a / b for a, b in zip(f32, i8)), 3)
    out["int8_kernel"] = quant.int8_kernel(engines["int8"].engine.model.cpu_path.isa)
    return out


def hf_logprobs(model_path: Path, chunks: list[list[int]]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32).eval()
    out: list[float] = []
    with torch.inference_mode():
        for chunk in chunks:
            logits = model(torch.tensor([chunk])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out += lp[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].tolist()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--text-tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=250, help="tokens per prompt of the logprob pass")
    ap.add_argument("--prefill-path", action="store_true",
                    help="score the text through the engine's own prefill path (wide steps: with int8 activations "
                         "on the avx2 path, the wide int8 GEMM) instead of the small-M kernel")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--isa", choices=("auto", "avx512", "avx2"), default="auto",
                    help="the CPU path tandem computes with (TANDEM_CPU_ISA), both settings")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="speed only: both settings in one process, requests alternating, ROUNDS rounds")
    ap.add_argument("--paired-steps", type=int, default=48, help="decode steps per request of --paired")
    args = parse_bench_args(ap, argv, "activations", QUICK)
    if args.isa != "auto":
        os.environ["TANDEM_CPU_ISA"] = args.isa  # read once by the engine's builder (engine/settings.py)
    from transformers import AutoTokenizer

    from engine.models.loader import embedded_gguf_path, resolve_model
    from engine.settings import Settings

    path = args.model or embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(str(path), Settings.from_env().cache_dir).meta_dir)
    pool = token_pool(tokenizer, args.text_tokens + 4096)
    text = pool[:args.text_tokens]
    chunks = [text[i:i + args.chunk] for i in range(0, len(text), args.chunk) if len(text[i:i + args.chunk]) > 1]
    prompts = windows(pool[args.text_tokens:], [64] * args.prompts, random.Random(args.seed))

    if args.paired:
        from kernels import quant

        path = quant.resolve_cpu_path(args.isa)  # the engines' (TANDEM_CPU_ISA above)
        if not quant.int8_activations_available(path):
            raise SystemExit(f"--paired: the CPU path ({quant.kernel_path(path)}) has no int8 kernel")
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        result = {"benchmark": "activations_paired", "model": Path(path).name, "commit": commit,
                  "threads": args.threads,
                  "loadavg": list(os.getloadavg()), "cpu": cpu_identity(),
                  **paired_pass(args.model, args.threads, prompts, args.paired, args.paired_steps),
                  "loadavg_after": list(os.getloadavg())}
        write_result(result, args.out)
        return result
    reference = hf_greedy(Path(path), prompts, args.new_tokens)
    ref_lp = hf_logprobs(Path(path), chunks)
    result: dict = {"benchmark": "activations", "model": Path(path).name, "threads": args.threads,
                    "new_tokens": args.new_tokens, "text_tokens": len(ref_lp), "chunk": args.chunk,
                    "logprob_path": "prefill" if args.prefill_path else "small-M kernel",
                    "loadavg": list(os.getloadavg()), "cpu": cpu_identity(),
                    "transformers": {"perplexity": round(math.exp(-statistics.fmean(ref_lp)), 4)}, "settings": {}}
    from kernels import quant

    path = quant.resolve_cpu_path(args.isa)  # the engines' (TANDEM_CPU_ISA above)
    result["int8_kernel"] = quant.int8_kernel(path.isa)
    settings = SETTINGS if quant.int8_activations_available(path) else ("float32",)
    if len(settings) < len(SETTINGS):
        result["skipped"] = {"int8": f"the CPU path ({quant.kernel_path(path)}) has no int8 kernel"}
    for setting in settings:
        run = tandem_pass(args.model, setting, args.threads, prompts, args.new_tokens, chunks, args.prefill_path)
        lp = run.pop("logprobs")
        run["vs_transformers"] = agreement(run.pop("tokens"), reference)
        run["mean_abs_logprob_diff"] = round(statistics.fmean(abs(a - b) for a, b in zip(lp, ref_lp)), 6)
        run["max_abs_logprob_diff"] = round(max(abs(a - b) for a, b in zip(lp, ref_lp)), 6)
        run["perplexity"] = round(math.exp(-statistics.fmean(lp)), 4)
        result["settings"][setting] = run
    result["loadavg_after"] = list(os.getloadavg())
    if "int8" in result["settings"]:
        f32, i8 = result["settings"]["float32"], result["settings"]["int8"]
        result["int8_vs_float32_decode"] = round(i8["decode_tok_s"] / f32["decode_tok_s"], 3)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
