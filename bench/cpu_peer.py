"""Generation on CPU through the service: `tandem serve` against llama.cpp's own `llama-server`, same run (#28, #48).

Both serve the very same GGUF file (`--model-size`: 135m, the embedded SmolLM2 Q4_1 file, the default; gemma-270m,
the Gemma 3 270M Q4_K_M file; 1.7b, SmolLM2-1.7B's shape with random weights made by llama.cpp's own converter and
quantizer in `--quant` q4_k_m or q8_0, bench/big_model.py; or --model PATH.gguf), with the same --threads, on
loopback, and get the same requests at the same concurrency: prompts are token windows of AlpacaEval text, sent as
token ids (no template, no BOS added by either side), greedy, EOS ignored, and no prompt is sent to a server twice
(llama-server's cache_prompt is off; tandem's prefix cache stays on as users run it, but finds nothing), so each
system does exactly the same useful work. Phases:

* batch1: one request at a time, --new-tokens after a prompt of --batch1-prompt-tokens, for 3 prompts; tok/s
  including prefill = new tokens / (last token's arrival - send); the median of the 3 prompts counts. Also the
  decode rate alone (tokens after the first / time from the first to the last).
* prefill: --prefill-rounds prompts of --prefill-tokens tokens, one new token each: prompt tokens / time to that
  token, the best round counts.
* concurrent N (--concurrency): N requests sent at once, prompts of --concurrent-prompt-tokens LO HI tokens and
  --concurrent-new-tokens LO HI new tokens (seeded), llama-server with `-np N` slots; useful tok/s = requested new
  tokens / wall time.

The peer at its best (#48): every llama-server build the host runs (bench.peers.llama_server: `avx2`, AVX2-only, and
`avx512`, AVX-512 with AMX off, where the CPU has AVX-512) serves every phase, and each figure's ratio is tandem
against the faster build, named beside it. `--isa avx2` compares like with like: tandem runs with
TANDEM_CPU_ISA=avx2 and only the avx2 build runs. The sizes of each phase default per --model-size (SIZES: at 1.7B,
on 2 cores, the whole run must stay short); the JSON records the ones used. `--cpu-activations` passes tandem serve's
setting (default auto, what users get; int8 or float32 to measure a path, named in the result file and the table).

The memory limit (#48): the host's read bandwidth (bench.bandwidth: a streaming float32 sum over 1 GiB, all
threads, best of 5) is measured first, and batch-1 decode is reported as weight bytes read per token (the file's
tensor bytes, less the token embedding table where an untied LM head exists) x decode tok/s, as a share of it.

Quality beside speed: each system's batch-1 tokens against transformers' greedy tokens on the same file
(transformers dequantizes it; float32): identical share and the first differing position; `--logit-parity` adds
tandem's prompt log-probabilities against transformers' (bench.big_model.parity, in process).
When a build cannot be made or started, its rows are skipped with the reason in the JSON.

The result (bench/results/cpu_peer[_<size>[_<quant>]][_<isa>].json) records the CPU's model and vector flags, the
commit, the path each system took, and a Markdown table (also printed) that docs/benchmarks.md carries.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.big_model import ModelSize, Quant
from bench.datasets import token_pool, windows
from bench.host import cpu_identity
from bench.peers.llama_server import SWITCHES, Build, LlamaServer, PeerUnavailable, host_builds
from bench.report import RESULTS, parse_bench_args, rotated, write_result
from bench.servers import Spawned
from clients import AsyncClient
from engine.models.loader import embedded_gguf_path
from kernels.quant import Activations


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each phase does (defaults per --model-size; any option overrides)."""
    new_tokens: int = 256
    batch1_prompt_tokens: int = 128
    prefill_tokens: int = 512
    prefill_rounds: int = 3
    concurrency: list[int] = field(default_factory=lambda: [32, 128])
    concurrent_prompt_tokens: tuple[int, int] = (16, 256)
    concurrent_new_tokens: tuple[int, int] = (16, 256)
    kv_cache_bytes: str = "2GiB"


