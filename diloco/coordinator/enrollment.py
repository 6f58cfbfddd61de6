"""Who may take part in a run: the config's islands, plus those an operator admits while it runs, less the retired.

Membership (roster.py) says who trains now; enrollment says who may. A name that is not enrolled is refused at the
door (authentication, join, push) whatever it sends. The decisions are pure functions over plain values
(`admission_refusal`, `overdue`), table-tested in tests/test_enrollment.py; `Enrollment` applies them and keeps the
result durable in RUN_DIR/roster.json (0600, replaced whole by a rename), so a restarted coordinator knows every
admitted island and every retirement. It keeps the SHA-256 of each admitted island's secret, never the secret:
`diloco admit` makes the secret on the operator's machine and writes it only to the island's own 0600 file
(docs/architecture.md, "Elastic federation").

Admission is bounded: `islands.max` enrolled islands at once, `islands.admissions_per_minute` (a window on the wall
clock, kept in roster.json across restarts), and a credential that was retired, an admitted island's or a
configured island's secret, is never accepted again (`RetiredCredentials`). So is what the roster keeps: the live
roster, every retired configured island, the newest `RETIRED_SHOWN` retired admitted ones, a count of all, and a
fixed-size filter of retired credentials; 1,000 admissions and retirements leave roster.json the size it was.

A change is written first and adopted after (`Enrollment._commit`): a write that fails leaves the roster as it was,
on disk and in memory, and the caller is told so.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import json
import math
import time
from collections.abc import Callable, Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from floor.errors import UserError
from floor.files import write_atomically
from transport.auth import is_island_name, reserved_name_refusal
from transport.errors import Rejected

ROSTER_FILE = "roster.json"
SECRET_DIGEST_BYTES = 32
RETIRED_SHOWN = 32
"""How many retired admitted islands the roster lists (with round and reason), oldest forgotten first."""
CREDENTIAL_FILTER_BYTES = 1 << 15
"""The size of the filter of retired credentials (`RetiredCredentials`): 2^18 bits."""
CREDENTIAL_PROBES = 8
WINDOW_S = 60.0
"""`islands.admissions_per_minute` counts admissions in this window."""
MAX_WINDOW = 1 << 16
"""The most admissions of one second a roster.json may claim (what a damaged file can make a coordinator allocate)."""


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
    retired_credentials: Container[bytes]
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
    if reserved := reserved_name_refusal(name):
        return grpc.StatusCode.INVALID_ARGUMENT, reserved
    if len(digest) != SECRET_DIGEST_BYTES:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"secret_sha256 must be {SECRET_DIGEST_BYTES} bytes (got {len(digest)})",
        )
    if name in view.enrolled:
        how = "configured" if name in view.configured else "admitted"
        return grpc.StatusCode.ALREADY_EXISTS, f"island {name!r} is already on the roster ({how})"
    if digest in view.retired_credentials:
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


@dataclass(frozen=True)
class RetiredCredentials:
    """The credentials (SHA-256 digests) of every retired island, in a fixed size: a Bloom filter (Bloom 1970) whose
    `CREDENTIAL_PROBES` bits per credential are cut from the digest itself (uniform already). A retired credential is
    never forgotten however many islands are retired; a fresh one is taken for a retired one with probability
    (1 - e^(-k n / m))^k after n retirements (k = 8, m = 2^18 bits): under 1e-7 for 4096 retirements, 0.06 % for
    16384, and `diloco admit` then makes another."""

    bits: bytes = bytes(CREDENTIAL_FILTER_BYTES)

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, bytes) and all(self.bits[i // 8] >> (i % 8) & 1 for i in _probes(digest))

    def with_credential(self, digest: bytes) -> RetiredCredentials:
        out = bytearray(self.bits)
        for i in _probes(digest):
            out[i // 8] |= 1 << (i % 8)
        return RetiredCredentials(bytes(out))


def _probes(digest: bytes) -> list[int]:
    bits = CREDENTIAL_FILTER_BYTES * 8
    return [int.from_bytes(digest[4 * i : 4 * i + 4], "big") % bits for i in range(CREDENTIAL_PROBES)]


@dataclass(frozen=True)
class Book:
    """roster.json's content, as a value: a change makes a new Book, which is written before it is adopted."""

    admitted: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Name -> {"secret_sha256": hex, "round": the round open when it was admitted}."""
    retired: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Name -> {"round": ..., "reason": ...}, oldest first: every retired configured island (they stay retired: the
    config names them), and the newest `RETIRED_SHOWN` retired admitted islands."""
    retired_total: int = 0
    """Every retirement of the run, including those no longer listed in `retired`."""
    retired_credentials: RetiredCredentials = RetiredCredentials()
    """The credentials of every retired island."""
    admissions: tuple[float, ...] = ()
    """When (wall clock) the admissions of the last `WINDOW_S` happened: the rate window, kept across restarts."""


