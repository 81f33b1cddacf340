"""What the CLI says (docs/cli.md): why a completion ended, exit codes (refused, aborted, cut off), `--chat`, rerank
excerpts, one-line start-up errors, the metrics port's 404, and the threading environment of `tandem serve`."""
from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from clients.cli import EXCERPT_CHARS, excerpt, run
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.cli import OPENMP_SPINS, build_engine_config, build_parser, threading_environment
from service.metrics import Metrics
from tests.service.conftest import CHAT, PROMPTS
from tests.service.process_harness import HANG, ROOT, SERVE, serve_env, serve_in_process


def _cli(*argv: str) -> tuple[int, str]:
    """Run a client command in-process: (exit code, stdout). stderr is left to capsys."""
    out = io.StringIO()
    code = run(build_parser().parse_args(list(argv)), out)
    return code, out.getvalue()


def test_generate_prints_the_text_then_why_it_ended_on_stderr(served, offline, capsys):
    for i in {next(i for i, o in enumerate(offline.greedy) if o.finish_reason == reason)
              for reason in {o.finish_reason for o in offline.greedy}}:
        code, out = _cli("generate", "--target", served.address, PROMPTS[i], "--max-tokens", "8")
        assert (code, out) == (0, offline.greedy[i].text + "\n")
        assert capsys.readouterr().err == f"[{offline.greedy[i].finish_reason}]\n"


def test_generate_chat_applies_the_template(served, offline, capsys):
    code, out = _cli("generate", "--target", served.address, "--chat", CHAT[0]["content"], "--max-tokens", "8")
    assert (code, out) == (0, offline.chat.text + "\n")
    assert capsys.readouterr().err == f"[{offline.chat.finish_reason}]\n"
    with pytest.raises(SystemExit, match="--system needs --chat"):
        _cli("generate", "--target", served.address, "--system", "Be brief.", "Hi")


def test_a_refused_generation_exits_1_with_the_status_and_its_message(served, capsys):
    code, out = _cli("generate", "--target", served.address, "Hi", "--max-tokens", "1000000")
    assert (code, out) == (1, "")
    assert capsys.readouterr().err.startswith("tandem: INVALID_ARGUMENT: max_tokens is too large: 1000000;")


class EndsEarly(pb_grpc.TandemServicer):
    """Streams one delta of a generation, then aborts it (a final with ABORT) or cuts the stream (UNAVAILABLE)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def Generate(self, request_iterator, context):
        rid = next(request_iterator).request.request_id
        yield pb.GenerateServerMessage(request_id=rid, delta=pb.TokenDelta(text="Once upon", token_ids=[1, 2]))
        if self.how == "cut":
            context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")
        yield pb.GenerateServerMessage(request_id=rid, final=pb.GenerateFinal(
            finish_reason=pb.FINISH_REASON_ABORT, usage=pb.Usage(prompt_tokens=3, completion_tokens=2)))
        for _ in request_iterator:  # until the client half-closes
            pass


def test_a_server_abort_exits_3_and_says_abort(fake_tandem_server, capsys):
    target = fake_tandem_server(EndsEarly("abort"))
    code, out = _cli("generate", "--target", target, "Tell me a story")
    assert (code, out) == (3, "Once upon\n")
    assert capsys.readouterr().err == "[abort]\n"


def test_a_cut_off_stream_prints_the_partial_text_says_so_and_exits_3(fake_tandem_server, capsys):
    target = fake_tandem_server(EndsEarly("cut"))
    code, out = _cli("generate", "--target", target, "Tell me a story")
    assert (code, out) == (3, "Once upon\n")
    err = capsys.readouterr().err
    assert err.startswith("tandem: the stream was cut off before the completion ended (UNAVAILABLE: ")
    assert "the text above is partial" in err and err.count("\n") == 1


def test_rerank_prints_an_excerpt_unless_full(served):
    long_doc = "Paris is the capital of France.\n" + "It has many museums and bridges. " * 10
    docs = [long_doc, "Bananas."]
    code, out = _cli("rerank", "--target", served.address, "--query", "capital of France", *docs)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    by_index = {line.split()[1]: line for line in lines}
    assert by_index["[0]"].endswith("  " + excerpt(long_doc)) and by_index["[1]"].endswith("  Bananas.")
    shown = excerpt(long_doc)
    assert len(shown) == EXCERPT_CHARS and shown.endswith("\u2026") and "\n" not in shown
    assert " ".join(long_doc.split()).startswith(shown[:-1])
    code, out = _cli("rerank", "--target", served.address, "--full", "--query", "capital of France", *docs)
    assert code == 0 and long_doc in out


def test_rerank_max_windows_reaches_the_server_and_each_result_says_its_windows(served):
    long_doc = "The committee discussed road repairs. " * 80 + "Paris is the capital of France."  # > 256 tokens
    code, out = _cli("rerank", "--target", served.address, "--json", "--max-windows", "6", "--query",
                     "capital of France", long_doc, "Bananas.")
    windows = {r["index"]: r["windows"] for r in json.loads(out)}
    assert code == 0 and windows[1] == 1 and 2 <= windows[0] <= 6
    code, out = _cli("rerank", "--target", served.address, "--query", "capital of France", "--max-windows", "6",
                     long_doc)
    assert code == 0 and f"[best of {windows[0]} windows]" in out
    code, out = _cli("rerank", "--target", served.address, "--json", "--query", "capital of France", long_doc)
    assert code == 0 and json.loads(out)[0]["windows"] == 1  # the server's default: cut


def _status(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_metrics_port_answers_404_off_its_own_paths():
    http, _ = Metrics().serve("127.0.0.1", 0)
    base = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        status, body = _status(base + "/metrics")
        assert status == 200 and b"tandem_" in body
        assert _status(base + "/healthz") == _status(base + "/ready") == (200, b"SERVING\n")
        assert _status(base + "/health") == (200, b"OK\n")
        for path in ("/v1/rerank", "/", "/metrics/extra", "/favicon.ico"):
            status, body = _status(base + path)
            assert status == 404 and b"/metrics, /health, /ready and /healthz" in body, path
    finally:
        http.shutdown()


def _unsupported_architecture(tmp_path: Path) -> Path:
    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    model = tmp_path / "foo-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    embedded = default_model_dir(Settings.from_env().cache_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, model / name)
    return model


def _not_gguf(tmp_path: Path) -> Path:
    """A file named like a model that is not one (a download cut short, a wrong file): --model reads its magic."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>not a model</html>")
    return path


