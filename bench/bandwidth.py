"""The host's memory read bandwidth, and how many weight bytes a batch-1 decode step of a GGUF file reads (#48).

`read_bandwidth()`: a streaming float32 sum (torch, all --threads) over a buffer far larger than the caches (1 GiB by
default), best of N passes: bytes / seconds. A decode step of one sequence reads every weight once, so weight bytes
per token / time per token, as a share of this, says how close a decoder is to the memory limit.

`decode_bytes_per_token()`: the GGUF's tensor bytes as stored (its quantized blocks), less what a token does not
read: the token embedding table is only gathered (one row per token) when the file has its own LM head
(`output.weight`); with tied embeddings the LM head is that table, read in full every token, so it counts. The KV
cache a token attends to is not counted (small at the benchmark's contexts).

    python -m bench.bandwidth [--gib 1] [--repeats 5] [--threads 2] [--model FILE.gguf]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Bandwidth:
    gbps: float  # best pass, 1e9 bytes per second
    gbps_each: list[float]
    bytes: int
    threads: int


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> Bandwidth:
    """Stream-read a float32 buffer of `nbytes` with torch.sum on `threads` threads (default: torch's), `repeats`
    timed passes after one untimed one; the best pass counts."""
    if nbytes < 4 or repeats < 1:
        raise ValueError("read_bandwidth needs at least one float32 and one pass")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written, so every page is really there
        used = buf.numel() * 4
        total = buf.sum()
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            total = buf.sum()
            rates.append(used / (time.perf_counter() - start) / 1e9)
        if float(total) != buf.numel():  # the sum was really computed
            raise RuntimeError(f"read_bandwidth: the sum of {buf.numel()} ones came out {float(total)}")
        return Bandwidth(max(rates), rates, used, torch.get_num_threads())
    finally:
        torch.set_num_threads(before)


def decode_bytes_per_token(path: Path) -> dict:
    """Bytes of `path`'s tensors one batch-1 decode token reads (see the module's docstring), with the parts."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    return bytes_read_per_token(sizes)


def bytes_read_per_token(sizes: dict[str, int]) -> dict:
    """From GGUF tensor names and byte sizes: all of them, less the token embedding table when an `output.weight`
    (an untied LM head) exists."""
    embed = sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    total = sum(sizes.values())
    return {"bytes": total - (0 if tied else embed), "file_tensor_bytes": total, "token_embd_bytes": embed,
            "tied_embeddings": tied}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="also print a GGUF's bytes read per decode token")
    args = ap.parse_args(argv)
    out: dict = {"bandwidth": asdict(read_bandwidth(int(args.gib * (1 << 30)), args.repeats, args.threads))}
    if args.model:
        out["decode_bytes_per_token"] = decode_bytes_per_token(args.model)
    print(out)
    return out


if __name__ == "__main__":
    main()
