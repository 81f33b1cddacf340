"""engine/models/decoder_args.py ARCHITECTURES: the one table HF configs and GGUF files are checked against."""
from __future__ import annotations

import pytest

from engine.models.decoder_args import ARCHITECTURES, DecoderArgs, Family, architecture


def test_a_config_finds_its_row_by_class_name_else_by_model_type() -> None:
    assert architecture({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).family is Family.QWEN3
    assert architecture({"model_type": "gemma3_text"}).name == "Gemma3ForCausalLM"  # a GGUF file's config
    assert architecture({"model_type": "mistral"}).name == "MistralForCausalLM"
    assert architecture({}).name == "LlamaForCausalLM"  # no model_type: llama, as transformers assumes


def test_an_unknown_architecture_names_every_served_one() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture 'FooForCausalLM' \(model_type 'foo'\); "
                                         r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        DecoderArgs.from_hf_config({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    with pytest.raises(ValueError, match=r"unsupported architecture '\?' \(model_type 'phi3'\)"):
        architecture({"model_type": "phi3"})


def test_every_row_is_one_architecture() -> None:
    for column in ("name", "gguf"):
        values = [getattr(a, column) for a in ARCHITECTURES]
        assert len(values) == len(set(values)), column
    model_types = [t for a in ARCHITECTURES for t in a.model_types]
    assert len(model_types) == len(set(model_types))
