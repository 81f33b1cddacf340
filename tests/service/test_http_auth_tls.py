"""The HTTP door takes the gRPC door's TLS files, bearer token and scoped tokens (scopes name gRPC methods)."""
from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from service.server import ServerConfig
from tests.service.conftest import CHAT, DOCUMENTS, QUERY

DATA = Path(__file__).parent / "data"
TOKEN, RERANK_ONLY = "s3cret-token", "rerank-only"


@pytest.fixture(scope="module")
def https(served):
    door = served.add_http(ServerConfig(host="127.0.0.1", port=0, tls_cert=str(DATA / "localhost.crt"),
                                        tls_key=str(DATA / "localhost.key"), auth_token=TOKEN,
                                        auth_scoped_tokens={RERANK_ONLY: ("Rerank",)}))
    with httpx.Client(base_url=f"https://localhost:{door.address.rsplit(':', 1)[1]}",
                      verify=ssl.create_default_context(cafile=str(DATA / "localhost.crt"))) as client:
        yield client
    served.stop_http(door)


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_and_scopes(https):
    chat = {"messages": CHAT, "max_tokens": 2}
    rerank = {"query": QUERY, "documents": DOCUMENTS[:2]}
    missing = https.post("/v1/chat/completions", json=chat)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert https.post("/v1/chat/completions", json=chat, headers=_auth("wrong")).status_code == 401
    assert https.post("/v1/chat/completions", json=chat, headers=_auth(TOKEN)).status_code == 200
    denied = https.post("/v1/chat/completions", json=chat, headers=_auth(RERANK_ONLY))
    assert denied.status_code == 403 and "Generate" in denied.json()["error"]["message"]
    assert https.post("/v2/rerank", json=rerank, headers=_auth(RERANK_ONLY)).status_code == 200
    assert https.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS[:2]},
                      headers=_auth(RERANK_ONLY)).status_code == 200
    assert https.post("/v2/rerank", json=rerank).json() == {"message": https.post("/v2/rerank", json=rerank)
                                                            .json()["message"]}
    assert https.get("/health").status_code == 200 and https.get("/ready").status_code == 200  # open


def test_plain_http_is_refused_on_a_tls_port(https):
    plain = str(https.base_url).replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        r = httpx.get(f"{plain}/health", timeout=10)
        r.raise_for_status()
