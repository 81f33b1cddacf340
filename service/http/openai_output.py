"""The core API's generation events to OpenAI response bodies and stream chunks (chat and completions).

One `Completion` per HTTP request accumulates or streams its choices: with several prompts (completions) or
n > 1, choice index = prompt index * n + completion index, as OpenAI numbers them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from engine.outputs import Logprobs
from engine.request import FinishReason
from service.core import GenerateEvent
from service.tokens import TokenTexts
from service.tool_calls import CallDelta, CallReader, ToolPlan

# OpenAI's finish_reason for the engine's (an abort keeps tandem's own word: OpenAI has none for it).
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    calls: CallReader | None = None  # with tools: the reply read as content and tool calls as it streams
    logprobs: list = field(default_factory=list)  # chat: content entries; completions: (token, logprob, top)
    finish_reason: str | None = None
    started: bool = False
    offset: int = 0  # completions' text_offset of the next token


@dataclass(slots=True)
class Completion:
    chat: bool
    model: str
    n: int
    tokens: TokenTexts
    top_logprobs: int | None  # None: no logprobs asked for
    include_usage: bool = False
    tools: ToolPlan | None = None  # the request's tool use: its output is read back as tool calls
    id: str = ""  # the request's one id (the core's, GenerationStream.ids): the response's is chatcmpl-<id>
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0})

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    # ---- one message in --------------------------------------------------------------------------

    def add(self, event: GenerateEvent) -> tuple[int, str, list, str | None]:
        """Record one output; returns (choice index, text, logprobs of its tokens, finish reason)."""
        out = event.output
        index = event.index * self.n + out.index
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(calls=self.tools.reader() if self.tools is not None else None)
        finish = _FINISH.get(out.finish_reason)
        if finish is not None:
            choice.finish_reason = finish
        logprobs = self._logprobs(choice, out.new_token_ids, out.logprobs) if self.top_logprobs is not None else []
        choice.text.append(out.text)
        choice.logprobs += logprobs
        if event.usage is not None:
            u = event.usage
            self.usage["prompt_tokens"] += u.prompt_tokens
            self.usage["completion_tokens"] += u.completion_tokens
            self.usage["cached_tokens"] += u.cached_tokens
        return index, out.text, logprobs, finish

    def _logprobs(self, choice: _Choice, token_ids: list[int], entries: list[Logprobs] | None) -> list:
        out = []
        k = self.top_logprobs or 0
        for token, lp in zip(token_ids, entries or ()):
            # the chosen token first, then the others most likely first (as the gRPC door orders them)
            ordered = ([(token, lp[token])] if token in lp else []) + \
                sorted(((t, v) for t, v in lp.items() if t != token), key=lambda e: -e[1])
            chosen = ordered[0][1] if ordered else 0.0
            top = sorted(ordered, key=lambda e: -e[1])[:k]
            if self.chat:
                out.append({"token": self.tokens.text(token), "logprob": chosen, "bytes": self.tokens.bytes(token),
                            "top_logprobs": [{"token": self.tokens.text(t), "logprob": v,
                                              "bytes": self.tokens.bytes(t)} for t, v in top]})
            else:
                text = self.tokens.text(token)
                out.append((text, chosen, {self.tokens.text(t): v for t, v in top}, choice.offset))
                choice.offset += len(text)
        return out

    # ---- non-streaming ---------------------------------------------------------------------------

    def response(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            logprobs = self._choice_logprobs(c.logprobs) if self.top_logprobs is not None else None
            if self.chat:
                message: dict = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if c.calls is not None and finish in ("stop", "length"):
                    content, calls = c.calls.read(text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": [
                            {"id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]}
                        finish = _with_calls(finish)
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        return {"id": self.response_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage()}

    def _choice_logprobs(self, items: list) -> dict:
        if self.chat:
            return {"content": items}
        return {"tokens": [t for t, _, _, _ in items], "token_logprobs": [lp for _, lp, _, _ in items],
                "top_logprobs": [top for _, _, top, _ in items], "text_offset": [o for _, _, _, o in items]}

    def _usage(self) -> dict:
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    # ---- streaming -------------------------------------------------------------------------------

    def chunk(self, event: GenerateEvent) -> bytes:
        """The server-sent event for one output; b"" where a reply read for tool calls has nothing to send yet (its
        text held back as a call's possible start: no empty content deltas)."""
        index, text, logprobs, finish = self.add(event)
        choice = self.choices[index]
        lp = self._choice_logprobs(logprobs) if self.top_logprobs is not None else None
        if self.chat:
            deltas: list[CallDelta] = []
            if choice.calls is not None:  # a call's text goes out as tool_calls deltas, the rest as content
                text, deltas = choice.calls.feed("".join(choice.text), final=finish is not None)
                if finish is not None and choice.calls.made_calls:
                    finish = _with_calls(finish)
                if choice.started and not text and not deltas and finish is None and not logprobs:
                    return b""
            delta: dict = {"content": text if text or not deltas else None}
            if not choice.started:
                delta = {"role": "assistant", **delta}
                choice.started = True
            if deltas:
                delta["tool_calls"] = [_call_delta(d) for d in deltas]
            body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            body = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        chunk = {"id": self.response_id, "object": self.object + (".chunk" if self.chat else ""),
                 "created": self.created, "model": self.model, "choices": [body]}
        if self.include_usage:
            chunk["usage"] = None
        return _event(chunk)

    def closing(self) -> bytes:
        """The usage chunk (stream_options.include_usage) and [DONE]."""
        out = b""
        if self.include_usage:
            out += _event({"id": self.response_id, "object": self.object + (".chunk" if self.chat else ""),
                           "created": self.created, "model": self.model, "choices": [], "usage": self._usage()})
        return out + b"data: [DONE]\n\n"


def _with_calls(finish: str) -> str:
    """A reply that made calls ends with "tool_calls", unless it was cut short (max_tokens: "length")."""
    return "tool_calls" if finish == "stop" else finish


def _call_delta(d: CallDelta) -> dict:
    """OpenAI's streamed tool call: index, id, type and name in the first delta of a call, argument text after."""
    function: dict = {"arguments": d.arguments}
    out: dict = {"index": d.index, "function": function}
    if d.id is not None:
        out["id"], out["type"] = d.id, "function"
        function["name"] = d.name
    return out


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
