"""`tandem serve` flags are the one path to ServerConfig: every field has a flag, each flag also reads its
TANDEM_<FLAG> variable, and a flag left unset keeps ServerConfig's default."""
from __future__ import annotations

import dataclasses
import os

import pytest

from engine import EngineConfig
from engine.config import EMBEDDED_EMBEDDER
from service.cli import build_engine_config, build_parser, build_server_config, main
from service.server import ServerConfig

NEW_FLAGS = ("--drain-grace", "--tls-client-ca", "--auth-scoped-tokens", "--max-stream-buffer-bytes",
             "--keepalive-time", "--keepalive-timeout", "--max-connection-idle", "--max-connection-age",
             "--max-concurrent-streams", "--http-port")


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def _config(*argv: str) -> ServerConfig:
    return build_server_config(build_parser().parse_args(["serve", *argv]))


def test_serve_help_lists_the_server_flags_and_their_variables(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    for flag in NEW_FLAGS:
        assert flag in text
        assert "TANDEM_" + flag[2:].replace("-", "_").upper() in text


def test_serve_help_groups_the_flags_and_shows_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "gRPC" in text and "HTTP" in text and "Serve over gRPC." not in text
    for group in ("model:", "engine:", "ports:", "requests:", "security:", "logging:"):
        assert f"\n{group}\n" in out, group
    default = EngineConfig()
    for flag, shown in (("--port", "50051"), ("--http-port", "8000"), ("--metrics-port", "9464"),
                        ("--max-documents", "1000"), ("--max-embed-inputs", "1000"), ("--drain-timeout", "30.0"),
                        ("--kv-cache-bytes", "1GiB"), ("--max-num-seqs", str(default.max_num_seqs)),
                        ("--block-size", str(default.block_size)), ("--max-model-len", "the model's own context")):
        help_text = text[text.index(flag + " " + flag[2:].replace("-", "_").upper(), text.index("options:")):]
        assert f"(default: {shown}" in help_text[:400], flag
    assert default.kv_cache_bytes == 2**30 and default.device == "cpu" and default.scoring_share == 0.5


def test_unset_flags_keep_the_server_config_defaults():
    assert _config() == ServerConfig()


def test_flags_set_every_server_config_field():
    config = _config("--host", "0.0.0.0", "--port", "6000", "--max-documents", "7", "--max-embed-inputs", "9",
                     "--max-message-bytes", "1MiB",
                     "--drain-timeout", "9", "--drain-grace", "2.5", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                     "--tls-client-ca", "ca.pem", "--auth-token", "t", "--auth-scoped-tokens",
                     "a=Rerank, RerankStream; b=Generate", "--replica", "r1", "--max-stream-buffer-bytes", "2MiB",
                     "--keepalive-time", "5", "--keepalive-timeout", "3", "--max-connection-idle", "60",
                     "--max-connection-age", "600", "--max-concurrent-streams", "8", "--http-port", "8081",
                     "--served-model-name", "smol", "chat,tiny", "--strict-model-names",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--allowed-hosts", "api.example,*.corp.example")
    assert (config.host, config.port, config.max_message_bytes) == ("0.0.0.0", 6000, 2**20)
    assert (config.drain_timeout_s, config.drain_grace_s) == (9.0, 2.5)
    assert (config.tls_cert, config.tls_key, config.tls_client_ca) == ("c.pem", "k.pem", "ca.pem")
    assert config.auth_token == "t" and config.replica == "r1"
    assert config.auth_scoped_tokens == {"a": ("Rerank", "RerankStream"), "b": ("Generate",)}
    assert config.max_stream_buffer_bytes == 2 * 2**20
    assert (config.keepalive_time_s, config.keepalive_timeout_s) == (5.0, 3.0)
    assert (config.max_connection_idle_s, config.max_connection_age_s, config.max_concurrent_streams) == (60, 600, 8)
    assert config.http_port == 8081
    assert config.served_model_names == ("smol", "chat", "tiny") and config.strict_model_names is True
    assert config.enable_auto_tool_choice is True and config.tool_call_parser == "hermes"
    assert config.allowed_hosts == ("api.example", "*.corp.example")
    # Every field but the internal stop grace is reachable from the command line: no setting is env-only.
    default = ServerConfig()
    unset = [f.name for f in dataclasses.fields(ServerConfig) if getattr(config, f.name) == getattr(default, f.name)]
    assert unset == ["stop_grace_s"]
    assert ("grpc.max_concurrent_streams", 8) in config.grpc_options()


def test_each_flag_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("TANDEM_DRAIN_GRACE", "4")
    monkeypatch.setenv("TANDEM_AUTH_SCOPED_TOKENS", "tokenA=Rerank")
    monkeypatch.setenv("TANDEM_MAX_STREAM_BUFFER_BYTES", "64KiB")
    monkeypatch.setenv("TANDEM_KEEPALIVE_TIME", "7.5")
    monkeypatch.setenv("TANDEM_MAX_CONNECTION_AGE", "")  # empty: as if unset
    monkeypatch.setenv("TANDEM_MAX_CONCURRENT_STREAMS", "16")
    config = _config("--keepalive-time", "8")  # the flag wins over its variable
    assert config.drain_grace_s == 4.0 and config.auth_scoped_tokens == {"tokenA": ("Rerank",)}
    assert config.max_stream_buffer_bytes == 64 * 2**10 and config.max_concurrent_streams == 16
    assert config.keepalive_time_s == 8.0 and config.max_connection_age_s is None


def test_http_port_flag_variable_and_zero_for_off(monkeypatch):
    assert _config().http_port == 8000
    assert _config("--http-port", "0").http_port is None
    assert _config("--http-port", "off").http_port is None
    assert build_parser().parse_args(["serve", "--metrics-port", "off"]).metrics_port is None
    monkeypatch.setenv("TANDEM_HTTP_PORT", "9000")
    assert _config().http_port == 9000
    monkeypatch.setenv("TANDEM_HTTP_PORT", "0")
    assert _config().http_port is None
    with pytest.raises(ValueError, match="http_port"):
        _config("--http-port", "-3")


@pytest.mark.parametrize("name, value, flag", [("TANDEM_KEEPALIVE_TIME", "soon", "--keepalive-time"),
                                               ("TANDEM_AUTH_SCOPED_TOKENS", "secret-token", "--auth-scoped-tokens")])
def test_a_malformed_variable_is_a_serve_usage_error_not_a_crash_of_every_command(monkeypatch, capsys, name, value,
                                                                                 flag):
    monkeypatch.setenv(name, value)
    assert build_parser().parse_args(["generate", "Hi"]).command == "generate"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err
    assert "secret-token" not in err  # a token never reaches the terminal or a log


def _engine_config(*argv: str) -> EngineConfig:
    return build_engine_config(build_parser().parse_args(["serve", *argv]))


def test_engine_flags_reach_the_engine_config_and_unset_ones_keep_its_defaults(monkeypatch):
    assert _engine_config("--embedder", "none") == EngineConfig()
    assert _engine_config().embedder == EMBEDDED_EMBEDDER  # tandem serve embeds unless told --embedder none
    assert _engine_config("--embedder", "/models/e5").embedder == "/models/e5"
    config = _engine_config("--max-num-seqs", "7", "--kv-cache-bytes", "64MiB", "--enforce-eager", "--max-documents",
                            "12", "--max-embed-inputs", "5")
    assert (config.max_num_seqs, config.kv_cache_bytes, config.enforce_eager) == (7, 64 * 2**20, True)
    assert (config.max_rerank_documents, config.max_embed_inputs) == (12, 5)
    assert _engine_config("--enforce-eager", "false").enforce_eager is False
    assert _engine_config("--rerank-mode", "judge").rerank_mode == "judge"
    cascade = _engine_config("--rerank-mode", "cascade", "--rerank-cascade-k", "5")
    assert (cascade.rerank_mode, cascade.rerank_cascade_k) == ("cascade", 5)
    recipe = _engine_config("--rerank-recipe", "mxbai-v2", "--rerank-max-windows", "4", "--rerank-window-overlap", "32")
    assert (recipe.rerank_recipe, recipe.rerank_max_windows, recipe.rerank_window_overlap) == ("mxbai-v2", 4, 32)
    assert _engine_config("--rerank-template", '{"template": "{query} {document}"}').rerank_template.startswith("{")
    with pytest.raises(ValueError, match="rerank_recipe must be one of qwen3, mxbai-v2, template"):
        _engine_config("--rerank-recipe", "bge")
    monkeypatch.setenv("TANDEM_RERANK_MODE", "likelihood")
    assert _engine_config().rerank_mode == "likelihood"
    monkeypatch.setenv("TANDEM_RERANK_MODE", "yesno")
    with pytest.raises(ValueError, match="rerank_mode must be one of likelihood, judge, cross-encoder, fusion, "
                                         "dense, cascade"):
        _engine_config()
    monkeypatch.delenv("TANDEM_RERANK_MODE")
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "1")
    assert _engine_config().enforce_eager is True
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "maybe")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


