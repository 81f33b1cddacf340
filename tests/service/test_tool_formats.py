"""The tool-call formats (service/tool_formats.py) without a model: each parser on crafted replies, whole and
streamed a character at a time (the deltas add up to the whole reading), what the shipped templates render read back
by their format's parser, the grammar of one call accepting the format's text and nothing else, and how a server
picks a format and refuses tools it cannot serve."""
from __future__ import annotations

import json

import pytest

from engine.chat_templates import ChatTemplate
from engine.config import StructuredOutputsParams
from service.tool_calls import CallReader, ToolChoice, ToolSettings, ToolSupport, plan, support, template_messages
from service.tool_formats import TEMPLATE_OF, ToolParser, call_grammar, closed, detect

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "get_time"}}]
HERMES = ToolSupport(ToolParser.HERMES, renders=True)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded SmolLM2's (any tokenizer renders a template; the grammar tests tokenize the format's text)."""
    from transformers import AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    return AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))


def _streamed(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]], list[int]]:
    """(content, [(name, arguments)], deltas per call) of `text` fed a character at a time."""
    reader = CallReader(parser)
    content, calls, counts = "", {}, {}
    for k in range(1, len(text) + 1):
        piece, deltas = reader.feed(text[:k], final=k == len(text))
        content += piece
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.name
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
            counts[d.index] = counts.get(d.index, 0) + 1
    return content, [tuple(calls[i]) for i in sorted(calls)], [counts[i] for i in sorted(counts)]


CASES = [
    (ToolParser.HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", '
                        '"where": {"lat": 48.8}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                        '</tool_call>', "Let me look.",
     [("get_weather", {"city": 'Pa"ris }', "where": {"lat": 48.8}}), ("get_time", {})]),
    (ToolParser.HERMES, '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>', None,
     [("get_weather", {"city": "Rome"})]),  # arguments before the name: read whole, sent in one delta
    (ToolParser.LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                             '{"name": "get_time", "parameters": {}}', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    (ToolParser.LLAMA3_JSON, '\n{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (ToolParser.MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                         '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    (ToolParser.MISTRAL, '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),  # marker skipped
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_format_reads_its_calls_whole_and_streamed_alike(parser, text, content, calls):
    got_content, got = CallReader(parser).read(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    streamed_content, streamed, counts = _streamed(parser, text)
    assert streamed_content.strip() == (content or "")
    assert streamed == [(c.name, c.arguments) for c in got]  # the chunks add up to the same argument text
    name_first = text.index('"name"') < text.replace('"parameters"', '"arguments"').index('"arguments"')
    if name_first and len(streamed[0][1]) > 10:  # the name, then the arguments in many chunks as they come
        assert counts[0] > 3


@pytest.mark.parametrize("parser, text", [
    (ToolParser.HERMES, "It is sunny; 2 < 3 and <b>bold</b>."),
    (ToolParser.HERMES, "Sure <tool_call>{not json}</tool_call>"),  # not a call: stays content
    (ToolParser.HERMES, '<tool_call>\n{"nom": "x"}\n</tool_call>'),
    (ToolParser.LLAMA3_JSON, 'It is {"name": "get_weather"} inline.'),
    (ToolParser.LLAMA3_JSON, '{"answer": 42}'),
    (ToolParser.MISTRAL, "See [1] and [TOOL] [2]."),
])
def test_text_that_is_not_a_call_is_content_whole_and_streamed(parser, text):
    assert CallReader(parser).read(text) == (text, [])
    assert _streamed(parser, text)[:2] == (text, [])


def test_streaming_holds_back_only_what_may_start_a_call():
    reader = CallReader(ToolParser.HERMES)
    assert reader.feed("Sure. <tool", final=False) == ("Sure. ", [])
    assert reader.feed("Sure. <tab", final=False) == ("<tab", [])
    assert CallReader(ToolParser.LLAMA3_JSON).feed('  {"name"', final=False) == ("", [])
    assert CallReader(ToolParser.LLAMA3_JSON).feed("It is", final=False) == ("It is", [])
    assert CallReader(ToolParser.MISTRAL).feed("Look [TOOL_", final=False) == ("Look ", [])


def test_a_call_cut_short_comes_back_as_far_as_it_got():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, (call,) = CallReader(ToolParser.HERMES).read(text)
    assert content is None and call.name == "get_weather" and call.arguments == '{"city": "Par'


@pytest.mark.parametrize("parser", list(ToolParser), ids=str)
def test_the_shipped_template_renders_calls_its_parser_reads_back(tokenizer, parser):
    """An assistant turn with calls, rendered by the family's shipped template (through transformers), is read back
    by that family's parser: the template and the parser agree on the format."""
    template = ChatTemplate(TEMPLATE_OF[parser]).path.read_text()
    assert detect(template, None) is parser
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]

    def render(messages, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    ask = [{"role": "user", "content": "Weather?"}]
    before = render(ask, True)
    after = render(template_messages([*ask, {"role": "assistant", "content": "", "tool_calls": calls}]), False)
    assert '"get_weather"' in before and "get_time" in before  # the tools reached the prompt
    if parser is not ToolParser.MISTRAL:
        assert after.startswith(before)
    reply = after[len(before):] if after.startswith(before) else after[after.rindex("[/INST]") + len("[/INST]"):]
    for end in ("<|im_end|>\n", "<|eot_id|>", tokenizer.eos_token):
        reply = reply.removesuffix(end)
    content, found = CallReader(parser).read(reply)
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": "Rome"}), ("get_time", {})]


def test_closing_a_schema_closes_every_object_that_lists_its_properties():
    out = closed(WEATHER["parameters"])
    assert out["additionalProperties"] is False and out["properties"]["where"]["additionalProperties"] is False
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object"})  # a free-form object stays free


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from engine.structured import GrammarCompiler

    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


def _accepts(compiler, grammar: str, text: str) -> bool:
    tok, comp = compiler
    matcher = comp.matcher(comp.compile(StructuredOutputsParams(grammar=grammar)))
    return all(matcher.accept(t) for t in tok(text, add_special_tokens=False).input_ids) and matcher.is_terminated()


@pytest.mark.parametrize("parser, good, extra_key", [
    (ToolParser.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "x": 1}}\n</tool_call>'),
    (ToolParser.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Rome", "where": {"lat": 1.5}}}',
     '{"name": "get_weather", "parameters": {"city": "Rome", "where": {"lat": 1.5, "lon": 2}}}'),
    (ToolParser.MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "get_time", "arguments": {"now": true}}]'),
])
def test_the_grammar_of_one_call_takes_the_formats_text_with_declared_arguments_only(compiler, parser, good,
                                                                                    extra_key):
    grammar = call_grammar(parser, [t["function"] for t in TOOLS])
    assert _accepts(compiler, grammar, good)
    assert not _accepts(compiler, grammar, extra_key)  # objects closed: no undeclared key, no rambling
    assert not _accepts(compiler, grammar, good.replace("get_", "set_"))  # only the given tools
    named = call_grammar(parser, [WEATHER])
    assert _accepts(compiler, named, good) is ("get_weather" in good)


