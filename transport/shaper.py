"""WAN link shaper: make an in-process or loopback link behave like a slow, lossy, flaky WAN link.

DiLoCo (arXiv 2311.08105) exists because the links between regions are slow; to test and benchmark it on
one machine we put a shaper in front of every transfer. The transports call it once per message
(`start_message`: one-way latency plus seeded jitter), that is twice per RPC (the request up, its reply down:
an RPC costs one RTT), and once per ~1 MiB chunk (`transmit`).

Model, per direction ("up" = island -> coordinator, "down" = coordinator -> island), each independent:

* **Bandwidth** is a serialisation queue with a small token bucket. A chunk reserves the next free slot,
  ``next_free = max(now - bucket_s, next_free) + nbytes * 8 / bw``, and its sender sleeps until
  ``next_free``. Concurrent senders in one direction therefore queue behind each other and share the
  bandwidth; the long-run rate is exactly the configured one. The bucket (``DEFAULT_BUCKET_BYTES``,
  64 KiB, far less than one 1 MiB chunk) is the only burst allowed: it lets a link that has been idle
  send that many bytes at once, and it absorbs the few hundred microseconds a real ``time.sleep``
  oversleeps, so the achieved rate does not drift below the configured one on fast links.
* **Loss** is TCP-like: with probability ``loss`` a chunk is lost, noticed one RTT (2 x latency) later,
  and retransmitted (taking its bandwidth slot again). A retransmission can be lost too, so a chunk is
  sent a geometric number of times: ``1 / (1 - loss)`` in expectation. Draws come from an RNG seeded by
  ``(seed, direction)``, so a run is reproducible.
* **Outages** ``(start_s, duration_s)`` since the shaper was created: `transmit` and `start_message` raise
  `LinkDown` during one, and a transfer still in flight when one begins fails at its start (the RPC layer
  turns that into UNAVAILABLE and retries). `set_partitioned` simulates an unscheduled partition.

`transfer_time_s` is the matching pure cost model (used by benchmarks and the cost model in docs/architecture.md).
The clock and sleep are injected so unit tests can run on a fake clock and check times exactly.
"""

from __future__ import annotations

import difflib
import math
import random
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from floor.errors import UserError

Direction = Literal["up", "down"]
DIRECTIONS: tuple[str, str] = ("up", "down")

DEFAULT_BUCKET_BYTES = 64 * 1024
"""Burst allowance of each direction's token bucket, in bytes (well under one 1 MiB chunk)."""

DEFAULT_PROFILE_NAME = "default"
"""Key under which `load_link_profiles` returns the file's optional ``[default]`` table."""


class LinkDown(ConnectionError):
    """The link is in a scheduled outage (or a simulated partition)."""


