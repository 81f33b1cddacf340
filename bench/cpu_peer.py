"""Generation on CPU through the service: `tandem serve` against llama.cpp's own `llama-server`, same run (#28).

Both servers serve the very same GGUF file (the embedded SmolLM2 Q4_1 file, or --model PATH.gguf), with the same
--threads, on loopback, and get the same requests at the same concurrency: prompts are token windows of AlpacaEval
text, sent as token ids (no template, no BOS added by either side), greedy, EOS ignored, and no prompt is sent to
a server twice (llama-server's cache_prompt is off; tandem's prefix cache stays on as users run it, but finds
nothing), so each system does exactly the same useful work. Phases:

* batch1: one request at a time, --new-tokens after a prompt of --batch1-prompt-tokens, for 3 prompts; tok/s
  including prefill = new tokens / (last token's arrival - send); the median of the 3 prompts counts. Also the
  decode rate alone (tokens after the first / time from the first to the last).
* prefill: one prompt of --prefill-tokens tokens, one new token: prompt tokens / time to that token.
* concurrent N (--concurrency, default 32 and 128): N requests sent at once, prompts of 16-256 tokens and 16-256
  new tokens (seeded), llama-server with `-np N` slots; useful tok/s = requested new tokens / wall time.

Quality beside speed: each system's batch-1 tokens against transformers' greedy tokens on the same file
(transformers dequantizes it; float32): identical share and the first differing position.
The peer: bench.llama_server (built once from the llama-cpp-python sdist's vendored source, cached). When it cannot
be built, its rows are skipped with the reason in the JSON.

`--isa avx2` compares like with like on a CPU with more than AVX2: tandem runs with TANDEM_CPU_ISA=avx2 and the peer
is the llama-server built with AVX-512 off (bench.llama_server's `avx2` build); the result goes to
cpu_peer_avx2.json. Every result records the CPU's model and vector flags and the path each system took.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

from bench.llama_server import BUILDS, LlamaServer, PeerUnavailable
from bench.report import RESULTS, parse_bench_args, rotated, write_result
from bench.serve import Spawned
from clients import AsyncClient

QUICK = dict(new_tokens=8, batch1_prompt_tokens=32, prefill_tokens=64, concurrency=[4])


_VECTOR_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "bmi", "neon", "asimd", "sve")


def cpu_identity() -> dict:
    """The CPU's model name and the vector-unit flags the kernels of either system may use (/proc/cpuinfo, Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    return {"model": fields.get("model name", ""), "vector_flags": sorted(f for f in flags
                                                                           if f.startswith(_VECTOR_FLAG_PREFIXES))}


