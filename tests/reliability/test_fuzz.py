"""gRPC fuzzing against a live server: over 2,000 malformed and edge-case messages, generated from the
server's own reflection descriptors (so every field of every tandem.v1.Tandem method is covered, including
fields and methods added later).

Rules held for every call:
* bytes that do not parse as the method's request message: INVALID_ARGUMENT (RESOURCE_EXHAUSTED when
  over the message size limit), never grpc.aio's default UNKNOWN;
* a well-formed message, whatever its values (NaN, negative, huge, empty, non-BMP unicode, out-of-range
  enum numbers, 100,000-item repeated fields, both members of a oneof, duplicate and unknown ids): only
  documented codes, as the call's status and in every per-request error; never UNKNOWN or INTERNAL;
* afterwards the server is healthy (health SERVING, a normal generation and rerank work) and every KV block
  is free.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service.server import ServerConfig
from tests.reliability.grammars import GRAMMARS
from tests.reliability.tiny import tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

SERVICE = "tandem.v1.Tandem"
MAX_DOCUMENTS = 16
MAX_MESSAGE_BYTES = 1 * 2**20
S = grpc.StatusCode
# service/errors.py: what a well-formed message may get back (CANCELLED only for calls the fuzzer cancels).
DOCUMENTED = {S.OK, S.INVALID_ARGUMENT, S.NOT_FOUND, S.ALREADY_EXISTS, S.RESOURCE_EXHAUSTED,
              S.DEADLINE_EXCEEDED, S.UNAVAILABLE, S.FAILED_PRECONDITION}
CODES = {c.value[0]: c for c in S}
# Known-good starting points, so mutations also reach the engine instead of failing the first check.
TEMPLATES = {
    "GenerateClientMessage": {"request": {"request_id": "t", "prompt": "Hello there",
                                          "params": {"max_tokens": 4, "temperature": 0.0}}},
    "RerankRequest": {"query": "what is blue", "documents": ["the sky", "a stone"], "request_id": "t"},
}


def _edge_strings(rng: random.Random) -> list[str]:
    return ["", " ", "t", "x" * rng.choice([1000, 65_000]), "\U0001F600\U0001D11E" * rng.randint(1, 500),
            "\x00", "a\x00b", "\u202e\u0301\ufeff", "t" * 3, "Hello there", "<|im_end|>", "é" * 40]


def _edge_values(f: FD, rng: random.Random) -> list:
    t = f.type
    if t == FD.TYPE_STRING:
        return _edge_strings(rng) + GRAMMARS.get(f.name, [])
    if t == FD.TYPE_BYTES:
        return [b"", b"\xff\xfe", bytes(rng.randrange(256) for _ in range(64)), b"x" * 100_000]
    if t == FD.TYPE_BOOL:
        return [True, False]
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        big = 1e308 if t == FD.TYPE_DOUBLE else 3e38
        return [math.nan, math.inf, -math.inf, -0.0, 0.0, big, -big, 5e-324 if t == FD.TYPE_DOUBLE else 1e-45,
                0.5, 1.0, -1.0, 2.0]
    if t == FD.TYPE_ENUM:
        return [v.number for v in f.enum_type.values] + [-1, 99, 2**31 - 1, -(2**31)]
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return [0, 1, 3, 49151, 49152, 2**32 - 1]
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return [0, 1, 2**63, 2**64 - 1]
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return [0, 1, -1, 2**63 - 1, -(2**63)]
    return [0, 1, 2, -1, 7, 2**31 - 1, -(2**31)]  # 32-bit signed


def _is_map(f: FD) -> bool:
    return f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def _repeated(f: FD) -> bool:
    return f.is_repeated


def leaf_paths(desc, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every field path under a message type (recursion cut at depth 4)."""
    out = []
    for f in desc.fields:
        path = prefix + (f.name,)
        out.append(path)
        if f.type == FD.TYPE_MESSAGE and not _is_map(f) and depth < 4:
            out += leaf_paths(f.message_type, path, depth + 1)
    return out


