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
from transport.auth import CERTIFIED_KEY, Authenticator, SecretError, TlsConfig, call_metadata, resolve_secret
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
    for md in (
        [],
        [("x-diloco-island", "i0")],
        [("x-diloco-island", "i0"), ("x-diloco-secret", "s1")],
        [("x-diloco-island", "i9"), ("x-diloco-secret", "s0")],
    ):
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


def make_test_pki(d: Path, island: str = "i0") -> Path:
    """ca.crt, server.crt/.key (localhost, 127.0.0.1), client.crt/.key (issued to `island`) in `d`: made here,
    independently of the product's own generator (diloco/deploy/tls.py), so that each checks the other."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(_name("diloco-test-ca"), _name("diloco-test-ca"), ca_key, ca_key, ca=True)
    _write(d / "ca", ca)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _write(d / "server", _cert(_name("localhost"), ca.subject, srv_key, ca_key, san=san), srv_key)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    _write(d / "client", _cert(_name(island), ca.subject, cli_key, ca_key), cli_key)
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_test_pki(tmp_path_factory.mktemp("pki"))


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
        cert_file=str(pki / "server.crt"),
        key_file=str(pki / "server.key"),
        ca_file=str(pki / "ca.crt") if mutual else None,
    )
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


# -- secrets never leave as values; the product's TLS checks and local PKI -------------------------------------------


def test_literal_secrets_are_redacted_and_the_placeholder_never_authenticates():
    from transport.auth import REDACTED_SECRET, redact_secret

    assert redact_secret("env:S") == "env:S" and redact_secret("file:/run/s") == "file:/run/s"
    assert redact_secret("hunter2") == REDACTED_SECRET
    with pytest.raises(SecretError, match="placeholder"):
        resolve_secret(REDACTED_SECRET)


def test_tls_config_errors_are_user_errors(tmp_path):
    from floor.errors import UserError

    with pytest.raises(UserError, match="tls.cert_file: file not found"):
        TlsConfig(cert_file=str(tmp_path / "a.crt"), key_file=str(tmp_path / "a.key"))


def test_tls_files_are_checked_with_one_line_naming_key_and_flag(pki, tmp_path):
    from diloco.deploy.tls import TlsSetupError, client_tls, server_tls

    crt, key, ca = str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt")
    assert server_tls("", "", "") is None and client_tls("", "", "", "") is None
    assert server_tls(crt, key, "").ca_file is None  # TLS, no client certificate required
    assert server_tls(crt, key, ca).ca_file == ca  # mutual TLS
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    cases = [
        (lambda: server_tls("", "", ca), "network.tls_cert / --tls-cert is required"),
        (lambda: server_tls(str(tmp_path / "none.crt"), key, ""), "network.tls_cert / --tls-cert: cannot read"),
        (lambda: server_tls(str(garbage), key, ""), "is not a PEM certificate"),
        (lambda: server_tls(crt, str(garbage), ""), "network.tls_key / --tls-key: " + f"{garbage} is not a PEM"),
        (lambda: server_tls(crt, str(pki / "client.key"), ""), "is not the key of"),
        (lambda: server_tls(crt, key, str(garbage)), "network.tls_ca / --tls-ca"),
        (lambda: client_tls(ca, str(pki / "client.crt"), "", ""), "network.tls_key / --tls-key is required"),
    ]
    for call, expected in cases:
        with pytest.raises(TlsSetupError) as info:
            call()
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_loopback_rule():
    from diloco.deploy.tls import ExposureError, check_client_exposure, exposure_problem, is_loopback

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("", "0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.evil.com"):
        assert not is_loopback(host), host
    assert exposure_problem("127.0.0.1:0", authenticated=False, encrypted=False) is None
    assert exposure_problem("[::1]:0", authenticated=False, encrypted=False) is None
    assert exposure_problem("0.0.0.0:1", authenticated=True, encrypted=True) is None
    assert "network.secrets" in exposure_problem("0.0.0.0:1", authenticated=False, encrypted=True)
    assert "in clear" in exposure_problem(":1", authenticated=True, encrypted=False)
    check_client_exposure("10.0.0.1:1", sends_secret=False, encrypted=False, insecure=False)
    check_client_exposure("10.0.0.1:1", sends_secret=True, encrypted=True, insecure=False)
    check_client_exposure("127.0.0.1:1", sends_secret=True, encrypted=False, insecure=False)
    check_client_exposure("10.0.0.1:1", sends_secret=True, encrypted=False, insecure=True)
    with pytest.raises(ExposureError, match="in clear to 10.0.0.1:1"):
        check_client_exposure("10.0.0.1:1", sends_secret=True, encrypted=False, insecure=False)


def test_local_pki_is_private_and_gives_mutual_tls(tmp_path):
    """What `launch` makes: private keys 0600 in a 0700 dir, no CA key on disk, a server certificate valid for
    127.0.0.1 (what the islands dial) and client certificates the server requires."""
    import stat

    from diloco.deploy.tls import make_local_pki, server_tls

    pki = make_local_pki(tmp_path / "tls", ["i0", "i1"])
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == [
        "ca.crt",
        "client-i0.crt",
        "client-i0.key",
        "client-i1.crt",
        "client-i1.key",
        "server.crt",
        "server.key",
    ]
    for key in (tmp_path / "tls").glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    h = ReferenceHandler(RUN, {"w": np.zeros(4, np.float32)})
    svc = DilocoService(h, RUN, h.model_spec(), authenticator=Authenticator({"i0": "s0"}), config=CFG)
    srv = start_server(svc, "127.0.0.1:0", tls=server_tls(*(str(p) for p in (pki.server_cert, pki.server_key, pki.ca))))
    try:
        with GrpcTransport(f"127.0.0.1:{srv.port}", "i0", "s0", config=CFG, tls=pki.client_tls("i0")) as c:
            assert _push(c).accepted
        with GrpcTransport(f"127.0.0.1:{srv.port}", "i0", "s0", config=CFG, tls=TlsConfig(ca_file=str(pki.ca))) as c:
            with pytest.raises(TransportError) as info:
                c.status()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE  # no client certificate: no handshake
    finally:
        srv.stop(0)


def test_a_client_certificate_is_accepted_for_its_own_island_only(tmp_path):
    """Under mutual TLS a certificate names its island (launch's and deploy's PKI: the common name): another
    island's secret over it is PERMISSION_DENIED, and a client cannot claim a certificate name in its metadata."""
    from diloco.deploy.tls import make_local_pki, server_tls

    pki = make_local_pki(tmp_path / "tls", ["i0", "i1"])
    h = ReferenceHandler(RUN, {"w": np.zeros(4, np.float32)})
    svc = DilocoService(h, RUN, h.model_spec(), authenticator=Authenticator({"i0": "s0", "i1": "s1"}), config=CFG)
    srv = start_server(svc, "127.0.0.1:0", tls=server_tls(*(str(p) for p in (pki.server_cert, pki.server_key, pki.ca))))
    target = f"127.0.0.1:{srv.port}"
    try:
        with GrpcTransport(target, "i0", "s0", config=CFG, tls=pki.client_tls("i1")) as c:
            with pytest.raises(TransportError) as info:
                _push(c)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "client certificate issued to 'i1'" in info.value.reason, info.value.reason
        tls = pki.client_tls("i1")
        creds = grpc.ssl_channel_credentials(
            Path(tls.ca_file).read_bytes(), Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes()
        )
        with grpc.secure_channel(target, creds) as channel:
            join = channel.stream_unary(
                "/diloco.v1.Diloco/Join",
                request_serializer=pb.JoinRequest.SerializeToString,
                response_deserializer=pb.JoinReply.FromString,
            )
            forged = (*call_metadata("i0", "s0"), (CERTIFIED_KEY, "i0"))
            with pytest.raises(grpc.RpcError) as refused:
                join(iter([pb.JoinRequest(run_id=RUN, island="i0")]), metadata=forged, timeout=30)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
        with GrpcTransport(target, "i1", "s1", config=CFG, tls=pki.client_tls("i1")) as c:
            assert _push(c, island="i1").accepted
        assert h.applied == [("i1", 0, 0, 1)] and len(h.members) == 0
    finally:
        srv.stop(0)


def test_a_certified_name_in_plaintext_metadata_is_dropped():
    """Without TLS there is no certificate: an entry of the certified-name key the client sent is dropped by the
    server, so it neither admits nor refuses anyone."""
    h, srv = _serve(None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            join = channel.stream_unary(
                "/diloco.v1.Diloco/Join",
                request_serializer=pb.JoinRequest.SerializeToString,
                response_deserializer=pb.JoinReply.FromString,
            )
            claimed = (*call_metadata("i0", "s0"), (CERTIFIED_KEY, "i1"))
            reply = join(iter([pb.JoinRequest(run_id=RUN, island="i0")]), metadata=claimed, timeout=30)
        assert reply.run_id == RUN and h.members == {"i0": 0}
    finally:
        srv.stop(0)
