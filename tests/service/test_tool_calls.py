"""Tool calling through the `openai` SDK against the HTTP door, on tiny random models served with no tool flag:

* a Qwen3 whose own chat template renders tools (Qwen 2.5's Hermes template, tests/service/data): the format
  (hermes) is read from the template;
* a Llama given the shipped `llama3` template (`--chat-template llama3`): llama3_json, read from that template;
* the same Llama with its own template (SmolLM2's, which renders no tools): a 400 naming the shipped templates.

A random model never means to call a tool, so each case forces what a real model would do honestly: "required" and
named choices are constrained by the grammar of one call, which is the feature under test (every call complete and
valid against its schema, at temperature 1, with schemas that do not close their objects); the "auto" case asks for
the call's text as the only allowed choice (vLLM's `structured_outputs.choice`), so the server's parser is what turns
it into `tool_calls`. The parsers on crafted replies are tests/service/test_tool_formats.py."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from engine import LLM, EngineConfig
from engine.models.loader import default_model_dir
from engine.settings import Settings
from service.server import ServerConfig
from service.tool_calls import template_messages
from tests.service.harness import ServerThread

QWEN_TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_tools.jinja"
# Schemas as users write them: no additionalProperties, optional keys, a nested object.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "at": {"type": "object", "properties": {
                                                "hour": {"type": "integer", "minimum": 0, "maximum": 23}}}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "exact": {"type": "boolean"}},
        "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))


def _model_dir(directory: Path, config, chat_template: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=len(_tokenizer()), head_dim=16, architectures=["Qwen3ForCausalLM"], **SMALL)
    return _model_dir(tmp_path_factory.mktemp("tiny-qwen3"), config, QWEN_TEMPLATE.read_text())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(_tokenizer()), architectures=["LlamaForCausalLM"], **SMALL)
    return _model_dir(tmp_path_factory.mktemp("tiny-llama"), config)  # SmolLM2's template: no tools


def _serve(engine):
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0))  # no tool flag: the format is read
    door = server.add_http(server.server.config)
    return server, openai.OpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    engine = LLM(EngineConfig(model=str(qwen3_dir), num_kv_blocks=256)).engine
    server, client = _serve(engine)
    yield client, engine
    client.close()
    server.close()


@pytest.fixture(scope="module")
def llama(llama_dir):
    engine = LLM(EngineConfig(model=str(llama_dir), chat_template="llama3", num_kv_blocks=256)).engine
    server, client = _serve(engine)
    yield client, engine
    client.close()
    server.close()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def served(request):
    return request.getfixturevalue(request.param)


def _prompt_tokens(engine, messages, tools=None) -> int:
    return len(engine.intake.chat_token_ids(messages, tools))


def _check_call(name: str, arguments: str, only: str | None = None) -> dict:
    """The call names one of the tools (the named one) and its arguments are valid against that tool's schema."""
    assert name in SCHEMAS and (only is None or name == only)
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def _stream(client, **kwargs):
    """(content, {index: [id, name, arguments, number of deltas]}, finish reasons) of a streamed chat."""
    content, calls, finishes = "", {}, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.id, d.function.name, "", 0]
            else:
                assert d.function.name is None  # the name comes once, in the call's first delta
            calls[d.index][2] += d.function.arguments or ""
            calls[d.index][3] += 1
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, calls, finishes


# ---- constrained: named and required ---------------------------------------------------------------------------

def test_a_named_choice_is_one_complete_call_at_temperature_1_though_the_schema_leaves_objects_open(served):
    client, engine = served
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=150, n=4, temperature=1.0,
                                       seed=5, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments, only="get_weather")
    # the tools reached the prompt in the template's own format (transformers'), not the chat without them
    assert r.usage.prompt_tokens == _prompt_tokens(engine, ASK, TOOLS) > _prompt_tokens(engine, ASK) + 50


def test_required_streams_one_call_as_tool_call_deltas_at_temperature_1(served):
    client, _ = served
    for seed in range(3):
        content, calls, finishes = _stream(client, model="", messages=ASK, tools=TOOLS, max_tokens=150,
                                           temperature=1.0, seed=seed, tool_choice="required")
        assert finishes == ["tool_calls"] and content == ""  # the call's text is not content
        ((_, name, arguments, deltas),) = calls.values()
        _check_call(name, arguments)
        assert deltas > 2  # the name first, then the arguments as they are generated


# ---- auto: the model's own text read back -------------------------------------------------------------------------

CALL_TEXT = {"qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "llama": '{"name": "get_weather", "parameters": {"city": "Paris"}}'}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_auto_reads_the_models_call_in_its_format(request, family, stream):
    client, _ = request.getfixturevalue(family)
    kwargs = dict(model="", messages=ASK, tools=TOOLS, max_tokens=60,
                  extra_body={"structured_outputs": {"choice": [CALL_TEXT[family]]}})
    if stream:
        content, found, finishes = _stream(client, **kwargs)
        finish, calls = finishes[-1], [(name, args) for _, name, args, _ in found.values()]
        content = content or None
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, content = choice.finish_reason, choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and content is None
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Paris"})]


def test_auto_text_that_is_no_call_is_content(qwen3):
    client, _ = qwen3
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["It is sunny <b>today</b>."]}})
    assert r.choices[0].message.content == "It is sunny <b>today</b>." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


# ---- a full round trip ------------------------------------------------------------------------------------------

def test_round_trip_tools_then_a_call_then_its_result_then_an_answer(served):
    client, engine = served
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=150,
                                           tool_choice="required")
    message = first.choices[0].message
    (call,) = message.tool_calls
    arguments = _check_call(call.function.name, call.function.arguments)
    turn = [*ASK, message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "in": arguments})}]
    answer = client.chat.completions.create(model="", messages=turn, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    # the call and its result reached the prompt as the template renders them (transformers')
    expected = template_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]}, turn[2]])
    assert answer.usage.prompt_tokens == _prompt_tokens(engine, expected)
    assert "sunny" in engine.tokenizer.decode(engine.intake.chat_token_ids(expected))


# ---- refusals ---------------------------------------------------------------------------------------------------

def test_a_model_whose_template_renders_no_tools_gets_a_400_naming_the_templates(llama_dir):
    engine = LLM(EngineConfig(model=str(llama_dir), num_kv_blocks=64)).engine  # SmolLM2's ChatML: no tools
    server, client = _serve(engine)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required")
        message = caught.value.body["message"]
        assert caught.value.body["param"] == "tool_choice"
        for shipped in ("--chat-template", "chatml (hermes)", "llama3 (llama3_json)", "mistral (mistral)"):
            assert shipped in message, message
        r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
        assert r.choices[0].message.tool_calls is None  # "none" leaves the tools out: any template serves it
    finally:
        client.close()
        server.close()


def test_a_constrained_choice_with_response_format_is_refused(qwen3):
    client, _ = qwen3
    with pytest.raises(openai.BadRequestError, match="constrains the output already"):
        client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
