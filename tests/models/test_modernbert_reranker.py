"""ModernBERT sequence classifiers (the gte-reranker-modernbert-base architecture), tiny and random, built from a
transformers config here: logits through the cross-encoder rerank path within 1e-4 of transformers, for CLS and
mean pooling, with documents longer than the local attention window so local and global layers both matter."""
from __future__ import annotations

import pytest
import torch

from tests.models_built import copy_minilm_tokenizer
from engine import RerankParams
from engine.models.encoder_loader import CrossEncoder
from engine.rerank.cross_encoder import CrossEncoderScorer

QUERY = "how do lighthouses warn ships"
DOCS = ["A lighthouse keeper trims the wick and winds the clockwork that turns the lens every night of the year.",
        "Fog horns sound when the light cannot be seen.", "Bananas.",
        "Ships read the light's pattern of flashes on their charts to know which lighthouse they are passing by."]


def _build(tmp_path, pooling: str):
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    torch.manual_seed(5)
    config = ModernBertConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
                              max_position_embeddings=512, num_labels=1, classifier_pooling=pooling,
                              pad_token_id=0, cls_token_id=101, sep_token_id=102, bos_token_id=101,
                              eos_token_id=102)
    config.architectures = ["ModernBertForSequenceClassification"]
    model = ModernBertForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.3)  # far from init's near-constant output
    model.save_pretrained(tmp_path)
    copy_minilm_tokenizer(tmp_path)
    return model


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_logits_match_transformers(tmp_path, pooling: str) -> None:
    hf = _build(tmp_path, pooling)
    ce = CrossEncoder.from_pretrained(tmp_path)
    pairs, _ = CrossEncoderScorer(ce).pairs(QUERY, DOCS, RerankParams(), ce.max_length)
    token_pairs = [(p.token_ids, p.token_type_ids) for p in pairs]
    assert max(len(ids) for ids, _ in token_pairs) > 2 * 8  # longer than the local window
    ours = ce.logits(token_pairs)
    with torch.inference_mode():
        ref = torch.cat([hf(input_ids=torch.tensor([ids])).logits for ids, _ in token_pairs])
    assert ours.shape == ref.shape == (len(DOCS), 1)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ref.std().item() > 1e-3  # the pairs score differently


def test_a_bare_modernbert_encoder_says_what_to_do(tmp_path) -> None:
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, pad_token_id=0, bos_token_id=101, eos_token_id=102)
    ModernBertModel(config).save_pretrained(tmp_path)
    copy_minilm_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is a bare modernbert encoder .* pass a cross-encoder"):
        CrossEncoder.from_pretrained(tmp_path)
