"""Generation over real localhost sockets: multiplexing, cancel, disconnect, deadlines, metadata."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from clients import AsyncClient, Client, TandemError
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from tests.service.conftest import CHAT, PROMPTS, UNENDING
from tests.service.harness import assert_all_blocks_free


def _request(request_id: str, prompt: str, **params) -> pb.GenerateClientMessage:
    return pb.GenerateClientMessage(request=pb.GenerateRequest(request_id=request_id, prompt=prompt,
                                                               params=pb.SamplingParams(**params)))


async def test_32_generations_over_4_streams_match_offline(served, offline):
    clients = [AsyncClient(served.address) for _ in range(4)]
    try:
        outs = await asyncio.gather(*(
            clients[i % 4].complete(prompt, max_tokens=8, temperature=0.0, request_id=f"mux-{i}")
            for i, prompt in enumerate(PROMPTS)))
    finally:
        for client in clients:
            await client.close()
    assert [o.text for o in outs] == [r.text for r in offline.greedy]
    assert [o.token_ids for o in outs] == [r.token_ids for r in offline.greedy]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in offline.greedy]
    assert [o.usage.prompt_tokens for o in outs] == [len(r.prompt_token_ids) for r in offline.greedy]
    assert [o.usage.completion_tokens for o in outs] == [len(r.token_ids) for r in offline.greedy]
    assert all(o.usage.time_to_first_token_s > 0 for o in outs)
    streams = {served.recorder.finished[f"mux-{i}"][-1].metadata["stream"] for i in range(len(PROMPTS))}
    assert len(streams) == 4  # four streams really carried the 32 requests
    assert_all_blocks_free(await served.idle_stats())


async def test_cancel_ends_one_request_with_abort_and_siblings_continue(served, offline):
    # Neither generation can end on its own; the sibling is decoding before the cancel and is stopped only after
    # the cancelled one's final message, so the order below is the protocol's, not the machine's speed.
    async with AsyncClient(served.address) as client:
        sibling = client.generate(PROMPTS[1], max_tokens=UNENDING, temperature=0.0, ignore_eos=True,
                                  request_id="sibling")
        kept = [await sibling.__anext__()]
        deltas = []
        async for delta in client.generate(PROMPTS[0], max_tokens=UNENDING, ignore_eos=True, temperature=0.0,
                                           request_id="cancel-me"):
            deltas.append(delta)
            if len(deltas) == 1:
                client.cancel("cancel-me")
        while sum(len(d.token_ids) for d in kept) < len(offline.long.token_ids):
            kept.append(await sibling.__anext__())
        assert not any(d.finished for d in kept)  # the cancel did not touch it
        client.cancel("sibling")
        kept += [d async for d in sibling]
    assert deltas[-1].finish_reason == "abort"
    assert deltas[-1].usage.completion_tokens == sum(len(d.token_ids) for d in deltas) < UNENDING
    n = len(offline.long.token_ids)
    assert [t for d in kept for t in d.token_ids][:n] == offline.long.token_ids  # greedy: LONG_12's tokens first
    assert kept[-1].finish_reason == "abort"
    cancelled, finished = served.recorder.finished["cancel-me"][-1], served.recorder.finished["sibling"][-1]
    assert cancelled.finish_reason == "abort" and finished.finished > cancelled.finished
    assert_all_blocks_free(await served.idle_stats())


async def test_breaking_out_of_the_loop_cancels_on_the_server(served):
    async with AsyncClient(served.address) as client:
        async for _ in client.generate(PROMPTS[2], max_tokens=UNENDING, ignore_eos=True, request_id="left-early"):
            break
        stats = await served.idle_stats()
    lc = served.recorder.finished["left-early"][-1]
    assert lc.finish_reason == "abort" and 1 <= lc.completion_tokens < UNENDING
    assert_all_blocks_free(stats)


async def test_disconnect_cancels_every_request_on_the_stream(served):
    channel = grpc.aio.insecure_channel(served.address)
    call = pb_grpc.TandemStub(channel).Generate()
    ids = [f"gone-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        await call.write(_request(request_id, PROMPTS[3 + i], max_tokens=UNENDING, ignore_eos=True))
    started: set[str] = set()
    while started != set(ids):
        message = await call.read()
        assert message.WhichOneof("kind") == "delta"
        started.add(message.request_id)
    await channel.close()  # no cancel messages: the client just goes away
    stats = await served.idle_stats()
    for request_id in ids:
        lc = served.recorder.finished[request_id][-1]
        assert lc.finish_reason == "abort" and lc.completion_tokens < UNENDING
    assert_all_blocks_free(stats)


async def test_stream_deadline_gets_deadline_exceeded_and_work_stops(served):
    async with grpc.aio.insecure_channel(served.address) as channel:
        call = pb_grpc.TandemStub(channel).Generate(timeout=1.0)
        await call.write(_request("deadline", PROMPTS[4], max_tokens=UNENDING, ignore_eos=True))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    stats = await served.idle_stats()
    lc = served.recorder.finished["deadline"][-1]
    assert lc.finish_reason == "abort" and lc.completion_tokens < UNENDING
    assert_all_blocks_free(stats)


async def test_request_timeout_gets_deadline_exceeded_and_work_stops(served):
    async with AsyncClient(served.address) as client:
        with pytest.raises(TandemError) as info:
            async for _ in client.generate(PROMPTS[5], max_tokens=UNENDING, ignore_eos=True, timeout=0.5,
                                           request_id="timeout"):
                pass
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "timeout_ms of 500 ms" in info.value.message
        stats = await served.idle_stats()
    lc = served.recorder.finished["timeout"][-1]
    assert lc.finish_reason == "deadline" and lc.error == "DEADLINE_EXCEEDED" and lc.completion_tokens < UNENDING
    assert_all_blocks_free(stats)


async def test_max_tokens_past_the_context_is_refused_while_a_neighbour_keeps_running(served, offline):
    prompt_tokens = len(offline.greedy[0].prompt_token_ids)
    async with AsyncClient(served.address) as client:
        neighbour = client.generate(PROMPTS[0], max_tokens=UNENDING, ignore_eos=True, request_id="neighbour")
        kept = [await neighbour.__anext__()]
        with pytest.raises(TandemError) as info:
            await client.complete(PROMPTS[0], max_tokens=1_000_000)
        kept.append(await neighbour.__anext__())
        client.cancel("neighbour")
        kept += [d async for d in neighbour]
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == (f"max_tokens is too large: 1000000; the prompt has {prompt_tokens} tokens and "
                                  f"max_model_len is 8192, so max_tokens can be at most {8192 - prompt_tokens}")
    assert not any(d.finished for d in kept[:2]) and kept[-1].finish_reason == "abort"
    assert_all_blocks_free(await served.idle_stats())


async def test_chat_and_token_ids_inputs_match_offline(served, offline):
    async with AsyncClient(served.address) as client:
        chat = await client.complete(messages=CHAT, max_tokens=8, temperature=0.0)
        ids = await client.complete(token_ids=offline.greedy[6].prompt_token_ids, max_tokens=8, temperature=0.0)
    assert (chat.text, chat.finish_reason) == (offline.chat.text, offline.chat.finish_reason)
    assert ids.token_ids == offline.greedy[6].token_ids


async def test_every_response_names_the_replica(served, offline):
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        stream = stub.Generate()
        await stream.write(_request("meta", PROMPTS[0], max_tokens=1))
        await stream.done_writing()
        unary = stub.ModelInfo(pb.ModelInfoRequest())
        refused = stub.Rerank(pb.RerankRequest(query="", documents=["a"]))
        for call in (stream, unary, refused):
            assert dict(await call.initial_metadata())["x-tandem-replica"] == served.address
        assert [m.WhichOneof("kind") async for m in stream][-1] == "final"
        assert (await unary).replica == served.address
        assert (await unary).cpu_kernels == offline.llm.engine.model.cpu_path.isa.label  # embedded GGUF on CPU
        assert await refused.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_sync_client_streams_and_reranks(served, offline):
    i = next(i for i, out in enumerate(offline.greedy) if out.finish_reason == "length")
    with Client(served.address) as client:
        deltas = list(client.generate(PROMPTS[i], max_tokens=8, temperature=0.0))
        results = client.rerank("capital of France", ["Paris is in France.", "Bananas."], top_n=1,
                                return_documents=True)
    assert "".join(d.text for d in deltas) == offline.greedy[i].text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 8
    assert len(results) == 1 and results[0].document == ["Paris is in France.", "Bananas."][results[0].index]
    assert 0.0 <= results[0].score <= 1.0


async def test_sync_client_break_cancels_on_the_server(served):
    def run() -> None:
        with Client(served.address) as client:
            for _ in client.generate(PROMPTS[9], max_tokens=UNENDING, ignore_eos=True, request_id="sync-left"):
                break
    await asyncio.to_thread(run)
    stats = await served.idle_stats()
    assert served.recorder.finished["sync-left"][-1].finish_reason == "abort"
    assert_all_blocks_free(stats)


def test_a_chat_without_max_tokens_runs_until_it_stops_over_grpc(served):
    """Unset max_tokens over gRPC is what it is over HTTP: the rest of the context (not the old 16), so the reply
    ends by itself at EOS: the embedded model's greedy haiku is 39 tokens and ends there (no ignore_eos)."""
    haiku = [{"role": "user", "content": "Write a haiku about the sea."}]
    with Client(served.address) as client:
        reply = client.complete(messages=haiku, temperature=0.0)
        with pytest.raises(TandemError) as refused:
            client.complete(messages=CHAT, max_tokens=8192)
    assert reply.finish_reason == "stop" and reply.usage.completion_tokens > 16, reply
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and "max_tokens is too large" in refused.value.message
