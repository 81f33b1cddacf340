"""One protocol for every kind of work (docs/architecture.md, "Kinds of work"): the engine reads a request's kind
only where execution truly differs, and the service only through the kinds' descriptors (service/kinds.py). Read with `ast` from the source, as tests/test_doors.py reads imports: a comparison that names
`SeqKind` (`seq.kind is SeqKind.RERANK`, `kind in (SeqKind.A, SeqKind.B)`) may appear only in the files below, and no
engine module asks which job class a request is (`isinstance(job, RerankJob)`): it calls engine/jobs.py's Job."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"
# Where a row's request kind may be read: the runner's forward (which encoder runs a row), the planner's prices
# (step_time.work_kind) and the Sequence itself (request.py: its `samples` property says what a kind does).
ALLOWED = {"request.py", "runner.py", "step_time.py"}
JOB_CLASSES = {"Generation", "RerankJob", "EmbedJob"}


def kind_checks(source: str) -> list[tuple[int, str]]:
    """(line, what) of every comparison naming SeqKind and every isinstance against a job class in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = {n.id for part in (node.left, *node.comparators) for n in ast.walk(part) if isinstance(n, ast.Name)}
            if "SeqKind" in names:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if classes & JOB_CLASSES:
                found.append((node.lineno, ast.unparse(node)))
    return found


def _engine_files() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if "models" not in p.relative_to(ENGINE).parts)


@pytest.mark.parametrize("path", _engine_files(), ids=lambda p: str(p.relative_to(ENGINE)))
def test_no_request_kind_branches_outside_the_forward_and_the_prices(path):
    checks = kind_checks(path.read_text())
    if str(path.relative_to(ENGINE)) in ALLOWED:
        checks = [(line, what) for line, what in checks if "isinstance" in what]
    assert not checks, f"engine/{path.relative_to(ENGINE)} branches on the request kind: {checks}"


def test_the_walk_finds_the_branches_it_forbids():
    source = ("if seq.kind is SeqKind.RERANK:\n    pass\n"
              "x = 1 if s.kind in (SeqKind.EMBED, SeqKind.RERANK) else 2\n"
              "if isinstance(job, (RerankJob, EmbedJob)):\n    pass\n"
              "y = seq.kind\nz = isinstance(job, dict)\nrow = Sequence(kind=SeqKind.EMBED)\n")
    assert sorted(line for line, _ in kind_checks(source)) == [1, 3, 4]


SERVICE = ENGINE.parent / "service"
# The engine's per-kind entry points, kept as thin wrappers over prepare() and add() for the offline LLM and tests.
PER_KIND_CALLS = {"add_request", "add_rerank", "add_embed", "prepare_rerank", "prepare_embed"}
KIND_NAMES = {"SeqKind", "GenerateSpec", "RerankSpec", "EmbedSpec"}


def _names(source: str) -> tuple[set[str], set[str]]:
    """(attributes read or called, plain names and imported names) in `source`."""
    tree = ast.parse(source)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return attrs, names


@pytest.mark.parametrize("path", sorted(SERVICE.rglob("*.py")), ids=lambda p: str(p.relative_to(SERVICE)))
def test_the_service_queues_work_through_prepare_and_add_only(path):
    """One add(job) path (issue #62): service/ builds a spec and submits it; it never calls the engine's per-kind
    wrappers, so a new kind of work needs no new entry point in the bridge."""
    attrs, _ = _names(path.read_text())
    assert not attrs & PER_KIND_CALLS, f"service/{path.relative_to(SERVICE)} calls {sorted(attrs & PER_KIND_CALLS)}"


def test_the_bridge_names_no_kind_of_work():
    """The bridge reads a request through its spec's protocol (engine/specs.py JobSpec) only: no kind, no spec class."""
    _, names = _names((SERVICE / "bridge.py").read_text())
    assert not names & KIND_NAMES, f"service/bridge.py names {sorted(names & KIND_NAMES)}"


def test_the_service_walk_finds_what_it_forbids():
    attrs, names = _names("from engine.specs import RerankSpec\nengine.add_rerank('r', 'q', ['d'])\nx = SeqKind.EMBED\n")
    assert "add_rerank" in attrs and {"RerankSpec", "SeqKind"} <= names


