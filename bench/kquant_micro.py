"""Per-projection GB/s of the small-M quantized matmul at a real model's shapes (issue #48 item 4).

`python -m bench.kquant_micro [--model FILE.gguf] [--rows 1] [--rounds 7] [--calls 24]` loads every layer's
projection weights of a GGUF file as stored (a Q4_K_M file keeps q/k/o/gate/up and half of v and down in Q4_K, the
other half and the output in Q6_K) and times single `quant.matmul` calls, one projection kind and storage format at a
time, cycling over the layers so the weights stream from memory (24 layers of a 1.7B model: 50-230 MB per kind, far
past the caches), on every CPU path this host has (avx512, avx2) with float32 and with int8 activations.

Variants are interleaved call by call (each round visits every variant in a rotated order), so load on a shared host
slows them alike; per variant the median over rounds of the wall time of `--calls` calls, and the process CPU time
(all threads) of the same calls, as GB/s of weight bytes read. Threads: torch's (set `--threads`). `--layers 1` keeps one
layer's weights in the cache (compute-bound speed), `--threads 1` against 2 says whether a thread is the limit.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache/tandem/bench-models/smollm2-1.7b-random-s0/smollm2-1.7b-random-s0.Q4_K_M.gguf"
KINDS = {"attn_q": "q", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}


def load_weights(path: Path) -> dict[tuple[str, str], list]:
    """(projection, format) -> the layers' QuantWeights of that projection stored in that format (and the output)."""
    from gguf import GGUFReader

    from kernels.quant import BLOCK_BYTES, QuantWeight

    reader = GGUFReader(str(path))
    out: dict[tuple[str, str], list] = {}
    for t in reader.tensors:
        fmt = t.tensor_type.name
        if fmt not in BLOCK_BYTES or fmt in ("F16", "BF16"):
            continue
        parts = t.name.split(".")
        kind = "lm_head" if t.name == "token_embd.weight" else KINDS.get(parts[2]) if parts[0] == "blk" else None
        if kind is None:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        data = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(n, -1)
        out.setdefault((kind, fmt), []).append(QuantWeight(data, fmt, (n, k)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (M)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=24, help="calls per timing (cycling over the layers)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="", help="comma-separated projection kinds (default: all)")
    parser.add_argument("--isas", default="avx512,avx2")
    parser.add_argument("--layers", type=int, default=0,
                        help="cycle over this many layers only (1: the weights stay in the L3 cache; 0: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kernels import quant

    weights = load_weights(args.model)
    wanted = set(filter(None, args.kinds.split(",")))
    isas = [quant.CpuIsa[name.upper()] for name in args.isas.split(",") if quant.CpuIsa[name.upper()] <= quant.best_isa()]
    variants = [(isa, act) for isa in isas for act in (quant.Activations.FLOAT32, quant.Activations.INT8)]
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model.name}, M={args.rows}, {args.threads} threads, load {os.getloadavg()[0]:.1f}, "
          f"median of {args.rounds} rounds x {args.calls} calls; GB/s wall (GB/s per CPU-second)")
    for (kind, fmt), ws in sorted(weights.items()):
        if wanted and kind not in wanted:
            continue
        ws = ws[:args.layers] if args.layers else ws
        n, k = ws[0].shape
        x = torch.randn(args.rows, k, generator=gen)
        nbytes = ws[0].nbytes
        for isa, act in variants:  # warm-up
            quant.matmul(x, ws[0], isa=isa, activations=act)
        wall: dict = {v: [] for v in variants}
        cpu: dict = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                c0, t0 = time.process_time(), time.perf_counter()
                for i in range(args.calls):
                    quant.matmul(x, ws[i % len(ws)], isa=v[0], activations=v[1])
                wall[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
        gb = nbytes * args.calls / 1e9
        cells = []
        for v in variants:
            w, c = statistics.median(wall[v]), statistics.median(cpu[v])
            cells.append(f"{v[0].label}/{v[1].value}: {w / args.calls * 1e3:.3f} ms {gb / w:.1f} ({gb / c:.1f})")
        print(f"{kind:7s} {fmt} {n}x{k} ({nbytes / 1e6:.1f} MB x {len(ws)}) | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
