"""The #20 generation parameters over real localhost sockets: bad values are refused by name while other requests
run on, n > 1 streams tagged deltas, log-probabilities reach the client as the engine computed them, structured
output constrains the text, and nothing leaks a KV block."""
from __future__ import annotations

import asyncio
import json
import math
import re
from collections import defaultdict

import grpc
import jsonschema
import pytest

from clients import AsyncClient
from clients.params import sampling_params
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from tests.service.conftest import PROMPTS, UNENDING
from tests.service.harness import assert_all_blocks_free

VOCAB = 49152  # SmolLM2's vocabulary (ModelInfo.vocab_size says so; checked below)
NAN, INF = math.nan, math.inf

# (what is wrong, sampling keywords, the text the INVALID_ARGUMENT message must contain: the field's name)
BAD = [
    ("n = 0", dict(n=0), "n must be"),
    ("n over 16", dict(n=17), "n must be"),
    ("logprobs over 20", dict(logprobs=21), "logprobs must be"),
    ("prompt_logprobs over 20", dict(prompt_logprobs=21), "prompt_logprobs must be"),
    ("repetition_penalty 0", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty NaN", dict(repetition_penalty=NAN), "repetition_penalty"),
    ("presence_penalty NaN", dict(presence_penalty=NAN), "presence_penalty"),
    ("presence_penalty over 2", dict(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty -inf", dict(frequency_penalty=-INF), "frequency_penalty"),
    ("min_p NaN", dict(min_p=NAN), "min_p"),
    ("min_p over 1", dict(min_p=1.5), "min_p"),
    ("min_tokens over max_tokens", dict(max_tokens=4, min_tokens=5), "min_tokens"),
    ("logit_bias negative id", dict(logit_bias={-1: 1.0}), "logit_bias"),
    ("logit_bias id past the vocabulary", dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    ("logit_bias NaN", dict(logit_bias={5: NAN}), "logit_bias"),
    ("logit_bias over 100", dict(logit_bias={5: 101.0}), "logit_bias"),
    ("json_schema not JSON", dict(json_schema="{not json"), "json_schema"),
    ("json_schema not an object", dict(json_schema="[1, 2]"), "json_schema"),
    ("json_schema not a schema", dict(json_schema='{"type": "no-such-type"}'), "json"),
    ("regex that does not compile", dict(regex="(ab"), "regex"),
    ("empty choice list", dict(choice=[]), "choice"),
    ("empty choice", dict(choice=["yes", ""]), "choice"),
]


def _request(request_id: str, *, prompt: str | None = None, token_ids: list[int] | None = None,
             **params) -> pb.GenerateClientMessage:
    request = pb.GenerateRequest(request_id=request_id, params=sampling_params(**params))
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.prompt = prompt or PROMPTS[0]
    return pb.GenerateClientMessage(request=request)


async def _run(address: str, messages: list[pb.GenerateClientMessage]) -> dict[str, list[pb.GenerateServerMessage]]:
    """Send every message on one Generate stream, half-close, and return the replies by request id."""
    replies: dict[str, list] = defaultdict(list)
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.TandemStub(channel).Generate()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        async for reply in call:
            replies[reply.request_id].append(reply)
    return replies


async def test_bad_values_are_refused_by_name_while_a_neighbour_runs_and_nothing_leaks(served, offline):
    async with AsyncClient(served.address) as client:
        assert (await client.model_info()).vocab_size == VOCAB
    neighbour = _request("neighbour", prompt=PROMPTS[1], max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = [_request(f"bad-{i}", **params) for i, (_, params, _) in enumerate(BAD)]
    replies = await _run(served.address, [neighbour, *bad])
    wrong = {}
    for i, (what, _, needle) in enumerate(BAD):
        got = replies[f"bad-{i}"]
        if len(got) != 1 or got[0].WhichOneof("kind") != "error" or got[0].error.code != 3 \
                or needle not in got[0].error.message:
            wrong[what] = [str(r)[:200] for r in got]
    assert not wrong, wrong
    final = replies["neighbour"][-1].final
    assert [t for r in replies["neighbour"] for t in getattr(r, r.WhichOneof("kind")).token_ids] \
        == offline.long.token_ids
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.usage.completion_tokens == 12
    assert_all_blocks_free(await served.idle_stats())


async def test_n2_streams_deltas_tagged_by_index_two_finish_reasons_and_one_final(served, offline):
    """Greedy n = 2: both completions are the offline greedy text; usage counts the prompt once."""
    replies = (await _run(served.address, [_request("n2", prompt=PROMPTS[1], n=2, max_tokens=12, temperature=0.0,
                                                    ignore_eos=True)]))["n2"]
    kinds = [r.WhichOneof("kind") for r in replies]
    assert kinds.count("final") == 1 and kinds[-1] == "final" and "error" not in kinds
    parts = [getattr(r, k) for r, k in zip(replies, kinds)]
    tokens = {i: [t for p in parts if p.index == i for t in p.token_ids] for i in (0, 1)}
    assert {p.index for p in parts} == {0, 1}
    assert tokens[0] == tokens[1] == offline.long.token_ids
    ends = [(p.index, p.finish_reason) for p in parts if p.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(ends) == [(0, pb.FINISH_REASON_LENGTH), (1, pb.FINISH_REASON_LENGTH)]
    usage = parts[-1].usage
    assert usage.prompt_tokens == len(offline.long.prompt_token_ids) and usage.completion_tokens == 24
    assert_all_blocks_free(await served.idle_stats())


async def test_client_complete_gathers_n_completions(served, offline):
    async with AsyncClient(served.address) as client:
        deltas = [d async for d in client.generate(PROMPTS[1], n=2, max_tokens=12, temperature=0.0, ignore_eos=True)]
        result = await client.complete(PROMPTS[1], n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1]
    assert [c.index for c in result.outputs] == [0, 1]
    assert all(c.token_ids == offline.long.token_ids and c.finish_reason == "length" for c in result.outputs)
    assert result.text == offline.long.text and result.usage.completion_tokens == 24


async def test_cancel_of_an_n2_request_ends_both_completions_and_frees_every_block(served):
    async with AsyncClient(served.address) as client:
        deltas = []
        async for delta in client.generate(PROMPTS[3], n=2, max_tokens=UNENDING, ignore_eos=True, request_id="n2-cancel"):
            deltas.append(delta)
            if len(deltas) == 1:
                client.cancel("n2-cancel")
        stats = await served.idle_stats()
    ends = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert ends == {0: "abort", 1: "abort"} and deltas[-1].finished
    assert deltas[-1].usage.completion_tokens == sum(len(d.token_ids) for d in deltas) < 2 * UNENDING
    assert served.recorder.finished["n2-cancel"][-1].finish_reason == "abort"
    assert_all_blocks_free(stats)


async def test_logprobs_reach_the_client_as_the_engine_scored_them(served, offline):
    """Greedy with logprobs=3: every token has its entry, chosen first and the most likely (greedy takes the argmax
    of the raw distribution the values are of). The same tokens fed back as a prompt get the same values as
    prompt_logprobs, computed in prefill instead of decode: the two engine paths agree through the transport."""
    prompt = offline.greedy[0].prompt_token_ids
    async with AsyncClient(served.address) as client:
        deltas = [d async for d in client.generate(token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   logprobs=3, prompt_logprobs=2)]
        generated = [t for d in deltas for t in d.token_ids]
        again = await client.complete(token_ids=prompt + generated, max_tokens=1, temperature=0.0,
                                      prompt_logprobs=3)
    assert all(len(d.logprobs or ()) == len(d.token_ids) for d in deltas)
    positions = [lp for d in deltas for lp in d.logprobs or ()]
    for token, lp in zip(generated, positions):
        values = list(lp.values())
        assert next(iter(lp)) == token and len(lp) == 3 and values[0] == max(values)
        assert values[1:] == sorted(values[1:], reverse=True) and all(v <= 0 for v in values)
    first = deltas[0].prompt_logprobs
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert len(first) == len(prompt) and first[0] is None
    assert [next(iter(p)) for p in first[1:]] == prompt[1:] and all(2 <= len(p) <= 3 for p in first[1:])
    fed_back = again.prompt_logprobs[len(prompt):]
    for decoded, prefilled in zip(positions, fed_back):
        assert set(decoded) == set(prefilled)
        assert all(abs(decoded[t] - prefilled[t]) < 2e-4 for t in decoded), (decoded, prefilled)
    for served_first, prefilled in zip(first[1:], again.prompt_logprobs[1:len(prompt)]):
        chosen = next(iter(served_first))
        assert abs(served_first[chosen] - prefilled[chosen]) < 2e-4


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "count"], "additionalProperties": False}


async def test_structured_output_json_regex_and_choice(served):
    prompt = "Describe a ball as JSON."
    async with AsyncClient(served.address) as client:
        docs = await asyncio.gather(*(client.complete(prompt, json_schema=SCHEMA, max_tokens=40, temperature=0.8,
                                                      seed=seed) for seed in range(3)))
        code = await client.complete("A product code:", regex=r"[A-Z]{2}-[0-9]{3}", max_tokens=12, temperature=0.8,
                                     seed=1)
        picks = await client.complete("Is the sky blue?", choice=["yes", "no", "maybe"], n=3, temperature=1.0,
                                      max_tokens=8, seed=2)
    for doc in docs:
        assert doc.finish_reason == "stop", doc
        jsonschema.validate(json.loads(doc.text), SCHEMA)
    assert code.finish_reason == "stop" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", code.text), code.text
    assert [c.text in ("yes", "no", "maybe") for c in picks.outputs] == [True] * 3, picks.outputs
    assert_all_blocks_free(await served.idle_stats())


@pytest.mark.parametrize("params", [dict(n=0), dict(logprobs=21), dict(json_schema="{")])
def test_sync_client_raises_the_refusal(served, params):
    from clients import Client, TandemError

    with Client(served.address) as client, pytest.raises(TandemError) as info:
        list(client.generate("Hi", **params))
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and next(iter(params)) in info.value.message


def test_cli_generate_prints_n_completions_with_logprobs_as_json(served, offline):
    import io

    from clients.cli import run
    from service.cli import build_parser

    args = build_parser().parse_args(["generate", "--target", served.address, "--n", "2", "--max-tokens", "8",
                                      "--temperature", "0", "--logprobs", "1", "--json", PROMPTS[0]])
    out = io.StringIO()
    assert run(args, out) == 0
    result = json.loads(out.getvalue())
    assert [c["index"] for c in result["completions"]] == [0, 1]
    for c in result["completions"]:
        assert c["token_ids"] == offline.greedy[0].token_ids and c["text"] == offline.greedy[0].text
        assert [lp[0][0] for lp in c["logprobs"]] == c["token_ids"]  # chosen token first at every position
    assert result["usage"]["completion_tokens"] == 2 * len(offline.greedy[0].token_ids)
