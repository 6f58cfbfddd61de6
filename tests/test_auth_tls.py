"""Island credentials (literal / env: / file: secrets, bound to one island) and TLS / mutual TLS.

Certificates are generated at test time with `cryptography`: a CA, a server cert for localhost, a client cert.
"""

import datetime
import ipaddress
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.reference_handler import ReferenceHandler, fp32_tensor
from transport import diloco_pb2 as pb
from transport.auth import Authenticator, SecretError, TlsConfig, resolve_secret
from transport.config import TransportConfig
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport
from transport.grpc_server import start_server
from transport.service import DilocoService

RUN = "run-a"
CFG = TransportConfig(max_attempts=1, rpc_timeout_s=5)


def test_resolve_secret(tmp_path, monkeypatch):
    assert resolve_secret("literal-s3cret") == "literal-s3cret"
    monkeypatch.setenv("DILOCO_TEST_SECRET", "from-env")
    assert resolve_secret("env:DILOCO_TEST_SECRET") == "from-env"
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    assert resolve_secret(f"file:{f}") == "from-file"
    with pytest.raises(SecretError, match="DILOCO_TEST_UNSET"):
        resolve_secret("env:DILOCO_TEST_UNSET")
    with pytest.raises(SecretError, match="cannot read"):
        resolve_secret(f"file:{tmp_path / 'nope'}")
    with pytest.raises(SecretError, match="empty"):
        resolve_secret("")


def test_authenticator_rules():
    auth = Authenticator({"i0": "s0", "i1": "s1"})
    assert auth.authenticate([("x-diloco-island", "i0"), ("x-diloco-secret", "s0")]) == "i0"
    for md in ([], [("x-diloco-island", "i0")], [("x-diloco-island", "i0"), ("x-diloco-secret", "s1")],
               [("x-diloco-island", "i9"), ("x-diloco-secret", "s0")]):  # fmt: skip
        with pytest.raises(Exception) as info:
            auth.authenticate(md)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert Authenticator(None).authenticate([]) is None


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, issuer, key, issuer_key, *, ca=False, san=None):
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert, key=None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(_name("diloco-test-ca"), _name("diloco-test-ca"), ca_key, ca_key, ca=True)
    _write(d / "ca", ca)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _write(d / "server", _cert(_name("localhost"), ca.subject, srv_key, ca_key, san=san), srv_key)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    _write(d / "client", _cert(_name("island-i0"), ca.subject, cli_key, ca_key), cli_key)
    return d


def _serve(tls):
    h = ReferenceHandler(RUN, {"w": np.zeros(4, np.float32)})
    svc = DilocoService(h, RUN, h.model_spec(), authenticator=Authenticator({"i0": "s0", "i1": "s1"}), config=CFG)
    return h, start_server(svc, "127.0.0.1:0", tls=tls)


def _push(c, island="i0"):
    meta = pb.PushMeta(run_id=RUN, island=island, round=0, tokens=1)
    return c.push(meta, [fp32_tensor("w", np.ones(4, np.float32))])


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(pki, mutual):
    server_tls = TlsConfig(
        cert_file=str(pki / "server.crt"), key_file=str(pki / "server.key"),
        ca_file=str(pki / "ca.crt") if mutual else None,
    )  # fmt: skip
    h, srv = _serve(server_tls)
    try:
        target = f"localhost:{srv.port}"
        client_files = {"cert_file": str(pki / "client.crt"), "key_file": str(pki / "client.key")}
        good = TlsConfig(ca_file=str(pki / "ca.crt"), **(client_files if mutual else {}))
        with GrpcTransport(target, "i0", "s0", config=CFG, tls=good) as c:
            assert _push(c).accepted
            # Credentials are checked over TLS too: a wrong secret and impersonation are refused.
        with GrpcTransport(target, "i0", "wrong", config=CFG, tls=good) as c:
            with pytest.raises(TransportError) as info:
                _push(c)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with GrpcTransport(target, "i1", "s1", config=CFG, tls=good) as c:
            with pytest.raises(TransportError) as info:
                _push(c, island="i0")
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        # A plaintext client cannot talk to a TLS server.
        with GrpcTransport(target, "i0", "s0", config=CFG) as c:
            with pytest.raises(TransportError) as info:
                c.status()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        if mutual:  # without a client certificate the handshake fails
            with GrpcTransport(target, "i0", "s0", config=CFG, tls=TlsConfig(ca_file=str(pki / "ca.crt"))) as c:
                with pytest.raises(TransportError) as info:
                    c.status()
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert h.applied == [("i0", 0, 0, 1)]
    finally:
        srv.stop(0)


def test_missing_credentials_plaintext():
    h, srv = _serve(None)
    try:
        with GrpcTransport(srv.address, "i0", None, config=CFG) as c:
            with pytest.raises(TransportError) as info:
                _push(c)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert h.applied == []
    finally:
        srv.stop(0)


def test_tls_config_errors(tmp_path):
    with pytest.raises(ValueError, match="together"):
        TlsConfig(cert_file=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="tls.ca_file: file not found"):
        TlsConfig(ca_file=str(tmp_path / "missing.crt"))