# At 1.7B a token reads ~1 GB (Q4_K_M) on 2 cores: 3 x 32 new tokens at batch 1, one 512-token prefill, 32 at once
# with short prompts and answers keep each ISA's run around 10 minutes.
SIZES: dict[ModelSize, Sizes] = {
    ModelSize.SMOLLM2_135M: Sizes(),
    ModelSize.GEMMA_270M: Sizes(),
    ModelSize.SMOLLM2_1P7B: Sizes(new_tokens=32, batch1_prompt_tokens=32, prefill_rounds=1, concurrency=[32],
                                  concurrent_prompt_tokens=(16, 64), concurrent_new_tokens=(16, 48),
                                  kv_cache_bytes="4GiB"),
}
QUICK = dict(new_tokens=8, batch1_prompt_tokens=32, prefill_tokens=64, prefill_rounds=1, concurrency=[4],
             concurrent_prompt_tokens=(16, 32), concurrent_new_tokens=(8, 8))
TANDEM = "tandem"
LLAMA = "llama_cpp"  # peer names: llama_cpp_<build>
# The figures of the table: (key in the result, label, where the rate is in a system's entry).
FIGURES = (("batch1", "batch 1 incl. prefill, tok/s", "median_tok_s_incl_prefill"),
           ("decode", "batch 1 decode alone, tok/s", "median_decode_tok_s"),
           ("prefill", "prefill, tok/s", "best_tok_s"))


def peer_name(build: Build | str) -> str:
    return f"{LLAMA}_{Build(build).value}"


class TandemPeer:
    """`tandem serve` driven over gRPC with token ids."""

    name = TANDEM

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
    """One llama-server build, named llama_cpp_<build>."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server
        self.name = peer_name(server.build)

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


def git_commit() -> str:
    """This checkout's commit, short, with -dirty when files differ from it ("" outside git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return sha + ("-dirty" if dirty else "")


def start_servers(model_path: Path, builds: list[Build], skipped: dict, **kw) -> list[LlamaServer]:
    """A started LlamaServer per build; a build that cannot be made or started is skipped with its reason."""
    out = []
    for build in builds:
        try:
            srv = LlamaServer(model_path, isa=build, **kw)
            srv.__enter__()
            out.append(srv)
        except PeerUnavailable as exc:
            skipped[peer_name(build)] = str(exc)
    return out


def stop_servers(servers: list[LlamaServer]) -> None:
    for srv in servers:
        srv.__exit__(None, None, None)


async def measure(args, model_path: Path, tokenizer, builds: list[Build], skipped: dict) -> tuple[dict, list, dict]:
    rng = random.Random(args.seed)
    pool = token_pool(tokenizer, 200_000 if not args.quick else 20_000)
    serve_args = ["--num-threads", str(args.threads), "--metrics-port", "-1", "--max-num-seqs",
                  str(max(args.concurrency + [1])), "--kv-cache-bytes", args.kv_cache_bytes,
                  "--cpu-activations", args.cpu_activations]
    if model_path != embedded_gguf_path():  # the embedded file is what `tandem serve` loads by default
        serve_args += ["--model", str(model_path)]
    tandem = Spawned(serve_args)
    servers: list[LlamaServer] = []
    try:
        async with AsyncClient(tandem.address) as client:
            info = await client.model_info()
        paths = {TANDEM: f"cpu_kernels={info.cpu_kernels or 'none'}"}
        paths.update({peer_name(b): f"{b.value} build: {' '.join(SWITCHES[b])}" for b in builds})
        out: dict = {"paths": paths}
        servers = start_servers(model_path, builds, skipped, threads=args.threads, slots=1,
                                ctx_per_slot=max(args.batch1_prompt_tokens + args.new_tokens, args.prefill_tokens)
                                + 16)
        peers = [TandemPeer(tandem.address)] + [LlamaPeer(s) for s in servers]
        # batch 1
        b1_prompts = windows(pool, [args.batch1_prompt_tokens] * 3, rng)
        per_prompt: dict[str, list[dict]] = {p.name: [] for p in peers}
        tokens: dict[str, list[list[int]]] = {p.name: [] for p in peers}
        for i, ids in enumerate(b1_prompts):
            runs = await phase(peers, [ids], [args.new_tokens], 1, first=i)
            for name, [(_, [(toks, times, start)])] in runs.items():
                if len(toks) != args.new_tokens:  # llama-server's stream came short once at 1.7B (31 of 32):
                    out.setdefault("short_streams", []).append({"system": name, "prompt": i, "tokens": len(toks)})
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
        for i, ids in enumerate(windows(pool, [args.prefill_tokens] * args.prefill_rounds, rng)):
            for name, [(_, [(_, times, start)])] in (await phase(peers, [ids], [1], 1, first=i)).items():
                rates[name].append(args.prefill_tokens / (times[0] - start))
        out["prefill"] = {name: {"prompt_tokens": args.prefill_tokens, "best_tok_s": max(r), "tok_s_each": r}
                          for name, r in rates.items()}
        stop_servers(servers)
        servers = []
        # N at once: tandem, then each build with -np N
        out["concurrent"] = {}
        (plo, phi), (nlo, nhi) = args.concurrent_prompt_tokens, args.concurrent_new_tokens
        for n in args.concurrency:
            lengths = [rng.randint(plo, phi) for _ in range(n)]
            news = [rng.randint(nlo, nhi) for _ in range(n)]
            prompts = windows(pool, lengths, rng)
            runs = await phase([peers[0]], prompts, news, 1)
            for build in builds:
                if peer_name(build) in skipped:
                    continue
                servers = start_servers(model_path, [build], skipped, threads=args.threads, slots=n,
                                        ctx_per_slot=phi + nhi + 16)
                try:
                    for srv in servers:
                        runs.update(await phase([LlamaPeer(srv)], prompts, news, 1))
                except PeerUnavailable as exc:
                    skipped[f"{peer_name(build)}_np{n}"] = str(exc)
                finally:
                    stop_servers(servers)
                    servers = []
            out["concurrent"][str(n)] = {name: {"useful_tok_s": sum(news) / rs[0][0], "wall_s": rs[0][0]}
                                         for name, rs in runs.items()}
        return out, b1_prompts, tokens
    finally:
        stop_servers(servers)
        tandem.stop()


