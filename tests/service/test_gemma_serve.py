"""`tandem serve --model gemma-3-270m-q4_k_m.gguf` as a real process: greedy continuations through gRPC equal
transformers' on the same file (the shared session reference of tests/gemma.py), and the model's info names it.
The same process serves the operator's first-day flags: `--chat-template gemma` (a template that ships) gives the base
model (its GGUF has no template) a chat that stops at `<end_of_turn>`, `--served-model-name` its aliases, and special tokens stay out of the text."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from clients import AsyncClient
from service.cluster import free_port
from tests.gemma import MAX_TOKENS, check_greedy
from tests.service.conftest import GUARD_S
from tests.service.process_harness import ServeProcess


@pytest.fixture(scope="module")
def gemma_server(gemma_gguf):
    http_port = free_port()
    # float32 activations: the greedy check against transformers allows summation order only (tests/gemma.py
    # check_greedy); under the default (`auto`: the K-quants' activations rounded to int8 in decode-only steps, float32
    # in mixed ones) two of the sixteen continuations diverged as this server schedules them.
    server = ServeProcess("--model", str(gemma_gguf), "--host", "127.0.0.1", "--http-port", str(http_port),
                          "--metrics-port", "-1", "--chat-template", "gemma", "--served-model-name", "gemma", "gemma3",
                          "--cpu-activations", "float32")
    server.http = f"http://127.0.0.1:{http_port}"
    yield server
    server.stop()


async def test_greedy_through_grpc_matches_transformers(gemma_server, gemma_prompts, gemma_reference) -> None:
    # Six of the sixteen, batched together: three short ones, a middle one and the two past the 512-token window.
    # The engine's parity on all sixteen is tests/models/test_gemma3_gguf.py's; this one checks the served path
    # (tokenizing, the gRPC door, concurrent streams), which ten more prompts of the same kinds only made longer.
    chosen = [0, 1, 2, 8, 14, 15]
    async with AsyncClient(gemma_server.address) as client:
        info = await client.model_info()
        assert info.architecture == "Gemma3ForCausalLM"
        outs = await asyncio.gather(*(client.complete(gemma_prompts[i], max_tokens=MAX_TOKENS, temperature=0.0)
                                      for i in chosen))
    check_greedy([o.token_ids for o in outs], [gemma_reference.greedy[i] for i in chosen])


async def test_aliases_from_the_openai_and_cohere_sdks(gemma_server) -> None:
    """--served-model-name: /v1/models lists the aliases (and the embedder); each works and is echoed; the file's path
    is not a name any more; the cohere SDK's required model gets the one reranker whatever it names."""
    import cohere
    import openai

    client = openai.OpenAI(base_url=gemma_server.http + "/v1", api_key="x")
    assert [m.id for m in client.models.list().data] == ["gemma", "gemma3", "all-MiniLM-L6-v2"]  # and the embedder
    for name in ("gemma", "gemma3"):
        out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert out.model == name and out.choices[0].text
    with pytest.raises(openai.NotFoundError, match="it serves \\['gemma', 'gemma3'\\]"):
        client.completions.create(model="gemma-3-270m-q4_k_m", prompt="Hi", max_tokens=1)
    co = cohere.ClientV2(api_key="x", base_url=gemma_server.http)
    ranked = co.rerank(model="rerank-v3.5", query="capital of France", documents=["Paris is in France.", "Bananas."])
    assert [r.index for r in ranked.results] == [0, 1]


async def test_chat_template_makes_the_base_model_chat_without_special_tokens_in_the_text(gemma_server) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=gemma_server.http + "/v1", api_key="x")
    chat = await client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=24, temperature=0)
    assert chat.choices[0].message.content and chat.usage.prompt_tokens > 5
    async with httpx.AsyncClient(base_url=gemma_server.http, timeout=GUARD_S) as http:
        rendered = (await http.post("/tokenize", json={
            "model": "gemma", "messages": [{"role": "user", "content": "Say hello."}]})).json()
    assert rendered["tokens"][:2] == [2, 105] and rendered["count"] == chat.usage.prompt_tokens  # <bos><start_of_turn>
    # Special tokens (here <start_of_image>, which the GGUF stores as an ordinary added token) are not text unless
    # asked for; their ids are still generated.
    forced = dict(model="gemma", prompt="A picture:", max_tokens=3, temperature=0, logit_bias={"255999": 100})
    plain = await client.completions.create(**forced)
    raw = await client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert plain.choices[0].text == "" and plain.usage.completion_tokens == 3
    assert raw.choices[0].text == "<start_of_image>" * 3


async def test_a_chat_stops_at_the_templates_end_of_turn_token(gemma_server) -> None:
    """The GGUF declares EOS 1 only; its chat template closes a turn with <end_of_turn> (106). A chat ends there, as
    llama.cpp ends at a template's end-of-generation token; a plain completion (no template) does not, and
    ignore_eos keeps a chat going past it as past EOS. (logit_bias makes the base model write 106 at once.)"""
    import openai

    client = openai.AsyncOpenAI(base_url=gemma_server.http + "/v1", api_key="x")
    forced = dict(model="gemma", max_tokens=6, temperature=0, logit_bias={"106": 100})
    chat = await client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}], **forced)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    assert chat.choices[0].message.content == ""
    plain = await client.completions.create(prompt="Say hello.", **forced)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 6
    ignoring = await client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}], **forced,
                                                    extra_body={"ignore_eos": True})
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 6


def test_start_up_says_what_capped_the_context(gemma_server) -> None:
    """The file's context is 32,768 tokens; the default KV budget holds 29,120 of them, and start-up says so."""
    said = "".join(gemma_server.output)
    assert ("context 29,120 of the model's 32,768 tokens, capped by the KV cache (tandem serve --kv-cache-bytes / "
            "--num-kv-blocks)") in said, said
    # the default with the embedded embedder, and what it means for a pipeline that retrieved with it (issue 63)
    assert ("rerank: dense (all-MiniLM-L6-v2's cosine: documents retrieved by this embedder come back in their "
            "retrieval order; a trained cross-encoder is --reranker BAAI/bge-reranker-v2-m3)") in said
