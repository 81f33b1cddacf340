"""Tool calling, door-neutral: what a request's `tools` and `tool_choice` ask of a generation, and its output read
back as tool calls, whole or streamed (vLLM's conventions and names; the formats are service/tool_formats.py).

* The tools reach the prompt through the chat template's own tool format (transformers'
  `apply_chat_template(..., tools=...)`, on the engine's intake thread). The shipped templates chatml, llama3 and
  mistral render tools in their family's format; a template that renders none gets a 400 naming them.
* The server knows one format (`--tool-call-parser hermes|llama3_json|mistral`, else read from the chat template's
  markers, else from the model's family): the one its template writes calls in.
* `tool_choice` "none": the tools are left out of the prompt (no call can come back). "auto" (the default with
  tools): the model decides; its reply is parsed. "required" and a named function: the output is constrained by the
  engine's structured output to the grammar of exactly one call in the model's own format, to one of the tools (the
  named one) with arguments valid against its parameters schema (objects closed: no undeclared keys), so the call
  is complete and parses whatever the sampling.
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.config import StructuredOutputsParams
from service.tool_formats import TEMPLATE_OF, CallText, ToolParser, call_grammar, detect, names, renders_tools, scan


class ToolChoice(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's flags: `--tool-call-parser` (None: read from the template) and `--enable-auto-tool-choice`
    (accepted for vLLM's command lines; "auto" works wherever the format is known)."""
    auto: bool = False
    parser: ToolParser | None = None


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """What the served model can do with tools: resolved once at start-up from the settings, its chat template and
    family (support())."""
    parser: ToolParser | None = None  # the format its replies' calls are in; None: unknown
    renders: bool = False  # its chat template renders `tools`
    marker_token: int | None = None  # Mistral's [TOOL_CALLS] as one token of the vocabulary

    def problem(self) -> str | None:
        """Why a request with tools cannot be served (None: it can), naming what to start the server with."""
        shipped = ", ".join(f"{TEMPLATE_OF[p]} ({p})" for p in ToolParser)
        if not self.renders:
            return ("tools: this model's chat template renders no tools; start the server with a template that "
                    f"does: --chat-template NAME, shipped with their tool formats: {shipped}, or a Jinja file "
                    f"with --tool-call-parser ({', '.join(names())}); or send tool_choice \"none\"")
        if self.parser is None:
            return ("tools: the tool-call format of this model's chat template is not known: start the server with "
                    f"--tool-call-parser {' | '.join(names())}")
        return None


def support(settings: ToolSettings, template: str | None, model_type: str | None, tokenizer: Any = None) -> ToolSupport:
    """The served model's ToolSupport; ValueError where --enable-auto-tool-choice cannot be honoured."""
    parser = settings.parser or detect(template, model_type)
    if settings.auto and parser is None:
        raise ValueError("--enable-auto-tool-choice: the tool-call format of this model's chat template is not known: "
                         f"name it with --tool-call-parser {' | '.join(names())}")
    marker = None
    if parser is ToolParser.MISTRAL and tokenizer is not None:
        token = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
        if isinstance(token, int) and token != tokenizer.unk_token_id:
            marker = token
    return ToolSupport(parser, renders_tools(template), marker)


def describe_tools(served: ToolSupport) -> str:
    """The start-up line: which tool-call format requests with tools get, or why they get a 400."""
    if served.problem() is None:
        return f"tool calls: {served.parser} format (tool_choice auto, required and named; docs/http.md#tool-calling)"
    if not served.renders:
        return ("tool calls: off, the chat template renders no tools (--chat-template chatml, llama3 or mistral "
                "does)")
    return "tool calls: off, the template's tool-call format is not known (--tool-call-parser)"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it (cut short where the reply was)
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tool use: which tools reach the template, how the output is constrained and read back."""
    tools: list[dict]  # OpenAI tool definitions ({"type": "function", "function": {name, description, parameters}})
    choice: ToolChoice
    name: str | None = None  # the named function (ToolChoice.NAMED)
    parser: ToolParser | None = None  # the format the reply's calls are in (None with "none")
    marker_token: int | None = None

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets: none with tool_choice none (no call can come back)."""
        return None if self.choice is ToolChoice.NONE else self.tools

    @property
    def constrained(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar of one call (required: to any of the tools; named: to that one); None where the model is
        free."""
        if not self.constrained or self.parser is None:
            return None
        functions = [self._function(self.name)] if self.choice is ToolChoice.NAMED else \
            [t["function"] for t in self.tools]
        if len(functions) == 1:  # what a refusal names: the schema as the client sent it
            index = next(i for i, t in enumerate(self.tools) if t["function"] is functions[0])
            source = f"tools[{index}].function.parameters"
        else:
            source = "tools[*].function.parameters"
        return StructuredOutputsParams(grammar=call_grammar(self.parser, functions, self.marker_token),
                                       source=source)

    def _function(self, name: str | None) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")

    def reader(self) -> "CallReader | None":
        """A reader of one choice's reply (None: the reply is all content)."""
        if self.parser is None or self.choice is ToolChoice.NONE:
            return None
        if not self.constrained:
            return CallReader(self.parser)
        names = (self.name,) if self.choice is ToolChoice.NAMED else tuple(t["function"]["name"] for t in self.tools)
        return CallReader(self.parser, names)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply."""
        reader = self.reader()
        if reader is None:
            return text, []
        return reader.read(text)


def plan(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None,
         served: ToolSupport) -> ToolPlan | None:
    """A request's ToolPlan (None: no tools asked for); ValueError naming what is wrong. `parallel`
    (parallel_tool_calls) changes nothing: "auto" reads every call the model makes, a constrained choice makes one."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {_said(tool_choice)} needs tools")
        return None
    tools = list(tools)
    _check_names(tools)
    if tool_choice == "none":
        return ToolPlan(tools, ToolChoice.NONE)
    if tool_choice is None or tool_choice == "auto":
        choice, name = ToolChoice.AUTO, None
    elif tool_choice == "required":
        choice, name = ToolChoice.REQUIRED, None
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}')
        choice = ToolChoice.NAMED
    else:
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got '
                         f"{_said(tool_choice)}")
    problem = served.problem()
    if problem is not None:
        raise ValueError(problem)
    out = ToolPlan(tools, choice, name=name, parser=served.parser, marker_token=served.marker_token)
    if choice is ToolChoice.NAMED:
        out._function(name)  # named but not given: refused
    if out.constrained:
        _check_schemas(out)
    return out


