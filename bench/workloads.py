"""Deterministic workloads shared by the benchmarks."""
from __future__ import annotations

import random
from dataclasses import dataclass

_TOPICS = ["the ocean", "a lighthouse", "prime numbers", "bread", "the Roman empire", "a robot painter",
           "volcanoes", "chess", "bees", "the moon landing", "jazz", "glaciers", "origami", "trains"]
_FILLER = ("Please be specific, give examples, and explain your reasoning step by step so that a curious "
           "student could follow along. ")


@dataclass(slots=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def synthetic_chat(tokenizer, n: int, output_tokens: int, seed: int = 0) -> list[GenerationRequest]:
    """n chat-formatted prompts of 20 to ~300 tokens, each asking for `output_tokens` tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"Tell me about {rng.choice(_TOPICS)}. " + _FILLER * rng.randint(0, 12)
        out.append(GenerationRequest(chat_prompt_ids(tokenizer, text), output_tokens))
    return out


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """One user turn rendered with the model's chat template, as token ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def alpaca_eval_chat(tokenizer, n: int, max_output_tokens: int, seed: int = 0) -> list[GenerationRequest]:
    """n AlpacaEval instructions (sampled without replacement, then cycled), each asking for as many tokens as its
    GPT-4 reference answer has, capped at `max_output_tokens`."""
    from bench.datasets import alpaca_eval

    rows = alpaca_eval()
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    out = []
    for i in range(n):
        row = rows[order[i % len(order)]]
        answer_tokens = len(tokenizer(row["output"], add_special_tokens=False)["input_ids"])
        out.append(GenerationRequest(chat_prompt_ids(tokenizer, row["instruction"]),
                                     max(1, min(answer_tokens, max_output_tokens))))
    return out