def test_unknown_rerank_mode_stops_serve_at_start_with_the_valid_modes(capsys):
    assert main(["serve", "--rerank-mode", "yesno", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "rerank_mode must be one of likelihood, judge, cross-encoder, fusion, dense, cascade, got 'yesno'" in err


def test_tpot_target_flag_and_variable_reach_the_engine_config(monkeypatch, capsys):
    assert _engine_config().tpot_target_ms == "auto"  # unset: the objective is on, with the automatic target
    assert _engine_config("--tpot-target-ms", "45").tpot_target_ms == 45.0
    assert _engine_config("--tpot-target-ms", "off").tpot_target_ms is None  # plain budget filling
    assert _engine_config("--tpot-target-ms", "auto").tpot_target_ms == "auto"
    monkeypatch.setenv("TANDEM_TPOT_TARGET_MS", "30.5")
    assert _engine_config().tpot_target_ms == 30.5
    for bad in ("-1", "fast"):
        monkeypatch.setenv("TANDEM_TPOT_TARGET_MS", bad)
        with pytest.raises(SystemExit):
            _engine_config()
        assert "not a latency objective" in capsys.readouterr().err


def test_deadline_stretch_flag_reaches_the_engine_config_and_zero_turns_deadlines_off():
    assert _engine_config().deadline_stretch == 4.0
    assert _engine_config("--deadline-stretch", "6").deadline_stretch == 6.0
    assert _engine_config("--deadline-stretch", "0").deadline_stretch is None


def test_quantization_flag_and_dtype_float32_asking_for_the_dense_path(monkeypatch):
    assert _engine_config().quantization is None  # the engine decides: the embedded model's GGUF blocks on CPU
    assert _engine_config("--quantization", "int8").quantization == "int8"
    # --dtype alone asks for dense weights in that dtype (issue #19: "unless --dtype float32 asks for it")
    assert _engine_config("--dtype", "float32").quantization == "none"
    assert _engine_config("--dtype", "float32", "--quantization", "gguf").quantization == "gguf"
    monkeypatch.setenv("TANDEM_QUANTIZATION", "none")
    assert _engine_config().quantization == "none"


def test_generate_flags_become_the_request_sampling_params(tmp_path):
    """The client command's generation flags reach the proto message the server reads (a schema from a file)."""
    from clients.cli import _params
    from clients.params import sampling_params

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = build_parser().parse_args([
        "generate", "--n", "2", "--logprobs", "3", "--prompt-logprobs", "1", "--repetition-penalty", "1.2",
        "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--min-p", "0.1", "--min-tokens", "2",
        "--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--json-schema", str(schema), "--seed", "3", "Hi"])
    params = _params(args)
    params.pop("timeout")
    msg = sampling_params(**params)
    assert (msg.n, msg.logprobs, msg.prompt_logprobs, msg.min_tokens, msg.seed) == (2, 3, 1, 2, 3)
    assert (msg.repetition_penalty, msg.presence_penalty, msg.frequency_penalty) == (1.2, 0.5, -0.5)
    assert abs(msg.min_p - 0.1) < 1e-9 and dict(msg.logit_bias) == {5: -100.0, 7: 2.5}
    assert msg.WhichOneof("response_format") == "json_schema" and msg.json_schema == '{"type": "object"}'
    plain = sampling_params(**{k: v for k, v in _params(build_parser().parse_args(["generate", "Hi"])).items()
                               if k != "timeout"})
    assert not plain.HasField("n") and not plain.HasField("logprobs") and plain.WhichOneof("response_format") is None
    choice = build_parser().parse_args(["generate", "--choice", "yes", "--choice", "no", "Q"])
    assert list(sampling_params(choice=choice.choice).choice.choices) == ["yes", "no"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--regex", "a", "--choice", "b", "Q"])


def test_make_serve_moves_all_three_ports():
    """A second `make serve` beside a running one needs the HTTP and metrics ports moved too, not only gRPC's."""
    import subprocess
    from pathlib import Path

    done = subprocess.run(["make", "-n", "serve", "PORT=50052", "HTTP_PORT=8001", "METRICS_PORT=9465"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    command = " ".join(done.stdout.replace("\\\n", " ").split())
    assert "tandem serve --port 50052 --http-port 8001 --metrics-port 9465" in command, done.stdout + done.stderr
    plain = subprocess.run(["make", "-n", "serve"], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                           text=True, timeout=60)
    assert "--http-port" not in plain.stdout  # unset: tandem's defaults (and TANDEM_HTTP_PORT) apply


def test_the_reranker_help_says_what_scores_by_default():
    """`tandem serve --help` once said the LLM scores pairs by default, beside a dense default (issue 63)."""
    from engine.config import RerankMode
    from engine.rerank import default_mode

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "the LLM scores pairs" not in text
    assert default_mode(EngineConfig(embedder=EMBEDDED_EMBEDDER)) is RerankMode.DENSE
    assert "default: none; reranks are then scored by the embedder's cosine" in text


def test_rerank_share_is_the_deprecated_spelling_of_scoring_share(monkeypatch):
    """--scoring-share was --rerank-share (the share predates embeddings): the old flag and its variable still work."""
    parse = build_parser().parse_args
    assert build_engine_config(parse(["serve", "--rerank-share", "0.25"])).scoring_share == 0.25
    assert build_engine_config(parse(["serve", "--scoring-share", "0.3"])).scoring_share == 0.3
    monkeypatch.setenv("TANDEM_RERANK_SHARE", "0.2")
    assert build_engine_config(build_parser().parse_args(["serve"])).scoring_share == 0.2


def test_every_flag_of_every_command_is_documented():
    """docs/cli.md names every flag of every command's --help (the serve flags by their --help group), and every
    serve flag has its meaning and default in docs/configuration.md (the limits, TLS and connection flags in
    docs/reliability.md's table): a flag added to the parser without its docs fails here."""
    import argparse
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    cli = (docs / "cli.md").read_text()
    meaning = (docs / "configuration.md").read_text() + (docs / "reliability.md").read_text()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"serve", "cluster", "generate", "chat", "rerank", "embed", "info"} <= set(commands)

    def named(flag: str, text: str) -> bool:
        return re.search(r"`" + re.escape(flag) + r"(?![\w-])", text) is not None

    flags = {(name, flag) for name, parser in commands.items() for action in parser._actions
             for flag in action.option_strings if flag.startswith("--") and flag != "--help"}
    assert {("serve", "--classifier"), ("serve", "--sparse-embedder"), ("generate", "--tls")} <= flags
    assert sorted(f"{name} {flag}" for name, flag in flags if not named(flag, cli)) == []
    assert sorted(flag for name, flag in flags if name == "serve" and not named(flag, meaning)) == []