def admitted_to(book: Book, name: str, digest: bytes, round_: int, now: float) -> Book:
    """The book once `name` is admitted at wall-clock time `now`."""
    retired = {n: e for n, e in book.retired.items() if n != name}
    admissions = (*(t for t in book.admissions if now - t < WINDOW_S), now)
    admitted = {**book.admitted, name: {"secret_sha256": digest.hex(), "round": round_}}
    return dataclasses.replace(book, admitted=admitted, retired=retired, admissions=admissions)


def retired_from(
    book: Book, name: str, round_: int, reason: str, configured: Collection[str], credential: bytes | None
) -> Book:
    """The book once `name` is retired: its credential (`credential`, its configured secret's SHA-256; an admitted
    island's own) never accepted again; the listed history bounded (`Book.retired`)."""
    entry = book.admitted.get(name)
    credentials = book.retired_credentials
    for digest in (credential, None if entry is None else bytes.fromhex(str(entry["secret_sha256"]))):
        if digest is not None:
            credentials = credentials.with_credential(digest)
    retired = {**{n: e for n, e in book.retired.items() if n != name}, name: {"round": round_, "reason": reason[:200]}}
    admitted_names = [n for n in retired if n not in configured]
    for old in admitted_names[: max(0, len(admitted_names) - RETIRED_SHOWN)]:
        del retired[old]
    return dataclasses.replace(
        book,
        admitted={n: e for n, e in book.admitted.items() if n != name},
        retired=retired,
        retired_total=book.retired_total + 1,
        retired_credentials=credentials,
    )


