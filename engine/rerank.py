"""LLM-as-reranker: each (query, document) pair becomes a yes/no relevance question (Qwen3-Reranker recipe)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import RerankParams
from engine.request import Sequence

JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_DOC_SLOT = "\x00DOCUMENT\x00"


@dataclass(slots=True, eq=False)
class RerankJob:
    """One Rerank request: a query, its documents, one prefill-only pair sequence per document."""
    request_id: str
    query: str
    documents: list[str]
    params: RerankParams
    arrival_time: float
    pairs: list[Sequence] = field(default_factory=list)
    scores: list[float | None] = field(default_factory=list)
    remaining: int = 0
    first_pair_done: bool = False  # later pairs wait for it, so they find the shared prefix cached

    @property
    def prompt_tokens(self) -> int:
        return sum(p.num_prompt_tokens for p in self.pairs)

    @property
    def cached_tokens(self) -> int:
        return sum(p.num_cached_tokens for p in self.pairs)


class JudgePrompt:
    """Renders pairs with the model's chat template; the prefix up to the document is tokenized once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.yes_id = self._single_token("yes")
        self.no_id = self._single_token("no")

    def _single_token(self, word: str) -> int:
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer splits {word!r} into {len(ids)} tokens; LLM reranking needs one")
        return ids[0]

    def split(self, query: str, instruction: str | None) -> tuple[list[int], list[int]]:
        """Token ids before and after the document for this query (identical for all its documents)."""
        user = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {_DOC_SLOT}"
        messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(_DOC_SLOT)
        prefix = self.tokenizer(before).input_ids
        suffix = self.tokenizer(after, add_special_tokens=False).input_ids
        return list(prefix), list(suffix)

    def document_ids(self, document: str) -> list[int]:
        return list(self.tokenizer(document, add_special_tokens=False).input_ids)