# The service reads a kind of work through its descriptor (service/kinds.py) alone: no comparison names a kind enum's
# member (`task is Task.RERANK`, `Task.GENERATE in known`, `kind == SeqKind.EMBED`) or a kind's label as a string
# (`lc.kind == "rerank"`, `path in ("embed", ...)`) outside the registry.
KIND_ENUMS = {"SeqKind", "Task", "PoolingTask", "TokenKind"}
KIND_LABELS = {"generate", "rerank", "embed", "classify", "embed_sparse"}
SERVICE_ALLOWED = {"kinds.py"}


def service_kind_checks(source: str) -> list[tuple[int, str]]:
    """(line, what) of every comparison in `source` naming a member of a kind enum or a kind's label."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        parts = [n for part in (node.left, *node.comparators) for n in ast.walk(part)]
        members = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in KIND_ENUMS
                      for n in parts)
        labels = any(isinstance(n, ast.Constant) and n.value in KIND_LABELS for n in parts)
        if members or labels:
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", sorted(SERVICE.rglob("*.py")), ids=lambda p: str(p.relative_to(SERVICE)))
def test_the_service_branches_on_no_kind_outside_the_descriptors(path):
    if path.name in SERVICE_ALLOWED and path.parent == SERVICE:
        return
    checks = service_kind_checks(path.read_text())
    assert not checks, f"service/{path.relative_to(SERVICE)} branches on a kind of work: {checks}"


def test_the_service_walk_finds_the_branches_it_forbids():
    source = ("if task is Task.RERANK:\n    pass\n"
              "x = Task.GENERATE in known\n"
              "if lc.kind == 'rerank':\n    pass\n"
              "y = 1 if path in ('embed', '/x') else 2\n"
              "z = KINDS[Task.RERANK].verb\nif kind.decodes:\n    pass\nw = mode == 'dense'\n")
    assert sorted(line for line, _ in service_kind_checks(source)) == [1, 3, 4, 6]


def test_the_service_and_engine_registries_name_the_same_kinds():
    """A lifecycle label is the engine spec's kind (the bridge labels a request by it), so every service kind's label
    is an engine kind, every engine kind is served, and each engine kind registers one spec and builder."""
    from engine.embed.tasks import POOLING
    from engine.kinds import KINDS as ENGINE_KINDS
    from engine.request import SeqKind
    from service import kinds

    assert set(kinds.LABELS) == {k.value for k in SeqKind} == {k.value for k in ENGINE_KINDS}
    assert all(k.spec.kind is seq_kind for seq_kind, k in ENGINE_KINDS.items())
    assert {k.pooling for k in kinds.pooled()} <= set(POOLING)  # each pooled kind's encoder is a pooling task


def test_each_pooled_kind_is_served_from_its_rows_alone():
    """A kind with an encoder of its own is read off its rows (issue #72): its service row names its engine task,
    whose field and flag it repeats (`tandem serve` adds the flag from the service row, EngineConfig takes the field of
    the flag's name); its HTTP routes are its door schema's ROUTES, its gRPC method one of the service's, whose
    response the gRPC door builds from the row's grpc_item (test_each_pooled_kind_s_output_fills_its_grpc_response)."""
    from engine.config import EngineConfig, PoolingTask
    from engine.embed.tasks import POOLING
    from proto import tandem_pb2 as pb
    from service import kinds
    from service.http.kind_routes import kind_routes

    config_fields = set(EngineConfig.__dataclass_fields__)
    for kind in kinds.pooled():
        task = POOLING[PoolingTask(kind.pooling)]
        assert (kind.model_field, kind.flag) == (task.field, task.flag)
        assert kind.flag == "--" + kind.model_field.replace("_", "-") and kind.model_field in config_fields
        assert kind.flag_help and set(kind_routes(kind)) == set(kind.routes)
        assert kind.grpc_method in pb.DESCRIPTOR.services_by_name["Tandem"].methods_by_name
        assert kind.grpc_item is not None


class _Encoder:
    """What a pooling kind's `finish` reads of its encoder (engine/embed/heads Encoder)."""
    name = "m"
    labels = ("negative", "neutral", "positive")
    multi_label = False
    max_length = 8


def _outcome(kind, truncated=(False, True)):
    """A PooledOutcome of `kind` as the engine makes one: each input's output is the kind's own `finish` (its module
    in engine/embed/heads/) run on a small vector, one weight a label or vocabulary id, some zero."""
    import torch

    from engine.config import EmbedParams, PoolingTask
    from engine.embed.tasks import POOLING
    from service.core_types import PooledOutcome, Usage

    finish = POOLING[PoolingTask(kind.pooling)].finish
    outputs = [finish(_Encoder(), torch.tensor(v), EmbedParams(task=kind.pooling))
               for v in ([0.0, 1.5, 0.25], [2.0, 0.0, 0.0])[:len(truncated)]]
    return PooledOutcome("r", outputs, _Encoder.labels, list(truncated), Usage(prompt_tokens=7), "m")


def test_each_pooled_kind_s_output_fills_its_grpc_response():
    """The gRPC door builds every pooled kind's response one way (service/servicer.py pooled_response, no code of the
    kind's): the response is its RPC's type, its one repeated message field one item per input, input order, each
    filled from the kind's row (service/kinds.py grpc_item: plain data) and `truncated`, then `model` and `usage`. A
    kind whose grpc_item is missing, or names a field its item message has not, fails here (and at registration)."""
    from service import kinds
    from service.handlers import rpc_types
    from service.servicer import items_field, pooled_response

    for kind in kinds.pooled():
        _, response = rpc_types(kind.grpc_method)
        message = pooled_response(kind)(_outcome(kind))
        items = getattr(message, items_field(response.DESCRIPTOR).name)
        assert type(message) is response and [i.truncated for i in items] == [False, True], kind.task
        assert (message.model, message.usage.prompt_tokens) == ("m", 7), kind.task
        assert all({f.name for f, _ in item.ListFields()} - {"truncated"} for item in items), \
            f"{kind.grpc_method}: grpc_item filled no field of {items[0].DESCRIPTOR.name}"


def test_the_generic_grpc_builder_refuses_what_it_cannot_build():
    import dataclasses

    from service import kinds
    from service.servicer import pooled_response

    kind = kinds.pooled()[0]
    with pytest.raises(TypeError, match="grpc_item"):
        pooled_response(dataclasses.replace(kind, grpc_item=None))
    wrong = pooled_response(dataclasses.replace(kind, grpc_item=lambda output, labels: {"no_such_field": output}))
    with pytest.raises(ValueError, match="no_such_field"):
        wrong(_outcome(kind))


def _messages(descriptor, seen=None) -> set[str]:
    """The message types `descriptor` is made of, itself included (names)."""
    seen = set() if seen is None else seen
    if descriptor.full_name not in seen:
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            if field.message_type is not None:
                _messages(field.message_type, seen)
    return seen


def test_the_grpc_door_names_no_pooled_kind_s_messages():
    """service/servicer.py holds no protobuf code of a pooled kind's: it names no message type that only pooled
    kinds' RPCs carry (ClassifyResponse, Classification, LabelScore, SparseEmbedding, ...), so a new kind adds none."""
    from proto import tandem_pb2 as pb
    from service import kinds

    methods = pb.DESCRIPTOR.services_by_name["Tandem"].methods
    pooled = {k.grpc_method for k in kinds.pooled()}
    others: set[str] = set()
    theirs: set[str] = set()
    for method in methods:
        for t in (method.input_type, method.output_type):
            _messages(t, theirs if method.name in pooled else others)
    only_pooled = {name.rsplit(".", 1)[-1] for name in theirs - others}
    assert {"ClassifyResponse", "LabelScore", "SparseEmbedding"} <= only_pooled
    attrs, names = _names((SERVICE / "servicer.py").read_text())
    assert not (attrs | names) & only_pooled, f"service/servicer.py names {sorted((attrs | names) & only_pooled)}"
