"""The HTTP door's OpenAI API, driven by the `openai` package (sync and async) over loopback, against the
offline engine's outputs and the tokenizer's own token texts."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.service.conftest import CHAT, GUARD_S, MAX_MESSAGE_BYTES, MAX_MODEL_LEN, PROMPTS

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(http_url):
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(http_url):
    async with openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_served_names(client, served):
    ids = [m.id for m in client.models.list().data]
    assert ids and set(ids) <= {*served.core.info.served_names, served.core.info.embedder}  # the embedder: its own id
    assert client.models.retrieve(ids[0]).id == ids[0]


def test_chat_greedy_equals_the_offline_engine(client, offline):
    r = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == offline.chat.text
    assert r.choices[0].finish_reason == offline.chat.finish_reason
    assert r.usage.completion_tokens == len(offline.chat.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream_with_usage(client, offline):
    stream = client.chat.completions.create(messages=CHAT, model="", max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline.chat.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == offline.chat.finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(offline.chat.token_ids)


def test_chat_without_max_tokens_runs_until_it_stops(client, http_url, served):
    """The SDK sends no max_tokens unless told (nor does curl with only `messages`): the rest of the context, as
    vLLM fills it in, not a 400 over the server's own default. The generation ends by itself (EOS, or the stop
    string: no ignore_eos)."""
    stream = client.chat.completions.create(model="", messages=CHAT, stream=True, temperature=0, stop=["."])
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    r = client.chat.completions.create(model="", messages=CHAT, temperature=0, stop=["."])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.strip()
    with httpx.Client(base_url=http_url, timeout=None) as h:
        only = h.post("/v1/chat/completions", json={"messages": CHAT, "stop": [".", "\n"], "seed": 1})
    assert only.status_code == 200, only.text
    assert only.json()["choices"][0]["finish_reason"] == "stop"
    completion = client.completions.create(model="", prompt="The capital of France is", temperature=0,
                                           stop=[".", "\n"])
    assert completion.choices[0].finish_reason == "stop"
    # legacy completions keep OpenAI's (and vLLM's) default of 16 tokens
    sixteen = client.completions.create(model="", prompt="Count: one, two,", temperature=0,
                                        extra_body={"ignore_eos": True})
    assert sixteen.usage.completion_tokens == 16 and sixteen.choices[0].finish_reason == "length"


def test_a_max_tokens_set_too_large_is_still_a_400_naming_the_most_that_fits(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=CHAT, max_tokens=MAX_MODEL_LEN)
    assert "max_tokens is too large: 8192" in info.value.message and "can be at most" in info.value.message


def test_completions_prompt_list_greedy(client, offline):
    r = client.completions.create(model="", prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in offline.greedy[:3]]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in offline.greedy[:3])


def test_completions_token_ids_prompt(client, offline):
    ids = offline.llm.engine.tokenizer(PROMPTS[0])["input_ids"]
    r = client.completions.create(model="", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == offline.greedy[0].text


def test_chat_logprobs_carry_the_tokenizers_token_text(client, offline):
    r = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    tokenizer = offline.llm.engine.tokenizer
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in offline.chat.token_ids]
    special = set(tokenizer.all_special_ids)
    spoken = [t for t, i in zip(content, offline.chat.token_ids) if i not in special]  # the EOS has logprobs too
    assert b"".join(bytes(t.bytes) for t in spoken).decode() == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)


def test_completions_logprobs_shape(client, offline):
    r = client.completions.create(model="", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    special = set(offline.llm.engine.tokenizer.all_special_tokens)  # in logprobs, never in the text
    assert "".join(t for t in lp.tokens if t not in special) == r.choices[0].text
    assert r.choices[0].text.startswith(offline.greedy[0].text.removesuffix("<|im_end|>"))
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) == 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))


def test_n2_sampled_chat(client):
    r = client.chat.completions.create(model="", messages=CHAT, max_tokens=6, temperature=1.0, seed=7, n=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12
    again = client.chat.completions.create(model="", messages=CHAT, max_tokens=6, temperature=1.0, seed=7, n=2,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded


def test_json_schema_response_validates(client):
    r = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Weather in Paris as JSON."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


async def test_async_chat_stream_n2_and_completions(aclient):
    stream = await aclient.chat.completions.create(model="", messages=CHAT, max_tokens=5, n=2, stream=True,
                                                   temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    texts, finishes = {0: "", 1: ""}, {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length"} and all(texts.values())
    r = await aclient.completions.create(model="", prompt="Once upon a time", max_tokens=4, stream=False,
                                         extra_body={"ignore_eos": True, "min_tokens": 4})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    s = await aclient.completions.create(model="", prompt="Once upon a time", max_tokens=4, stream=True,
                                         extra_body={"ignore_eos": True})
    assert len([c async for c in s]) >= 1


@pytest.mark.parametrize("extra, field", [({"tool_choice": "required"}, "tool_choice"),
                                          ({"modalities": ["text", "audio"]}, "modalities"),
                                          ({"functions": [{"name": "f"}]}, "functions"),
                                          ({"web_search_options": {"search_context_size": "low"}},
                                           "web_search_options"),
                                          ({"frobnicate": 1}, "frobnicate")])
def test_unsupported_fields_are_refused_by_name(client, extra, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=CHAT, max_tokens=2, extra_body=extra)
    assert info.value.status_code == 400 and field in info.value.message
    assert info.value.body["param"] == field


def test_fields_that_change_nothing_are_accepted(client):
    """What frameworks send and what changes no answer here is accepted (docs/http.md lists them)."""
    r = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi", "name": "ada"}], max_tokens=2, tool_choice="none",
        modalities=["text"], metadata={"session": "s1"}, service_tier="auto", reasoning_effort="low", store=False,
        parallel_tool_calls=True, user="u1", prediction={"type": "content", "content": "Hello"})
    assert r.choices[0].message.content is not None and r.choices[0].message.tool_calls is None


def test_tools_on_a_template_that_renders_none_are_refused_naming_the_templates(client):
    """The embedded SmolLM2's own template has no tool format: a 400 naming the shipped templates that do."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=CHAT, max_tokens=2, tools=tools)  # default: "auto"
    assert "renders no tools" in info.value.message and "--chat-template" in info.value.message
    assert "chatml (hermes)" in info.value.message and info.value.body["param"] == "tool_choice"


