"""Tool calling through the `openai` SDK on a tiny random Qwen2 whose chat template renders tools (Qwen2.5's), served
with `--enable-auto-tool-choice --tool-call-parser hermes`; and the parsers on text the template itself renders.

A random model never emits a call on its own, so each end-to-end case forces its output honestly, with the engine's
structured output: tool_choice "required" and a named function constrain it to a call by schema (as vLLM does), and
the "auto" case asks for the Hermes call text as the only allowed choice (vLLM's `structured_outputs.choice`), so
the server's parser is what turns it into `tool_calls`."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from engine import LLM, EngineConfig
from engine.models.loader import default_model_dir
from engine.settings import Settings
from service.server import ServerConfig
from service.tool_calls import ToolChoice, ToolParser, ToolSettings, call_starts, parse, plan, template_messages
from tests.service.harness import ServerThread

TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_tools.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
                       "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))
    tok.chat_template = TEMPLATE.read_text()
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config

    directory = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(11)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLM(EngineConfig(model=str(model_dir), chat_template=str(TEMPLATE), num_kv_blocks=128)).engine


@pytest.fixture(scope="module")
def client(engine):
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, enable_auto_tool_choice=True,
                                               tool_call_parser="hermes"))
    door = server.add_http(server.server.config)
    with openai.OpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0) as c:
        yield c
    server.close()


@pytest.fixture(scope="module")
def served_tokenizer(engine, client):
    return engine.tokenizer  # the served one (the engine marks markup tokens such as <tool_call> special)


def _prompt_tokens(tokenizer, messages, tools=None) -> int:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- parsers, on text the chat template renders ------------------------------------------------------------------

def test_hermes_parser_reads_back_what_the_template_renders(tokenizer):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]
    turn = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": calls}]
    rendered = tokenizer.apply_chat_template(template_messages(turn), tools=TOOLS, tokenize=False)
    reply = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    content, parsed = parse(ToolParser.HERMES, reply)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"city": "Oslo"})]
    assert parse(ToolParser.HERMES, "no call here") == ("no call here", [])
    assert parse(ToolParser.HERMES, "<tool_call>{not json</tool_call>")[1] == []  # not a call: stays content


def test_llama3_json_parser():
    content, calls = parse(ToolParser.LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": '
                                                   '{"city": "Rome"}}; {"name": "get_time", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert parse(ToolParser.LLAMA3_JSON, "It is sunny.") == ("It is sunny.", [])


def test_plans_follow_vllms_rules():
    auto = ToolSettings(auto=True, parser=ToolParser.HERMES)
    assert plan(None, None, None, ToolSettings()) is None and plan(TOOLS, "none", None, ToolSettings()).choice \
        is ToolChoice.NONE
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        plan(TOOLS, None, None, ToolSettings())  # "auto" is the default with tools
    assert plan(TOOLS, "auto", None, auto).parser is ToolParser.HERMES
    with pytest.raises(ValueError, match="not in tools"):
        plan(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, auto)
    with pytest.raises(ValueError, match="needs tools"):
        plan(None, "required", None, auto)
    named = plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, auto)
    assert named.read('{"city": "Oslo"}')[1][0].name == "get_time"
    assert named.read('{"city": "Os') == ('{"city": "Os', [])  # cut short by max_tokens: no call
    required = plan(TOOLS, "required", False, auto).structured_outputs().json
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2


def test_streaming_holds_back_from_where_a_call_may_start():
    assert call_starts(ToolParser.HERMES, "Sure. <tool") == len("Sure. ")
    assert call_starts(ToolParser.HERMES, "Sure. <tool_call>{") == len("Sure. ")
    assert call_starts(ToolParser.HERMES, "a < b") is None
    assert call_starts(ToolParser.LLAMA3_JSON, ' {"name"') == 0
    assert call_starts(ToolParser.LLAMA3_JSON, "It is") is None


# ---- end to end through the openai SDK ------------------------------------------------------------------------------

def test_named_tool_choice_returns_that_call_and_the_tools_reached_the_prompt(client, served_tokenizer):
    tokenizer = served_tokenizer
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # exactly the template's rendering with the tools (transformers'), not the chat without them
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, ASK, TOOLS) > _prompt_tokens(tokenizer, ASK) + 50


def test_required_tool_choice_streams_tool_call_deltas(client):
    stream = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=60, stream=True,
                                            tool_choice="required", parallel_tool_calls=False)
    chunks = list(stream)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the call's JSON is not content
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id
    name, arguments = deltas[0].function.name, json.loads(deltas[0].function.arguments)
    assert (name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"city"}))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_hermes_call(client, stream):
    kwargs = dict(model="", messages=ASK, tools=TOOLS, max_tokens=60, extra_body={"structured_outputs": {
        "choice": [CALL_TEXT]}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
        calls = [(c.function.name, c.function.arguments) for c in calls]
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][-1]
        content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
        calls = [(d.function.name, d.function.arguments) for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert finish == "tool_calls" and content is None
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Paris"})]


def test_tool_choice_none_leaves_the_tools_out_and_a_tool_turn_renders_as_transformers_does(client,
                                                                                           served_tokenizer):
    tokenizer = served_tokenizer
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens == _prompt_tokens(tokenizer, ASK)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="", messages=turn, tools=TOOLS, tool_choice="none", max_tokens=3)
    expected = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}, turn[2]]
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, template_messages(expected))


def test_a_ggufs_tool_call_markers_stay_in_the_text(tokenizer):
    """A GGUF stores Qwen's <tool_call> as a plain added token; the engine makes <word_word> markup special again (so
    skip_special_tokens drops Gemma's <start_of_image>, as its own tokenizer does), but not the tool-call markers,
    which Qwen's tokenizer keeps as text and the hermes parser must see in the reply."""
    from transformers import AutoTokenizer

    from engine.builder import _mark_markup_tokens_special

    tok = AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))
    tok.add_tokens(["<tool_call>", "<start_of_image>"])
    _mark_markup_tokens_special(tok)
    ids = tok("<start_of_image>" + CALL_TEXT, add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == CALL_TEXT