class LinkProfileError(UserError, ValueError):
    """A link profile (or a link profile file) is invalid; the message is one line naming the key."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        """The offending field of `LinkProfile`, when the error is about one field."""
        self.detail = detail
        """What is wrong with it, without the key (so a loader can prefix its own location)."""


def _field_error(key: str, detail: str) -> LinkProfileError:
    return LinkProfileError(f"link.{key} {detail}", key=key, detail=detail)


def _as_number(key: str, value: object) -> float:
    # bool is an int subclass; `up_mbps = true` is a mistake, not 1 Mbit/s.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _field_error(key, f"must be a number (got {value!r})")
    value = float(value)
    if math.isnan(value):
        raise _field_error(key, "must be a number (got nan)")
    return value


def _validate_outages(outages: object) -> tuple[tuple[float, float], ...]:
    if not isinstance(outages, list | tuple):
        raise _field_error("outages", f"must be a list of [start_s, duration_s] pairs (got {outages!r})")
    result = []
    for i, window in enumerate(outages):
        if not isinstance(window, list | tuple) or len(window) != 2:
            raise _field_error(f"outages[{i}]", f"must be a [start_s, duration_s] pair (got {window!r})")
        start = _as_number(f"outages[{i}][0]", window[0])
        duration = _as_number(f"outages[{i}][1]", window[1])
        if not 0 <= start < math.inf:
            raise _field_error(f"outages[{i}][0]", f"(start_s) must be finite and >= 0 (got {start:g})")
        if not 0 < duration < math.inf:
            raise _field_error(f"outages[{i}][1]", f"(duration_s) must be finite and > 0 (got {duration:g})")
        result.append((start, duration))
    return tuple(sorted(result))


def _check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'up' or 'down' (got {direction!r})")
    return direction


@dataclass(frozen=True)
class LinkProfile:
    """One island's WAN link to the coordinator."""

    up_mbps: float
    """Island -> coordinator bandwidth in megabits/s (1e6 bits/s); 0 or inf means unshaped."""
    down_mbps: float
    """Coordinator -> island bandwidth in megabits/s (1e6 bits/s); 0 or inf means unshaped."""
    latency_ms: float = 0.0
    """One-way latency in milliseconds, paid once per message; a round trip (RTT) is twice this."""
    jitter_ms: float = 0.0
    """Uniform +- jitter on the one-way latency, in milliseconds (seeded); at most ``latency_ms``."""
    loss: float = 0.0
    """Probability that a chunk is lost; a lost chunk is retransmitted after one RTT (TCP-like)."""
    outages: tuple[tuple[float, float], ...] = ()
    """Scheduled outages as ``(start_s, duration_s)`` pairs, in seconds since the shaper started."""

    def __post_init__(self) -> None:
        for key in ("up_mbps", "down_mbps"):
            value = _as_number(key, getattr(self, key))
            if value < 0:
                raise _field_error(key, f"must be > 0, or 0 or inf for unshaped (got {value:g})")
            object.__setattr__(self, key, value)
        latency = _as_number("latency_ms", self.latency_ms)
        if not 0 <= latency < math.inf:
            raise _field_error("latency_ms", f"must be finite and >= 0 (got {latency:g})")
        jitter = _as_number("jitter_ms", self.jitter_ms)
        if not 0 <= jitter <= latency:
            # Jitter beyond the latency would make delays negative; reject rather than silently clip.
            raise _field_error("jitter_ms", f"must be in [0, latency_ms={latency:g}] (got {jitter:g})")
        loss = _as_number("loss", self.loss)
        if not 0 <= loss < 1:
            raise _field_error("loss", f"must be in [0, 1) (got {loss:g})")
        object.__setattr__(self, "latency_ms", latency)
        object.__setattr__(self, "jitter_ms", jitter)
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "outages", _validate_outages(self.outages))

    def mbps(self, direction: str) -> float:
        """Bandwidth of one direction in megabits/s (0 or inf: unshaped)."""
        return self.up_mbps if _check_direction(direction) == "up" else self.down_mbps

    def bits_per_s(self, direction: str) -> float:
        """Bandwidth of one direction in bits/s; inf when unshaped."""
        mbps = self.mbps(direction)
        return math.inf if mbps == 0 else mbps * 1e6

    @property
    def rtt_s(self) -> float:
        """Round-trip time in seconds (twice the one-way latency, no jitter)."""
        return 2 * self.latency_ms / 1e3


UNSHAPED = LinkProfile(up_mbps=0.0, down_mbps=0.0)
"""A link with no bandwidth limit, latency, loss or outage."""


# ---------------------------------------------------------------------------------------------------------
# Loading profiles from TOML


_PROFILE_KEYS = tuple(f.name for f in fields(LinkProfile))


