"""`tandem cluster` puts the replicas' HTTP doors behind HAProxy too: an HTTP chat is hashed on x-tandem-prefix (or,
without it, on the OpenAI `user` field), and a key reaches the same replica through either door."""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import pytest

from clients import AsyncClient
from tests.cluster.harness import ClusterProcess

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="HAProxy is not installed (`apt-get install -y haproxy`)")

KEYS = [f"chat-{i}" for i in range(8)]


@pytest.fixture(scope="module")
def cluster():
    proc = ClusterProcess(2)
    yield proc
    proc.stop()


def chat(cluster: ClusterProcess, *, key: str | None = None, user: str | None = None) -> str:
    """One short HTTP chat through HAProxy; the name of the replica (gRPC address) that answered it."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if user is not None:
        body["user"] = user
    headers = {"Content-Type": "application/json", **({"x-tandem-prefix": key} if key is not None else {})}
    request = urllib.request.Request(cluster.http_url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            http_address = reply.headers["x-tandem-replica"]
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code} {exc.read()!r}\n{cluster.log_tail()}") from None
    return next(r.address for r in cluster.replicas.values() if r.http_address == http_address)


async def test_http_chats_are_hashed_on_the_header_or_the_user_field_like_grpc(cluster):
    by_header = {key: chat(cluster, key=key) for key in KEYS}
    assert set(by_header.values()) == {r.address for r in cluster.replicas.values()}  # both replicas get keys
    for key in KEYS:
        assert chat(cluster, key=key) == by_header[key], cluster.log_tail()  # the same key, the same replica
        assert chat(cluster, user=key) == by_header[key], cluster.log_tail()  # no header: `user` is the key
        async with AsyncClient(cluster.address) as client:
            out = await client.complete("Hi", max_tokens=1, routing_key=key)
        assert out.replica == by_header[key], cluster.log_tail()  # and the gRPC door routes the key to the same replica
