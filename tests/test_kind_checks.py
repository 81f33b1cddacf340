"""One protocol for every kind of work (DESIGN.md "The step"): the engine reads a request's kind only where execution
truly differs. Read with `ast` from the source, as tests/test_doors.py reads imports: a comparison that names
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
