"""Schemas as clients write them, through both doors of one server (a tiny random Llama given the shipped `chatml`
template, whose tools format is hermes), issue #73:

* tool `parameters` from pydantic's `model_json_schema()` for nested models (`$defs` and `$ref`s to the schema's own
  root) are served: every call's arguments validate with the pydantic model, at temperature 1;
* a recursive schema the grammar can serve (a tree) is served; those it cannot (a `$ref` every value must take, a
  pattern or regex of large nested repetitions) are refused at submission, 400 / INVALID_ARGUMENT naming the field
  the client sent, never a 500 / INTERNAL a few tokens in;
* two tools of one name are a 400;
* afterwards every block is free."""
from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pydantic
import pytest

from clients.params import sampling_params
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from service.tool_formats import closed
from tests.reliability.tiny import make_tiny_model_dir, tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free


class Where(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(pattern=r"^[A-Z]{2}$")


class Hour(pydantic.BaseModel):
    hour: int = pydantic.Field(ge=0, le=23)


class Weather(pydantic.BaseModel):
    where: Where
    at: Hour | None = None
    unit: str = "celsius"


class Node(pydantic.BaseModel):  # recursive, and servable: children may be empty
    value: int = pydantic.Field(ge=0, le=9)
    children: list["Node"] = pydantic.Field(default_factory=list, max_length=2)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
HEAVY_PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(.{1,1000}){1000}$"}},
                 "required": ["s"]}
HEAVY_REGEX = "(x{1000}){1000}"
DEFS_BY_HAND = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 9}},
                                  "required": ["city"]}},
                "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}
DEFINITIONS = {"definitions": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}, "type": "object",
               "properties": {"a": {"$ref": "#/definitions/n"}, "b": {"$ref": "#/properties/a"}},
               "required": ["a", "b"]}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = tiny_engine(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-schemas")), chat_template="chatml",
                         num_kv_blocks=256, max_model_len=1024)
    config = ServerConfig(host="127.0.0.1", port=0)
    server = ServerThread(engine, config)
    http = server.add_http(config)
    with httpx.Client(base_url=http.url, timeout=120) as client:
        yield server, client
    server.close()


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "", "messages": ASK, "max_tokens": 300, **body})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_pydantic_nested_models_as_tool_parameters_give_arguments_that_validate(live, choice):
    _, client = live
    tools = [_tool("get_weather", Weather.model_json_schema()), _tool("get_tree", Node.model_json_schema())]
    assert "$defs" in tools[0]["function"]["parameters"] and "$defs" in tools[1]["function"]["parameters"]
    r = _chat(client, tools=tools, tool_choice=choice, n=3, temperature=1.0, seed=7)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        model = {"get_weather": Weather, "get_tree": Node}[call["function"]["name"]]
        model.model_validate_json(call["function"]["arguments"])


@pytest.mark.parametrize("schema", [DEFS_BY_HAND, DEFINITIONS, Node.model_json_schema()],
                         ids=["$defs", "definitions and properties pointers", "recursive tree"])
def test_refs_to_the_schemas_own_root_resolve_in_tools_as_in_response_format(live, schema):
    _, client = live
    r = _chat(client, tools=[_tool("f", schema)], tool_choice="required", temperature=1.0, seed=3)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    # closed as the tool call's is (a random model would otherwise add keys until max_tokens)
    r = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": closed(schema)}},
              temperature=1.0, seed=3)
    assert r.status_code == 200, r.text
    doc = json.loads(r.json()["choices"][0]["message"]["content"])
    for value in (args, doc):
        jsonschema.validate(value, schema)


# What the grammar cannot serve, as each door takes it: the field the client sent is named.
HTTP_REFUSED = [
    ("tool $ref to #", dict(tools=[_tool("f", {"$ref": "#"})], tool_choice="required"),
     "tools[0].function.parameters"),
    ("tool recursive required", dict(tools=[_tool("f", RECURSIVE_REQUIRED)],
                                     tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools[0].function.parameters"),
    ("tool heavy pattern", dict(tools=[_tool("f", HEAVY_PATTERN)], tool_choice="required"),
     "tools[0].function.parameters"),
    ("response_format recursive required",
     dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE_REQUIRED}}),
     "response_format.json_schema.schema"),
    ("response_format heavy pattern",
     dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": HEAVY_PATTERN}}),
     "response_format.json_schema.schema"),
    ("structured_outputs.regex heavy", dict(structured_outputs={"regex": HEAVY_REGEX}), "structured_outputs.regex"),
    ("guided_json recursive", dict(guided_json=RECURSIVE_REQUIRED), "guided_json"),
    ("duplicate tool names", dict(tools=[_tool("f", DEFS_BY_HAND), _tool("f", {"type": "object"})],
                                  tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools[1].function.name 'f'"),
    ("duplicate tool names, auto", dict(tools=[_tool("f", DEFS_BY_HAND), _tool("f", {"type": "object"})]),
     "tools[1].function.name 'f'"),
]


@pytest.mark.parametrize("body, field", [(b, f) for _, b, f in HTTP_REFUSED], ids=[i for i, _, _ in HTTP_REFUSED])
def test_what_the_grammar_cannot_serve_is_a_400_naming_the_field_over_http(live, body, field):
    _, client = live
    for stream in (False, True):
        r = _chat(client, **body, stream=stream)
        assert r.status_code == 400, (stream, r.text)
        assert field in r.json()["error"]["message"], r.json()


GRPC_REFUSED = [
    ("json_schema recursive required", dict(json_schema=json.dumps(RECURSIVE_REQUIRED)),
     "response_format.json_schema"),
    ("json_schema $ref to #", dict(json_schema='{"$ref": "#"}'), "response_format.json_schema"),
    ("json_schema heavy pattern", dict(json_schema=json.dumps(HEAVY_PATTERN)), "response_format.json_schema"),
    ("regex heavy", dict(regex=HEAVY_REGEX), "response_format.regex"),
]


async def test_what_the_grammar_cannot_serve_is_invalid_argument_over_grpc_beside_a_served_tree(live):
    server, _ = live
    messages = [pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id=name, prompt="A JSON value:", params=sampling_params(max_tokens=200, **params)))
        for name, params, _ in GRPC_REFUSED]
    messages.append(pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id="tree", prompt="A tree:", params=sampling_params(
            max_tokens=300, temperature=1.0, seed=2, json_schema=json.dumps(Node.model_json_schema())))))
    replies: dict[str, list] = {}
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = pb_grpc.TandemStub(channel).Generate()
        for m in messages:
            await call.write(m)
        await call.done_writing()
        async for reply in call:
            replies.setdefault(reply.request_id, []).append(reply)
    for name, _, field in GRPC_REFUSED:
        (reply,) = replies[name]
        assert reply.WhichOneof("kind") == "error", reply
        assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and field in reply.error.message, reply
    tree = replies["tree"]
    assert tree[-1].WhichOneof("kind") == "final", tree[-1]
    text = "".join(r.delta.text for r in tree if r.WhichOneof("kind") == "delta") + tree[-1].final.text
    if tree[-1].final.finish_reason == pb.FINISH_REASON_STOP:
        Node.model_validate_json(text)
    assert_all_blocks_free(await server.idle_stats())
