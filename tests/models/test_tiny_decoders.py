"""Tiny random decoders of every family the one decoder definition serves, built from transformers configs here (no
download), saved as Hugging Face directories and loaded through `LLM`: logits equal transformers' within 1e-4.

Each case is chosen so its feature matters: Llama 3 rope scaling with prompts past the original context (both
config spellings, sharded safetensors, an explicit head_dim), linear and yarn scaling, Gemma 2 and Gemma 3 with a
16-token window and prompts longer than it (Gemma 2 with its attention and final soft-caps), Qwen3's q/k norms."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.models.decoder_ops import FusedOps
from engine.models.loader import default_model_dir
from engine.settings import Settings
from kernels import quant
from tests.engine.test_hf_parity import _ragged_logits

VOCAB = 49152  # the embedded SmolLM2 tokenizer's, saved beside each model
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def _config(case: str):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if case.startswith("llama3"):
        return LlamaConfig(**BASE, head_dim=24, rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    if case == "llama-linear":
        return LlamaConfig(**BASE, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    if case == "llama-yarn":
        return LlamaConfig(**BASE, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 32})
    if case == "gemma2":
        return Gemma2Config(**{**BASE, "tie_word_embeddings": True}, head_dim=16, sliding_window=16,
                            query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if case.startswith("gemma3"):
        return Gemma3TextConfig(**{**BASE, "tie_word_embeddings": True, "num_hidden_layers": 4}, head_dim=16,
                                sliding_window=16, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                             "sliding_attention"])
    if case == "qwen3":
        return Qwen3Config(**BASE, head_dim=32)
    if case == "qwen2":  # q/k/v biases
        return Qwen2Config(**BASE)
    raise AssertionError(case)


def _hf_model(case: str, directory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(7)
    config = _config(case)
    config.architectures = [{"llama": "LlamaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                             "gemma3_text": "Gemma3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen2": "Qwen2ForCausalLM"}[config.model_type]]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # random norms and biases too, so (1 + w), the q/k norms and the biases matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory, max_shard_size="2MB" if case == "llama3-sharded" else "1GB")
    AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir)).save_pretrained(directory)
    if case == "llama3-rope_scaling":  # transformers 4's spelling of the same scaling
        cfg = json.loads((directory / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
        (directory / "config.json").write_text(json.dumps(cfg))
    return model


CASES = ["llama3", "llama3-rope_scaling", "llama3-sharded", "llama-linear", "llama-yarn", "gemma2", "gemma3", "qwen3",
         "gemma3-torch-ops"]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str, tmp_path, monkeypatch) -> None:
    if case.endswith("torch-ops"):  # the ops every other backend uses: plain torch ops, the torch attention reference
        monkeypatch.setenv("TANDEM_FUSED_OPS", "0")
        monkeypatch.setenv("TANDEM_KERNELS", "torch")
    hf = _hf_model(case, tmp_path)
    if case == "llama3-sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    llm = LLM(EngineConfig(model=str(tmp_path), num_kv_blocks=64))
    assert isinstance(llm.engine.model.ops, FusedOps) != case.endswith("torch-ops")  # chosen once, at build
    g = torch.Generator().manual_seed(3)
    # 70 and 45 tokens: past the 32-token original context of the scaled ropes and the 16-token windows
    token_lists = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (70, 45, 9)]
    ours = _ragged_logits(llm, token_lists)
    with torch.inference_mode():
        for ids, mine in zip(token_lists, ours):
            ref = hf(torch.tensor([ids])).logits[0]
            assert (mine - ref).abs().max().item() <= 1e-4, case
    # and decoding token by token (the C++ decode kernel, with the window): each sampled token's log-probability
    # equals transformers' at that position of the whole sequence
    ids = token_lists[1]
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    full = ids + out.token_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([full])).logits[0].log_softmax(-1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp[token] - ref[len(ids) - 1 + i, token].item()) <= 1e-4, (case, i)


class _CountingWalker:
    """The model's C++ layer walker, counting the steps it walked."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def forward(self, *args):
        self.calls += 1
        return self.inner.forward(*args)


@pytest.mark.skipif(not quant.available(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("case", ["llama3", "gemma2", "gemma3", "qwen3", "qwen2"])
def test_small_decode_steps_walk_the_layers_in_one_call_with_the_loops_values(case: str, tmp_path,
                                                                               monkeypatch) -> None:
    """Issue #28 item 3: on quantized weights (int8 here: blocks the walker multiplies), a decode step of a few
    sequences runs every layer in one C++ call (kernels/quant.py `decode_layers`). Each family's features (Gemma's
    sandwich norms, GELU, soft-caps and windows, q/k norms, Qwen2's biases) go through it, and every sampled token
    and log-probability is bit-identical to the Python layer loop's (TANDEM_LAYER_WALKER=0)."""
    _hf_model(case, tmp_path)
    config = EngineConfig(model=str(tmp_path), num_kv_blocks=64, quantization="int8")
    walked = LLM(config)
    monkeypatch.setenv("TANDEM_LAYER_WALKER", "0")
    looped = LLM(config)
    assert walked.engine.model.walker is not None and looped.engine.model.walker is None
    counter = walked.engine.model.walker = _CountingWalker(walked.engine.model.walker)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 25, 9)]  # past the 16-token window
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    ours, theirs = walked.generate(prompts, params), looped.generate(prompts, params)
    assert counter.calls >= 11  # every decode step after the prefill
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert [lp[t] for lp, t in zip(a.logprobs, a.token_ids)] == [lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
