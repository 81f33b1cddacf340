"""The HTTP door on a developer's laptop (issue 63): request heads are bounded before anything reads them (raw
sockets: an oversized or unterminated header, too many fields), a web page's form post never reaches a JSON route
(415), and the Host header is checked against an allow-list (DNS rebinding); normal requests go on meanwhile."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from service.http.headers import MAX_HEAD_BYTES, MAX_HEADER_FIELDS
from service.http.hosts import allowed_hosts, host_allowed
from service.server import ServerConfig
from tests.service.conftest import CHAT, GUARD_S

UNTERMINATED_BYTES = 64 * 2**20  # what the attacker would send, were the server to keep reading


def _address(http_url: str) -> tuple[str, int]:
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_reply(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection ("" when it reset it first)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _refused_431_or_closed(reply: bytes) -> None:
    if not reply:
        return  # reset with our bytes unread: closed, which is as good
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), reply[:200]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and str(MAX_HEAD_BYTES) in error["message"]


def test_a_complete_oversized_header_gets_431_before_routing(http_url):
    with socket.create_connection(_address(http_url), timeout=GUARD_S) as sock:
        big = b"x" * (2 * MAX_HEAD_BYTES)
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + big + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return  # closed while we sent: refused
        reply = _read_reply(sock)
    assert reply, "the server closed without a reply to a complete request"
    _refused_431_or_closed(reply)


def test_an_unterminated_header_is_cut_off_not_held(http_url):
    """The server stops reading long before the attacker's 64 MB: it answers 431 and closes (or resets), so the
    send fails or the reply arrives within a few MB (the kernel's socket buffers)."""
    sent = 0
    with socket.create_connection(_address(http_url), timeout=GUARD_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        chunk = b"a" * 65536
        try:
            while sent < UNTERMINATED_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < UNTERMINATED_BYTES, "the server read a 64 MB header line to its end"
        _refused_431_or_closed(_read_reply(sock))


def test_too_many_header_fields_get_431(http_url):
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS + 5))
    with socket.create_connection(_address(http_url), timeout=GUARD_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + fields + b"\r\n")
        reply = _read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b"header fields" in reply


def test_a_stream_runs_on_through_header_attacks_and_normal_heads_pass(http_url):
    """A chat streaming while oversized heads arrive on other connections finishes whole; a head of ordinary size
    (a long bearer token, many cookies) is served."""
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    done = {}

    def stream() -> None:
        with httpx.Client(base_url=http_url, timeout=GUARD_S) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                done["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    chat = threading.Thread(target=stream)
    chat.start()
    for _ in range(3):
        test_an_unterminated_header_is_cut_off_not_held(http_url)
    chat.join(GUARD_S)
    assert done["events"][-1] == "data: [DONE]"
    assert json.loads(done["events"][-2][6:])["choices"][0]["finish_reason"] == "length"
    headers = {"x-token": "t" * 8000, "cookie": "; ".join(f"c{i}=v" for i in range(500))}
    assert httpx.get(f"{http_url}/health", headers=headers, timeout=GUARD_S).status_code == 200


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain;charset=UTF-8",
                                          "multipart/form-data; boundary=x"])
def test_a_web_pages_simple_request_never_reaches_a_chat(http_url, served, content_type):
    """What a page may POST cross-site without a preflight: a JSON text under a form's or text's Content-Type. It is
    refused (415, OpenAI's invalid_request_error) and no generation is admitted."""
    before = sum(len(v) for v in served.recorder.finished.values())
    body = json.dumps({"messages": CHAT, "max_tokens": 4})
    r = httpx.post(f"{http_url}/v1/chat/completions", content=body, headers={"content-type": content_type},
                   timeout=GUARD_S)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
    assert sum(len(v) for v in served.recorder.finished.values()) == before
    r = httpx.post(f"{http_url}/v2/rerank", content=json.dumps({"query": "q", "documents": ["d"]}),
                   headers={"content-type": content_type}, timeout=GUARD_S)
    assert r.status_code == 415 and "must be JSON" in r.json()["message"]  # Cohere's own shape


@pytest.mark.parametrize("host, allowed", [("localhost", True), ("localhost:{port}", True), ("127.0.0.1:{port}", True),
                                           ("[::1]:{port}", True), ("app.localhost:{port}", True),
                                           ("127.0.0.2", True), ("attacker.example", False),
                                           ("attacker.example:{port}", False), ("10.0.0.5:{port}", False)])
def test_a_server_on_loopback_answers_loopback_hosts_only(http_url, host, allowed):
    port = _address(http_url)[1]
    r = httpx.get(f"{http_url}/v1/models", headers={"host": host.format(port=port)}, timeout=GUARD_S)
    if allowed:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_host"
        assert "--allowed-hosts" in error["message"]


def test_allowed_hosts_adds_names_to_a_loopback_door(served):
    door = served.add_http(ServerConfig(host="127.0.0.1", port=0, allowed_hosts=("api.example", "*.corp.example")))
    try:
        for host, status in (("api.example:80", 200), ("a.corp.example", 200), ("localhost", 200),
                             ("evil.example", 400), ("corp.example.evil", 400)):
            r = httpx.get(f"{door.url}/health", headers={"host": host}, timeout=GUARD_S)
            assert r.status_code == status, (host, r.text)
    finally:
        served.stop_http(door)


def test_the_allow_list_by_bind_address():
    # loopback: its names only, plus what --allowed-hosts adds; elsewhere: any host, unless --allowed-hosts lists some
    assert host_allowed("localhost:8000", allowed_hosts("127.0.0.1"))
    assert not host_allowed("rebound.example", allowed_hosts("127.0.0.1"))
    assert not host_allowed("rebound.example", allowed_hosts("::1"))
    assert allowed_hosts("0.0.0.0") is None and host_allowed("my-box.lan:8000", allowed_hosts("0.0.0.0"))
    assert not host_allowed("other.lan", allowed_hosts("0.0.0.0", ("my-box.lan",)))
    assert host_allowed("my-box.lan", allowed_hosts("0.0.0.0", ("my-box.lan",)))
    assert allowed_hosts("127.0.0.1", ("*",)) is None
    assert host_allowed(None, allowed_hosts("127.0.0.1"))  # no Host (HTTP/1.0): not a browser's request
    with pytest.raises(ValueError, match="allowed-hosts"):
        ServerConfig(allowed_hosts=("api.*.example",))


def test_the_metrics_port_checks_the_host_as_the_door_does():
    """`--metrics-port` (/metrics, /health, /ready, /healthz) answers the same hosts: a rebinding page reads neither
    port; a probe without Host (HAProxy's `option httpchk`, HTTP/1.0) and an --allowed-hosts name still pass."""
    from service.metrics import Metrics

    http, _ = Metrics().serve("127.0.0.1", 0, hosts=allowed_hosts("127.0.0.1", ("api.example",)))
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        for path in ("/metrics", "/health", "/healthz"):
            for host, status in (("rebound.example", 400), ("localhost", 200), ("api.example:9464", 200)):
                r = httpx.get(url + path, headers={"host": host}, timeout=GUARD_S)
                assert r.status_code == status, (path, host, r.text)
            assert "--allowed-hosts" in httpx.get(url + path, headers={"host": "rebound.example"},
                                                  timeout=GUARD_S).text
        with socket.create_connection(("127.0.0.1", http.server_address[1]), timeout=GUARD_S) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")  # no Host at all
            assert _read_reply(sock).split(b"\r\n", 1)[0].endswith(b" 200 OK")
    finally:
        http.shutdown()
