"""The text formats of tool calls of the families tandem serves, by vLLM's `--tool-call-parser` names: how a reply's
calls are read back (whole, or as far as a streamed reply has got), where in a reply a call may begin, and the
grammar of one call (what tool_choice "required" and a named function constrain the output to).

* `hermes` (Hermes, Qwen 2.5 / Qwen 3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number
  of them; text before the first is content.
* `llama3_json` (Llama 3.1+ JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`.
* `mistral` (Mistral / Mixtral v0.3 tokenizers): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; the marker
  is a special token, which the reply's text may have dropped (skip_special_tokens), so a reply that opens with `[{`
  reads the same.

A call's `arguments` are the JSON text the model wrote (its object as written, not re-serialized), so a streamed
call's argument chunks add up to exactly the non-streamed call's.
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any


class ToolParser(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"

    def __str__(self) -> str:
        return self.value


# The shipped chat template (engine/templates/<name>.jinja) that renders each format's tools.
TEMPLATE_OF = {ToolParser.HERMES: "chatml", ToolParser.LLAMA3_JSON: "llama3", ToolParser.MISTRAL: "mistral"}
# A model's family (config.json model_type) when its template does not tell.
PARSER_OF_MODEL_TYPE = {"qwen2": ToolParser.HERMES, "qwen2_moe": ToolParser.HERMES, "qwen3": ToolParser.HERMES,
                        "qwen3_moe": ToolParser.HERMES, "llama": ToolParser.LLAMA3_JSON,
                        "mistral": ToolParser.MISTRAL, "mixtral": ToolParser.MISTRAL}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARK = "[TOOL_CALLS]"


def names() -> list[str]:
    return [p.value for p in ToolParser]


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` transformers gives it (Jinja that names them)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def detect(template: str | None, model_type: str | None) -> ToolParser | None:
    """The format a chat template writes calls in (its own markers), else the model family's; None: unknown."""
    if renders_tools(template):
        if HERMES_OPEN in template:
            return ToolParser.HERMES
        if MISTRAL_MARK in template or "[AVAILABLE_TOOLS]" in template:
            return ToolParser.MISTRAL
        if PYTHON_TAG in template or "<|start_header_id|>" in template:
            return ToolParser.LLAMA3_JSON
    return PARSER_OF_MODEL_TYPE.get(model_type or "")


# ---- reading calls back ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class CallText:
    """One call as far as the text has got: its name once written whole, its arguments' JSON text so far."""
    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class Scan:
    """A reply read as content and calls. `held`: where the calls (or a possible call start) begin; the text before
    it is content. `malformed`: a call began but is not a call (its text is content once the reply ends)."""
    held: int
    calls: list[CallText] = field(default_factory=list)
    malformed: bool = False


def scan(parser: ToolParser, text: str, final: bool) -> Scan:
    """Read `text` (a whole reply when `final`, else what has streamed so far)."""
    out = _SCANNERS[parser](text, final)
    if final and out.held == len(text) and not out.calls:
        return Scan(len(text))
    return out


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON object or array opening at text[i]; None where the text stops inside it."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _object_call(text: str, i: int) -> tuple[CallText | None, int | None]:
    """The call object opening at text[i] ('{'): (the call, or None where the object is not a call; the object's
    end, or None where the text stops inside it)."""
    end = _value_end(text, i)
    named = _NAME_FIRST.match(text, i)
    if end is not None:
        try:
            value = json.loads(text[i:end])
        except ValueError:
            return None, end
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, end
        arguments = value.get("arguments", value.get("parameters", {}))
        start = named.end() if named is not None else -1
        if start >= 0 and text[start] == "{":
            raw = text[start:_value_end(text, start)]
        else:
            raw = _compact(arguments)
        return CallText(value["name"], raw, True), end
    if named is None:
        return CallText(None), None
    try:
        name = json.loads(f'"{named.group(1)}"')
    except ValueError:
        return None, None
    start = named.end()
    if start < len(text) and text[start] == "{":
        return CallText(name, text[start:_value_end(text, start) or len(text)]), None
    return CallText(name), None


