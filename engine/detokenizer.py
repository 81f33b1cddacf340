"""Incremental detokenization that never emits half a UTF-8 character or part of a stop string."""
from __future__ import annotations


class TextStream:
    """Turns a growing list of output token ids into text deltas and finds stop strings."""

    def __init__(self, tokenizer, stop: list[str] | None = None, min_tokens: int = 0,
                 skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.tokenizer = tokenizer
        self.stop = stop or []
        # As vLLM: stop strings are looked for only in text that arrives once more than min_tokens tokens exist.
        self.min_tokens = min_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (possibly cut at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append a token; returns the text that is now safe to emit ('' if none)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            before = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            self._find_stop(before)
        return self._take(final=self.stopped)

    def _find_stop(self, before: int) -> None:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return
        start = max(0, before - self.holdback)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def finish(self) -> str:
        """Flush what was held back (and any undecodable tail) when the sequence ends."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset:])
            before = len(self.text)
            self.text += full[len(prefix):]
            self._read_offset = len(self.token_ids)
            self._find_stop(before)
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
