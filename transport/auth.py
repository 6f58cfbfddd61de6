"""Island authentication (per-island shared secrets in call metadata) and optional (mutual) TLS.

Each island has a secret, written in config as a literal, ``env:VAR`` or ``file:PATH`` (`resolve_secret`).
The client sends its island name and secret as call metadata on every RPC; the server compares the secret
with `hmac.compare_digest` (constant time) against the one configured for that name. A secret is bound to
one island name, and the service requires the message's island field to equal the authenticated one, so an
island cannot push as another (UNAUTHENTICATED for bad credentials, PERMISSION_DENIED for impersonation).
Secrets in metadata are only confidential over TLS; `TlsConfig` builds gRPC SSL credentials (server, and
client with an optional client certificate for mutual TLS). A secret's *reference* (``env:VAR``, ``file:PATH``)
may be written down and sent (config dumps, the config an island sends at join); a literal never is: it is
replaced by `REDACTED_SECRET` (`redact_secret`), which `resolve_secret` refuses.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from floor.errors import UserError
from transport.errors import Rejected

ISLAND_KEY = "x-diloco-island"
SECRET_KEY = "x-diloco-secret"


REDACTED_SECRET = "<literal secret redacted>"
"""What a literal secret becomes in every dump of a config (run dir's config.toml, the config sent at join).
`resolve_secret` refuses it, so a dumped config reused as input can never authenticate with a known string."""


class SecretError(UserError, ValueError):
    """A secret reference that cannot be resolved."""


def is_secret_reference(ref: str) -> bool:
    """True for ``env:VAR`` and ``file:PATH``: they name where a secret lives, so they may be written down and
    shared; anything else is the secret itself."""
    return ref.startswith(("env:", "file:"))


def redact_secret(ref: str) -> str:
    """A reference as written, a literal replaced by `REDACTED_SECRET`: what may leave the process."""
    return ref if is_secret_reference(ref) else REDACTED_SECRET


def resolve_secret(ref: str) -> str:
    """Resolve a secret written as a literal, ``env:VAR`` or ``file:PATH`` (file content, stripped)."""
    if ref == REDACTED_SECRET:
        raise SecretError(
            f"secret {REDACTED_SECRET!r} is the placeholder a dumped config holds, not a secret; "
            "give the island's secret as env:VAR or file:PATH"
        )
    if ref.startswith("env:"):
        var = ref[4:]
        value = os.environ.get(var)
        if not value:
            raise SecretError(f"secret env:{var}: environment variable {var} is not set or empty")
        return value
    if ref.startswith("file:"):
        path = Path(ref[5:]).expanduser()
        try:
            value = path.read_text().strip()
        except OSError as e:
            raise SecretError(f"secret file:{path}: cannot read ({e.strerror})") from None
        if not value:
            raise SecretError(f"secret file:{path}: file is empty")
        return value
    if not ref:
        raise SecretError("secret is empty")
    return ref


CERTIFIED_KEY = "x-diloco-certified-island"
"""A name the caller's TLS client certificate carries (its common name, or one of its subject alternative names),
as the gRPC server adds it to the call's metadata for the service, one entry per name. The server drops any entry
of this key the client sent itself, so only a verified certificate can put one there (mutual TLS)."""


def certified_names(metadata: Iterable[tuple[str, str | bytes]] | None) -> frozenset[str]:
    """The names the caller's verified client certificate carries (`CERTIFIED_KEY`); empty without mutual TLS."""
    return frozenset(
        value.decode(errors="replace") if isinstance(value, bytes) else value
        for key, value in metadata or ()
        if key == CERTIFIED_KEY
    )


def check_certified(island: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
    """Under mutual TLS a client certificate is one island's: a call for another island is PERMISSION_DENIED, so
    one island's certificate cannot carry another island's secret. Without a client certificate nothing is
    checked here (the secret is the credential)."""
    names = certified_names(metadata)
    if names and island not in names:
        shown = ", ".join(repr(n[:64]) for n in sorted(names)[:4])
        raise Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"island {island!r} called with a client certificate issued to {shown}: each island presents its own "
            "certificate, whose common name (or a subject alternative name) is the island's name",
        )


def call_metadata(island: str, secret: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every RPC."""
    if secret is None:
        return ((ISLAND_KEY, island),)
    return ((ISLAND_KEY, island), (SECRET_KEY, secret))


class Authenticator:
    """Checks call metadata against the configured ``{island: secret}``; ``None`` disables auth."""

    def __init__(self, secrets: Mapping[str, str] | None) -> None:
        self._secrets = None if secrets is None else {k: v.encode() for k, v in secrets.items()}

    @property
    def enabled(self) -> bool:
        """Whether credentials are required."""
        return self._secrets is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The authenticated island name (``None`` when auth is off). Raises UNAUTHENTICATED."""
        md: dict[str, str | bytes] = {}
        for key, value in metadata or ():
            md.setdefault(key, value)
        island = md.get(ISLAND_KEY)
        island = island.decode(errors="replace") if isinstance(island, bytes) else island
        if self._secrets is None:
            return None
        secret = md.get(SECRET_KEY)
        if not island or secret is None:
            raise Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing island credentials in call metadata")
        given = secret.encode() if isinstance(secret, str) else secret
        # Compare against a dummy for unknown islands too, so timing does not reveal which names exist.
        expected = self._secrets.get(island)
        ok = hmac.compare_digest(given, expected if expected is not None else b"\0" * len(given))
        if expected is None or not ok:
            raise Rejected(grpc.StatusCode.UNAUTHENTICATED, f"bad credentials for island {island!r}")
        return island


class TlsError(UserError, ValueError):
    """TLS files that are missing or do not go together; one line naming the field."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS files (PEM). Server: cert+key (+ca to require client certs). Client: ca (+cert+key for mTLS)."""

    ca_file: str | None = None
    """CA that signed the peer's certificate (server side: the client CA; enables mutual TLS)."""
    cert_file: str | None = None
    """This side's certificate chain."""
    key_file: str | None = None
    """This side's private key."""
    server_name: str | None = None
    """Client only: the name to check in the server certificate, when it differs from the dialled host."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("tls.cert_file and tls.key_file must be given together")
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, key)
            if path is not None and not Path(path).is_file():
                raise TlsError(f"tls.{key}: file not found: {path}")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials; mutual TLS (client certificate required) when ``ca_file`` is set."""
        if self.cert_file is None or self.key_file is None:
            raise TlsError("tls.cert_file and tls.key_file are required on the server")
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials; presents a client certificate when cert/key are set."""
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """Extra channel options (server name override)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