class Enrollment:
    """The run's roster of who may take part, durable in RUN_DIR/roster.json. No lock of its own: the coordinator
    calls it under its condition variable; `secret_of` and `__contains__` are single reads, safe from the
    transport's threads. A change is written durably first and adopted after: a write that fails leaves the roster
    as it was, on disk and here, and the caller is told so (UNAVAILABLE)."""

    def __init__(
        self,
        configured: Sequence[str],
        run_dir: Path,
        limits: AdmissionLimits,
        configured_credentials: Mapping[str, bytes] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`configured_credentials`: SHA-256 of each configured island's secret (none in a run without per-island
        secrets), refused once that island is retired; `wall`: the clock of the admission rate window (a wall
        clock: the window outlives a restart)."""
        self.configured = tuple(configured)
        self.limits = limits
        self.path = run_dir / ROSTER_FILE
        self.wall = wall
        self._credentials = dict(configured_credentials or {})
        book = _load(self.path)
        for name in book.retired.keys() & self._credentials.keys():  # retired before its credential was refused
            credentials = book.retired_credentials.with_credential(self._credentials[name])
            book = dataclasses.replace(book, retired_credentials=credentials)
        self._adopt(book)

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
        """Why and when `island` was retired ("at round 5: operator"), or None (for an admitted island retired
        longer ago than the `RETIRED_SHOWN` newest, too)."""
        entry = self._book.retired.get(island)
        return None if entry is None else f"at round {entry['round']}: {entry['reason']}"

    def summary(self) -> dict[str, object]:
        """For `diloco status` and summary.json: bounded by the roster, not by its history."""
        return {
            "enrolled": list(self.names),
            "admitted": [n for n in self._book.admitted if n in self._enrolled],
            "retired": {n: dict(e) for n, e in self._book.retired.items()},
            "retired_total": self._book.retired_total,
            "max": self.limits.max_islands,
        }

    # -- changing (under the coordinator's lock) -------------------------------------------------------------

    def admit(self, name: str, digest: bytes, round_: int) -> None:
        """Admit `name` (Rejected with the reason otherwise), durably before this returns."""
        now = self.wall()
        refusal = admission_refusal(name, digest, self._view(now), now, self.limits)
        if refusal is not None:
            raise Rejected(*refusal)
        self._commit(admitted_to(self._book, name, digest, round_, now))

    def retire(self, name: str, round_: int, reason: str) -> bool:
        """Retire an enrolled island, durably; False when it is not enrolled (nothing changes)."""
        if name not in self._enrolled:
            return False
        credential = self._credentials.get(name) if name not in self._book.admitted else None
        self._commit(retired_from(self._book, name, round_, reason, self.configured, credential))
        return True

    def _view(self, now: float) -> EnrollmentView:
        book = self._book
        return EnrollmentView(
            configured=frozenset(self.configured),
            admitted=frozenset(book.admitted),
            retired=dict(book.retired),
            retired_credentials=book.retired_credentials,
            recent=tuple(t for t in book.admissions if now - t < WINDOW_S),
        )

    def _commit(self, book: Book) -> None:
        """Write `book`, then adopt it; a failed write changes nothing."""
        try:
            _save(self.path, book)
        except OSError as exc:
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot write {self.path} ({exc.strerror or exc}): the roster is unchanged; fix the run dir and "
                "try again",
            ) from None
        self._adopt(book)

    def _adopt(self, book: Book) -> None:
        self._book = book
        self._digests = {n: bytes.fromhex(str(e["secret_sha256"])) for n, e in book.admitted.items()}
        self._enrolled = frozenset((*self.configured, *book.admitted)) - book.retired.keys()


def _save(path: Path, book: Book) -> None:
    """Replace roster.json whole (write, fsync, rename, fsync the directory): a crash leaves the old roster or the
    new one. Its size is bounded by the roster, not by the run's history."""
    data = {
        "version": 2,
        "admitted": book.admitted,
        "retired": book.retired,
        "retired_total": book.retired_total,
        "retired_credentials": base64.b64encode(book.retired_credentials.bits).decode(),
        # Per whole second (rounded up: the window holds each a fraction of a second longer, never shorter), so the
        # file holds at most WINDOW_S + 1 pairs whatever islands.admissions_per_minute allows.
        "admissions": sorted(collections.Counter(math.ceil(t) for t in book.admissions).items()),
    }
    write_atomically(path, json.dumps(data, indent=1), mode=0o600)


def _load(path: Path) -> Book:
    """The roster a previous coordinator of this run dir left (version 2, or 1: its retired credentials folded into
    the filter), or an empty one; a damaged file is one line."""
    if not path.exists():
        return Book()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") not in (1, 2):
            raise ValueError("not a version 1 or 2 roster")
        admitted = {
            str(n): {"secret_sha256": bytes.fromhex(str(e["secret_sha256"])).hex(), "round": int(e["round"])}
            for n, e in data["admitted"].items()
        }
        retired = {str(n): {"round": int(e["round"]), "reason": str(e["reason"])} for n, e in data["retired"].items()}
        if data["version"] == 1:
            credentials = RetiredCredentials()
            for d in data["retired_digests"]:
                credentials = credentials.with_credential(bytes.fromhex(str(d)))
            book = Book(admitted, retired, len(retired), credentials)
        else:
            bits = base64.b64decode(str(data["retired_credentials"]), validate=True)
            if len(bits) != CREDENTIAL_FILTER_BYTES:
                raise ValueError(f"retired_credentials is {len(bits)} bytes, not {CREDENTIAL_FILTER_BYTES}")
            admissions = tuple(float(t) for t, n in data["admissions"] for _ in range(min(int(n), MAX_WINDOW)))
            book = Book(admitted, retired, int(data["retired_total"]), RetiredCredentials(bits), admissions)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise RosterFileError(f"{path}: cannot read the run's roster ({exc}); restore it from a backup") from None
    if any(len(bytes.fromhex(str(e["secret_sha256"]))) != SECRET_DIGEST_BYTES for e in admitted.values()):
        raise RosterFileError(f"{path}: an admitted island's secret_sha256 is not {SECRET_DIGEST_BYTES} bytes")
    return book
