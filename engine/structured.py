"""Structured output: a request's JSON schema, regex or choice list compiled once into a token grammar, one matcher
per sequence, and the bitmask the sampler applies (-inf on every token the grammar does not allow next).

The grammar library is llguidance, picked by measurement (bench/structured.py writes bench/results/structured.json:
CPU, the embedded tokenizer, 64 sequences decoding in lockstep). Mask cost per sequence and token, summed over the
three JSON schemas (nested object, array of enums, string with a pattern): outlines-core 50 us, llguidance 413 us,
xgrammar 3069 us (a string with maxLength costs xgrammar milliseconds per sequence and token, its open issue #852).
outlines-core is the cheapest but does not enforce minimum, maximum, exclusiveMinimum or multipleOf (it emits 151
for "maximum": 150, output that does not validate) and takes 16.5 s to compile an 8-property schema, on the engine
thread at submission. llguidance enforces every common keyword, refuses the ones it does not implement with a
message (not, uniqueItems, if/then, contains, oneOf), compiles in about a millisecond and pins with no dependencies.
JSON is generated compact (", " and ": ", no free whitespace, vLLM's `disable_any_whitespace`): a small model given
free whitespace can spend its whole budget on newlines.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from engine.config import StructuredOutputsParams

# Tokens probe() walks a new grammar before it is used: where llguidance's limits stop the grammars it gives up on.
PROBE_TOKENS = 32
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The characters Rust's regex::escape escapes (llguidance parses regexes with Rust's regex-syntax).
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A compiled language; shared by every sequence that asks for the same schema, regex or choice list."""
    kind: str  # "json" | "regex" | "choice" | "grammar"
    key: str  # canonical text of the spec (the cache key with kind)
    grammar: str  # llguidance's grammar text
    template: llguidance.LLMatcher  # a fresh matcher; each sequence gets a copy


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, advanced by each accepted token."""

    def __init__(self, compiled: CompiledGrammar, stop_token_ids: frozenset[int]):
        self.compiled = compiled
        self._matcher = compiled.template.deep_copy()
        self._stops = stop_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 row, bit t of word t // 32 = token t).
        Once the grammar has ended only the stop tokens are allowed; before its output may end they are not, even
        where llguidance's mask lets one through (a choice or literal that is a stop token's text, `<|im_end|>`: the
        mask allows the token, consuming it is refused, and the request would fail mid-generation)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_accepting() or self._matcher.is_error():
            return
        kept = bitmask[row].clone()
        clear_tokens(bitmask, row, self._stops)
        if not bitmask[row].any():  # a dead end (the probe refuses those it meets): leave the mask as it was
            bitmask[row] = kept

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it, or when the matcher has
        failed (llguidance's parser limits: its mask then allows only the stop tokens, which this refuses, so the
        engine fails the request instead of ending it as if complete)."""
        if self._matcher.is_error():
            return False
        if self._matcher.is_stopped():
            return token in self._stops
        return self._matcher.try_consume_tokens([token]) == 1

    def is_terminated(self) -> bool:
        """True once the grammar can take no further token (its output is complete), or a stop token ended it."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; an LRU of the last `cache_size` grammars."""

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: list[int] | set[int] | None = None,
                 cache_size: int = 64):
        # vocab_size is the model's: ids past the tokenizer's (padding of the embedding) are never allowed.
        self.vocab_size = vocab_size
        stops = sorted(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
        self.stop_token_ids = frozenset(stops)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for params (cached); ValueError naming the problem for a bad schema, regex or choice list, or
        one the grammar library gives up on (probe()), named as the client sent it (params.source)."""
        kind, key = canonical(params)
        with self._lock:
            hit = self._cache.get((kind, key))
            if hit is not None:
                self._cache.move_to_end((kind, key))
                return hit
        compiled = self._build(kind, key, params.source or f"structured_outputs.{kind}")
        with self._lock:
            self._cache[(kind, key)] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(compiled, self.stop_token_ids)

    def _build(self, kind: str, key: str, where: str) -> CompiledGrammar:
        L = llguidance.LLMatcher
        if kind == "json":
            grammar = L.grammar_from_json_schema(key, overrides=JSON_OPTIONS)
        elif kind == "grammar":
            grammar = L.grammar_from_lark(key)
        else:
            grammar = L.grammar_from_regex(key if kind == "regex" else choice_regex(json.loads(key)))
        template = L(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            what = {"json": "not a usable JSON schema", "regex": "not a usable regular expression",
                    "choice": "not usable", "grammar": "not a usable grammar"}[kind]
            raise ValueError(f"{where} is {what}: {_library_message(template.get_error())}")
        compiled = CompiledGrammar(kind, key, grammar, template)
        self._probe(compiled, where)
        return compiled

    def _probe(self, compiled: CompiledGrammar, where: str) -> None:
        """Walk a copy of the grammar PROBE_TOKENS tokens (the highest-numbered token it allows each time, never a
        stop token) so that what llguidance builds lazily is built now, under its own limits (ParserLimits: lexer
        fuel, Earley items, lexer states), and a grammar it gives up on is refused at submission instead of failing
        its request a few tokens in: a recursive `$ref` every value must take (`{"a": {"$ref": "#"}}` required:
        an infinite forced prefix), a pattern or regex of large nested repetitions (`(x{1000}){1000}`). A JSON
        grammar whose only output is the empty text is refused too (it would end every sequence at once; the
        library refuses the plainly unsatisfiable ones itself). Costs a few milliseconds for a usable grammar."""
        matcher = compiled.template.deep_copy()
        bitmask = allocate_bitmask(1, self.vocab_size)
        for step in range(PROBE_TOKENS):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error():
                break
            clear_tokens(bitmask, 0, self.stop_token_ids)
            words = bitmask[0].nonzero()
            if words.numel() == 0:  # only a stop token may come: the output is complete
                if step == 0 and compiled.kind == "json":
                    raise ValueError(f"{where} admits no JSON value")
                if not matcher.is_accepting():
                    raise ValueError(f"{where} cannot be served: no token can continue it (text the tokenizer "
                                     "keeps for a special token, such as `<|im_end|>`, cannot be generated)")
                return
            w = int(words[-1])
            word = int(bitmask[0, w]) & 0xFFFFFFFF
            if not matcher.consume_token(32 * w + word.bit_length() - 1):
                break
        if matcher.is_error():
            raise ValueError(f"{where} cannot be served: the grammar library gives up on it "
                             f"({matcher.get_error().strip().splitlines()[0]}); a recursive $ref that every value must "
                             "take, or a pattern or regex of large nested repetitions, is the usual cause")


def grammar_problem(grammar: str) -> str | None:
    """Why a Lark grammar (llguidance's) cannot be used, on one line (None: it can); checked without a tokenizer, so
    a caller can name the part of its request at fault before submitting it."""
    L = llguidance.LLMatcher
    try:
        error = L.validate_grammar(L.grammar_from_lark(grammar))
    except ValueError as exc:
        error = str(exc)
    if not error:
        return None
    first = error.strip().splitlines()[0]
    return re.sub(r"^at \d+\(\d+\): ", "", first).strip()


def clear_tokens(bitmask: torch.Tensor, row: int, tokens: frozenset[int]) -> None:
    """Disallow `tokens` in bitmask[row]."""
    for t in tokens:
        bitmask[row, t // 32] &= ~_bit(t % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int of the same bits (bit 31 is negative)."""
    return -(1 << 31) if j == 31 else 1 << j


def canonical(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, key): the spec as one text, the same for a schema dict and its JSON text. Key order is kept: the
    grammar emits properties in the schema's order, so two orders are two grammars."""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice), ensure_ascii=False)
    if params.grammar is not None:
        return "grammar", params.grammar
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{params.source or 'structured_outputs.json'} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{params.source or 'structured_outputs.json'} must be a JSON schema object, got a JSON "
                         f"{type(schema).__name__}")
    return "json", json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def choice_regex(choices: list[str]) -> str:
    """An alternation of the choices, each matched literally."""
    return "(" + "|".join(_REGEX_META.sub(r"\\\1", c) for c in choices) + ")"


def _library_message(error: str) -> str:
    """llguidance's message on one line: the regex parser's own `error:` line where it has one."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    lines[0] = re.sub(r"^at \d+\(\d+\): ", "", lines[0])  # a position in llguidance's own wrapper grammar
    detail = next((ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")), None)
    if detail is None:
        return " ".join(lines)
    return f"{lines[0].rstrip(':')}: {detail}"


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(V/32)] CPU bitmask with every token allowed (a row no matcher fills masks nothing)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# Byte value -> an upper limit per bit, lowest bit first: +inf where the bit is 1 (allowed), -inf where it is 0.
# Token 8*b + j of a little-endian int32 word is bit j of its byte b. min(logit, limit) masks in one pass, several
# times faster than building a boolean mask and masked_fill.
_LIMIT_BY_BYTE = torch.where((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1,
                             float("inf"), float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[r, t] to -inf where bit t of bitmask row r is 0, in place, and on the columns past the bitmask's
    ceil(V/32)*32 tokens. Rows whose bitmask allows everything (no grammar) are not touched. bitmask may be on the
    CPU when logits are not."""
    rows, width = logits.shape
    covered = min(width, bitmask.shape[1] * 32)
    masked = (bitmask[:rows] != -1).any(1).nonzero().flatten()
    if masked.numel() == 0:
        return
    part = bitmask[masked].to(logits.device, non_blocking=True)
    if masked.numel() == rows:  # no gather/scatter when every row has a grammar
        logits[:, covered:] = float("-inf")
        apply_bitmask_torch(logits[:, :covered], part)
        return
    idx = masked.to(logits.device)
    sub = logits[idx]
    sub[:, covered:] = float("-inf")
    apply_bitmask_torch(sub[:, :covered], part)
    logits[idx] = sub


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The unpack on any device: bitmask on logits' device, covering at least logits' columns."""
    rows, width = logits.shape
    table = _LIMIT_BY_BYTE.to(device=logits.device, dtype=logits.dtype)
    limit = table.index_select(0, bitmask.contiguous().view(torch.uint8).flatten().int()).view(rows, -1)
    torch.minimum(logits, limit[:, :width], out=logits)