def _compact(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _skip(text: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _partial_marker(text: str, marker: str) -> int:
    """Where a prefix of `marker` ends the text (it may be the marker's start), else len(text)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _objects(text: str, i: int, separators: str, calls: list[CallText]) -> bool:
    """Call objects from text[i] on, separated by `separators` and whitespace, appended to calls; False where one is
    not a call."""
    while True:
        i = _skip(text, i, " \t\r\n" + separators)
        if i >= len(text) or text[i] != "{":
            return True
        call, end = _object_call(text, i)
        if call is None:
            return False
        calls.append(call)
        if end is None:
            return True
        i = end


def _hermes(text: str, final: bool) -> Scan:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return Scan(len(text) if final else _partial_marker(text, HERMES_OPEN))
    out = Scan(start)
    i = start
    while i < len(text):
        i = text.find(HERMES_OPEN, i)
        if i < 0:
            break
        body = _skip(text, i + len(HERMES_OPEN))
        if body >= len(text):
            out.calls.append(CallText(None))
            break
        if text[body] != "{":
            out.malformed = True
            break
        call, end = _object_call(text, body)
        if call is None:
            out.malformed = True
            break
        out.calls.append(call)
        if end is None:
            break
        close = text.find(HERMES_CLOSE, end)
        if close < 0:
            break
        i = close + len(HERMES_CLOSE)
    return out


def _llama3_json(text: str, final: bool) -> Scan:
    i = _skip(text, 0)
    rest = text[i:]
    if not rest:
        return Scan(0 if not final else len(text))
    if rest.startswith(PYTHON_TAG):
        i = _skip(text, i + len(PYTHON_TAG))
    elif PYTHON_TAG.startswith(rest) and not final:
        return Scan(0)
    if i >= len(text):
        return Scan(0)
    if text[i] != "{":
        return Scan(len(text))
    out = Scan(0)
    out.malformed = not _objects(text, i, ";", out.calls)
    return out


def _mistral(text: str, final: bool) -> Scan:
    mark = text.find(MISTRAL_MARK)
    if mark >= 0:
        out = Scan(mark)
        i = _skip(text, mark + len(MISTRAL_MARK))
    else:
        i = _skip(text, 0)
        rest = text[i:]
        if re.match(r"\[\s*\{", rest):  # the marker dropped from the text (a special token): the reply opens with [{
            pass
        elif final:
            return Scan(len(text))
        elif re.fullmatch(r"(\[\s*)?", rest):  # may still open a call
            return Scan(0)
        else:
            return Scan(_partial_marker(text, MISTRAL_MARK))
        out = Scan(0)
    if i < len(text) and text[i] == "[":
        i += 1
    out.malformed = not _objects(text, i, ",", out.calls)
    return out


_SCANNERS = {ToolParser.HERMES: _hermes, ToolParser.LLAMA3_JSON: _llama3_json, ToolParser.MISTRAL: _mistral}


# ---- the grammar of one call -----------------------------------------------------------------------------------

# Compact JSON (as engine/structured.py generates it), inside the Lark grammar of the call's frame.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed (additionalProperties false where it says
    nothing): a call's arguments are the declared ones, and a model cannot go on adding keys until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "prefixItems", "not", "if",
                     "then", "else", "contains", "propertyNames", "unevaluatedProperties"):
            out[key] = closed(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def parameters(function: dict) -> dict:
    """A function's parameters schema (no parameters: an empty object), closed."""
    return closed(function.get("parameters") or {"type": "object", "properties": {}})


def call_grammar(parser: ToolParser, functions: list[dict], marker_token: int | None = None) -> str:
    """The Lark grammar (llguidance's) of exactly one call, in `parser`'s format, to one of `functions` (OpenAI
    function definitions) with arguments valid against its (closed) parameters schema. `marker_token`: the id of
    Mistral's [TOOL_CALLS] where the vocabulary has it as one token.

    The call object's frame is the grammar's own text and the arguments are their own `%json` rule, so the
    parameters schema is the root of its JSON schema: its `$ref`s to `#/$defs/...`, `#/definitions/...`,
    `#/properties/...` and `#` resolve in the schema the client wrote (pydantic's `model_json_schema()`), as they
    do in a response_format."""
    key = "parameters" if parser is ToolParser.LLAMA3_JSON else "arguments"
    rules = []
    for j, f in enumerate(functions):
        name = json.dumps({"const": f["name"], "x-guidance": _JSON_STYLE}, ensure_ascii=False)
        arguments = json.dumps({**parameters(f), "x-guidance": _JSON_STYLE}, ensure_ascii=False)
        rules += [f'call{j}: "{{\\"name\\": " name{j} ", \\"{key}\\": " arguments{j} "}}"',
                  f"name{j}: %json {name}", f"arguments{j}: %json {arguments}"]
    call = " | ".join(f"call{j}" for j in range(len(functions)))
    if parser is ToolParser.HERMES:
        frame = f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"'
    elif parser is ToolParser.LLAMA3_JSON:
        frame = "start: call"
    else:
        mark = f"<[{marker_token}]>" if marker_token is not None else json.dumps(MISTRAL_MARK)
        frame = f'start: {mark} " [" call "]"'
    return "\n".join([frame, f"call: {call}", *rules]) + "\n"


__all__ = ["CallText", "PARSER_OF_MODEL_TYPE", "Scan", "TEMPLATE_OF", "ToolParser", "call_grammar", "closed",
           "detect", "names", "parameters", "renders_tools", "scan"]