def token_pool(tokenizer, need: int) -> list[int]:
    """AlpacaEval instructions and answers, tokenized back to back: the text the prompt windows are cut from."""
    from bench.datasets import alpaca_eval

    ids: list[int] = []
    for row in alpaca_eval():
        ids += tokenizer(row["instruction"] + "\n" + row["output"] + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    return ids


def windows(pool: list[int], lengths: list[int], rng: random.Random) -> list[list[int]]:
    out = []
    for n in lengths:
        start = rng.randrange(0, len(pool) - n)
        out.append(pool[start:start + n])
    return out


class TandemPeer:
    """`tandem serve` driven over gRPC with token ids."""

    name = "tandem"

    def __init__(self, address: str) -> None:
        self.address = address

    async def one(self, client: AsyncClient, ids: list[int], n: int) -> tuple[list[int], list[float], float]:
        start = time.perf_counter()
        tokens, times = [], []
        async for delta in client.generate(token_ids=ids, max_tokens=n, temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            tokens += delta.token_ids
            times += [now] * len(delta.token_ids)
        return tokens, times, start

    async def run(self, prompts: list[list[int]], news: list[int]) -> list[tuple[list[int], list[float], float]]:
        async with AsyncClient(self.address) as client:
            return await asyncio.gather(*(self.one(client, p, n) for p, n in zip(prompts, news)))


class LlamaPeer:
    name = "llama_cpp"

    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    async def run(self, prompts: list[list[int]], news: list[int]) -> list[tuple[list[int], list[float], float]]:
        done = await asyncio.gather(*(asyncio.to_thread(self.server.complete, p, n) for p, n in zip(prompts, news)))
        return [(c.tokens, c.times, c.start) for c in done]


def hf_greedy(model_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None) for t, r in zip(tokens, ref)]
    return {"identical_share": sum(f is None for f in firsts) / len(firsts), "first_difference": firsts}


async def phase(peers: list, prompts: list[list[int]], news: list[int], rounds: int,
                first: int = 0) -> dict[str, list]:
    """Each peer runs the same requests `rounds` times, rotating who goes first; returns every round's
    (wall seconds, results). Callers give tandem a request only once (its prefix cache would serve a repeat)."""
    runs: dict[str, list] = {p.name: [] for p in peers}
    for r in range(first, first + rounds):
        for name in rotated([p.name for p in peers], r):
            peer = next(p for p in peers if p.name == name)
            t = time.perf_counter()
            res = await peer.run(prompts, news)
            runs[name].append((time.perf_counter() - t, res))
    return runs


async def measure(args, model_path: Path, tokenizer, llama: LlamaServer | None, skipped: dict) -> dict:
    rng = random.Random(args.seed)
    pool = token_pool(tokenizer, 200_000 if not args.quick else 20_000)
    serve_args = ["--num-threads", str(args.threads), "--metrics-port", "-1", "--max-num-seqs",
                  str(max(args.concurrency + [1])), "--kv-cache-bytes", "2GiB"]
    if args.model:
        serve_args += ["--model", str(model_path)]
    tandem = Spawned(serve_args)
    try:
        peers = [TandemPeer(tandem.address)] + ([LlamaPeer(llama)] if llama else [])
        async with AsyncClient(tandem.address) as client:
            info = await client.model_info()
        paths = {"tandem": f"cpu_kernels={info.cpu_kernels or 'none'}"}
        if llama is not None:
            paths["llama_cpp"] = f"{args.isa} build: {' '.join(BUILDS[args.isa][1])}"
        out: dict = {"paths": paths}
        # batch 1
        b1_prompts = windows(pool, [args.batch1_prompt_tokens] * 3, rng)
        per_prompt: dict[str, list[dict]] = {p.name: [] for p in peers}
        tokens: dict[str, list[list[int]]] = {p.name: [] for p in peers}
        for i, ids in enumerate(b1_prompts):
            runs = await phase(peers, [ids], [args.new_tokens], 1, first=i)
            for name, [(_, [(toks, times, start)])] in runs.items():
                assert len(toks) == args.new_tokens, (name, len(toks))
                per_prompt[name].append({"tok_s_incl_prefill": len(toks) / (times[-1] - start),
                                         "decode_tok_s": (len(times) - 1) / max(1e-9, times[-1] - times[0]),
                                         "ttft_s": times[0] - start})
                tokens[name].append(toks)
        out["batch1"] = {name: {"median_tok_s_incl_prefill":
                                statistics.median(r["tok_s_incl_prefill"] for r in rows),
                                "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
                                "per_prompt": rows} for name, rows in per_prompt.items()}
        # prefill of one long prompt
        rates: dict[str, list[float]] = {p.name: [] for p in peers}
        for i, ids in enumerate(windows(pool, [args.prefill_tokens] * (1 if args.quick else 3), rng)):
            for name, [(_, [(_, times, start)])] in (await phase(peers, [ids], [1], 1, first=i)).items():
                rates[name].append(args.prefill_tokens / (times[0] - start))
        out["prefill"] = {name: {"prompt_tokens": args.prefill_tokens, "best_tok_s": max(r), "tok_s_each": r}
                          for name, r in rates.items()}
        # N at once
        out["concurrent"] = {}
        for n in args.concurrency:
            lengths = [rng.randint(16, 256) for _ in range(n)]
            news = [rng.randint(16, 256) if not args.quick else args.new_tokens for _ in range(n)]
            prompts = windows(pool, lengths, rng)
            here = [peers[0]]
            if llama is not None:
                try:
                    with LlamaServer(model_path, threads=args.threads, slots=n, ctx_per_slot=256 + 256 + 16,
                                     isa=args.isa) as srv:
                        here.append(LlamaPeer(srv))
                        runs = await phase(here, prompts, news, 1)
                except PeerUnavailable as exc:
                    skipped[f"llama_cpp_np{n}"] = str(exc)
                    runs = await phase(here, prompts, news, 1)
            else:
                runs = await phase(here, prompts, news, 1)
            out["concurrent"][str(n)] = {name: {"useful_tok_s": sum(news) / rs[0][0], "wall_s": rs[0][0]}
                                         for name, rs in runs.items()}
        return out, b1_prompts, tokens
    finally:
        tandem.stop()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2 file)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch1-prompt-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[32, 128])
    ap.add_argument("--no-llama", action="store_true", help="tandem alone (the peer's rows are skipped)")
    ap.add_argument("--isa", choices=list(BUILDS), default="native",
                    help="avx2: tandem with TANDEM_CPU_ISA=avx2 against llama-server built with AVX-512 off")
    args = parse_bench_args(ap, argv, "cpu_peer", QUICK)  # another --model: give --out too
    if args.isa != "native":
        os.environ["TANDEM_CPU_ISA"] = args.isa  # the spawned `tandem serve` inherits it
        if args.out == RESULTS / "cpu_peer.json":
            args.out = RESULTS / f"cpu_peer_{args.isa}.json"
    from transformers import AutoTokenizer

    from engine.models.loader import embedded_gguf_path

    model_path = args.model or embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    skipped: dict[str, str] = {}
    llama = None
    if args.no_llama:
        skipped["llama_cpp"] = "--no-llama"
    else:
        try:
            llama = LlamaServer(model_path, threads=args.threads, slots=1,
                                ctx_per_slot=max(args.batch1_prompt_tokens + args.new_tokens, args.prefill_tokens) + 16,
                                isa=args.isa)
            llama.__enter__()
        except PeerUnavailable as exc:
            skipped["llama_cpp"] = str(exc)
            llama = None
    try:
        figures, b1_prompts, tokens = asyncio.run(measure(args, model_path, tokenizer, llama, skipped))
    finally:
        if llama is not None:
            llama.__exit__(None, None, None)
    ref = hf_greedy(model_path, b1_prompts, args.new_tokens)
    quality = {name: agreement(toks, ref) for name, toks in tokens.items()}
    ratios = {}
    if "llama_cpp" in figures["batch1"]:
        ratios["batch1_vs_llama_cpp"] = (figures["batch1"]["tandem"]["median_tok_s_incl_prefill"]
                                         / figures["batch1"]["llama_cpp"]["median_tok_s_incl_prefill"])
        ratios["prefill_vs_llama_cpp"] = (figures["prefill"]["tandem"]["best_tok_s"]
                                          / figures["prefill"]["llama_cpp"]["best_tok_s"])
        for n, rows in figures["concurrent"].items():
            if "llama_cpp" in rows:
                ratios[f"concurrent{n}_vs_llama_cpp"] = (rows["tandem"]["useful_tok_s"]
                                                         / rows["llama_cpp"]["useful_tok_s"])
    result = {"benchmark": "cpu_peer", "model": str(model_path.name), "threads": args.threads, "isa": args.isa,
              "cpu": cpu_identity(),
              "new_tokens": args.new_tokens, "loadavg": os.getloadavg(),
              "contended": os.getloadavg()[0] > args.threads + 0.5, **figures,
              "vs_transformers": quality, "ratios": ratios, "skipped": skipped}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
