"""Load a cross-encoder from a Hugging Face directory and score packed batches of tokenized pairs (the rerank mode
that builds the pairs is engine/rerank/cross_encoder.py)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels import linear as kernel_linear
from engine.models.bert import (FAMILIES, EncoderArgs, SequenceClassifier, build_model, pack_pairs, packed_positions,
                               use_kernels)
from engine.models.loader import load_state_dict
from engine.models.modernbert import ModernBertArgs, ModernBertForSequenceClassification, embed_tokens, run_layers
from engine.models.stages import Finish, Stages, StagedForward, StageResult, StageWork

Pair = tuple[list[int], list[int]]  # (input_ids, token_type_ids) of one tokenized (query, document) pair

# sentence-transformers stores the activation as an import path; we accept only these, never import the string.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Sigmoid": torch.sigmoid, "Identity": lambda x: x, "Tanh": torch.tanh,
}
# Buffers some checkpoints serialize; the packed forward computes them instead.
_IGNORED_SUFFIXES = (".position_ids", ".token_type_ids")


def normalize_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Map checkpoint keys to our module names: add the base-model prefix ("bert" or "roberta") to bare encoders,
    rename old LayerNorm gamma/beta."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if key.endswith(".gamma") or key.endswith(".beta"):
            key = key[: key.rfind(".")] + (".weight" if key.endswith(".gamma") else ".bias")
        if key.split(".", 1)[0] in ("embeddings", "encoder", "pooler"):
            key = f"{prefix}.{key}"
        out[key] = value
    if prefix == "roberta":  # RoBERTa classifiers have no pooler; checkpoints saved from RobertaModel may carry one
        out = {k: v for k, v in out.items() if not k.startswith("roberta.pooler.")}
    return out


def same_encoder(cross_encoder: Path, embedder: Path) -> bool:
    """Whether a cross-encoder directory and an embedder directory hold one encoder: the same directory, or BERT-family
    encoders with equal configs and bit-equal embedding and layer weights (a classifier trained on top of a frozen
    sentence encoder, the head being all that differs). Then one copy serves both (CrossEncoder shared=True)."""
    if cross_encoder.resolve() == embedder.resolve():
        return True
    try:
        a, b = (json.loads((p / "config.json").read_text()) for p in (cross_encoder, embedder))
        if a.get("model_type") != b.get("model_type") or a.get("model_type") not in FAMILIES:
            return False
        args = EncoderArgs.from_hf_config(a, num_labels=1)
        if args != EncoderArgs.from_hf_config(b, num_labels=1):
            return False
    except (OSError, ValueError, KeyError):
        return False
    family = args.family
    body = (f"{family}.embeddings.", f"{family}.encoder.")
    x, y = ({k: v for k, v in normalize_state_dict(load_state_dict(p), family).items() if k.startswith(body)}
            for p in (cross_encoder, embedder))
    return x.keys() == y.keys() and all(x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x)


def _num_labels(state: dict[str, torch.Tensor], family: str, path: Path) -> int:
    head = "classifier.out_proj.weight" if family == "roberta" else "classifier.weight"
    if head not in state:
        raise ValueError(f"{str(path)!r} is a bare {family} encoder (an embedding model) without a classification "
                         f"head ({head}), so it cannot score pairs: pass a cross-encoder (a *ForSequenceClassification "
                         "checkpoint, e.g. BAAI/bge-reranker-v2-m3) as --reranker, or put the head's weights in "
                         "another *.safetensors file in the same directory")
    return state[head].shape[0]


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return getattr(torch, dtype)


def resolve_encoder_dtype(wanted: str, engine_dtype: str, device: str | torch.device, native_bf16: bool,
                          decoder: bool = False) -> str:
    """The dtype an encoder runs in for EngineConfig.encoder_dtype `wanted`: itself unless "auto"; "auto" is
    bfloat16 for a bidirectional encoder on a CPU whose oneDNN has native bf16 dot products (AVX512_BF16 or AMX;
    kernels.linear.native_bf16) when the engine runs float32, and the engine's dtype otherwise (a decoder embedder,
    CUDA, a CPU that would emulate bf16 and gain nothing). `native_bf16`: Settings.native_bf16 (False:
    TANDEM_NATIVE_BF16=0 resolves as on a CPU without it)."""
    if wanted != "auto":
        return wanted
    if (not decoder and engine_dtype == "float32" and torch.device(device).type == "cpu" and native_bf16
            and kernel_linear.native_bf16()):
        return "bfloat16"
    return engine_dtype


def load_encoder(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                 kernels: str = "auto") -> tuple[SequenceClassifier | ModernBertForSequenceClassification,
                                                 EncoderArgs | ModernBertArgs, dict]:
    """The sequence classifier in eval mode on `device`/`dtype`, its args, and the raw config.json dict; `kernels`:
    the attention backend of a BERT-family model (TANDEM_KERNELS; ModernBERT attends with torch's SDPA)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"cross-encoder path {str(path)!r} is not a Hugging Face model directory "
                                "(no config.json)")
    cfg = json.loads(config_file.read_text())
    if cfg.get("model_type") == "modernbert":
        state = {k: v for k, v in load_state_dict(path).items() if not k.startswith(("decoder.", "head.decoder"))}
        if not any(k.startswith("model.") for k in state):  # a bare ModernBertModel saves its names unprefixed
            state = {f"model.{k}" if k.split(".", 1)[0] in ("embeddings", "layers", "final_norm") else k: v
                     for k, v in state.items()}
        args = ModernBertArgs.from_hf_config(cfg, num_labels=_num_labels(state, "modernbert", path))
        with torch.device("meta"):
            model = ModernBertForSequenceClassification(args)
    else:
        args = EncoderArgs.from_hf_config(cfg, num_labels=1)  # the real label count comes from the head's weights
        state = normalize_state_dict(load_state_dict(path), args.family)
        args = dataclasses.replace(args, num_labels=_num_labels(state, args.family, path))
        with torch.device("meta"):
            model = build_model(args)
        use_kernels(model, kernels)
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches between config.json and the weights
        raise ValueError(f"weights in {str(path)!r} do not fit its config.json: {e}") from e
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"weights in {str(path)!r} do not match a {cfg.get('model_type')} sequence classifier: "
                         f"missing {result.missing_keys[:8]}, unexpected {result.unexpected_keys[:8]}")
    return model.to(device=device, dtype=_torch_dtype(dtype)).eval(), args, cfg