def test_a_model_named_for_another_task_is_refused(client, http_url, served):
    """An embedding sent to the chat model's name, a chat sent to the embedder's: 400 in the API's own shape, not
    served by the other model under the name given. A rerank may name the embedder: it scores (here, in the fusion
    mode, beside the LLM), and the response names both."""
    chat_model, embedder = served.core.info.model, served.core.info.embedder
    with pytest.raises(openai.BadRequestError) as embed:
        client.embeddings.create(model=chat_model, input="hello")
    assert f"model {chat_model!r} does not embed" in embed.value.message and embedder in embed.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=embedder, messages=CHAT, max_tokens=2)
    assert "does not generate" in chat.value.message
    with httpx.Client(base_url=http_url, timeout=GUARD_S) as h:
        tei = h.post("/embed", json={"inputs": "hello"})  # no model field: the embedder
        cohere_ = h.post("/v2/rerank", json={"query": "q", "documents": ["d"], "model": embedder})
    assert tei.status_code == 200
    assert cohere_.status_code == 200 and cohere_.json()["model"] == f"{embedder}+{chat_model}", cohere_.text
    embedded = client.embeddings.create(model="text-embedding-3-small", input="hello")  # no model here: the embedder's
    assert embedded.model == embedder


def test_models_say_what_each_model_does(client, served):
    cards = {m.id: m for m in client.models.list().data}
    llm, embedder = cards[served.core.info.model], cards[served.core.info.embedder]
    assert (llm.task, llm.capabilities) == ("generate", ["generate", "rerank"])  # fusion: the LLM scores pairs
    assert (embedder.task, embedder.capabilities) == ("embed", ["embed", "rerank"])  # and the embedder's cosine
    assert llm.max_model_len == served.core.info.max_model_len
    assert embedder.max_model_len == served.core.info.embedder_max_tokens < llm.max_model_len
    assert client.models.retrieve(served.core.info.embedder).task == "embed"


def test_null_unsupported_fields_are_unset(client):
    r = client.chat.completions.create(model="", messages=CHAT, max_tokens=2, extra_body={"tools": None})
    assert r.choices[0].message.content is not None


def test_unknown_model_is_openais_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "gpt-4o" in info.value.message


def test_engine_refusals_are_400_with_the_grpc_message(client):
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite number >= 0"):
        client.chat.completions.create(model="", messages=CHAT, max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be an integer in"):
        client.completions.create(model="", prompt="x", max_tokens=2, n=0)
    with pytest.raises(openai.BadRequestError, match="prompt has .* tokens"):  # refused by the engine, not the door
        client.completions.create(model="", prompt="word " * 9000, max_tokens=2)


def test_errors_in_openais_shape(http_url):
    url = f"{http_url}/v1/chat/completions"
    cases = [(b'{"messages": [', 400, "malformed JSON"), (b'{"messages": "hi"}', 400, "messages"),
             (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400, "max_tokens"),
             (b'{}', 400, "messages is required"), (b"x" * (MAX_MESSAGE_BYTES + 1), 413, "over the limit")]
    with httpx.Client() as h:
        for body, status, text in cases:
            r = h.post(url, content=body)
            assert r.status_code == status, (body[:40], r.text)
            error = r.json()["error"]
            assert text in error["message"] and set(error) == {"message", "type", "param", "code"}
        assert h.get(f"{http_url}/v1/nothing").status_code == 404
        assert h.get(f"{http_url}/v1/chat/completions").status_code == 405
        assert h.get(f"{http_url}/health").status_code == 200
        assert h.get(f"{http_url}/ready").text.strip() == "SERVING"
        assert h.get(f"{http_url}/metrics").headers["content-type"].startswith("text/plain")
