"""Who may take part in a run: the config's islands, plus those an operator admits while it runs, less the retired.

Membership (roster.py) says who trains now; enrollment says who may. A name that is not enrolled is refused at the
door (authentication, join, push) whatever it sends. The decisions are pure functions over plain values
(`admission_refusal`, `overdue`), table-tested in tests/test_enrollment.py; `Enrollment` applies them and keeps the
result durable in RUN_DIR/roster.json (0600, replaced whole by a rename), so a restarted coordinator knows every
admitted island and every retirement. It keeps the SHA-256 of each admitted island's secret, never the secret:
`diloco admit` makes the secret on the operator's machine and writes it only to the island's own 0600 file
(docs/architecture.md, "Elastic federation").

Admission is bounded: `islands.max` enrolled islands at once, `islands.admissions_per_minute`, a credential that
was retired is never accepted again (a replayed admission of a retired island is refused), and the retired
credentials remembered are capped at `RETIRED_KEPT`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from floor.errors import UserError
from floor.files import write_atomically
from transport.auth import is_island_name
from transport.errors import Rejected

ROSTER_FILE = "roster.json"
SECRET_DIGEST_BYTES = 32
RETIRED_KEPT = 4096
"""How many retired credentials (digests) the roster remembers, oldest forgotten first."""
WINDOW_S = 60.0
"""`islands.admissions_per_minute` counts admissions in this window."""


class RosterFileError(UserError, ValueError):
    """RUN_DIR/roster.json cannot be read: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_islands: int
    """islands.max: enrolled islands at once."""
    per_minute: int
    """islands.admissions_per_minute."""


@dataclass(frozen=True)
class EnrollmentView:
    """What `admission_refusal` reads, as plain values."""

    configured: frozenset[str]
    admitted: frozenset[str]
    retired: Mapping[str, str]
    """Retired name -> why and when, as a refusal names it."""
    retired_digests: frozenset[bytes]
    recent: Sequence[float]
    """When the admissions of the last `WINDOW_S` happened."""

    @property
    def enrolled(self) -> frozenset[str]:
        return (self.configured | self.admitted) - self.retired.keys()


def admission_refusal(
    name: str, digest: bytes, view: EnrollmentView, now: float, limits: AdmissionLimits
) -> tuple[grpc.StatusCode, str] | None:
    """Why an operator's admission of `name` with a secret of SHA-256 `digest` is refused, or None to admit it."""
    if not is_island_name(name):
        return grpc.StatusCode.INVALID_ARGUMENT, "an island name is 1 to 64 characters of [A-Za-z0-9_-]"
    if len(digest) != SECRET_DIGEST_BYTES:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"secret_sha256 must be {SECRET_DIGEST_BYTES} bytes (got {len(digest)})",
        )
    if name in view.enrolled:
        how = "configured" if name in view.configured else "admitted"
        return grpc.StatusCode.ALREADY_EXISTS, f"island {name!r} is already on the roster ({how})"
    if digest in view.retired_digests:
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"the credential offered for {name!r} belonged to a retired island: make a new one (diloco admit)",
        )
    if len(view.enrolled) >= limits.max_islands:
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the roster is full: {len(view.enrolled)} islands enrolled, islands.max = {limits.max_islands} "
            "(retire one, or resume the run with a larger islands.max)",
        )
    recent = [t for t in view.recent if now - t < WINDOW_S]
    if len(recent) >= limits.per_minute:
        wait = WINDOW_S - (now - min(recent))
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(recent)} admissions in the last minute (islands.admissions_per_minute = {limits.per_minute}); "
            f"try again in {wait:.0f}s",
        )
    return None


def overdue(gone_since: Mapping[str, float], now: float, retire_after_s: float) -> list[str]:
    """The islands gone (lost, left, or not back after a coordinator restart) for `retire_after_s` or more, to retire;
    none when it is 0."""
    if retire_after_s <= 0:
        return []
    return sorted(name for name, since in gone_since.items() if now - since >= retire_after_s)


@dataclass
class _Book:
    """roster.json's content."""

    admitted: dict[str, dict[str, object]] = field(default_factory=dict)
    """Name -> {"secret_sha256": hex, "round": the round open when it was admitted}."""
    retired: dict[str, dict[str, object]] = field(default_factory=dict)
    """Name -> {"round": ..., "reason": ...}."""
    retired_digests: list[str] = field(default_factory=list)


