"""How a (query, document) pair becomes tokens: a fixed prefix and suffix around the document, fitted to a limit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Truncate = Literal["end", "none"]


@dataclass(slots=True)
class PairTokens:
    """One pair ready for the scheduler."""
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # cross-encoder segment ids
    logprob_start: int | None = None  # first position whose token's log-probability the score needs


@dataclass(slots=True)
class PairTemplate:
    """prefix + document + suffix; every pair of one request shares the prefix (so it can hit the prefix cache).
    The last `scored_suffix` tokens of the suffix are the ones scored by log-probability (query likelihood)."""
    prefix: list[int]
    suffix: list[int]
    prefix_types: list[int] | None = None  # cross-encoder segment ids of the prefix; the document and suffix
    document_type: int = 0                 # get document_type / suffix_types
    suffix_types: list[int] | None = None
    scored_suffix: int = 0

    def fit(self, documents: list[list[int]], limit: int, truncate: Truncate) -> list[PairTokens]:
        """Each document between prefix and suffix, cut at its end to fit `limit` tokens ("end") or rejected with a
        ValueError naming it ("none")."""
        fixed = len(self.prefix) + len(self.suffix)
        room = limit - fixed
        if room < 1:
            raise ValueError(f"query is too long: the rendered pair leaves no room for a document "
                             f"({fixed} tokens without it, limit {limit})")
        pairs = []
        for i, doc in enumerate(documents):
            if len(doc) > room:
                if truncate == "none":
                    raise ValueError(f"documents[{i}] with the query is {fixed + len(doc)} tokens, over the limit "
                                     f"of {limit}; shorten it or use truncate='end'")
                doc = doc[:room]
            ids = self.prefix + doc + self.suffix
            types = None
            if self.prefix_types is not None:
                types = self.prefix_types + [self.document_type] * len(doc) + (self.suffix_types or [])
            start = len(ids) - self.scored_suffix if self.scored_suffix else None
            pairs.append(PairTokens(ids, types, start))
        return pairs
