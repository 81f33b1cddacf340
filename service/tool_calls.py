"""Tool calling, door-neutral: what a request's `tools` and `tool_choice` ask of a generation, and the model's output
read back as tool calls (vLLM's convention and names).

* The tools reach the prompt through the chat template's own tool format (transformers'
  `apply_chat_template(..., tools=...)`, on the engine's intake thread).
* `tool_choice` "none": the tools are left out of the prompt (no call can come back); "auto" (the default with
  tools): the model decides, and its output is parsed by the server's parser (`tandem serve
  --enable-auto-tool-choice --tool-call-parser hermes|llama3_json`); "required" and a named function: the output is
  constrained by a JSON schema (the engine's structured output, as vLLM does with guided decoding), so it is a call
  by construction: a list of {name, parameters} (required) or the named function's arguments.
* Parsers: `hermes` (Hermes / Qwen 2.5 / Qwen 3 templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text before the first is the content) and `llama3_json` (Llama 3.1+: the reply is one JSON
  object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated by `;`).
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.config import StructuredOutputsParams


class ToolParser(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class ToolChoice(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's: `--enable-auto-tool-choice` and `--tool-call-parser`."""
    auto: bool = False
    parser: ToolParser | None = None

    def __post_init__(self) -> None:
        if self.auto and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tool use: which tools reach the template, how the output is constrained and read back."""
    tools: list[dict]  # OpenAI tool definitions ({"type": "function", "function": {name, description, parameters}})
    choice: ToolChoice
    name: str | None = None  # the named function (ToolChoice.NAMED)
    parallel: bool = True  # parallel_tool_calls: false allows one call only (required)
    parser: ToolParser | None = None  # reads free output back (auto)

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets: none with tool_choice none (no call can come back)."""
        return None if self.choice is ToolChoice.NONE else self.tools

    @property
    def constrained(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The JSON schema that makes the output a call (required, named); None where the model is free."""
        if self.choice is ToolChoice.NAMED:
            return StructuredOutputsParams(json=_parameters(self._function(self.name)))
        if self.choice is not ToolChoice.REQUIRED:
            return None
        items = [{"type": "object", "properties": {"name": {"enum": [f["name"]]}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in (t["function"] for t in self.tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def _function(self, name: str | None) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.constrained:
            try:
                value = json.loads(text)
            except ValueError:
                return text, []  # cut short (max_tokens): no call to report
            if self.choice is ToolChoice.NAMED:
                return None, [ToolCall(self.name or "", _compact(value))]
            return None, [ToolCall(c["name"], _compact(c.get("parameters", {}))) for c in value]
        if self.choice is ToolChoice.AUTO and self.parser is not None:
            return parse(self.parser, text)
        return text, []


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _compact(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, ensure_ascii=False)


def plan(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None,
         settings: ToolSettings) -> ToolPlan | None:
    """A request's ToolPlan (None: no tools asked for); ValueError naming what is wrong, as vLLM refuses it."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {_said(tool_choice)} needs tools")
        return None
    tools = list(tools)
    if tool_choice == "none":
        return ToolPlan(tools, ToolChoice.NONE)
    if tool_choice is None or tool_choice == "auto":
        return _auto(tools, parallel, settings)
    if tool_choice == "required":
        return ToolPlan(tools, ToolChoice.REQUIRED, parallel=parallel is not False)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}')
        out = ToolPlan(tools, ToolChoice.NAMED, name=name)
        out._function(name)  # named but not given: refused
        return out
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {_said(tool_choice)}')


def _auto(tools: list[dict], parallel: bool | None, settings: ToolSettings) -> ToolPlan:
    if not settings.auto:
        raise ValueError('"auto" tool choice (the default with tools) needs the server started with '
                         "--enable-auto-tool-choice and --tool-call-parser (hermes or llama3_json); or send "
                         'tool_choice "required", "none" or a named function')
    return ToolPlan(tools, ToolChoice.AUTO, parallel=parallel is not False, parser=settings.parser)


def _said(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


# ---- parsers ---------------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


def parse(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of free model output; text that is not a well-formed call stays content."""
    if parser is ToolParser.HERMES:
        return _hermes(text)
    return _llama3_json(text)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = json.loads(body)
            calls.append(ToolCall(call["name"], _compact(call.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []
    content = text[:start].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    try:
        while position < len(body):
            call, end = decoder.raw_decode(body, position)
            calls.append(ToolCall(call["name"], _compact(call.get("parameters", call.get("arguments", {})))))
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
    except (ValueError, KeyError, TypeError):
        return text, []
    return None, calls


def call_starts(parser: ToolParser | None, text: str) -> int | None:
    """Where in streamed text a tool call (may) begin: the index from which text must be held back rather than
    streamed as content (a prefix of the start marker at the end counts); None: all of it is content so far."""
    if parser is None:
        return None
    if parser is ToolParser.LLAMA3_JSON:
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None
        return 0 if stripped.startswith("{") or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]) else None
    found = text.find(HERMES_START)
    if found >= 0:
        return found
    for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-k:]):
            return len(text) - k
    return None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: a call's `arguments` JSON text becomes an object (vLLM does the
    same; Hermes / Qwen templates write `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _object(
                c["function"].get("arguments"))}} for c in calls]}
        out.append(m)
    return out


def _object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


__all__ = ["ToolCall", "ToolChoice", "ToolParser", "ToolPlan", "ToolSettings", "call_starts", "parse", "plan",
           "template_messages"]
