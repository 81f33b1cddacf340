"""Client commands of the `tandem` CLI: generate, chat, rerank, embed, info. Never imports torch.

Exit codes (docs/cli.md): 0 done (finish reason stop or length); 1 refused or failed (the server's status code and
message on stderr); 2 usage error; 3 incomplete: the server aborted the request ([abort]) or the stream was cut off
before the final message (the text so far is printed); 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from clients.sync import Client
from clients.types import Delta, TandemError

EXIT_INCOMPLETE = 3  # aborted by the server, or the stream was cut off before its final message
EXCERPT_CHARS = 80  # `tandem rerank` prints this much of each document unless --full


def add_commands(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate", help="stream a completion of a prompt (sent raw; --chat applies the chat template)",
        description="Stream a completion. The prompt is sent raw, as is: an instruct model may end at once on a "
                    "bare prompt ([stop] and nothing else); --chat (or `tandem chat`) wraps it in the model's chat "
                    "template as one user turn. Why the completion ended is printed on stderr: [stop], [length] "
                    "or [abort]. Exit code 0 when it ended by stop or length, 1 when the server refused or failed "
                    "it, 3 when the server aborted it or the stream was cut off.")
    _connection(gen)
    gen.add_argument("prompt", help="the prompt text, sent raw unless --chat")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as one user turn of a chat: the server applies the model's chat template")
    gen.add_argument("--system", default=None, help="with --chat: a system prompt")
    _sampling(gen)
    gen.add_argument("--json", action="store_true",
                     help="print the whole result as JSON (completions, token ids, logprobs, usage) instead of text")
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
    rr.add_argument("--max-windows", type=int, default=None,
                    help="score a long document as up to N overlapping windows, its best (default: the server's)")
    rr.add_argument("--json", action="store_true", help="print the results as JSON (whole documents)")
    rr.add_argument("--full", action="store_true",
                    help=f"print each document whole (default: its first {EXCERPT_CHARS} characters on one line)")
    rr.set_defaults(run=_rerank)

    emb = sub.add_parser("embed", help="embed texts: one JSON vector per line",
                         description="Embed texts with the server's embedding model; prints one JSON array per text "
                                     "(input order), or with --json one JSON object.")
    _connection(emb)
    emb.add_argument("texts", nargs="+", metavar="TEXT")
    emb.add_argument("--dimensions", type=int, default=None, help="keep the first N values (Matryoshka models)")
    emb.add_argument("--no-normalize", action="store_true", help="the pooled vectors as they are, not unit length")
    emb.add_argument("--truncate", choices=("end", "start", "none"), default="end",
                     help="cut a text over the model's limit at its end or start, or refuse it")
    emb.add_argument("--json", action="store_true", help='print {"embeddings": [...]} as one JSON object')
    emb.set_defaults(run=_embed)

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
    p.add_argument("--n", type=int, default=None, help="completions of the prompt (printed one after another)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each token's log-probability and its K most likely alternatives")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K", help="the same for the prompt (--json)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1: off")
    p.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    p.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    p.add_argument("--min-p", type=float, default=None, help="in [0, 1]; 0: off")
    p.add_argument("--min-tokens", type=int, default=None, help="no EOS / stop before this many tokens")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", default=None, metavar="FILE|TEXT",
                     help="constrain the output to this JSON schema (a file, or the schema's JSON text)")
    fmt.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    fmt.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")


def _client(args: argparse.Namespace) -> Client:
    root = Path(args.ca_cert).read_bytes() if args.ca_cert else None
    return Client(args.target, token=args.token, tls=args.tls, root_certificates=root)


def _params(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop, timeout=args.timeout, n=args.n, logprobs=args.logprobs,
                prompt_logprobs=args.prompt_logprobs, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                min_p=args.min_p, min_tokens=args.min_tokens, logit_bias=_logit_bias(args.logit_bias),
                json_schema=_schema_text(args.json_schema), regex=args.regex, choice=args.choice)


def _logit_bias(items: list[str]) -> dict[int, float] | None:
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"tandem: --logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from None
        if not sep:
            raise SystemExit(f"tandem: --logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}")
    return bias or None


def _schema_text(value: str | None) -> str | None:
    """--json-schema: a file's content when the value names one, else the value itself (the server checks it)."""
    if value is None or value.lstrip().startswith(("{", "[")):
        return value
    path = Path(value)
    return path.read_text() if path.is_file() else value


class CutOff(Exception):
    """The stream ended before the request's final message (the server went away or failed mid-stream)."""

    def __init__(self, text: str, error: TandemError) -> None:
        super().__init__(f"{error.code.name}: {error.message}")
        self.text = text


def _stream(deltas, out: TextIO) -> tuple[str, str | None]:
    """Print text as it streams; returns the text and why the completion ended. Raises CutOff when text had
    streamed and the stream then broke (a refusal before any text is raised as the TandemError itself)."""
    text: list[str] = []
    reason = None
    try:
        for delta in deltas:
            out.write(delta.text)
            out.flush()
            text.append(delta.text)
            reason = delta.finish_reason or reason
    except TandemError as exc:
        if not text:
            raise
        out.write("\n")
        raise CutOff("".join(text), exc) from None
    out.write("\n")
    return "".join(text), reason


