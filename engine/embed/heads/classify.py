"""Sequence classification (PoolingTask.CLASSIFY; EngineConfig.classifier, `tandem serve --classifier`): a sequence
classifier (BERT / RoBERTa / XLM-R / ModernBERT, engine/models/encoder_loader.py, the cross-encoder's loader) ending
in its logits [B, num_labels]; its labels are config.json's id2label, sigmoid for problem_type
multi_label_classification, else softmax (as transformers' and TEI's pipelines).
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EmbedParams, PoolingTask
from engine.embed.heads import Encoder, Head, PoolingKind
from engine.models.encoder_loader import classifier_stages, load_encoder
from engine.settings import Settings


def load_classifier(path: Path, cfg: dict, device: torch.device, dtype: torch.dtype, settings: Settings) -> Head:
    model, args, cfg = load_encoder(path, device, dtype, settings.kernels)
    id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(args.num_labels))
    return Head(classifier_stages(model, args), args.num_labels, args.max_tokens, labels,
                cfg.get("problem_type") == "multi_label_classification")


def _probabilities(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list[float]:
    """A classifier's logits as its labels' probabilities (softmax; sigmoid per label for a multi-label model), or
    the logits with raw_scores."""
    if params.raw_scores:
        return vector.tolist()
    return (torch.sigmoid(vector) if encoder.multi_label else torch.softmax(vector, dim=-1)).tolist()


KIND = PoolingKind(PoolingTask.CLASSIFY, "classifier", "--classifier", "classifier", _probabilities, load_classifier,
                   labels=True)
