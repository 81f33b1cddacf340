"""What the engine tests of the GPU suite share: engine options, prompts, greedy parameters."""
from __future__ import annotations

from engine import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)

# A small step budget: the 247-token prompt prefills in chunks (after 1, 123 and 245 tokens: inside blocks) in
# steps that also carry the other prompts' decodes; then the steps are decode-only (the CUDA-graph path).
# 128 tokens still hold one rerank pair (judge prompt ~80 tokens + the document).
ENGINE_OPTIONS = dict(max_num_batched_tokens=128)

RERANK_QUERY = "How do bees make honey?"
RERANK_DOCS = [
    "Bees collect nectar from flowers and store it in their honey stomach.",
    "The stock market fell three percent on Tuesday.",
    "Worker bees fan their wings to evaporate water from nectar, turning it into honey.",
    "A recipe for tomato soup with basil.",
]


def build_prompts(tokenizer) -> list[str]:
    """Eight prompts from 2 to ~250 tokens, plain text, code and chat-formatted."""
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
            for text in ("Explain prime numbers to a child in two sentences.",
                         "List three facts about the Roman empire.")]
    return [
        "Hi",
        "The capital of France is",
        "Once upon a time,",
        "Write a short paragraph about volcanoes. " + "Be vivid and specific. " * 6,
        *chat,
        "Summarize the following notes.\n"
        + "The lighthouse keeper climbed the ninety-one stairs every evening, counting each step twice. " * 14,
        "def fibonacci(n):\n",
    ]


def cuda_llm(**overrides) -> LLM:
    """An engine on the first CUDA device with ENGINE_OPTIONS and `overrides` (dtype, enforce_eager, ...)."""
    return LLM(EngineConfig(device="cuda", **{**ENGINE_OPTIONS, **overrides}))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