class Fuzzer:
    def __init__(self, pool: descriptor_pool.DescriptorPool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.covered: set[tuple] = set()  # (input type, field path) set to an edge value at least once

    def cls(self, desc):
        return message_factory.GetMessageClass(desc)

    def template(self, desc):
        msg = self.cls(desc)()
        spec = TEMPLATES.get(desc.name)
        if spec:
            self._fill(msg, spec)
        return msg

    @staticmethod
    def _fill(msg, spec: dict) -> None:
        for name, value in spec.items():
            if isinstance(value, dict):
                Fuzzer._fill(getattr(msg, name), value)
            elif isinstance(value, list):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)

    # ---- setting one field path to an edge value ------------------------------------------------------

    def set_path(self, root_desc, msg, path: tuple, value=None) -> None:
        self.covered.add((root_desc.full_name, path))
        for name in path[:-1]:
            f = msg.DESCRIPTOR.fields_by_name[name]
            if _repeated(f):
                items = getattr(msg, name)
                msg = items[0] if len(items) else items.add()
            else:
                msg = getattr(msg, name)
        f = msg.DESCRIPTOR.fields_by_name[path[-1]]
        self.assign(msg, f, value)

    def assign(self, msg, f: FD, value=None, depth: int = 0) -> None:
        rng = self.rng
        if _is_map(f):
            m = getattr(msg, f.name)
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            for _ in range(rng.choice([0, 1, 3])):
                key = rng.choice(_edge_values(key_f, rng))
                if val_f.type == FD.TYPE_MESSAGE:
                    self.randomize(m[key], depth + 1)
                else:
                    m[key] = rng.choice(_edge_values(val_f, rng))
            return
        if f.type == FD.TYPE_MESSAGE:
            if _repeated(f):
                items = getattr(msg, f.name)
                for _ in range(rng.choice([0, 1, 2, 5])):
                    self.randomize(items.add(), depth + 1)
                if not len(items):
                    del items[:]
            else:
                getattr(msg, f.name).SetInParent()
                self.randomize(getattr(msg, f.name), depth + 1)
            return
        if _repeated(f):
            items = getattr(msg, f.name)
            del items[:]
            n = rng.choice([0, 1, 2, 8, 100_000]) if value is None else 1
            if n == 100_000:  # tiny items, so the message stays under the size limit
                items.extend([rng.choice(_edge_values(f, rng)[:3])] * n if f.type != FD.TYPE_STRING else ["d"] * n)
            else:
                items.extend(value if isinstance(value, list) else
                             [value if value is not None else rng.choice(_edge_values(f, rng)) for _ in range(n)])
            return
        setattr(msg, f.name, value if value is not None else rng.choice(_edge_values(f, rng)))

    def randomize(self, msg, depth: int = 0) -> None:
        """Set a random subset of fields (a oneof may end with any member, or none) to edge values."""
        for f in msg.DESCRIPTOR.fields:
            if self.rng.random() < (0.5 if depth < 3 else 0.1):
                self.assign(msg, f, depth=depth)

    # ---- whole messages ------------------------------------------------------------------------------

    def systematic(self, desc) -> list[bytes]:
        """Each field path, in turn, set to each edge value of its type, on the method's template."""
        out = []
        for path in leaf_paths(desc):
            f = self._field_at(desc, path)
            values = [None] * 3 if f.type == FD.TYPE_MESSAGE else _edge_values(f, self.rng)
            for value in values:
                msg = self.template(desc)
                self.set_path(desc, msg, path, value)
                out.append(msg.SerializeToString())
        return out

    def random_messages(self, desc, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            msg = self.template(desc) if self.rng.random() < 0.6 else self.cls(desc)()
            paths = leaf_paths(desc)
            for path in self.rng.sample(paths, k=min(len(paths), self.rng.randint(1, 4))):
                self.set_path(desc, msg, path)
            data = msg.SerializeToString()
            if self.rng.random() < 0.1:  # a second copy with another oneof member: parsers merge, last wins
                other = self.cls(desc)()
                self.randomize(other)
                data += other.SerializeToString()
            out.append(data)
        return out

    def malformed(self, desc, n: int) -> list[bytes]:
        """Broken encodings of otherwise plausible messages (some still parse: they count as well-formed)."""
        rng, out = self.rng, []
        for _ in range(n):
            good = self.template(desc).SerializeToString() or b"\x0a\x01t"
            kind = rng.randrange(6)
            if kind == 0:  # truncated inside a field
                data = good[:rng.randrange(1, max(2, len(good)))]
            elif kind == 1:  # invalid UTF-8 inside a string
                data = good.replace(b"Hello", b"He\xff\xfeo").replace(b"the sky", b"the \xc3\x28y") or b"\x0a\x02\xff\xfe"
            elif kind == 2:  # random bytes
                data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            elif kind == 3:  # a length prefix far past the end
                data = b"\x0a\xff\xff\xff\x7f" + good
            elif kind == 4:  # a bit flipped
                i = rng.randrange(len(good))
                data = good[:i] + bytes([good[i] ^ (1 << rng.randrange(8))]) + good[i + 1:]
            else:  # nesting deeper than the parser's limit
                data = b""
                for _ in range(120):
                    data = b"\x0a" + _varint(len(data)) + data
            out.append(data)
        return out

    @staticmethod
    def _field_at(desc, path: tuple) -> FD:
        for name in path[:-1]:
            desc = desc.fields_by_name[name].message_type
        return desc.fields_by_name[path[-1]]


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def parses(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except Exception:
        return False


def request_errors(msg) -> list[int]:
    """Codes of every tandem.v1.RequestError inside a response message (found by type, not by name)."""
    codes = []
    for f, value in msg.ListFields():
        if f.type != FD.TYPE_MESSAGE:
            continue
        for item in (value if _repeated(f) else [value]):
            if f.message_type.full_name == "tandem.v1.RequestError":
                codes.append(item.code)
            elif not _is_map(f):
                codes += request_errors(item)
    return codes


@dataclass
class Tally:
    calls: int = 0
    messages: int = 0
    malformed: int = 0
    bad: list = field(default_factory=list)  # (method, what, status, detail)
    statuses: dict = field(default_factory=dict)

    def status(self, method: str, code: S, details: str, well_formed: bool, cancelled: bool = False) -> None:
        self.statuses[code.name] = self.statuses.get(code.name, 0) + 1
        allowed = DOCUMENTED | ({S.CANCELLED} if cancelled else set())
        if not well_formed:
            allowed = {S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED} | ({S.CANCELLED} if cancelled else set())
        if code not in allowed:
            self.bad.append((method, "malformed" if not well_formed else "well-formed", code.name, details[:300]))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=512, block_size=16, max_num_batched_tokens=256,
                         max_num_seqs=32, max_model_len=96, max_rerank_documents=MAX_DOCUMENTS)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
                          max_waiting=4096)
    yield server
    server.close()