class Enrollment:
    """The run's roster of who may take part, durable in RUN_DIR/roster.json. No lock of its own: the coordinator
    calls it under its condition variable; `secret_of` and `__contains__` are single dict reads, safe from the
    transport's threads."""

    def __init__(self, configured: Sequence[str], run_dir: Path, limits: AdmissionLimits) -> None:
        self.configured = tuple(configured)
        self.limits = limits
        self.path = run_dir / ROSTER_FILE
        self._book = _load(self.path)
        self._recent: list[float] = []
        self._digests = {n: bytes.fromhex(str(e["secret_sha256"])) for n, e in self._book.admitted.items()}
        self._enrolled = frozenset(self._view().enrolled)

    # -- reading (any thread) --------------------------------------------------------------------------------

    def __contains__(self, island: object) -> bool:
        return island in self._enrolled

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._enrolled)

    @property
    def names(self) -> tuple[str, ...]:
        """The enrolled islands: configured ones in config order, then admitted ones in admission order."""
        return tuple(n for n in dict.fromkeys((*self.configured, *self._book.admitted)) if n in self._enrolled)

    def secret_of(self, island: str) -> bytes | None:
        """SHA-256 of an admitted, not retired island's secret (`transport.auth.Authenticator`); None otherwise. A
        configured island that was retired and admitted again authenticates with its new secret only."""
        return self._digests.get(island) if island in self._enrolled else None

    def admitted(self, island: str) -> bool:
        return island in self._book.admitted and island in self._enrolled

    def retirement(self, island: str) -> str | None:
        """Why and when `island` was retired ("at round 5: operator"), or None."""
        entry = self._book.retired.get(island)
        return None if entry is None else f"at round {entry['round']}: {entry['reason']}"

    def summary(self) -> dict[str, object]:
        """For `diloco status` and summary.json."""
        return {
            "enrolled": list(self.names),
            "admitted": [n for n in self._book.admitted if n in self._enrolled],
            "retired": {n: dict(e) for n, e in self._book.retired.items()},
            "max": self.limits.max_islands,
        }

    # -- changing (under the coordinator's lock) -------------------------------------------------------------

    def admit(self, name: str, digest: bytes, round_: int, now: float) -> None:
        """Admit `name` (Rejected with the reason otherwise), durably before this returns."""
        refusal = admission_refusal(name, digest, self._view(), now, self.limits)
        if refusal is not None:
            raise Rejected(*refusal)
        self._recent = [t for t in self._recent if now - t < WINDOW_S] + [now]
        self._book.retired.pop(name, None)
        self._book.admitted[name] = {"secret_sha256": digest.hex(), "round": round_}
        self._digests[name] = digest
        self._commit()

    def retire(self, name: str, round_: int, reason: str) -> bool:
        """Retire an enrolled island, durably; False when it is not enrolled (nothing changes)."""
        if name not in self._enrolled:
            return False
        digest = self._digests.pop(name, None)
        if digest is not None:
            self._book.retired_digests = [*self._book.retired_digests, digest.hex()][-RETIRED_KEPT:]
        self._book.admitted.pop(name, None)
        self._book.retired[name] = {"round": round_, "reason": reason[:200]}
        self._commit()
        return True

    def _view(self) -> EnrollmentView:
        return EnrollmentView(
            configured=frozenset(self.configured),
            admitted=frozenset(self._book.admitted),
            retired=dict(self._book.retired),
            retired_digests=frozenset(bytes.fromhex(d) for d in self._book.retired_digests),
            recent=tuple(self._recent),
        )

    def _commit(self) -> None:
        _save(self.path, self._book)
        self._enrolled = frozenset(self._view().enrolled)


def _save(path: Path, book: _Book) -> None:
    """Replace roster.json whole (write, fsync, rename): a crash leaves the old roster or the new one."""
    data = {"version": 1, "admitted": book.admitted, "retired": book.retired, "retired_digests": book.retired_digests}
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True), mode=0o600)


def _load(path: Path) -> _Book:
    """The roster a previous coordinator of this run dir left, or an empty one; a damaged file is one line."""
    if not path.exists():
        return _Book()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a version 1 roster")
        admitted = {
            str(n): {"secret_sha256": bytes.fromhex(str(e["secret_sha256"])).hex(), "round": int(e["round"])}
            for n, e in data["admitted"].items()
        }
        retired = {str(n): {"round": int(e["round"]), "reason": str(e["reason"])} for n, e in data["retired"].items()}
        digests = [bytes.fromhex(str(d)).hex() for d in data["retired_digests"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RosterFileError(f"{path}: cannot read the run's roster ({exc}); restore it from a backup") from None
    if any(len(bytes.fromhex(e["secret_sha256"])) != SECRET_DIGEST_BYTES for e in admitted.values()):  # type: ignore[arg-type]
        raise RosterFileError(f"{path}: an admitted island's secret_sha256 is not {SECRET_DIGEST_BYTES} bytes")
    return _Book(admitted, retired, digests)
