"""Security: TLS and mutual TLS with certificates made here (cryptography), bearer tokens with scopes
(UNAUTHENTICATED / PERMISSION_DENIED), message size and document count limits, and no prompt or document
text in logs at INFO or above. tests/service/test_auth_tls.py covers TLS + one token with committed certs."""
from __future__ import annotations

import datetime
import logging
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.reliability.tiny import tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

FULL, RERANK_ONLY = "full-access-token", "rerank-only-token"
MAX_DOCUMENTS, MAX_MESSAGE_BYTES = 4, 64 * 1024


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, san: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = _cert(name, self.key, _name(name), self.key, ca=True)

    def issue(self, cn: str, san: bool = False) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(cn, key, self.cert.subject, self.key, ca=False, san=san)
        return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, rogue_ca = CA("tandem test server CA"), CA("tandem test client CA"), CA("rogue CA")
    key, cert = server_ca.issue("localhost", san=True)
    (d / "server.key").write_bytes(key)
    (d / "server.crt").write_bytes(cert)
    (d / "clients-ca.crt").write_bytes(client_ca.pem)
    return dict(dir=d, server_ca=server_ca.pem, client=client_ca.issue("retrieval-service"),
                rogue=rogue_ca.issue("retrieval-service"))


@pytest.fixture(scope="module")
def secure_server(tiny_model_dir, pki):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=128, block_size=16, max_rerank_documents=MAX_DOCUMENTS)
    d: Path = pki["dir"]
    plain = ServerConfig(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    server = ServerThread(engine, plain)
    tls = server.add_server(ServerConfig(host="127.0.0.1", port=0, tls_cert=str(d / "server.crt"),
                                         tls_key=str(d / "server.key"), auth_token=FULL,
                                         auth_scoped_tokens={RERANK_ONLY: ("Rerank", "RerankStream", "ModelInfo")}))
    mtls = server.add_server(ServerConfig(host="127.0.0.1", port=0, tls_cert=str(d / "server.crt"),
                                          tls_key=str(d / "server.key"), tls_client_ca=str(d / "clients-ca.crt")))
    port = lambda s: s.address.rsplit(":", 1)[1]  # noqa: E731
    server.tls_target, server.mtls_target = f"localhost:{port(tls)}", f"localhost:{port(mtls)}"
    yield server
    server.close()


def _generate_msg(prompt: str = "Hello there") -> pb.GenerateClientMessage:
    return pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id="a", prompt=prompt, params=pb.SamplingParams(max_tokens=2, temperature=0.0)))


async def _generate(stub, metadata=None, prompt: str = "Hello there") -> pb.GenerateServerMessage:
    call = stub.Generate(metadata=metadata)
    await call.write(_generate_msg(prompt))
    await call.done_writing()
    return [r async for r in call][-1]


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


# ---- TLS and bearer tokens with scopes ------------------------------------------------------------------


async def test_tls_tokens_unauthenticated_and_permission_denied(secure_server, pki):
    creds = grpc.ssl_channel_credentials(root_certificates=pki["server_ca"])
    rerank = pb.RerankRequest(query="blue", documents=["sky", "stone"])
    async with grpc.aio.secure_channel(secure_server.tls_target, creds) as channel:
        stub = pb_grpc.TandemStub(channel)
        full, scoped = [("authorization", f"Bearer {FULL}")], [("authorization", f"Bearer {RERANK_ONLY}")]
        assert (await _generate(stub, full)).final.usage.completion_tokens == 2
        assert len((await stub.Rerank(rerank, metadata=scoped)).results) == 2
        for metadata in (None, [("authorization", "Bearer nope")], [("authorization", FULL)]):
            assert await _code(stub.Rerank(rerank, metadata=metadata)) is grpc.StatusCode.UNAUTHENTICATED
            assert await _code(_generate(stub, metadata)) is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await _generate(stub, scoped)  # a known token, outside its scope
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "/tandem.v1.Tandem/Generate" in denied.value.details()
    # Plaintext to the TLS port never reaches a handler.
    async with grpc.aio.insecure_channel(secure_server.tls_target) as channel:
        code = await _code(pb_grpc.TandemStub(channel).Rerank(rerank, timeout=5))
        assert code is grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_needs_a_client_certificate_signed_by_the_configured_ca(secure_server, pki):
    rerank = pb.RerankRequest(query="blue", documents=["sky"])
    key, cert = pki["client"]
    good = grpc.ssl_channel_credentials(root_certificates=pki["server_ca"], private_key=key, certificate_chain=cert)
    async with grpc.aio.secure_channel(secure_server.mtls_target, good) as channel:
        assert len((await pb_grpc.TandemStub(channel).Rerank(rerank, timeout=30)).results) == 1
    key, cert = pki["rogue"]
    rogue = grpc.ssl_channel_credentials(root_certificates=pki["server_ca"], private_key=key, certificate_chain=cert)
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki["server_ca"])
    for creds in (rogue, no_cert):
        async with grpc.aio.secure_channel(secure_server.mtls_target, creds) as channel:
            assert await _code(pb_grpc.TandemStub(channel).Rerank(rerank, timeout=5)) is grpc.StatusCode.UNAVAILABLE


# ---- size and count limits ------------------------------------------------------------------------------


async def test_message_size_and_document_count_limits(secure_server):
    async with grpc.aio.insecure_channel(secure_server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        too_big = pb.RerankRequest(query="q", documents=["x" * MAX_MESSAGE_BYTES])
        with pytest.raises(grpc.aio.AioRpcError) as big:
            await stub.Rerank(too_big)
        assert big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as many:
            await stub.Rerank(pb.RerankRequest(query="q", documents=["d"] * (MAX_DOCUMENTS + 1)))
        assert many.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"takes at most {MAX_DOCUMENTS}" in many.value.details()
        ok = await stub.Rerank(pb.RerankRequest(query="q", documents=["d"] * MAX_DOCUMENTS))
        assert len(ok.results) == MAX_DOCUMENTS
        info = await stub.ModelInfo(pb.ModelInfoRequest())
        assert (info.limits.max_documents, info.limits.max_message_bytes) == (MAX_DOCUMENTS, MAX_MESSAGE_BYTES)
    assert_all_blocks_free(await secure_server.idle_stats())


# ---- prompts and documents stay out of the logs ---------------------------------------------------------


async def test_prompts_and_documents_never_logged_at_info(secure_server, caplog):
    secret_prompt, secret_doc, secret_query = "zebra-prompt-7f3a", "okapi-document-91c2", "narwhal-query-55d0"
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(secure_server.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        assert (await _generate(stub, prompt=f"Tell me about {secret_prompt}")).final.usage.completion_tokens == 2
        await stub.Rerank(pb.RerankRequest(query=secret_query, documents=[secret_doc, "other"]))
        # Refusals and failures too: an over-long prompt, too many documents, a bad chat message.
        refused = await _generate(stub, prompt=f"{secret_prompt} " * 2000)
        assert refused.WhichOneof("kind") == "error"
        await _code(stub.Rerank(pb.RerankRequest(query=secret_query, documents=[secret_doc] * 9)))
        await _code(stub.Rerank(pb.RerankRequest(query=secret_query, documents=[secret_doc], top_n=0)))
    await secure_server.idle_stats()
    leaked = [r for r in caplog.records if r.levelno >= logging.INFO
              and any(s in r.getMessage() or s in str(r.exc_info or "") for s in (secret_prompt, secret_doc, secret_query))]
    assert not leaked, [f"{r.levelname} {r.name}: {r.getMessage()[:200]}" for r in leaked]
