"""What an operator meets on the first day, through `tandem serve` as a subprocess (issue #38): a taken port stops it
with one line naming the flag (checked in this process: it fails before anything loads); start-up phases say their size and time; one access-log line per request on both
doors; vLLM's metric names and process_* beside tandem's, health paths on the metrics port; a second Ctrl-C stops
at once, and the last line says how it ended.

The tests of the shared server run in file order (the last one stops it). They wait on states (a line printed, a
health status, the process's exit); a timeout only turns a hang into a failure."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import AsyncClient, Client
from service.cli import build_parser
from service.cluster import free_port
from tests.service.process_harness import HANG, ROOT, SERVE, ServeProcess, serve_env, serve_in_process

LOUD = {"TANDEM_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
ENV = serve_env(**LOUD)
ACCESS = re.compile(r" INFO tandem\.access: (\S+) (\S+) model=(.+?) status=(\S+) finish=(\S+) ")


class _NoModel:
    """Stands in for engine.LLMEngine: a port check that came after loading fails the test at once."""

    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("the model was loaded before the ports were checked")


@pytest.mark.parametrize("door, flag", [("gRPC", "--port"), ("HTTP", "--http-port"),
                                        ("Prometheus metrics", "--metrics-port")])
def test_a_taken_port_stops_serve_with_one_line_naming_the_port_and_its_flag(door, flag, monkeypatch, capsys, caplog):
    # In this process (serve_in_process): the check runs before anything loads, so no interpreter need start.
    import engine

    monkeypatch.setattr(engine, "LLMEngine", _NoModel)
    caplog.set_level(logging.INFO)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = {"--port": "0", "--http-port": "off", "--metrics-port": "off", flag: str(taken)}
        code = serve_in_process("--host", "127.0.0.1", *[a for pair in ports.items() for a in pair])
    err = capsys.readouterr().err
    mine = [line for line in err.splitlines() if line.startswith("tandem serve:")]
    assert code == 1 and len(mine) == 1, err
    assert f"cannot listen for {door} on 127.0.0.1:{taken} (Address already in use)" in mine[0]
    assert f"move it with {flag}" in mine[0] and "Traceback" not in err
    assert "loading the model" not in caplog.text  # found before minutes of loading, not after


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_loading_stops_at_once_with_one_line(tmp_path):
    # The model "file" is a FIFO nobody writes: loading blocks on it until the process ends, whatever the machine.
    model = tmp_path / "model.gguf"
    os.mkfifo(model)
    # SIGINT as a terminal leaves it: a suite started in the background (`cmd &`, nohup) ignores SIGINT, and a child
    # inherits that, so the server would (rightly) ignore the Ctrl-C this test sends.
    proc = subprocess.Popen([*SERVE, "--port", "0", "--http-port", "off", "--metrics-port", "off", "--model",
                             str(model)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_sigint)
    try:
        for line in proc.stdout:
            if "loading the model" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=HANG)  # a server that ignores the signal fails here, not hangs
        assert proc.returncode == 130, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rest.strip().splitlines() == ["tandem serve: interrupted while starting"]


def test_no_access_log_flag_and_its_variable(monkeypatch):
    assert build_parser().parse_args(["serve"]).no_access_log is False
    assert build_parser().parse_args(["serve", "--no-access-log"]).no_access_log is True
    monkeypatch.setenv("TANDEM_NO_ACCESS_LOG", "1")
    assert build_parser().parse_args(["serve"]).no_access_log is True


def _access_lines(served: ServeProcess) -> list[re.Match]:
    return [m for line in served.output if (m := ACCESS.search(line))]


@pytest.fixture(scope="module")
def served():
    """`tandem serve` with both doors and the metrics port on free ports."""
    http_port, metrics_port = free_port(), free_port()
    server = ServeProcess("--host", "127.0.0.1", "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                          "--num-threads", "1", "--max-num-seqs", "4", "--num-kv-blocks", "600", "--drain-timeout",
                          "3600", env=LOUD)
    server.http = f"http://127.0.0.1:{http_port}"
    server.metrics = f"http://127.0.0.1:{metrics_port}"
    yield server
    server.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=HANG) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_start_up_phases_say_their_size_and_time_taken(served):
    said = served.text
    assert re.search(r"loading the model \(embedded SmolLM2-135M-Instruct\) \([\d,]+ MB\): started", said), said
    assert re.search(r"loading the model \(embedded SmolLM2-135M-Instruct\): done in [\d.]+ s", said), said


def test_one_access_log_line_per_request_on_both_doors(served):
    with Client(served.address) as client:
        assert client.complete("Hello", max_tokens=3).finish_reason == "length"
        assert len(client.rerank("capital of France", ["Paris", "Bananas"])) == 2
    assert _post(served.http + "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})[0] == 200
    assert _post(served.http + "/rerank", {"query": "capital of France", "texts": ["Paris", "Bananas"]})[0] == 200
    status, body = _post(served.http + "/v1/completions", {"prompt": "Hi", "max_tokens": 1_000_000})
    assert status == 400, body
    while len(_access_lines(served)) < 5:
        served.wait_for("tandem.access")
    lines = [m.groups() for m in _access_lines(served)]
    # each line names the model that served it: the LLM for generation, the embedder for a dense rerank (the default)
    llm, scorer = lines[0][2], lines[1][2]
    assert llm == "SmolLM2-135M-Instruct" and scorer == "all-MiniLM-L6-v2"
    assert [line[2] for line in lines] == [llm, scorer, llm, scorer, llm]
    assert [(door, route, status, finish) for door, route, _, status, finish in lines] == [
        ("grpc", "Generate", "OK", "length"), ("grpc", "Rerank", "OK", "stop"),
        ("http", "/v1/chat/completions", "200", "length"), ("http", "/rerank", "200", "stop"),
        ("http", "/v1/completions", "400", "error")]
    first = next(line for line in served.output if ACCESS.search(line))
    counts = r"prompt_tokens=\d+ completion_tokens=3 cached_tokens=\d+ ttft=[\d.]+s latency=[\d.]+s"
    assert re.search(counts, first), first


def test_vllm_metric_names_process_metrics_and_health_paths_on_the_metrics_port(served):
    status, text = _get(served.metrics + "/metrics")
    assert status == 200
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert name in samples, name
        assert samples[name].labels.get("model_name"), (name, samples[name].labels)
    assert samples["vllm:prompt_tokens_total"].value > 0 and samples["vllm:generation_tokens_total"].value >= 5
    assert samples["vllm:e2e_request_latency_seconds_count"].value >= 5
    assert "tandem_requests_total" in samples  # tandem's own names stay
    assert "process_cpu_seconds_total" in samples and "process_resident_memory_bytes" in samples
    for path in ("/health", "/ready", "/healthz"):
        assert _get(served.metrics + path)[0] == 200, path


async def test_ctrl_c_drains_and_a_second_ctrl_c_stops_at_once_saying_how_it_ended(served):
    before = len(_access_lines(served))
    async with AsyncClient(served.address, max_retries=0) as client:
        # Cannot end on its own (EOS ignored, thousands of tokens) and --drain-timeout is an hour: only the second
        # Ctrl-C ends it.
        stream = client.generate("Tell me a very long story.", max_tokens=8000, ignore_eos=True)
        await stream.__anext__()
        served.proc.send_signal(signal.SIGINT)
        served.wait_for("SIGINT: stopping; in-flight requests get up to 3600s")
        served.wait_for("draining (up to 3600s)")  # logged once health reports NOT_SERVING
        assert _get(served.metrics + "/ready")[0] == 503  # health fails first
        assert _get(served.metrics + "/health")[0] == 200  # still alive, draining
        served.proc.send_signal(signal.SIGINT)
        last = [delta async for delta in stream][-1]
    assert last.finish_reason == "abort"
    assert served.proc.wait(HANG) == 0
    output = served.rest()
    assert "second SIGINT: aborting 1 in-flight requests and stopping now" in "".join(output)
    assert output[-1].rstrip("\n").endswith("tandem serve stopped (second SIGINT): drained 0 requests, aborted 1"), output[-5:]
    assert len(_access_lines(served)) == before + 1  # the aborted request has its line too
    assert _access_lines(served)[-1].group(5) == "abort"