def test_a_bad_grammar_is_refused_with_a_message(compiler):
    with pytest.raises(ValueError, match="grammar"):
        compiler[1].compile(StructuredOutputsParams(grammar="start: nope"))


def test_the_format_comes_from_the_flag_the_template_or_the_family():
    assert detect(ChatTemplate.GEMMA.path.read_text(), "gemma3") is None
    assert detect("{{ tools }} <tool_call>", "llama") is ToolParser.HERMES  # the template's markers first
    assert detect("{{ messages }}", "qwen3") is ToolParser.HERMES
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    served = support(ToolSettings(parser=ToolParser.MISTRAL), plain, "qwen3")
    assert served.parser is ToolParser.MISTRAL and not served.renders
    with pytest.raises(ValueError, match="--tool-call-parser hermes"):
        support(ToolSettings(auto=True), plain, "gemma3")


def test_plans_name_what_is_wrong():
    assert plan(None, None, None, HERMES) is None
    assert plan(TOOLS, "none", None, ToolSupport()).choice is ToolChoice.NONE  # tools left out: any template
    assert plan(TOOLS, None, None, HERMES).choice is ToolChoice.AUTO  # "auto", the default, needs no flag
    with pytest.raises(ValueError, match="renders no tools.*chatml \\(hermes\\), llama3 \\(llama3_json\\), "
                                         "mistral \\(mistral\\)"):
        plan(TOOLS, "required", None, ToolSupport(ToolParser.HERMES, renders=False))
    with pytest.raises(ValueError, match="not known.*--tool-call-parser"):
        plan(TOOLS, "auto", None, ToolSupport(None, renders=True))
    with pytest.raises(ValueError, match="not in tools"):
        plan(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, HERMES)
    with pytest.raises(ValueError, match="needs tools"):
        plan(None, "required", None, HERMES)
    named = plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, HERMES)
    assert "get_time" in named.structured_outputs().grammar and "get_weather" not in named.structured_outputs().grammar
    assert plan(TOOLS, "auto", None, HERMES).structured_outputs() is None
    odd = [*TOOLS, {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}]
    with pytest.raises(ValueError, match=r"^tools\[2\]\.function\.parameters \('odd'\) cannot constrain a call: "
                                         r"Unimplemented keys: \[\"not\"\]$"):
        plan(odd, "required", None, HERMES)
    assert plan(odd, {"type": "function", "function": {"name": "get_time"}}, None, HERMES).name == "get_time"


def test_mistrals_marker_is_one_special_token_in_the_grammar_and_may_be_gone_from_the_text(compiler):
    """Where the vocabulary has [TOOL_CALLS] as a token (a special one: skip_special_tokens drops it from the reply's
    text), the grammar asks for that token, and the reply's text without it still reads as the call."""
    tok, comp = compiler
    marker = tok.convert_tokens_to_ids("<|im_start|>")  # a special token standing in for [TOOL_CALLS]
    grammar = call_grammar(ToolParser.MISTRAL, [{"name": "get_time"}], marker_token=marker)
    matcher = comp.matcher(comp.compile(StructuredOutputsParams(grammar=grammar)))
    ids = [marker, *tok(' [{"name": "get_time", "arguments": {}}]', add_special_tokens=False).input_ids]
    assert all(matcher.accept(t) for t in ids) and matcher.is_terminated()
    text = tok.decode(ids, skip_special_tokens=True)
    assert [(c.name, c.arguments) for c in CallReader(ToolParser.MISTRAL).read(text)[1]] == [("get_time", "{}")]
