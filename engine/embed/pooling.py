"""How token states become one vector: the sentence-transformers pooling a model directory declares."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch


class Pooling(str, enum.Enum):
    """A sentence-transformers pooling mode tandem computes; a str, so it reads as "mean" / "cls" / "lasttoken"."""
    CLS = "cls"
    MEAN = "mean"
    LAST_TOKEN = "lasttoken"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


# 1_Pooling/config.json's flags, by the mode each turns on.
_FLAGS = {"pooling_mode_cls_token": Pooling.CLS, "pooling_mode_mean_tokens": Pooling.MEAN,
          "pooling_mode_lasttoken": Pooling.LAST_TOKEN}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class SentenceConfig:
    """What a sentence-transformers directory says about the vectors it makes (modules.json and the modules'
    configs); a directory without modules.json gets `default` pooling, no normalisation and no length of its own."""
    pooling: Pooling
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # sentence_bert_config.json's cap on an input's tokens (specials included)

    @classmethod
    def read(cls, directory: Path, default: Pooling) -> "SentenceConfig":
        modules_file = directory / "modules.json"
        max_len = _max_seq_length(directory)
        if not modules_file.is_file():
            return cls(default, False, max_len)
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling = default
        if "Pooling" in kinds:
            pooling = _pooling_of(json.loads((directory / kinds["Pooling"] / "config.json").read_text()))
        unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
        if unknown:
            raise ValueError(f"{str(directory)!r}: sentence-transformers modules {sorted(unknown)} are not supported "
                             "(tandem runs Transformer, Pooling and Normalize)")
        return cls(pooling, "Normalize" in kinds, max_len)


def _pooling_of(cfg: dict) -> Pooling:
    if isinstance(cfg.get("pooling_mode"), str):  # the newer single-key form
        try:
            return Pooling(cfg["pooling_mode"])
        except ValueError:
            raise ValueError(f"pooling mode {cfg['pooling_mode']!r} is not supported; supported: "
                             f"{', '.join(p.value for p in Pooling)}") from None
    on = [mode for flag, mode in _FLAGS.items() if cfg.get(flag)]
    off = [flag for flag in _UNSUPPORTED if cfg.get(flag)]
    if off or len(on) != 1:
        raise ValueError(f"pooling config {cfg} is not supported: exactly one of cls, mean or lasttoken pooling")
    return on[0]


def _max_seq_length(directory: Path) -> int | None:
    f = directory / "sentence_bert_config.json"
    return json.loads(f.read_text()).get("max_seq_length") if f.is_file() else None


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Token states [T, H] of a packed batch (rows bounded by cu_seqlens [B + 1]) -> one vector per row [B, H],
    in float32."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if pooling is Pooling.CLS:
        return hidden[starts].float()
    if pooling is Pooling.LAST_TOKEN:
        return hidden[ends - 1].float()
    lens = ends - starts
    row = torch.repeat_interleave(torch.arange(lens.shape[0], device=hidden.device), lens)
    sums = torch.zeros(lens.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, row, hidden.float())
    return sums / lens[:, None].float()