def figure_rows(figures: dict) -> dict[str, dict[str, float]]:
    """Each figure's rate per system: batch1, decode, prefill, concurrent<N>."""
    rows = {}
    for key, _, field_name in FIGURES:
        src = figures["prefill" if key == "prefill" else "batch1"]
        rows[key] = {name: entry[field_name] for name, entry in src.items()}
    for n, entries in figures.get("concurrent", {}).items():
        rows[f"concurrent{n}"] = {name: entry["useful_tok_s"] for name, entry in entries.items()}
    return rows


def compare(rows: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per figure: tandem's rate, the faster llama-server build and its rate, and tandem / that rate."""
    out = {}
    for key, rates in rows.items():
        peers = {name: r for name, r in rates.items() if name.startswith(LLAMA)}
        if TANDEM not in rates or not peers:
            continue
        best = max(peers, key=peers.get)
        out[key] = {"tandem": rates[TANDEM], "faster_build": best.removeprefix(LLAMA + "_"),
                    "faster_tok_s": peers[best], "ratio": rates[TANDEM] / peers[best]}
    return out


def bandwidth_shares(figures: dict, bytes_per_token: int, gbps: float) -> dict[str, float]:
    """Per system: weight bytes per token x batch-1 decode tok/s, as a share of the measured read bandwidth."""
    return {name: bytes_per_token * entry["median_decode_tok_s"] / (gbps * 1e9)
            for name, entry in figures["batch1"].items()}


def render_table(result: dict) -> str:
    """The Markdown table of one run: each figure's rate for tandem and every build, the ratio against the faster
    build and which it was; the conditions in a caption above it."""
    s = result["settings"]
    builds = [b for b in result["builds"] if peer_name(b) not in result.get("skipped", {})]
    cpu = result.get("cpu", {})
    lines = [f"{result['model']} ({result.get('model_size') or 'file'}"
             f"{', ' + result['quant'] if result.get('quant') else ''}), tandem path {result['paths'][TANDEM]}, "
             f"--isa {result['isa']}, {result['threads']} threads, commit {result['commit'] or '?'}, load average "
             f"{result['loadavg'][0]:.1f}{' (contended)' if result['contended'] else ''}; CPU {cpu.get('model', '?')}, "
             f"flags {' '.join(cpu.get('vector_flags', []))}", "",
             _row(["tok/s", "tandem"] + [f"llama-server {b}" for b in builds]
                  + ["tandem / faster build", "faster build"]),
             _row(["---"] + ["---:"] * (len(builds) + 2) + ["---"])]
    labels = {k: label for k, label, _ in FIGURES}
    labels["batch1"] += f" ({s['batch1_prompt_tokens']} + {s['new_tokens']} tokens, median of 3)"
    labels["decode"] += f" ({s['new_tokens']} tokens)"
    labels["prefill"] = f"one {s['prefill_tokens']}-token prompt, prefill tok/s (best of {s['prefill_rounds']})"
    rows = figure_rows(result)
    for key, rates in rows.items():
        label = labels.get(key) or (f"{key.removeprefix('concurrent')} requests at once, useful tok/s (prompts "
                                    f"{'-'.join(map(str, s['concurrent_prompt_tokens']))}, new "
                                    f"{'-'.join(map(str, s['concurrent_new_tokens']))})")
        cmp = result["vs_faster_build"].get(key)
        cells = [f"{rates[TANDEM]:.1f}" if TANDEM in rates else "-"]
        cells += [f"{rates[peer_name(b)]:.1f}" if peer_name(b) in rates else "-" for b in builds]
        cells += [f"**{cmp['ratio']:.2f}x**", cmp["faster_build"]] if cmp else ["-", "-"]
        lines.append(_row([label] + cells))
    if "bandwidth" in result:
        bw, per = result["bandwidth"], result["decode_bytes_per_token"]
        shares = result["decode_bandwidth_share"]
        lines.append(_row([f"batch-1 decode, share of read bandwidth ({per['bytes'] / 1e9:.3f} GB/token, "
                           f"{bw['gbps']:.1f} GB/s)"]
                          + [f"{shares[n]:.0%}" if n in shares else "-" for n in [TANDEM] + [peer_name(b) for b in builds]]
                          + ["", ""]))
    q = result.get("vs_transformers", {})
    if q:
        lines.append(_row([f"batch-1 tokens identical to transformers ({s['new_tokens']} tokens)"]
                          + [_identity(q.get(n)) for n in [TANDEM] + [peer_name(b) for b in builds]] + ["", ""]))
    if "logit_parity" in result:
        lp = result["logit_parity"]
        lines += ["", f"tandem's prompt log-probabilities against transformers on the file (in process): max "
                  f"|difference| {lp['prompt_logprob_abs_diff_max']:.2g}, mean {lp['prompt_logprob_abs_diff_mean']:.2g}"]
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _identity(q: dict | None) -> str:
    if not q:
        return "-"
    firsts = q["first_difference"]
    same = sum(f is None for f in firsts)
    diff = [str(f) for f in firsts if f is not None]
    return f"{same}/{len(firsts)}" + (f" (first difference at {', '.join(diff)})" if diff else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=[m.value for m in ModelSize], default=None,
                    help="the file to serve (default: 135m, the embedded SmolLM2, unless --model names one)")
    ap.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.Q4_K_M.value,
                    help="the 1.7b file's type")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file instead of --model-size")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--batch1-prompt-tokens", type=int, default=None)
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument("--prefill-rounds", type=int, default=None)
    ap.add_argument("--concurrency", type=int, nargs="*", default=None)
    ap.add_argument("--concurrent-prompt-tokens", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    ap.add_argument("--concurrent-new-tokens", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    ap.add_argument("--kv-cache-bytes", default=None, help="tandem serve's --kv-cache-bytes")
    ap.add_argument("--no-llama", action="store_true", help="tandem alone (the peer's rows are skipped)")
    ap.add_argument("--isa", choices=["auto", "avx512", "avx2"], default="auto",
                    help="tandem's CPU path (TANDEM_CPU_ISA; auto: the widest the CPU has, against every build it "
                         "runs); avx2: against llama-server's avx2 build only")
    ap.add_argument("--builds", nargs="+", choices=[b.value for b in Build], default=None,
                    help="llama-server builds to run (default: avx2, and avx512 where the CPU has AVX-512; "
                         "--isa avx2: avx2)")
    ap.add_argument("--cpu-activations", choices=[a.value for a in Activations], default=Activations.AUTO.value,
                    help="tandem serve's --cpu-activations (default auto, what users get)")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the read-bandwidth measurement")
    ap.add_argument("--logit-parity", action="store_true",
                    help="also compare tandem's prompt log-probabilities with transformers' (in process)")
    args = parse_bench_args(ap, argv, "cpu_peer", {})
    if args.model is not None and args.model_size is not None:
        ap.error("give --model or --model-size, not both")
    defaults = SIZES[ModelSize(args.model_size or ModelSize.SMOLLM2_135M)]
    for key, value in asdict(defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.concurrent_prompt_tokens = tuple(args.concurrent_prompt_tokens)
    args.concurrent_new_tokens = tuple(args.concurrent_new_tokens)
    for lo, hi in (args.concurrent_prompt_tokens, args.concurrent_new_tokens):
        if not 1 <= lo <= hi:
            ap.error(f"a LO HI range needs 1 <= LO <= HI, got {lo} {hi}")
    if args.out == RESULTS / "cpu_peer.json":
        parts = ([args.model_size] if args.model_size else []) + (
            [args.quant] if args.model_size == ModelSize.SMOLLM2_1P7B else []) + (
            [args.isa] if args.isa != "auto" else []) + (
            [args.cpu_activations] if args.cpu_activations != Activations.AUTO.value else [])
        args.out = RESULTS / ("_".join(["cpu_peer"] + parts) + ".json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.isa != "auto":
        os.environ["TANDEM_CPU_ISA"] = args.isa  # the spawned `tandem serve` inherits it
    from transformers import AutoTokenizer

    from bench.bandwidth import decode_bytes_per_token, read_bandwidth
    from bench.big_model import model_file

    model_path = args.model or model_file(args.model_size or ModelSize.SMOLLM2_135M, args.quant, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    cpu = cpu_identity()
    skipped: dict[str, str] = {}
    if args.no_llama:
        builds = []
        skipped[LLAMA] = "--no-llama"
    elif args.builds:
        builds = [Build(b) for b in args.builds]
    else:
        builds = [Build.AVX2] if args.isa == "avx2" else host_builds(cpu.get("vector_flags", []))
    extra: dict = {}
    if not args.no_bandwidth:  # before any server starts: the host to itself
        bw = read_bandwidth(1 << 30 if not args.quick else 64 << 20, 5, args.threads)
        extra["bandwidth"] = asdict(bw)
        extra["decode_bytes_per_token"] = decode_bytes_per_token(model_path)
    figures, b1_prompts, tokens = asyncio.run(measure(args, model_path, tokenizer, builds, skipped))
    if args.logit_parity:
        from bench.big_model import parity

        extra["logit_parity"] = parity(model_path, b1_prompts, args.new_tokens)
        ref = extra["logit_parity"].pop("reference_tokens")
    else:
        ref = hf_greedy(model_path, b1_prompts, args.new_tokens)
    quality = {name: agreement(toks, ref) for name, toks in tokens.items()}
    vs = compare(figure_rows(figures))
    ratios = {f"{key}_vs_llama_cpp": c["ratio"] for key, c in vs.items()}  # against the faster build
    if "bandwidth" in extra:
        extra["decode_bandwidth_share"] = bandwidth_shares(figures, extra["decode_bytes_per_token"]["bytes"],
                                                           extra["bandwidth"]["gbps"])
    size = args.model_size or (None if args.model else ModelSize.SMOLLM2_135M.value)
    result = {"benchmark": "cpu_peer", "model": str(model_path.name), "model_size": size,
              "quant": args.quant if args.model_size == ModelSize.SMOLLM2_1P7B else None,
              "threads": args.threads, "isa": args.isa, "builds": [b.value for b in builds], "cpu": cpu,
              "commit": git_commit(),
              "settings": {k: getattr(args, k) for k in asdict(Sizes())},
              "new_tokens": args.new_tokens, "loadavg": os.getloadavg(),
              "contended": os.getloadavg()[0] > args.threads + 0.5, **figures, **extra,
              "vs_transformers": quality, "vs_faster_build": vs, "ratios": ratios, "skipped": skipped}
    result["table"] = render_table(result)
    print(result["table"])
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