def score_activation(cfg: dict, num_labels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits [B, num_labels] -> one relevance score per pair [B].

    num_labels == 1: the activation sentence-transformers' CrossEncoder applies: the one named in config.json
    (`sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_function`), else sigmoid.
    num_labels == 2: softmax probability of label 1 (sentence-transformers would return both raw logits; a rerank
    score needs one number, and label 1 is "relevant" in two-way classifiers). More labels: rejected.
    """
    if num_labels == 2:
        return lambda logits: torch.softmax(logits.float(), dim=-1)[:, 1]
    if num_labels != 1:
        raise ValueError(f"a cross-encoder with {num_labels} labels gives no single relevance score")
    name = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
    act = _ACTIVATIONS.get(name.rsplit(".", 1)[-1]) if name.startswith("torch.") else None
    if act is None:
        raise ValueError(f"unsupported cross-encoder activation {name!r}; supported: torch.nn "
                         f"{', '.join(_ACTIVATIONS)}")
    return lambda logits: act(logits.float())[:, 0]


class CrossEncoder:
    """A BERT / RoBERTa / XLM-R / ModernBERT cross-encoder: pairs packed into one ragged batch, no padding."""

    def __init__(self, model: SequenceClassifier | ModernBertForSequenceClassification,
                 args: EncoderArgs | ModernBertArgs, tokenizer, activation: Callable,
                 device: torch.device, shared: bool = False) -> None:
        """`shared`: an embedder is this same encoder (engine/builder.py), so the staged forward gives every token's
        final state (what the embedder pools) and the head reads the first tokens' after it, instead of the last
        layer computing the first tokens only."""
        self.model, self.args, self.tokenizer, self.activation, self.device = model, args, tokenizer, activation, device
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # what its forward runs in
        self.num_labels = args.num_labels
        self.max_length = min(int(getattr(tokenizer, "model_max_length", args.max_tokens)), args.max_tokens)
        if shared:
            self._forward_in_stages = StagedForward(classifier_stages(model, args, every_token=True), device)
            self._finish: Finish = lambda x, cu, lens, items: self.activation(
                classify_states(model, x, cu).float()).tolist()
        else:
            self._forward_in_stages = StagedForward(classifier_stages(model, args), device)
            # float32 scores from any dtype's logits (a bf16 sigmoid would round scores to 3 digits, tying them)
            self._finish = lambda logits, cu, lens, items: self.activation(logits.float()).tolist()

    @property
    def stages(self) -> int:
        """Stages a pair's forward is run in: one per encoder layer."""
        return self._forward_in_stages.count

    @property
    def staged(self) -> StagedForward:
        """Its staged forward (an embedder of the same encoder runs its rows in this one too)."""
        return self._forward_in_stages

    def stage_part(self, work: list[StageWork]) -> tuple[list[StageWork], Finish]:
        """Pairs' stages as a part of a forward shared with an embedder's rows (StagedForward.run_parts)."""
        return work, self._finish

    def score_stages(self, work: list[StageWork]) -> list[StageResult]:
        """Per pair, the stages it has this step from the states it brings (pairs with the same stages packed
        together): the score of each pair whose last stage ran as its output, the new states of the others."""
        return self._forward_in_stages.run(work, self._finish)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str = torch.float32, kernels: str = "auto",
                        shared: bool = False) -> "CrossEncoder":
        from transformers import AutoTokenizer

        model, args, cfg = load_encoder(path, device, dtype, kernels)
        activation = score_activation(cfg, args.num_labels)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(model, args, tokenizer, activation, torch.device(device), shared)

    @torch.inference_mode()
    def logits(self, pairs: Sequence[Pair]) -> torch.Tensor:
        """Raw classifier logits [B, num_labels] for tokenized pairs, one packed forward."""
        for i, (ids, types) in enumerate(pairs):
            if not 0 < len(ids) <= self.max_length or len(types) != len(ids):
                raise ValueError(f"pair {i}: {len(ids)} input ids and {len(types)} token type ids; expected "
                                 f"1..{self.max_length} of each")
        if not pairs:
            return torch.empty(0, self.num_labels, device=self.device)
        input_ids, token_type_ids, cu_seqlens = pack_pairs(list(pairs), self.device)
        return self.model(input_ids, token_type_ids, cu_seqlens)

    def score(self, pairs: Sequence[Pair]) -> list[float]:
        """One relevance score per pair (see `score_activation`), in input order."""
        return self.activation(self.logits(pairs).float()).tolist()


