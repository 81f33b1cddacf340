"""A constrained tool call (tool_choice "required" or named) cut short by max_tokens comes back as a call, as far as
it got (docs/http.md "Tool calling"): `tool_calls` with the arguments text so far and finish_reason "length", never
the raw call text as content; streamed, held-back steps send nothing (no empty content deltas), and the call's
deltas add up to the non-streamed call. Through the `openai` SDK and the HTTP door, on the tiny random Qwen3 (hermes
format) and Llama (llama3_json) of tests/service/test_tool_calls.py, greedy, so a reply cut at k tokens is the first
k tokens of the whole one.

The reader on crafted cut texts is at the end (every format, every place a cut can fall)."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig
from service.tool_calls import CallReader, ToolChoice, ToolPlan, ToolParser
from tests.service.test_tool_calls import ASK, QWEN_TEMPLATE, SMALL, TOOLS, _model_dir, _serve, _tokenizer

NAMES = [t["function"]["name"] for t in TOOLS]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def served(request, tmp_path_factory):
    from transformers import LlamaConfig, Qwen3Config

    if request.param == "qwen3":
        config = Qwen3Config(vocab_size=len(_tokenizer()), head_dim=16, architectures=["Qwen3ForCausalLM"], **SMALL)
        directory = _model_dir(tmp_path_factory.mktemp("tiny-qwen3"), config, QWEN_TEMPLATE.read_text())
        engine = LLM(EngineConfig(model=str(directory), num_kv_blocks=256)).engine
    else:
        config = LlamaConfig(vocab_size=len(_tokenizer()), architectures=["LlamaForCausalLM"], **SMALL)
        directory = _model_dir(tmp_path_factory.mktemp("tiny-llama"), config)
        engine = LLM(EngineConfig(model=str(directory), chat_template="llama3", num_kv_blocks=256)).engine
    server, client = _serve(engine)
    yield client
    client.close()
    server.close()


def _whole(client, choice) -> tuple[str, str, int]:
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=150,
                                       temperature=0.0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    return call.function.name, call.function.arguments, r.usage.completion_tokens


def _streamed(client, choice, max_tokens: int) -> tuple[list[tuple[str, str]], str, int]:
    """(calls as (name, arguments), finish reason, chunks that carried nothing)."""
    calls: dict[int, list[str]] = {}
    finish, empty = None, 0
    for n, chunk in enumerate(client.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                                             tool_choice=choice, max_tokens=max_tokens,
                                                             temperature=0.0, stream=True)):
        c = chunk.choices[0]
        assert not c.delta.content  # the call's text is never content
        if n and not c.delta.tool_calls and c.finish_reason is None:
            empty += 1
        for d in c.delta.tool_calls or ():
            if d.id is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = c.finish_reason or finish
    return [tuple(v) for _, v in sorted(calls.items())], finish, empty


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_constrained_call_cut_short_comes_back_as_far_as_it_got(served, choice):
    client = served
    name, arguments, tokens = _whole(client, choice)
    seen_cuts = {"before_arguments": 0, "inside_arguments": 0}
    for k in range(1, tokens, 3):
        r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=k,
                                           temperature=0.0)
        reply = r.choices[0]
        assert reply.finish_reason == "length" and reply.message.content is None, (k, reply)
        (call,) = reply.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        # the name is the call's wherever the text so far allows only one tool; else what was written of it
        assert call.function.name == name or (
            name.startswith(call.function.name) and sum(n.startswith(call.function.name) for n in NAMES) > 1), k
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        assert arguments.startswith(call.function.arguments), (k, call.function.arguments, arguments)
        if not call.function.arguments:
            seen_cuts["before_arguments"] += 1
        elif len(call.function.arguments) < len(arguments):
            seen_cuts["inside_arguments"] += 1

        streamed, finish, empty = _streamed(client, choice, k)
        assert finish == "length" and empty == 0, (k, empty)
        assert streamed == [(call.function.name, call.function.arguments)], k
    assert all(seen_cuts.values()), seen_cuts  # cuts fell before the arguments and inside them


# ---- the reader on crafted replies --------------------------------------------------------------------------------

WHOLE = {ToolParser.HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         ToolParser.LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
         ToolParser.MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'}


@pytest.mark.parametrize("parser", list(ToolParser))
@pytest.mark.parametrize("choice", [ToolChoice.REQUIRED, ToolChoice.NAMED])
def test_every_prefix_of_a_constrained_call_reads_as_that_call_so_far(parser, choice):
    text = WHOLE[parser]
    plan = ToolPlan(TOOLS, choice, name="get_weather" if choice is ToolChoice.NAMED else None, parser=parser)
    name_at = text.index('"get_weather"') + 1
    for cut in range(len(text) + 1):
        content, calls = plan.read(text[:cut])
        assert content is None, (cut, content)
        (call,) = calls
        if choice is ToolChoice.NAMED or cut > name_at + len("get_"):  # "get_w": only get_weather begins so
            assert call.name == "get_weather", (cut, call)
        else:  # nothing or "get_" so far: both tools begin so
            assert "get_weather".startswith(call.name), (cut, call)
        assert '{"city": "Paris"}'.startswith(call.arguments), (cut, call)
        streamed = plan.reader()
        _, deltas = streamed.feed(text[:cut], final=True)
        assert [(d.name, d.arguments) for d in deltas] == [(call.name, call.arguments)], cut


def test_a_reply_that_is_not_constrained_stays_content_when_cut_before_a_name():
    plan = ToolPlan(TOOLS, ToolChoice.AUTO, parser=ToolParser.HERMES)
    assert plan.read('<tool_call>\n{"name": "get_w') == ('<tool_call>\n{"name": "get_w', [])
    assert CallReader(ToolParser.HERMES).read("It is sunny.") == ("It is sunny.", [])