def _unknown_key_message(key: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return f"unknown key ({hint})"


def _profile_from_table(path: Path, where: str, table: object) -> LinkProfile:
    if not isinstance(table, dict):
        raise LinkProfileError(f"{path}: {where} must be a table (got {table!r})")
    for key in table:
        if key not in _PROFILE_KEYS:
            raise LinkProfileError(f"{path}: {where}.{key}: {_unknown_key_message(key, _PROFILE_KEYS)}")
    for key in ("up_mbps", "down_mbps"):
        if key not in table:
            raise LinkProfileError(f"{path}: {where}.{key}: missing (required; 0 means unshaped)")
    try:
        return LinkProfile(**table)
    except LinkProfileError as e:
        raise LinkProfileError(f"{path}: {where}.{e.key} {e.detail}", key=e.key, detail=e.detail) from None


def load_link_profiles(path: str | Path) -> dict[str, LinkProfile]:
    """Read ``[links.NAME]`` tables (and an optional ``[default]``) from a TOML file.

    Returns ``{name: profile}``; the ``[default]`` table, if present, is under ``DEFAULT_PROFILE_NAME``
    (use `profile_for` to look an island up with that fallback). Raises `LinkProfileError` with one line
    naming the file and the key for a missing file, bad TOML, an unknown key, a wrong type or a bad value.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise LinkProfileError(f"{path}: link profile file not found") from None
    except OSError as e:
        raise LinkProfileError(f"{path}: cannot read link profile file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise LinkProfileError(f"{path}: invalid TOML ({e})") from None
    top_keys = ("links", DEFAULT_PROFILE_NAME)
    for key in doc:
        if key not in top_keys:
            raise LinkProfileError(f"{path}: {key}: {_unknown_key_message(key, top_keys)}")
    profiles: dict[str, LinkProfile] = {}
    if DEFAULT_PROFILE_NAME in doc:
        profiles[DEFAULT_PROFILE_NAME] = _profile_from_table(path, "default", doc[DEFAULT_PROFILE_NAME])
    links = doc.get("links", {})
    if not isinstance(links, dict):
        raise LinkProfileError(f"{path}: links must be a table of [links.NAME] tables (got {links!r})")
    for name, table in links.items():
        if name == DEFAULT_PROFILE_NAME:
            raise LinkProfileError(f"{path}: links.{name}: reserved name; put it in a top-level [default]")
        profiles[name] = _profile_from_table(path, f"links.{name}", table)
    return profiles


def profile_for(profiles: dict[str, LinkProfile], island: str) -> LinkProfile:
    """The profile of ``island``, else the file's ``[default]``, else `UNSHAPED`."""
    return profiles.get(island) or profiles.get(DEFAULT_PROFILE_NAME) or UNSHAPED


# ---------------------------------------------------------------------------------------------------------
# Cost model


def transfer_time_s(profile: LinkProfile, nbytes: int, direction: str, chunk_bytes: int = 1 << 20) -> float:
    """Expected seconds for one message of ``nbytes`` sent as ``chunk_bytes`` chunks through the shaper.

    ``latency + nbytes * 8 / bw / (1 - loss) + n_chunks * RTT * loss / (1 - loss)``: one-way latency once,
    every byte sent ``1 / (1 - loss)`` times in expectation, and one RTT per lost attempt. Jitter has zero
    mean; outages and the token bucket (at most ``DEFAULT_BUCKET_BYTES`` sent early) are left out.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0 (got {nbytes})")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0 (got {chunk_bytes})")
    bw = profile.bits_per_s(direction)
    n_chunks = -(-nbytes // chunk_bytes)
    attempts = 1 / (1 - profile.loss)
    wire_s = nbytes * 8 / bw * attempts
    retransmit_wait_s = n_chunks * profile.rtt_s * (attempts - 1)
    return profile.latency_ms / 1e3 + wire_s + retransmit_wait_s


# ---------------------------------------------------------------------------------------------------------
# The shaper


class _Lane:
    """One direction: its serialisation queue, RNGs and byte counter (guarded by its own lock)."""

    def __init__(self, bits_per_s: float, bucket_bytes: int, seed: int, direction: str) -> None:
        self.lock = threading.Lock()
        self.bits_per_s = bits_per_s
        self.bucket_s = bucket_bytes * 8 / bits_per_s
        self.next_free = -math.inf  # the bucket starts full
        # Separate streams for loss and jitter so one does not shift the other's sequence.
        self.loss_rng = random.Random(f"loss:{seed}:{direction}")
        self.jitter_rng = random.Random(f"jitter:{seed}:{direction}")

    def reserve(self, nbytes: int, now: float) -> float:
        """Reserve the next transmission slot for ``nbytes``; return the time it ends."""
        with self.lock:
            start = max(self.next_free, now - self.bucket_s)
            self.next_free = start + nbytes * 8 / self.bits_per_s
            return self.next_free


class LinkShaper:
    """Shape one island's link (both directions) to a `LinkProfile`. Thread-safe.

    Call `start_message` once per message/RPC and `transmit` once per chunk. ``bytes_sent`` counts the
    payload bytes that got through, per direction (retransmissions are in ``bytes_retransmitted``).
    """

    def __init__(
        self,
        profile: LinkProfile,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 (got {bucket_bytes})")
        self.profile = profile
        self.bucket_bytes = bucket_bytes
        self._clock = clock
        self._sleep = sleep
        self._t0 = clock()
        self._partitioned = False
        self._lanes = {d: _Lane(profile.bits_per_s(d), bucket_bytes, seed, d) for d in DIRECTIONS}
        self.bytes_sent: dict[str, int] = {d: 0 for d in DIRECTIONS}
        """Payload bytes that crossed the link, per direction."""
        self.bytes_retransmitted: dict[str, int] = {d: 0 for d in DIRECTIONS}
        """Extra bytes sent again after simulated loss, per direction."""

    # -- faults -------------------------------------------------------------------------------------------

    def set_partitioned(self, down: bool = True) -> None:
        """Simulate an unscheduled partition: while set, every call raises `LinkDown`."""
        self._partitioned = down

    def is_down(self, now: float | None = None) -> bool:
        """Whether the link is in an outage (or partitioned) at ``now`` (default: the clock's now)."""
        return self._down_reason(self._clock() if now is None else now) is not None

    def _down_reason(self, now: float) -> str | None:
        if self._partitioned:
            return "link partitioned"
        t = now - self._t0
        for start, duration in self.profile.outages:
            if start <= t < start + duration:
                return f"link outage from t={start:g}s for {duration:g}s (now t={t:.3f}s)"
        return None

    def _next_outage_start(self, now: float, until: float) -> float | None:
        """Absolute clock time of the first outage starting in ``(now, until)``, if any."""
        for start, _ in self.profile.outages:  # sorted by start
            at = self._t0 + start
            if now < at < until:
                return at
        return None

    def _wait_until(self, deadline: float) -> None:
        """Sleep until ``deadline``; raise `LinkDown` now, or when an outage begins before the deadline."""
        now = self._clock()
        reason = self._down_reason(now)
        if reason is not None:
            raise LinkDown(reason)
        cut = self._next_outage_start(now, deadline)
        if cut is not None:
            # The link goes down mid-transfer: the sender finds out when it does, not before.
            self._sleep(cut - now)
            raise LinkDown(self._down_reason(cut) or "link outage")
        if deadline > now:
            self._sleep(deadline - now)
        if self._partitioned:
            raise LinkDown("link partitioned")

    # -- the two calls the transports make -----------------------------------------------------------------

    def start_message(self, direction: Direction) -> None:
        """Pay the one-way latency (+ seeded uniform jitter) once per message/RPC. Raises `LinkDown`."""
        lane = self._lanes[_check_direction(direction)]
        latency_s = self.profile.latency_ms / 1e3
        jitter_s = self.profile.jitter_ms / 1e3
        if jitter_s > 0:
            with lane.lock:
                latency_s += lane.jitter_rng.uniform(-jitter_s, jitter_s)
        self._wait_until(self._clock() + latency_s)

    def transmit(self, nbytes: int, direction: Direction) -> None:
        """Block until nbytes would have crossed the link in that direction.

        Thread-safe. Raises LinkDown during an outage.
        """
        lane = self._lanes[_check_direction(direction)]
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0 (got {nbytes})")
        reason = self._down_reason(self._clock())
        if reason is not None:
            raise LinkDown(reason)
        losses = 0
        if self.profile.loss > 0:
            with lane.lock:
                while lane.loss_rng.random() < self.profile.loss:
                    losses += 1
        for attempt in range(losses + 1):
            if attempt > 0:
                # The sender learns of the loss one RTT later, then sends the chunk again.
                self._wait_until(self._clock() + self.profile.rtt_s)
            if math.isfinite(lane.bits_per_s):
                self._wait_until(lane.reserve(nbytes, self._clock()))
            else:
                self._wait_until(self._clock())
        with lane.lock:
            self.bytes_sent[direction] += nbytes
            self.bytes_retransmitted[direction] += losses * nbytes