def classify_states(model: SequenceClassifier | ModernBertForSequenceClassification, x: torch.Tensor,
                    cu: torch.Tensor) -> torch.Tensor:
    """Logits [B, num_labels] of packed sequences from every token's final state (`classifier_stages(...,
    every_token=True)`' output)."""
    if isinstance(model, ModernBertForSequenceClassification):
        return model.classify(x, cu)
    return _bert_head(model, x[cu[:-1].long()])


def _bert_head(model: SequenceClassifier, first: torch.Tensor) -> torch.Tensor:
    """A BERT-family classifier's logits from its sequences' first-token states [B, hidden]."""
    base = model.bert if hasattr(model, "bert") else model.roberta
    return model.classifier(base.pooler(first) if base.pooler is not None else first)


def classifier_stages(model: SequenceClassifier | ModernBertForSequenceClassification,
                      args: EncoderArgs | ModernBertArgs, every_token: bool = False) -> Stages:
    """A sequence classifier's forward in stages, one per layer, ending in its logits [B, num_labels]; with
    `every_token`, ending in every token's final state [T, hidden] instead (what an embedder of the same encoder
    pools; `classify_states` turns them into the logits)."""
    if isinstance(model, ModernBertForSequenceClassification):
        body = model.model
        return Stages(args.num_layers, lambda ids, types, cu: embed_tokens(body, ids),
                      lambda x, cu, start, stop: run_layers(body, args, x, cu, start, stop),
                      (lambda x, cu: body.final_norm(x)) if every_token
                      else (lambda x, cu: model.classify(body.final_norm(x), cu)))
    base = model.bert if hasattr(model, "bert") else model.roberta
    layers = base.encoder.layer
    # The last layer keeps only each pair's first token (what the head reads), unless every token's state is wanted.
    shortcut = None if every_token else len(layers) - 1

    def begin(ids: torch.Tensor, types: torch.Tensor | None, cu: torch.Tensor) -> torch.Tensor:
        return base.embeddings(ids, torch.zeros_like(ids) if types is None else types, packed_positions(ids, cu, args))

    def run(x: torch.Tensor, cu: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for i in range(start, stop):
            x = layers[i](x, cu, cu[:-1].long() if i == shortcut else None)
        return x
    if every_token:
        return Stages(len(layers), begin, run)
    return Stages(len(layers), begin, run, lambda x, cu: _bert_head(model, x))
