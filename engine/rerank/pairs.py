"""How a (query, document) pair becomes tokens: a fixed prefix and suffix around the document, fitted to a limit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.errors import InputTooLong

Truncate = Literal["end", "none"]
# Where the document goes in a chat-rendered pair (likelihood and judge): `split_chat` cuts the rendering there.
DOC_SLOT = "\x00DOCUMENT\x00"


@dataclass(slots=True)
class PairTokens:
    """One pair ready for the scheduler."""
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # cross-encoder segment ids
    logprob_start: int | None = None  # first position whose token's log-probability the score needs
    document_tokens: int = 0  # of the document's tokens, those its pairs cover (all of them unless truncated)
    truncated: bool = False  # the document was cut at its end to fit the limit (past its last window)
    document: int = 0  # the document this pair scores (one of its windows)
    windows: int = 1  # the document's windows (pairs): its score is the best of theirs


def split_windows(doc: list[int], room: int, overlap: int, max_windows: int) -> tuple[list[list[int]], bool]:
    """A document's tokens as windows of at most `room` tokens, each starting `room - overlap` after the previous
    (overlap at most half a window), at most `max_windows` of them; and whether tokens were left past the last."""
    if len(doc) <= room:
        return [doc], False
    stride = room - min(overlap, room // 2)
    windows: list[list[int]] = []
    start = 0
    while len(windows) < max_windows:
        windows.append(doc[start:start + room])
        if start + room >= len(doc):
            return windows, False
        start += stride
    return windows, True


def covered(windows: list[list[int]], room: int, overlap: int) -> int:
    """How many of a document's tokens its windows (split_windows') cover."""
    stride = room - min(overlap, room // 2)
    return (len(windows) - 1) * stride + len(windows[-1])


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

    def fit(self, documents: list[list[int]], limit: int, truncate: Truncate, limit_by: str = "", max_windows: int = 1,
            overlap: int = 0) -> list[PairTokens]:
        """Each document between prefix and suffix: as up to `max_windows` overlapping windows (split_windows) that
        fit `limit` tokens each, the rest cut at its end ("end") or the request rejected with a ValueError naming it,
        the limit and `limit_by`, what sets the limit ("none"). Pairs in document order, its windows in order."""
        fixed = len(self.prefix) + len(self.suffix)
        room = limit - fixed
        by = f" ({limit_by})" if limit_by else ""
        if room < 1:
            raise ValueError(f"query is too long: the rendered pair leaves no room for a document "
                             f"({fixed} tokens without it, rerank pair limit {limit}{by})")
        pairs = []
        for i, whole in enumerate(documents):
            windows, truncated = split_windows(whole, room, overlap, max_windows)
            if truncated and truncate == "none":
                more = (f" (it needs more than max_windows={max_windows} windows of that size)" if max_windows > 1 else
                        " (or send max_windows > 1 to score it in overlapping windows)")
                raise InputTooLong(f"documents[{i}] with the query is {fixed + len(whole)} tokens, over the "
                                   f"rerank pair limit of {limit}{by}: a document may have {room} tokens with "
                                   f"this query; shorten it{more}")
            seen = covered(windows, room, overlap)
            for doc in windows:
                ids = self.prefix + doc + self.suffix
                types = None
                if self.prefix_types is not None:
                    types = self.prefix_types + [self.document_type] * len(doc) + (self.suffix_types or [])
                start = len(ids) - self.scored_suffix if self.scored_suffix else None
                pairs.append(PairTokens(ids, types, start, document_tokens=seen, truncated=truncated, document=i,
                                        windows=len(windows)))
        return pairs


def split_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[list[int], list[int]]:
    """Token ids of the chat-rendered messages before and after DOC_SLOT (which one message content holds); without
    a chat template, the contents as plain paragraphs."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    else:  # a base model without a chat template (Gemma 3 270M's GGUF): the turns as plain paragraphs
        text = "\n\n".join(m["content"] for m in messages) + ("\n\n" if add_generation_prompt else "")
    before, after = text.split(DOC_SLOT)
    return list(tokenizer(before).input_ids), list(tokenizer(after, add_special_tokens=False).input_ids)