def _say_why(reason: str | None, index: int | None = None) -> int:
    """[stop] / [length] / [abort] on stderr (stdout keeps only the text); the exit code it means."""
    which = f" completion {index}" if index is not None else ""
    print(f"[{reason or 'unknown'}]{which}", file=sys.stderr)
    return _exit_code(reason)


def _print_result(result: Delta, args: argparse.Namespace, out: TextIO) -> int:
    """A finished request (complete()): every completion, with its log-probabilities when asked; the exit code."""
    if args.json:
        out.write(json.dumps(_as_json(result)) + "\n")
        return max(_exit_code(c.finish_reason) for c in result.outputs)
    code = 0
    for c in result.outputs:
        if len(result.outputs) > 1:
            out.write(f"--- completion {c.index} ({c.finish_reason}) ---\n")
        out.write(c.text + "\n")
        for token, lp in zip(c.token_ids, c.logprobs or ()):
            alternatives = "  ".join(f"{t}:{v:.4f}" for t, v in list(lp.items())[1:])
            out.write(f"  {token:>6}  {lp.get(token, float('nan')):9.4f}  {alternatives}\n")
        out.flush()
        code = max(code, _say_why(c.finish_reason, c.index if len(result.outputs) > 1 else None))
    return code


def _exit_code(reason: str | None) -> int:
    return 0 if reason in ("stop", "length") else EXIT_INCOMPLETE


def _as_json(result: Delta) -> dict:
    completions = [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    "logprobs": _pairs(c.logprobs)} for c in result.outputs]
    return {"request_id": result.request_id, "completions": completions,
            "prompt_logprobs": _pairs(result.prompt_logprobs),
            "usage": dataclasses.asdict(result.usage) if result.usage else None}


def _pairs(positions: list | None) -> list | None:
    """Logprob dicts as JSON: [[token_id, logprob], ...] per position, chosen first (JSON keys must be strings)."""
    if positions is None:
        return None
    return [None if p is None else [[t, v] for t, v in p.items()] for p in positions]


def _generate(args: argparse.Namespace, out: TextIO) -> int:
    if args.system is not None and not args.chat:
        raise SystemExit("tandem generate: --system needs --chat (a raw prompt has no system turn)")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        source = dict(messages=[*system, {"role": "user", "content": args.prompt}])
    else:
        source = dict(prompt=args.prompt)
    with _client(args) as client:
        if args.json or (args.n or 1) > 1 or args.logprobs is not None:
            return _print_result(client.complete(**source, **_params(args)), args, out)
        _, reason = _stream(client.generate(**source, **_params(args)), out)
    return _say_why(reason)


def _chat(args: argparse.Namespace, out: TextIO) -> int:
    """Each reply streams (completion 0 with --n > 1 is the one the chat continues from)."""
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
            reply, reason = _stream((d for d in client.chat(messages, **_params(args)) if d.index == 0), out)
            if reason != "stop":  # a reply cut by max_tokens, or aborted, says so
                if _say_why(reason):
                    return EXIT_INCOMPLETE
            messages.append({"role": "assistant", "content": reply})


def _rerank(args: argparse.Namespace, out: TextIO) -> int:
    with _client(args) as client:
        results = client.rerank(args.query, args.documents, top_n=args.top_n, return_documents=True,
                                instruction=args.instruction, truncate=args.truncate, timeout=args.timeout,
                                max_windows=args.max_windows)
    if args.json:
        out.write(json.dumps([{"index": r.index, "score": r.score, "document": r.document,
                               "document_tokens": r.document_tokens, "truncated": r.truncated,
                               "windows": r.windows}
                              for r in results]) + "\n")
    else:
        for r in results:
            mark = f"  [truncated to {r.document_tokens} tokens]" if r.truncated else ""
            mark += f"  [best of {r.windows} windows]" if r.windows > 1 else ""
            out.write(f"{r.score:.4f}  [{r.index}]  {r.document if args.full else excerpt(r.document)}{mark}\n")
    return 0


def _embed(args: argparse.Namespace, out: TextIO) -> int:
    with _client(args) as client:
        vectors = client.embed(args.texts, normalize=not args.no_normalize, dimensions=args.dimensions,
                               truncate=args.truncate, timeout=args.timeout)
    if args.json:
        out.write(json.dumps({"embeddings": vectors}) + "\n")
    else:
        out.writelines(json.dumps(v) + "\n" for v in vectors)
    return 0


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """One line of at most `limit` characters: whitespace runs collapsed, a cut marked with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "\u2026"


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
    except CutOff as exc:
        print(f"tandem: the stream was cut off before the completion ended ({exc}); the text above is partial",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    except TandemError as exc:
        print(f"tandem: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
