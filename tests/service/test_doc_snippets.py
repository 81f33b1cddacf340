"""The code blocks of README.md and docs/*.md that are marked runnable run, and exit 0.

A block whose fence info string is ```python run or ```bash run is extracted and executed: python with this
interpreter (the repo's venv) in a subprocess, bash with `bash -e`. Blocks that talk to a server
(`localhost:50051`, the default target) get the session's in-process server instead: the address is rewritten
in the text, and TANDEM_TARGET points at it too. Blocks that load the model reuse the converted cache in
~/.cache/tandem (the `served` fixture's engine converted it first). Each block must print what it shows.

Plain ```python / ```bash blocks are not run (`make serve`, benchmarks, clusters, paths of your own). So that a
block meant to be run is never skipped by a forgotten `run`, every python block of README.md must be runnable or
be listed in README_NOT_RUN with the reason. docs/testing.md states the convention.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = "localhost:50051"
DEFAULT_HTTP = "localhost:8000"  # the HTTP door's default address, rewritten to the suite's HTTP door
RUNNERS = {"python": [sys.executable], "bash": ["bash", "-e"]}
# Languages a fence may name; anything else is a typo the test should catch (`pyhton run` would never run).
KNOWN_LANGS = {"python", "bash", "text", "console", "yaml", "json", "toml", "proto", "dockerfile", "haproxy", ""}
# README.md python blocks that are not run, each with the reason (file, first line of the block) -> reason.
README_NOT_RUN: dict[tuple[str, str], str] = {}
# Links that point at pages other branches write (the HTTP door's page comes with the HTTP door).
PENDING_PAGES: set[str] = set()
# A hang guard only (a client waiting on a server that never answers); a snippet takes seconds.
HANG_GUARD_S = 900


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repo root
    line: int  # the opening fence's line, 1-based
    lang: str
    flags: tuple[str, ...]  # the info string's words after the language, e.g. ("run",)
    code: str

    @property
    def runnable(self) -> bool:
        return "run" in self.flags


_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def parse_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file (CommonMark fences: ``` or ~~~, closed by a fence as long)."""
    blocks: list[Block] = []
    opened: tuple[int, str, str] | None = None  # (line, fence, info)
    body: list[str] = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(text)
        if opened is None:
            if m:
                opened, body = (number, m["fence"], m["info"].strip()), []
            continue
        line, fence, info = opened
        if m and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not m["info"].strip():
            words = info.split()
            name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            blocks.append(Block(name, line, words[0].lower() if words else "",
                                tuple(words[1:]), "\n".join(body) + "\n"))
            opened = None
        else:
            body.append(text)
    assert opened is None, f"{path}:{opened[0]}: a code fence is never closed"
    return blocks


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]
RUNNABLE = [b for b in ALL_BLOCKS if b.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.path}:{b.line}" for b in RUNNABLE])
def test_runnable_block_exits_zero_and_prints(block: Block, served, tmp_path, request):
    code = block.code.replace(DEFAULT_TARGET, served.address)
    if DEFAULT_HTTP in code:  # the HTTP door only for the blocks that speak to it
        code = code.replace(DEFAULT_HTTP, request.getfixturevalue("http_url").removeprefix("http://"))
    script = tmp_path / ("snippet.py" if block.lang == "python" else "snippet.sh")
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `tandem`, `python`
    env["TANDEM_TARGET"] = served.address
    for name in ("TANDEM_AUTH_TOKEN", "TANDEM_CA_CERT"):
        env.pop(name, None)
    # Run where the reader would not mind files appearing (a snippet may write e.g. a schema file).
    done = subprocess.run([*RUNNERS[block.lang], str(script)], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    where = f"{block.path}:{block.line} ({block.lang})"
    output = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, f"{where} exited {done.returncode}\n{output}"
    assert done.stdout.strip(), f"{where} printed nothing; a snippet prints what it shows\n{done.stderr}"


def test_parser_reads_info_strings_and_nested_fences(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("text\n```python run\nprint(1)\n```\n````markdown\n```python run\nnot a block\n```\n````\n"
                  "~~~bash\necho hi\n~~~\n")
    got = [(b.line, b.lang, b.flags, b.code, b.runnable) for b in parse_blocks(md)]
    assert got == [(2, "python", ("run",), "print(1)\n", True),
                   (5, "markdown", (), "```python run\nnot a block\n```\n", False),
                   (10, "bash", (), "echo hi\n", False)]
    md.write_text("```python run\nprint(1)\n")
    with pytest.raises(AssertionError, match="never closed"):
        parse_blocks(md)


def test_fences_name_a_known_language_and_run_only_python_or_bash():
    bad = [f"{b.path}:{b.line} ```{b.lang} {' '.join(b.flags)}" for b in ALL_BLOCKS
           if b.lang not in KNOWN_LANGS or set(b.flags) - {"run"} or (b.runnable and b.lang not in RUNNERS)]
    assert not bad, f"fences the snippet runner cannot read (only ```python run / ```bash run run): {bad}"


def test_no_readme_python_block_is_silently_skipped():
    readme = [b for b in ALL_BLOCKS if b.path == "README.md" and b.lang == "python"]
    assert readme, "README.md has no python block: did the fence parser break?"
    skipped = {(b.path, b.code.splitlines()[0] if b.code.strip() else ""): b for b in readme if not b.runnable}
    unlisted = [f"{b.path}:{b.line}" for key, b in skipped.items() if key not in README_NOT_RUN]
    assert not unlisted, f"README python blocks without `run` and not in README_NOT_RUN: {unlisted}"
    stale = set(README_NOT_RUN) - set(skipped)
    assert not stale, f"README_NOT_RUN names blocks that are gone or now run: {stale}"


def test_the_quick_start_has_runnable_python_and_bash():
    langs = {b.lang for b in RUNNABLE if b.path == "README.md"}
    assert {"python", "bash"} <= langs, f"README.md runnable blocks: {langs}"


def test_relative_links_of_the_docs_point_at_files_that_exist():
    missing = []
    for f in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", f.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            resolved = (f.parent / target.split("#", 1)[0]).resolve()
            rel = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            if not resolved.exists() and str(rel) not in PENDING_PAGES:
                missing.append(f"{f.relative_to(ROOT)} -> {target}")
    assert not missing, f"links to files that do not exist: {missing}"
