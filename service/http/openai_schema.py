"""OpenAI request bodies (pydantic), and their translation into the core API's GenerateInputs.

Types are checked strictly (a string is not a number). A field tandem does not implement is refused with 400
naming it, unless it is null, false or empty (what clients send for "unset"); see docs/http.md for the list.
Integers must fit the ranges the gRPC door's fields have; values are then checked where gRPC requests are checked
(the engine's SamplingParams, the core API), so both doors refuse the same values with the same messages.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.config import SamplingParams, StructuredOutputsParams
from service.core import GenerateInput, json_schema
from service.http.errors import HttpError
from service.tool_calls import ToolPlan, template_messages

# Fields of OpenAI's (or vLLM's) APIs that would change the answer and that tandem does not implement, with why;
# anything else unknown is refused as unknown. Fields that change nothing here (metadata, store, service_tier,
# reasoning_effort, prediction, user, modalities ["text"], parallel_tool_calls) are declared on the request and
# accepted (docs/http.md).
_UNSUPPORTED = {
    "functions": "use tools (the deprecated functions are not implemented)",
    "function_call": "use tool_choice (the deprecated function_call is not implemented)",
    "audio": "tandem generates text only", "web_search_options": "tandem does not search the web",
    "best_of": "use n", "echo": "echo is not implemented", "suffix": "suffix (insertion) is not implemented",
    "prompt_logprobs": "prompt logprobs are served over gRPC", "refusal": "not an input field",
}


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def refuse_extras(model: BaseModel, where: str = "") -> None:
    """400 for a set field the model does not declare (null, false and empty count as unset)."""
    for name, value in (model.model_extra or {}).items():
        if value in (None, False, [], {}, ""):
            continue
        field = f"{where}{name}"
        why = _UNSUPPORTED.get(name)
        message = (f"{field} is not supported: {why}" if why else
                   f"unknown field {field!r}: tandem does not implement it (see docs/http.md for the fields it takes)")
        raise HttpError(400, message, param=field, code="unsupported_field")


class TextPart(_Model):
    type: str
    text: str | None = None


class CalledFunction(_Model):
    name: str
    arguments: Union[str, dict] = "{}"  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallItem(_Model):
    """One of an assistant message's earlier calls, in OpenAI's shape."""
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(_Model):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None  # passed to the chat template, which may use it
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to a call

    def chat(self, i: int) -> dict:
        """The message as the core API (and the chat template) takes it."""
        refuse_extras(self, f"messages[{i}].")
        out: dict[str, Any] = {"role": self.role, "content": self.text(i)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            for j, call in enumerate(self.tool_calls):
                refuse_extras(call, f"messages[{i}].tool_calls[{j}].")
                refuse_extras(call.function, f"messages[{i}].tool_calls[{j}].function.")
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return out

    def text(self, i: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise HttpError(400, f"messages[{i}].content[{j}] has type {part.type!r}: tandem's models read "
                                     "text parts only", param=f"messages[{i}].content[{j}].type")
            refuse_extras(part, f"messages[{i}].content[{j}].")
            parts.append(part.text)
        return "".join(parts)


class JsonSchemaFormat(_Model):
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` (also its older guided_json / guided_regex / guided_choice fields)."""
    json_: Union[dict, str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None


class StreamOptions(_Model):
    include_usage: bool | None = None


class _Sampling(_Model):
    """Fields chat and completions share."""
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # accepted, changing nothing: nothing is stored, there is one service tier, the models do not reason and
    # predicted outputs only ever save time
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prediction: dict | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def sampling(self, *, max_tokens: int | None, logprobs: int | None,
                 tool_format: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's SamplingParams; `tool_format`: the schema tool_choice "required" or a named function puts
        on the output (refused beside another output format)."""
        refuse_extras(self)
        if self.stream_options is not None:
            refuse_extras(self.stream_options, "stream_options.")
        params: dict[str, Any] = {}
        for name in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty", "min_tokens", "priority"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        params["max_tokens"] = max_tokens  # None: the rest of the context
        if logprobs is not None:
            params["logprobs"] = logprobs
        if self.seed is not None:
            if self.seed < 0:
                raise HttpError(400, f"seed must be an integer >= 0, got {self.seed}", param="seed")
            params["seed"] = self.seed
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stop_token_ids:
            params["stop_token_ids"] = self.stop_token_ids
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.skip_special_tokens is not None:
            params["skip_special_tokens"] = self.skip_special_tokens
        if self.logit_bias:
            params["logit_bias"] = _logit_bias(self.logit_bias)
        _check_ranges(params)
        output_format = self._format()
        if tool_format is not None and output_format is not None:
            raise HttpError(400, "tool_choice \"required\" or a named function constrains the output already: "
                                 "give no response_format or structured_outputs with it", param="tool_choice")
        try:
            return SamplingParams(**params, structured_outputs=tool_format or output_format)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None

    def _format(self) -> StructuredOutputsParams | None:
        """The one output format: OpenAI's response_format, or vLLM's structured_outputs / guided_*."""
        formats: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            refuse_extras(rf, "response_format.")
            if rf.type == "json_object":
                formats.append(("response_format", {"json": {"type": "object"}, "source": "response_format"}))
            else:
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise HttpError(400, "response_format.json_schema.schema is required with type json_schema",
                                    param="response_format.json_schema")
                refuse_extras(rf.json_schema, "response_format.json_schema.")
                formats.append(("response_format", {"json": rf.json_schema.schema_,
                                                    "source": "response_format.json_schema.schema"}))
        so = self.structured_outputs
        if so is not None:
            refuse_extras(so, "structured_outputs.")
            formats += _vllm_format("structured_outputs.", so.json_, so.regex, so.choice)
        formats += _vllm_format("guided_", self.guided_json, self.guided_regex, self.guided_choice)
        if len(formats) > 1:
            raise HttpError(400, f"give one output format, not {[name for name, _ in formats]}",
                            param=formats[1][0])
        if not formats:
            return None
        try:
            return StructuredOutputsParams(**formats[0][1])
        except ValueError as exc:
            raise HttpError(400, str(exc), param=formats[0][0]) from None


# The gRPC door's integer field types (proto/tandem.proto SamplingParams): the same request is refused the same way.
_INT32, _UINT32 = (-(2**31), 2**31 - 1), (0, 2**32 - 1)
_RANGES = {"max_tokens": _INT32, "top_k": _INT32, "priority": _INT32, "n": _UINT32, "logprobs": _UINT32,
           "min_tokens": _UINT32, "seed": (0, 2**64 - 1)}


def _check_ranges(params: dict[str, Any]) -> None:
    for name, (low, high) in _RANGES.items():
        value = params.get(name)
        if value is not None and not low <= value <= high:
            raise HttpError(400, f"a sampling parameter is out of range: {name}={value}", param=name)
    if any(not _UINT32[0] <= t <= _UINT32[1] for t in params.get("stop_token_ids", ())):
        raise HttpError(400, "a sampling parameter is out of range: stop_token_ids", param="stop_token_ids")


def _vllm_format(where: str, schema, regex, choice) -> list[tuple[str, dict]]:
    out = []
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json_schema(schema, "response_format.json_schema")
            except ValueError as exc:
                raise HttpError(400, str(exc), param=f"{where}json") from None
        out.append((f"{where}json", {"json": schema, "source": f"{where}json"}))
    if regex is not None:
        out.append((f"{where}regex", {"regex": regex, "source": f"{where}regex"}))
    if choice is not None:
        out.append((f"{where}choice", {"choice": choice, "source": f"{where}choice"}))
    return out


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise HttpError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not -(2**63) <= token < 2**63:
            raise HttpError(400, f"logit_bias key {key} is out of range", param="logit_bias")
        out[token] = value
    return out


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef

    def definition(self, i: int) -> dict:
        refuse_extras(self, f"tools[{i}].")
        refuse_extras(self.function, f"tools[{i}].function.")
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # ["text"] only

    def tool_definitions(self) -> list[dict] | None:
        return [t.definition(i) for i, t in enumerate(self.tools)] if self.tools else None

    def to_inputs(self, tools: ToolPlan | None = None) -> list[GenerateInput]:
        """max_tokens (or max_completion_tokens) unset: None, the rest of the context (SamplingParams')."""
        if self.top_logprobs is not None and not self.logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise HttpError(400, f"modalities {self.modalities} is not supported: tandem generates text only",
                            param="modalities")
        params = self.sampling(max_tokens=max_tokens, logprobs=logprobs,
                               tool_format=tools.structured_outputs() if tools is not None else None)
        messages = template_messages([m.chat(i) for i, m in enumerate(self.messages)])
        return [GenerateInput("", params, messages=messages, model=self.model,
                              tools=tools.template_tools if tools is not None else None)]


Prompt = Union[str, list[str], list[int], list[list[int]]]


COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = None

    def to_inputs(self) -> list[GenerateInput]:
        # OpenAI's legacy completions default to 16 tokens (vLLM's too); chat's unset max_tokens is the rest of the
        # context (ChatRequest above)
        params = self.sampling(max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None
                               else self.max_tokens, logprobs=self.logprobs)
        prompts = self.prompts()
        if not prompts:
            raise HttpError(400, "prompt must not be an empty list", param="prompt")
        for prompt in prompts:
            if not isinstance(prompt, str) and any(t < 0 or t >= 2**32 for t in prompt):
                raise HttpError(400, "prompt token ids must be integers >= 0 (and in the vocabulary)",
                                param="prompt")
        return [GenerateInput("", params, prompt=prompt, model=self.model) for prompt in prompts]

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request model of a JSON body; 400 saying where the JSON is malformed or which field is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> HttpError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return HttpError(400, f"malformed JSON body: {first['msg'].removeprefix('Invalid JSON: ')}",
                         code="invalid_json")
    loc = _where(first["loc"])
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if first["type"] == "missing":
        return HttpError(400, f"{loc} is required{more}", param=loc)
    return HttpError(400, f"{loc}: {first['msg']}{more}", param=loc)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; pydantic's union branch tags ('str', 'list[TextPart]',
    'TextPart', 'function-after[...]') are left out (field names are lower-case identifiers)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out or "body"
