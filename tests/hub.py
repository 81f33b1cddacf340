"""A local stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's snapshot_download and
hf_hub_download (the requests they make, read from huggingface_hub 2.x: repo_info, the recursive tree listing, then
HEAD + GET of each file's resolve URL with X-Repo-Commit, ETag and Content-Length), serving folders on disk as
repositories. Tests point HF_ENDPOINT at it; nothing reaches the internet.

Every request is recorded (method, path, authorization header), so a test can assert what was fetched and that an
offline run asked for nothing. A repository may be private: then only `Authorization: Bearer <token>` sees it, others
get the Hub's 401 "repository not found".
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    folder: Path
    token: str | None = None  # private: this bearer token only

    @property
    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, authorization)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fetched(self) -> list[str]:
        """The repository files whose bytes were sent (GET of a resolve URL): 'org/name/file'."""
        return [_file_of(path) for method, path, _ in self.requests if method == "GET" and "/resolve/" in path]

    @staticmethod
    def commit(repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    # ---- the Hub's answers -----------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            repo = self._repo(h, repo_id)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                if rest and not self._revision(h, repo_id, rest[1]):
                    return
                return self._json(h, {"id": repo_id, "modelId": repo_id, "sha": self.commit(repo_id),
                                      "private": repo.token is not None,
                                      "siblings": [{"rfilename": f} for f in repo.files]}, body)
            if rest[0] == "tree" and len(rest) >= 2:
                if not self._revision(h, repo_id, rest[1]):
                    return
                under = "/".join(rest[2:])
                return self._json(h, [{"type": "file", "path": f, "size": (repo.folder / f).stat().st_size,
                                       "oid": _sha1(repo.folder / f)}
                                      for f in repo.files if f.startswith(under)], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(h, repo_id)
            if repo is None or not self._revision(h, repo_id, revision):
                return
            file = repo.folder / name
            if not file.is_file():
                return self._error(h, 404, "EntryNotFound", f"{name} not found")
            data = file.read_bytes()
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(len(data)))
            h.send_header("X-Repo-Commit", self.commit(repo_id))
            h.send_header("ETag", f'"{_sha1(file)}"')
            h.end_headers()
            if body:
                h.wfile.write(data)
            return
        self._error(h, 404, None, "not found")

    def _repo(self, h, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is not None and repo.token is not None and h.headers.get("authorization") != f"Bearer {repo.token}":
            repo = None
        if repo is None:  # the Hub answers a private repository without the right token as a missing one
            status = 401 if h.headers.get("authorization") is None else 404
            self._error(h, status, "RepoNotFound", "Repository not found")
        return repo

    def _revision(self, h, repo_id: str, revision: str) -> bool:
        if revision in ("main", self.commit(repo_id)):
            return True
        self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return False

    @staticmethod
    def _json(h, payload, body: bool) -> None:
        data = json.dumps(payload).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _error(h, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def _file_of(path: str) -> str:
    """'/org/name/resolve/REV/dir/file' -> 'org/name/dir/file'."""
    parts = path.strip("/").split("/")
    return "/".join(parts[:2] + parts[4:])


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


# ---- the repositories the tests serve -------------------------------------------------------------------------

TINY_LLAMA = "tandem-test/tiny-llama"  # a Hugging Face directory: random tiny Llama, SmolLM2's tokenizer
TINY_BERT = "tandem-test/tiny-bert-reranker"  # a cross-encoder: random tiny BERT sequence classifier (private)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the embedded embedder's folder (nested 1_Pooling/config.json)
GGUF_REPO = "tandem-test/SmolLM2-135M-Instruct-GGUF"  # two quants: the embedded Q4_1 file and a Q8_0 placeholder
GGUF_Q4 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_Q8 = "SmolLM2-135M-Instruct.Q8_0.gguf"
TOKEN = "hf_tandem_test_token"  # the private repository's


def build_repos(root: Path) -> dict[str, Repo]:
    """The repositories above, built under `root` (tiny random weights; the GGUF file linked, not copied)."""
    from engine.embed import embedded_embedder_dir
    from engine.models.loader import embedded_gguf_path
    from tests.engine.test_cross_encoder import _tiny_bert
    from tests.reliability.tiny import make_tiny_model_dir

    gguf = root / "gguf"
    gguf.mkdir(parents=True)
    (gguf / GGUF_Q4).symlink_to(embedded_gguf_path())
    (gguf / GGUF_Q8).write_bytes(b"GGUF: a placeholder no test may fetch")
    (gguf / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    return {TINY_LLAMA: Repo(make_tiny_model_dir(root / "llama")),
            TINY_BERT: Repo(_tiny_bert(root / "bert"), token=TOKEN),
            MINILM: Repo(embedded_embedder_dir()),
            GGUF_REPO: Repo(gguf)}