def reflected_service(address: str):
    """The Tandem service as the server describes itself, and a pool holding its messages."""
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)
        service = pool.FindServiceByName(SERVICE)
        for m in service.methods:  # resolve everything while the channel is open
            leaf_paths(m.input_type), m.output_type.fields
    assert SERVICE in services and "grpc.health.v1.Health" in services
    return pool, service


async def _unary(channel, method, data: bytes, tally: Tally, cls) -> None:
    call = channel.unary_unary(f"/{SERVICE}/{method.name}", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    well_formed = parses(cls, data) and len(data) < MAX_MESSAGE_BYTES
    try:
        await call(data, timeout=120)
        code, details = S.OK, ""
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code(), exc.details() or ""
    tally.calls += 1
    tally.messages += 1
    tally.malformed += not well_formed
    tally.status(method.name, code, details, well_formed)


async def _stream(channel, method, batch: list[bytes], tally: Tally, cls, out_cls, rng: random.Random) -> None:
    """Write a batch on one stream, then half-close (or, sometimes, walk away); read everything back."""
    call = channel.stream_stream(f"/{SERVICE}/{method.name}", request_serializer=lambda b: b,
                                 response_deserializer=out_cls.FromString)(timeout=120)
    well_formed = all(parses(cls, d) and len(d) < MAX_MESSAGE_BYTES for d in batch)
    walk_away = rng.random() < 0.1
    responses = []

    async def reader():
        async for reply in call:
            responses.append(reply)
    read = asyncio.create_task(reader())
    try:
        for data in batch:
            await call.write(data)
        if walk_away:
            await asyncio.sleep(rng.random() * 0.05)
            call.cancel()
        else:
            await call.done_writing()
        await read
        code, details = S.OK, ""
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code(), exc.details() or ""
    except asyncio.CancelledError:  # our own cancel surfaced through the reader
        code, details = S.CANCELLED, "cancelled by the fuzzer"
    finally:
        read.cancel()
    if code is S.CANCELLED and not walk_away:
        code = S.UNKNOWN  # nobody cancelled it: count it as a fault
    tally.calls += 1
    tally.messages += len(batch)
    tally.malformed += not well_formed
    tally.status(method.name, code, details, well_formed, cancelled=walk_away)
    for reply in responses:
        for number in request_errors(reply):
            tally.status(method.name + " request", CODES.get(number, S.UNKNOWN), str(reply)[:200], True)


async def test_fuzzing_gets_only_documented_statuses_and_leaks_nothing(fuzz_server):
    pool, service = await asyncio.to_thread(reflected_service, fuzz_server.address)
    fuzzer = Fuzzer(pool, seed=20240611)
    rng = random.Random(7)
    tally = Tally()
    jobs = []  # (method, kind, payloads)
    for method in service.methods:
        desc = method.input_type
        payloads = fuzzer.systematic(desc) + fuzzer.random_messages(desc, 260) + fuzzer.malformed(desc, 120)
        if method.client_streaming:
            ok = [p for p in payloads if parses(fuzzer.cls(desc), p)]
            bad = [p for p in payloads if not parses(fuzzer.cls(desc), p)]
            rng.shuffle(ok)
            # Well-formed messages in streams of 1..12; an unparseable one ends its stream, so it goes last.
            i = 0
            while i < len(ok):
                n = rng.randint(1, 12)
                jobs.append((method, "stream", ok[i:i + n]))
                i += n
            jobs += [(method, "stream", [*rng.sample(ok, k=rng.randint(0, 2)), b]) for b in bad]
            jobs += [(method, "stream", []) for _ in range(10)]  # open and half-close at once
        else:
            jobs += [(method, "unary", [p]) for p in payloads]
    rng.shuffle(jobs)
    limit = asyncio.Semaphore(24)
    async with grpc.aio.insecure_channel(fuzz_server.address, options=[
            ("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]) as ch:
        async def run(method, kind, payloads):
            async with limit:
                cls = fuzzer.cls(method.input_type)
                if kind == "unary":
                    await _unary(ch, method, payloads[0], tally, cls)
                else:
                    await _stream(ch, method, payloads, tally, cls, fuzzer.cls(method.output_type), rng)
        await asyncio.wait_for(asyncio.gather(*(run(*job) for job in jobs)), 600)

    assert not tally.bad, f"{len(tally.bad)} undocumented statuses, e.g. {tally.bad[:5]}"
    assert tally.messages >= 2000 and tally.malformed >= 200, tally
    # Every field of every method's request message was set to edge values at least once.
    expected = {(m.input_type.full_name, p) for m in service.methods for p in leaf_paths(m.input_type)}
    assert expected <= fuzzer.covered, sorted(expected - fuzzer.covered)
    assert {"OK", "INVALID_ARGUMENT"} <= set(tally.statuses), tally.statuses
    await _assert_healthy(fuzz_server)


# Every field of tandem.v1.SamplingParams, as the server reflects it, and the values proto/tandem.proto and the
# docs/generation.md's parameter table document as refused (INVALID_ARGUMENT, the message naming the field: `needle`). A field
# added to the proto without an entry here fails the test below, so its bad values get documented and checked.
# Values are on the template (max_tokens 4); VOCAB stands for ModelInfo.vocab_size.
class _Vocab:
    def __repr__(self) -> str:
        return "VOCAB"


VOCAB = _Vocab()
BAD_VALUES: dict[str, tuple[str, list]] = {
    "max_tokens": ("max_tokens", [0, -1, -(2**31)]),
    "temperature": ("temperature", [math.nan, -1.0, math.inf, -math.inf]),
    "top_p": ("top_p", [0.0, 1.5, math.nan, -math.inf]),
    "top_k": ("top_k", [-2, -(2**31)]),
    "seed": ("seed", []),
    "stop": ("stop", [[""], ["ok", ""]]),
    "stop_token_ids": ("stop_token_ids", []),
    "ignore_eos": ("ignore_eos", []),
    "skip_special_tokens": ("skip_special_tokens", []),
    "priority": ("priority", []),
    "n": ("n", [0, 17, 2**32 - 1]),
    "logprobs": ("logprobs", [21, 2**32 - 1]),
    "prompt_logprobs": ("prompt_logprobs", [21, 2**32 - 1]),
    "repetition_penalty": ("repetition_penalty", [0.0, -1.0, math.nan, math.inf]),
    "presence_penalty": ("presence_penalty", [math.nan, 2.5, -2.5, math.inf]),
    "frequency_penalty": ("frequency_penalty", [math.nan, 2.5, -math.inf]),
    "min_p": ("min_p", [math.nan, -0.1, 1.5]),
    "min_tokens": ("min_tokens", [5, 2**32 - 1]),
    "logit_bias": ("logit_bias", [{-1: 0.0}, {-(2**63): 1.0}, {VOCAB: 1.0}, {2**63 - 1: 1.0}, {5: math.nan},
                                  {5: 101.0}, {5: -math.inf}]),
    "json_schema": ("json", ["", "not json", "[1, 2]", "{", '{"type": "no-such-type"}']),
    "regex": ("regex", ["", "(ab", "[z-a]"]),
    "choice": ("choice", [[], ["yes", ""]]),
}


def _documented_rows() -> dict[str, str]:
    """docs/generation.md's generation parameter table: field name -> its row."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "generation.md").read_text()
    section = page.split("\n## Generation parameters\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", section, re.M)}


def _bad_request(pool, request_id: str, field: str, value, vocab: int):
    """A Generate request (the fuzz template) with one SamplingParams field set to a bad value, via reflection."""
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("tandem.v1.GenerateClientMessage"))
    msg = cls()
    Fuzzer._fill(msg, TEMPLATES["GenerateClientMessage"])
    msg.request.request_id = request_id
    params = msg.request.params
    f = params.DESCRIPTOR.fields_by_name[field]
    if _is_map(f):
        getattr(params, field).update({vocab if k is VOCAB else k: v for k, v in value.items()})
    elif f.type == FD.TYPE_MESSAGE:  # choice: the member message holds the list
        member = getattr(params, field)
        member.SetInParent()
        getattr(member, member.DESCRIPTOR.fields[0].name).extend(value)
    elif f.is_repeated:
        getattr(params, field).extend(value)
    else:
        setattr(params, field, value)
    return msg


async def test_every_sampling_field_documents_its_bad_values_and_each_gets_invalid_argument(fuzz_server):
    pool, service = await asyncio.to_thread(reflected_service, fuzz_server.address)
    fields = {f.name for f in pool.FindMessageTypeByName("tandem.v1.SamplingParams").fields}
    assert fields == set(BAD_VALUES), f"undocumented fields {fields - set(BAD_VALUES)}, gone {set(BAD_VALUES) - fields}"
    rows = _documented_rows()
    assert fields <= set(rows), f"docs/generation.md's table misses {sorted(fields - set(rows))}"
    for name, (_, values) in BAD_VALUES.items():  # a field with refused values says so in its row, and vice versa
        assert rows[name].rstrip(" |").endswith("—") == (not values), rows[name]

    from proto import tandem_pb2 as pb
    from proto import tandem_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(fuzz_server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        vocab = (await stub.ModelInfo(pb.ModelInfoRequest())).vocab_size
        cases = {f"{name}-{i}": (name, value) for name, (_, values) in BAD_VALUES.items()
                 for i, value in enumerate(values)}
        call = stub.Generate()
        # A neighbour on the same stream, running while every refusal happens.
        await call.write(pb.GenerateClientMessage(request=pb.GenerateRequest(
            request_id="neighbour", prompt="Hello there", params=pb.SamplingParams(max_tokens=24, ignore_eos=True))))
        for rid, (name, value) in cases.items():
            await call.write(_bad_request(pool, rid, name, value, vocab))
        await call.done_writing()
        replies = [r async for r in call]
    by_id: dict[str, list] = {}
    for r in replies:
        by_id.setdefault(r.request_id, []).append(r)
    wrong = {}
    for rid, (name, value) in cases.items():
        got = by_id.get(rid, [])
        needle = BAD_VALUES[name][0]
        if [r.WhichOneof("kind") for r in got] != ["error"] or CODES.get(got[0].error.code) is not S.INVALID_ARGUMENT \
                or needle not in got[0].error.message:
            wrong[f"{name}={value!r}"] = [str(r)[:160] for r in got]
    assert not wrong, "\n".join(f"{case}: {got}" for case, got in wrong.items())
    neighbour = by_id["neighbour"]
    assert neighbour[-1].final.usage.completion_tokens == 24 and len(by_id) == len(cases) + 1
    assert_all_blocks_free(await fuzz_server.idle_stats())


async def _assert_healthy(server: ServerThread) -> None:
    from proto import tandem_pb2 as pb
    from proto import tandem_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(server.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.TandemStub(channel)
        call = stub.Generate()
        await call.write(pb.GenerateClientMessage(request=pb.GenerateRequest(
            request_id="after", prompt="Hello", params=pb.SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True))))
        await call.done_writing()
        replies = [r async for r in call]
        assert replies[-1].final.usage.completion_tokens == 3
        ranked = await stub.Rerank(pb.RerankRequest(query="what is blue", documents=["sky", "sea", "stone"]))
        assert sorted(r.index for r in ranked.results) == [0, 1, 2]
    assert_all_blocks_free(await server.idle_stats())
