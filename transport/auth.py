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

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from floor.errors import UserError
from transport.errors import Rejected

ISLAND_KEY = "x-diloco-island"
SECRET_KEY = "x-diloco-secret"
OPERATOR_KEY = "x-diloco-operator"
"""The operator's secret, on `diloco admit` and `diloco retire` calls (`check_operator`)."""

MAX_NAME_LENGTH = 64
RESERVED_NAMES = frozenset({"diloco-operator"})
"""Never an island's name, configured or admitted: the common name of the operator's client certificate in kits made
by earlier releases (now `diloco.operator`, no island name), which an island of that name would be bound to
(`check_certified`)."""


def is_island_name(name: str) -> bool:
    """An island name: 1 to 64 characters of [A-Za-z0-9_-] (configured or admitted alike)."""
    return 0 < len(name) <= MAX_NAME_LENGTH and name.isascii() and name.replace("-", "").replace("_", "").isalnum()


def reserved_name_refusal(name: str) -> str | None:
    """Why `name` cannot be an island's although it is well formed (`RESERVED_NAMES`), or None."""
    if name in RESERVED_NAMES:
        return f"{name!r} is the name of operator certificates made by earlier releases: choose another island name"
    return None


def secret_digest(secret: str | bytes) -> bytes:
    """SHA-256 of a secret: what a coordinator keeps of an admitted island's secret (diloco/coordinator/enrollment.py).
    An island's secret is 256 random bits (`diloco admit`), so a plain hash cannot be reversed or guessed."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


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
    """Checks call metadata against the configured ``{island: secret}`` (``None``: configured islands are not
    authenticated) and, through ``admitted``, against the SHA-256 digests of islands admitted while the run goes on
    (`secret_digest`; None for a name that is not admitted). An admitted island always authenticates."""

    def __init__(
        self, secrets: Mapping[str, str] | None, admitted: Callable[[str], bytes | None] | None = None
    ) -> None:
        self._secrets = None if secrets is None else {k: v.encode() for k, v in secrets.items()}
        self._admitted = admitted or (lambda island: None)

    @property
    def enabled(self) -> bool:
        """Whether credentials are required of the configured islands."""
        return self._secrets is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The authenticated island name (``None`` when auth is off for it). Raises UNAUTHENTICATED."""
        md: dict[str, str | bytes] = {}
        for key, value in metadata or ():
            md.setdefault(key, value)
        island = md.get(ISLAND_KEY)
        island = island.decode(errors="replace") if isinstance(island, bytes) else island
        admitted = self._admitted(island) if island else None
        if self._secrets is None and admitted is None:
            return None
        secret = md.get(SECRET_KEY)
        if not island or secret is None:
            raise Rejected(grpc.StatusCode.UNAUTHENTICATED, "missing island credentials in call metadata")
        given = secret.encode() if isinstance(secret, str) else secret
        if admitted is not None:
            ok = hmac.compare_digest(secret_digest(given), admitted)
        else:
            # Compare against a dummy for unknown islands too, so timing does not reveal which names exist.
            expected = (self._secrets or {}).get(island)
            ok = hmac.compare_digest(given, expected if expected is not None else b"\0" * len(given))
            ok = ok and expected is not None
        if not ok:
            raise Rejected(grpc.StatusCode.UNAUTHENTICATED, f"bad credentials for island {island[:64]!r}")
        return island


def check_operator(metadata: Iterable[tuple[str, str | bytes]] | None, operator: bytes | None) -> None:
    """An operator's call (admit, retire) carries the operator's secret (`OPERATOR_KEY`), checked against the
    SHA-256 `operator` of `network.operator_secret` in constant time; without one configured, none is accepted."""
    if operator is None:
        raise Rejected(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this coordinator takes no operator calls: start it with network.operator_secret (env:VAR or file:PATH)",
        )
    given = next((v for k, v in metadata or () if k == OPERATOR_KEY), None)
    if given is None:
        raise Rejected(
            grpc.StatusCode.UNAUTHENTICATED, f"missing operator credentials in call metadata ({OPERATOR_KEY})"
        )
    if not hmac.compare_digest(secret_digest(given), operator):
        raise Rejected(grpc.StatusCode.UNAUTHENTICATED, "bad operator credentials")


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
