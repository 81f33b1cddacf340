"""The models an embedder runs, each as `Stages` of a packed batch (token ids [T] and cu_seqlens [B + 1] in, every
token's final hidden state [T, H] out), so a row can run a few layers a step beside decodes and carry its hidden
states to the next step. Encoders (BERT / RoBERTa / XLM-R, ModernBERT) reuse the cross-encoder modules of
engine/models, one stage per layer; a decoder embedder (Qwen3-Embedding style) runs the one decoder over a scratch KV
cache that lives for one forward, as one stage."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import AttentionMetadata
from engine.models.bert import FAMILIES, EncoderArgs, EncoderModel, packed_positions, use_kernels
from engine.models.loader import load_state_dict
from engine.models.modernbert import Body, ModernBertArgs, embed_tokens, run_layers
from engine.models.stages import Stages
from engine.settings import Settings

_SCRATCH_BLOCK = 16  # tokens per block of a decoder embedder's one-forward KV cache


def is_decoder(cfg: dict) -> bool:
    return cfg.get("model_type") not in (*FAMILIES, "modernbert")


def load_token_states(path: Path, cfg: dict, device: torch.device, dtype: torch.dtype, settings: Settings
                      ) -> tuple[Stages, int, int]:
    """The model's forward in stages, its hidden size and the longest row its positions take."""
    if cfg.get("model_type") == "modernbert":
        return _modernbert(path, cfg, device, dtype)
    if cfg.get("model_type") in FAMILIES:
        return _bert(path, cfg, device, dtype, settings.kernels)
    return _decoder(path, cfg, device, dtype, settings)


def _load(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, what: str) -> None:
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise ValueError(f"weights in {str(path)!r} do not fit its config.json: {e}") from e
    if result.missing_keys:
        raise ValueError(f"weights in {str(path)!r} are not a {what} encoder: missing {result.missing_keys[:8]}")


def _bert(path: Path, cfg: dict, device, dtype, kernels: str) -> tuple[Stages, int, int]:
    args = EncoderArgs.from_hf_config(cfg, num_labels=1)
    prefix = f"{args.family}."
    state = {}
    for key, value in load_state_dict(path).items():
        key = key[len(prefix):] if key.startswith(prefix) else key
        if key.startswith(("embeddings.", "encoder.")) and not key.endswith((".position_ids", ".token_type_ids")):
            state[key.replace(".gamma", ".weight").replace(".beta", ".bias")] = value
    with torch.device("meta"):
        model = EncoderModel(args, pooler=False)
    _load(model, state, path, cfg["model_type"])
    model = model.to(device=device, dtype=dtype).eval()
    use_kernels(model, kernels)

    def begin(input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return model.embeddings(input_ids, torch.zeros_like(input_ids), packed_positions(input_ids, cu_seqlens, args))

    def run(x: torch.Tensor, cu_seqlens: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for layer in model.encoder.layer[start:stop]:
            x = layer(x, cu_seqlens)
        return x
    return Stages(args.num_layers, begin, run), args.hidden_size, args.max_tokens


def _modernbert(path: Path, cfg: dict, device, dtype) -> tuple[Stages, int, int]:
    args = ModernBertArgs.from_hf_config(cfg, num_labels=1)
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in load_state_dict(path).items()}
    state = {k: v for k, v in state.items() if k.startswith(("embeddings.", "layers.", "final_norm."))}
    with torch.device("meta"):
        body = Body(args)
    _load(body, state, path, "modernbert")
    body = body.to(device=device, dtype=dtype).eval()
    stages = Stages(args.num_layers, lambda ids, types, cu: embed_tokens(body, ids),
                    lambda x, cu, start, stop: run_layers(body, args, x, cu, start, stop),
                    lambda x, cu: body.final_norm(x))
    return stages, args.hidden_size, args.max_tokens


def _decoder(path: Path, cfg: dict, device, dtype, settings: Settings) -> tuple[Stages, int, int]:
    from engine.models.decoder_args import DecoderArgs
    from engine.models.decoder_weights import build_decoder

    if cfg.get("use_bidirectional_attention") or cfg.get("is_causal") is False:
        raise ValueError(f"{str(path)!r} is a decoder with bidirectional attention (e.g. EmbeddingGemma); tandem runs "
                         "decoder embedders causally (Qwen3-Embedding style), so its vectors would be wrong")
    # An embedder is saved as the bare body (Qwen3Model): read it as its causal LM, whose head it never uses.
    archs = [a[:-len("Model")] + "ForCausalLM" if a.endswith("Model") else a for a in cfg.get("architectures") or []]
    args = DecoderArgs.from_hf_config({**cfg, "architectures": archs} if archs else cfg)
    weights = {(k if k.startswith(("model.", "lm_head.")) else f"model.{k}"): v
               for k, v in load_state_dict(path).items()}
    if "lm_head.weight" not in weights and not args.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # never used: an embedder reads states
    model = build_decoder(args, weights, str(device), dtype, settings=settings)

    def states(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        bounds = cu_seqlens.tolist()
        lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        bs = _SCRATCH_BLOCK
        tables, slots, positions, used = [], [], [], 0
        for n in lens:
            blocks = -(-n // bs)
            tables.append(list(range(used, used + blocks)))
            slots.extend(used * bs + p for p in range(n))
            positions.extend(range(n))
            used += blocks
        width = max(len(t) for t in tables)
        kv = torch.zeros((args.num_layers, 2, used, bs, args.num_kv_heads, args.head_dim), dtype=dtype,
                         device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                      device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            query_start_loc=cu_seqlens.to(torch.int32))
        return model(input_ids, torch.tensor(positions, dtype=torch.int64, device=device), kv, meta)
    # One stage: its state between stages would be every layer's KV, not a hidden state (the input is the token ids).
    return Stages(1, lambda ids, types, cu: ids, lambda ids, cu, start, stop: states(ids, cu)), args.hidden_size, \
        args.max_position_embeddings
