"""The code blocks of README.md and docs/*.md that are marked runnable run, exit 0 and print what the page shows.

A block whose fence info string is ```python run or ```bash run is extracted and executed: python with this
interpreter (the repo's venv) in a subprocess, bash with `bash -e`. Blocks that talk to a server
(`localhost:50051`, the default target, and `localhost:8000`, the HTTP door) get an in-process server configured as
`tandem serve` is by default (the embedded SmolLM2 and all-MiniLM-L6-v2, reranks scored dense) instead: the address is
rewritten in the text, and TANDEM_TARGET points at it too. Blocks that load the model reuse the converted cache in
~/.cache/tandem. Each block must print something.

**Expected output.** A ```text block that follows a runnable block with only blank lines between is what the block
prints, and is compared with its stdout after this normalisation (`same_output`): trailing spaces and the blank lines
at either end are ignored; every other line must match, except that a decimal number may differ by up to
NUMBER_TOLERANCE (the embedder runs in bfloat16 on a CPU with native bf16 and in float32 elsewhere, and this suite
runs it in float32: TANDEM_NATIVE_BF16=0). So the scores, vectors and generated text a page shows are what a reader
gets; a block whose output cannot be fixed (sampled text, timings) is followed by prose or a ```console block.

Plain ```python / ```bash blocks are not run (`make serve`, benchmarks, clusters, paths of your own). So that a
block meant to be run is never skipped by a forgotten `run`, every python block of README.md must be runnable or
be listed in README_NOT_RUN with the reason. docs/testing.md states the convention.
"""
from __future__ import annotations

import dataclasses
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
# How far a decimal number in an expected output may be from the one printed (bfloat16 vs float32 embedder).
NUMBER_TOLERANCE = 0.01
_NUMBER = re.compile(r"-?\d+\.\d+")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repo root
    line: int  # the opening fence's line, 1-based
    lang: str
    flags: tuple[str, ...]  # the info string's words after the language, e.g. ("run",)
    code: str
    expected: str | None = None  # a runnable block's expected stdout: the ```text block right after it

    @property
    def runnable(self) -> bool:
        return "run" in self.flags


_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def parse_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file (CommonMark fences: ``` or ~~~, closed by a fence as long)."""
    blocks: list[Block] = []
    opened: tuple[int, str, str] | None = None  # (line, fence, info)
    body: list[str] = []
    between: list[str] = []  # the lines since the last block closed
    for number, text in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(text)
        if opened is None:
            if m:
                opened, body = (number, m["fence"], m["info"].strip()), []
            else:
                between.append(text)
            continue
        line, fence, info = opened
        if m and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not m["info"].strip():
            words = info.split()
            name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            block = Block(name, line, words[0].lower() if words else "", tuple(words[1:]), "\n".join(body) + "\n")
            if blocks and blocks[-1].runnable and block.lang == "text" and not "".join(between).strip():
                blocks[-1] = dataclasses.replace(blocks[-1], expected=block.code)
            blocks.append(block)
            opened, between = None, []
        else:
            body.append(text)
    assert opened is None, f"{path}:{opened[0]}: a code fence is never closed"
    return blocks


def same_output(expected: str, got: str) -> str | None:
    """None when `got` is `expected` under the normalisation of the module's docstring, else the first difference."""
    def lines(text: str) -> list[str]:
        return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n").splitlines()

    want, have = lines(expected), lines(got)
    for number, (a, b) in enumerate(zip(want, have), 1):
        numbers_a, numbers_b = _NUMBER.findall(a), _NUMBER.findall(b)
        same = _NUMBER.split(a) == _NUMBER.split(b) and len(numbers_a) == len(numbers_b) and all(
            abs(float(x) - float(y)) <= NUMBER_TOLERANCE for x, y in zip(numbers_a, numbers_b))
        if not same:
            return f"line {number}: the page shows {a!r}, the block printed {b!r}"
    if len(want) != len(have):
        return f"the page shows {len(want)} lines, the block printed {len(have)}"
    return None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]
RUNNABLE = [b for b in ALL_BLOCKS if b.runnable]


@pytest.fixture(scope="module")
def default_served():
    """A server as `tandem serve` starts by default (the embedded LLM and embedder, dense reranks), with its HTTP
    door: what a reader of the pages talks to."""
    from engine import LLM, EngineConfig
    from engine.config import EMBEDDED_EMBEDDER
    from service.server import ServerConfig
    from tests.service.conftest import NUM_KV_BLOCKS
    from tests.service.harness import ServerThread

    llm = LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, num_kv_blocks=NUM_KV_BLOCKS))
    server = ServerThread(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    server.http_url = server.add_http(server.server.config).url
    yield server
    server.close()


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.path}:{b.line}" for b in RUNNABLE])
def test_runnable_block_exits_zero_and_prints(block: Block, default_served, tmp_path):
    served = default_served
    code = block.code.replace(DEFAULT_TARGET, served.address)
    code = code.replace(DEFAULT_HTTP, served.http_url.removeprefix("http://"))
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
    if block.expected is not None:
        difference = same_output(block.expected, done.stdout)
        assert difference is None, f"{where} printed other than the page shows: {difference}\n{output}"


def test_expected_output_is_the_text_block_right_after_and_numbers_have_a_tolerance(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("```python run\nprint(1)\n```\n\n```text\n0.5000 [1]\n```\n```bash run\necho\n```\nprose\n"
                  "```text\nnot its output\n```\n")
    blocks = parse_blocks(md)
    assert [b.expected for b in blocks] == ["0.5000 [1]\n", None, None, None]
    assert same_output("0.5000 [1]\n", "\n0.5042 [1]  \n") is None
    assert "line 1" in same_output("0.5000 [1]", "0.5200 [1]")  # past NUMBER_TOLERANCE
    assert "line 1" in same_output("0.5000 [1]", "0.5000 [2]")
    assert "lines" in same_output("a\nb", "a")


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


def test_the_readmes_langchain_lines_name_models_the_default_server_serves(default_served):
    """README's LangChain lines (prose: langchain is not installed here) run as written: ChatOpenAI and
    OpenAIEmbeddings call the OpenAI API through the `openai` SDK with the `model` they were given, so the same calls
    with the README's names must be served, and the SDK's default name, what ChatOpenAI sends without `model=`, is
    OpenAI's 404 (issue 72: the README's ChatOpenAI had no `model=`)."""
    import openai

    text = (ROOT / "README.md").read_text()
    calls = {name: re.search(rf"`{name}\(([^`]*)\)`", text) for name in ("ChatOpenAI", "OpenAIEmbeddings")}
    assert all(calls.values()), calls
    models = {name: re.search(r'model="([^"]+)"', m.group(1)) for name, m in calls.items()}
    assert all(models.values()), f"a LangChain line without model=: {calls}"
    client = openai.OpenAI(base_url=f"{default_served.http_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=models["ChatOpenAI"].group(1), max_tokens=1,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == models["ChatOpenAI"].group(1)
    embedded = client.embeddings.create(model=models["OpenAIEmbeddings"].group(1), input="Hi")
    assert embedded.model == models["OpenAIEmbeddings"].group(1) and embedded.data[0].embedding
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-3.5-turbo", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    client.close()
