"""Client commands of the `tandem` CLI: generate, chat, rerank, info. Never imports torch."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from clients.sync import Client
from clients.types import TandemError


def add_commands(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion of a prompt", description="Stream a completion.")
    _connection(gen)
    gen.add_argument("prompt", help="the prompt text (sent raw; use `tandem chat` for the chat template)")
    _sampling(gen)
    gen.set_defaults(run=_generate)

    chat = sub.add_parser("chat", help="chat on stdin (one user turn per line)",
                          description="Chat: each line on stdin is a user turn; replies stream to stdout.")
    _connection(chat)
    chat.add_argument("--system", default=None, help="a system prompt")
    _sampling(chat)
    chat.set_defaults(run=_chat)

    rr = sub.add_parser("rerank", help="score documents against a query", description="Rerank documents.")
    _connection(rr)
    rr.add_argument("--query", "-q", required=True)
    rr.add_argument("documents", nargs="+", metavar="DOC")
    rr.add_argument("--top-n", type=int, default=None)
    rr.add_argument("--instruction", default=None, help="replace the default relevance instruction")
    rr.add_argument("--truncate", choices=("end", "none"), default="end")
    rr.add_argument("--json", action="store_true", help="print the results as JSON")
    rr.set_defaults(run=_rerank)

    info = sub.add_parser("info", help="what the server serves and its limits")
    _connection(info)
    info.set_defaults(run=_info)


def _connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("TANDEM_TARGET", "localhost:50051"),
                   help="HOST:PORT of a tandem server (env TANDEM_TARGET)")
    p.add_argument("--token", default=os.environ.get("TANDEM_AUTH_TOKEN"),
                   help="bearer token, if the server requires one (env TANDEM_AUTH_TOKEN)")
    p.add_argument("--ca-cert", default=os.environ.get("TANDEM_CA_CERT"),
                   help="PEM of the CA that signed the server's certificate: connect with TLS (env TANDEM_CA_CERT)")
    p.add_argument("--tls", action="store_true", help="connect with TLS using the system's root certificates")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the server abandons the request")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def _client(args: argparse.Namespace) -> Client:
    root = Path(args.ca_cert).read_bytes() if args.ca_cert else None
    return Client(args.target, token=args.token, tls=args.tls, root_certificates=root)


def _params(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop, timeout=args.timeout)


def _stream(deltas, out: TextIO) -> str:
    text = []
    for delta in deltas:
        out.write(delta.text)
        out.flush()
        text.append(delta.text)
    out.write("\n")
    return "".join(text)


def _generate(args: argparse.Namespace, out: TextIO) -> int:
    with _client(args) as client:
        _stream(client.generate(args.prompt, **_params(args)), out)
    return 0


def _chat(args: argparse.Namespace, out: TextIO) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply = _stream(client.chat(messages, **_params(args)), out)
            messages.append({"role": "assistant", "content": reply})


def _rerank(args: argparse.Namespace, out: TextIO) -> int:
    with _client(args) as client:
        results = client.rerank(args.query, args.documents, top_n=args.top_n, return_documents=True,
                                instruction=args.instruction, truncate=args.truncate, timeout=args.timeout)
    if args.json:
        out.write(json.dumps([{"index": r.index, "score": r.score, "document": r.document} for r in results]) + "\n")
    else:
        for r in results:
            out.write(f"{r.score:.4f}  [{r.index}]  {r.document}\n")
    return 0


def _info(args: argparse.Namespace, out: TextIO) -> int:
    from google.protobuf.json_format import MessageToJson

    with _client(args) as client:
        out.write(MessageToJson(client.model_info()) + "\n")
    return 0


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run a parsed client command; a refusal prints the server's code and message and exits 1."""
    command: Callable[[argparse.Namespace, TextIO], int] = args.run
    try:
        return command(args, out)
    except TandemError as exc:
        print(f"tandem: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