def _check_names(tools: list[dict]) -> None:
    """Two tools of one name are refused: a call names its function, so which schema it was held to, and which
    function the client should run, would be a guess."""
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is also tools[{seen[name]}]'s: each tool needs a "
                             "name of its own")
        seen[name] = i


def _check_schemas(tool_plan: ToolPlan) -> None:
    """A constrained call's parameters schemas, each checked as its grammar: a schema the grammar library cannot
    use is refused naming the tool, not as the whole grammar."""
    from engine.structured import grammar_problem

    for i, t in enumerate(tool_plan.tools):
        f = t["function"]
        if tool_plan.choice is ToolChoice.NAMED and f["name"] != tool_plan.name:
            continue
        problem = grammar_problem(call_grammar(tool_plan.parser, [f], tool_plan.marker_token))
        if problem is not None:
            raise ValueError(f"tools[{i}].function.parameters ({f['name']!r}) cannot constrain a call: "
                             f"{problem.removeprefix('failed to compile JSON schema: ')}")


def _said(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


# ---- reading a reply back ----------------------------------------------------------------------------------------

# A call's name as far as a reply has written it, and its closing quote once whole (every format writes "name" first).
_NAME_SO_FAR = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*\\?)(")?')

@dataclass(frozen=True, slots=True)
class CallDelta:
    """What one streamed step adds to call `index`: its id and name the first time, then argument text."""
    index: int
    id: str | None
    name: str | None
    arguments: str


class CallReader:
    """One choice's reply read as content and tool calls: whole (read) or as it streams (feed, then feed(final)).
    `constrained`: the names a constrained reply's one call may have (tool_choice "required" or named): the whole
    reply is that call, so one cut short by max_tokens before its name was whole is still read as the call, as far
    as it got (_cut_call)."""

    def __init__(self, parser: ToolParser, constrained: tuple[str, ...] | None = None) -> None:
        self.parser = parser
        self.constrained = constrained
        self._content = 0  # characters of the text given out as content
        self._ids: list[str] = []
        self._arguments: list[str] = []  # each call's argument text given out

    @property
    def made_calls(self) -> bool:
        return bool(self._ids)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply: text that is not a well-formed call stays content; a call cut short
        (max_tokens) comes back as far as it got, once its name is whole."""
        found = scan(self.parser, text, final=True)
        calls = [c for c in found.calls if c.name is not None] or self._cut_call(text)
        if found.malformed or not calls:
            return text, []
        content = text[:found.held].strip() if found.calls else ""
        return content or None, [ToolCall(c.name or "", c.arguments) for c in calls]

    def _cut_call(self, text: str) -> list[CallText]:
        """A constrained reply cut short (max_tokens) before its call's name was whole: the call as far as it got, no
        arguments yet. Its name is the one allowed name that begins as written (the grammar allows no other), else
        what was written of it (several allowed names begin so); [] for a reply that is not constrained."""
        if self.constrained is None:
            return []
        match = _NAME_SO_FAR.search(text)
        written, whole = (match.group(1), bool(match.group(2))) if match else ("", False)
        try:
            written = json.loads(f'"{written}"')
        except ValueError:  # cut inside an escape
            pass
        able = [n for n in self.constrained if (n == written if whole else n.startswith(written))]
        return [CallText(able[0] if len(able) == 1 else written)]

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and call deltas `text` (the reply so far) adds to what was given out; `final`: the reply is
        whole (held-back text that is no call goes out as content)."""
        found = scan(self.parser, text, final)
        calls = [c for c in found.calls if c.name is not None]
        if final and not calls and not found.malformed:
            calls = self._cut_call(text)
            found.held = 0 if calls else found.held
        if final and not self._ids and (found.malformed or not calls):
            out, self._content = text[self._content:], len(text)
            return out, []
        content = text[self._content:found.held] if found.held > self._content else ""
        self._content = max(self._content, found.held)
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self._ids):
                self._ids.append(new_call_id())
                self._arguments.append(call.arguments)
                deltas.append(CallDelta(i, self._ids[i], call.name, call.arguments))
            elif len(call.arguments) > len(self._arguments[i]) and call.arguments.startswith(self._arguments[i]):
                deltas.append(CallDelta(i, None, None, call.arguments[len(self._arguments[i]):]))
                self._arguments[i] = call.arguments
        return content, deltas


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


__all__ = ["CallDelta", "CallReader", "describe_tools", "ToolCall", "ToolChoice", "ToolParser", "ToolPlan", "ToolSettings",
           "ToolSupport", "plan", "support", "template_messages"]