def _cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda starts")


@pytest.mark.parametrize("case, argv, says", [
    ("missing path", ("--model", "{tmp}/nope"), "--model {tmp}/nope: no such file or directory"),
    ("missing reranker", ("--reranker", "{tmp}/nope"), "--reranker {tmp}/nope: no such file or directory (give a "
                                                       "cross-encoder's Hugging Face directory"),
    ("not a GGUF file", ("--model", "{path}"), "is not a GGUF file (it does not start with b'GGUF')"),
    ("unsupported architecture", ("--model", "{path}"), "unsupported architecture 'FooForCausalLM' (model_type 'foo'); supported: "),
    ("no CUDA", ("--device", "cuda"), "--device cuda: CUDA is not available"),
])
def test_start_up_failures_are_one_line_and_the_traceback_waits_for_debug(tmp_path, monkeypatch, capsys, caplog, case,
                                                                          argv, says):
    """In this process (each fails before a model is served, so no interpreter need start; serve_in_process); what
    --log-level debug prints on stderr, a subprocess's own logging, is checked once below."""
    path = {"not a GGUF file": _not_gguf, "unsupported architecture": _unsupported_architecture,
            "no CUDA": _cuda}.get(case, lambda _: None)(tmp_path)
    argv = [a.format(tmp=tmp_path, path=path) for a in argv]
    monkeypatch.delenv("TANDEM_LOG_LEVEL", raising=False)
    caplog.set_level(logging.DEBUG, logger="tandem.serve")
    code = serve_in_process(*argv)
    err = capsys.readouterr().err
    mine = [line for line in err.splitlines() if line.startswith("tandem serve:")]
    assert code == 1 and len(mine) == 1, err
    assert says.format(tmp=tmp_path) in mine[0] and "Traceback" not in err
    if case != "no CUDA":  # found before the engine is built: there is no traceback to show
        assert mine[0].endswith("(the traceback: --log-level debug)")
        failed = [r for r in caplog.records if r.getMessage() == "start-up failed"]
        assert len(failed) == 1 and failed[0].levelno == logging.DEBUG and failed[0].exc_info  # what debug prints


def test_the_traceback_of_a_start_up_failure_is_on_stderr_at_debug(tmp_path):
    """`tandem serve` as a process (its own logging set up by --log-level): the traceback only at debug."""
    base = [*SERVE, "--port", "0", "--http-port", "off", "--metrics-port", "off", "--model", str(tmp_path / "nope")]
    # A hang guard, not a time limit: a server that starts instead of failing would otherwise serve forever.
    loud = subprocess.run([*base, "--log-level", "debug"], cwd=ROOT, env=serve_env(TANDEM_LOG_LEVEL=""),
                          capture_output=True, text=True, timeout=HANG)
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr, loud.stderr
    mine = [line for line in loud.stderr.splitlines() if line.startswith("tandem serve:")]
    assert len(mine) == 1 and f"--model {tmp_path / 'nope'}: no such file or directory" in mine[0], loud.stderr
    assert not mine[0].endswith("(the traceback: --log-level debug)")  # it is there already


def test_threads_flag_and_a_passive_openmp_wait_policy_unless_the_user_chose():
    args = build_parser().parse_args(["serve", "--threads", "3"])
    assert args.num_threads == 3 and build_engine_config(args).num_threads == 3
    environ: dict[str, str] = {}
    threading_environment(3, environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OPENMP_SPINS, "OMP_NUM_THREADS": "3"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "8"}
    threading_environment(3, chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "8"}  # no spin count beside their policy
    spins = {"GOMP_SPINCOUNT": "0"}
    threading_environment(None, spins)
    assert spins == {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    unset: dict[str, str] = {}
    threading_environment(None, unset)
    assert unset == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OPENMP_SPINS}
