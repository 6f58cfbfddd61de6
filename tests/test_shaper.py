"""Tests for the WAN link shaper (transport/shaper.py): bandwidth, latency, jitter, loss, outages, profiles.

Most tests run on a fake clock so times can be checked exactly; a few run in real time with threads to
show that concurrent senders share a direction and that the achieved rate matches the configured one.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pytest

from transport.shaper import (
    DEFAULT_BUCKET_BYTES,
    UNSHAPED,
    LinkDown,
    LinkProfile,
    LinkProfileError,
    LinkShaper,
    load_link_profiles,
    profile_for,
    transfer_time_s,
)

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    """A clock whose sleep advances time exactly (single-threaded tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class FrozenClock(FakeClock):
    """A clock that never moves: sleep only records, so queued reservations are visible."""

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)


def shaper(profile: LinkProfile, clock: FakeClock, seed: int = 0, bucket_bytes: int = 0) -> LinkShaper:
    return LinkShaper(profile, seed=seed, clock=clock, sleep=clock.sleep, bucket_bytes=bucket_bytes)


# --- bandwidth --------------------------------------------------------------------------------------------


def test_one_chunk_takes_exactly_its_serialisation_time():
    clock = FakeClock()
    s = shaper(LinkProfile(up_mbps=8.0, down_mbps=8.0), clock)
    s.transmit(MiB, "up")
    assert clock.now - 1000.0 == pytest.approx(MiB * 8 / 8e6, abs=1e-9)
    assert s.bytes_sent == {"up": MiB, "down": 0}


def test_long_run_rate_is_exact_and_bucket_is_the_only_burst():
    clock = FakeClock()
    bw = 50e6
    s = shaper(LinkProfile(up_mbps=50.0, down_mbps=50.0), clock, bucket_bytes=DEFAULT_BUCKET_BYTES)
    for _ in range(20):
        s.transmit(MiB, "up")
    assert clock.now - 1000.0 == pytest.approx((20 * MiB - DEFAULT_BUCKET_BYTES) * 8 / bw, abs=1e-9)
    # After a long idle the bucket refills to at most DEFAULT_BUCKET_BYTES, never more.
    clock.now += 100.0
    t0 = clock.now
    s.transmit(MiB, "up")
    s.transmit(MiB, "up")
    assert clock.now - t0 == pytest.approx((2 * MiB - DEFAULT_BUCKET_BYTES) * 8 / bw, abs=1e-9)
    assert DEFAULT_BUCKET_BYTES <= MiB


def test_senders_queue_per_direction_and_directions_are_independent():
    clock = FrozenClock()
    s = shaper(LinkProfile(up_mbps=10.0, down_mbps=20.0), clock)
    s.transmit(MiB, "up")
    s.transmit(MiB, "down")  # not behind the up chunk
    s.transmit(MiB, "up")  # behind the first up chunk
    up, down = MiB * 8 / 10e6, MiB * 8 / 20e6
    assert clock.sleeps == pytest.approx([up, down, 2 * up])


def test_unshaped_link_never_sleeps():
    clock = FakeClock()
    s = shaper(UNSHAPED, clock)
    s.start_message("up")
    for _ in range(10):
        s.transmit(MiB, "up")
        s.transmit(MiB, "down")
    assert clock.now == 1000.0
    assert s.bytes_sent == {"up": 10 * MiB, "down": 10 * MiB}
    inf = LinkProfile(up_mbps=float("inf"), down_mbps=float("inf"))
    assert transfer_time_s(inf, 10 * MiB, "up") == 0.0


def frozen_shaper() -> tuple[LinkShaper, list[float]]:
    """A 40 Mbit/s shaper whose clock stands at 0: each transmit sleeps until its slot on its direction's lane ends,
    so the sleeps it asks for are those ends (no wall clock: the lanes' schedule, whatever the machine's load)."""
    ends: list[float] = []
    shaper = LinkShaper(LinkProfile(up_mbps=40.0, down_mbps=40.0), clock=lambda: 0.0, sleep=ends.append, bucket_bytes=0)
    return shaper, ends


def test_two_senders_in_one_direction_split_the_bandwidth():
    # 2 x 8 x 128 KiB at 40 Mbit/s: 0.42 s in all; one sender alone would need half of that.
    s, ends = frozen_shaper()
    chunk, chunks = 128 * 1024, 8
    chunk_s = chunk * 8 / 40e6
    last: dict[str, float] = {}
    for _ in range(chunks):
        for sender in ("a", "b"):
            s.transmit(chunk, "up")
            last[sender] = ends[-1]
    # Both finish near the end: they share one lane rather than one running at full speed first.
    assert last == {"a": pytest.approx((2 * chunks - 1) * chunk_s), "b": pytest.approx(2 * chunks * chunk_s)}
    assert s.bytes_sent["up"] == 2 * chunks * chunk


def test_up_and_down_run_concurrently_at_full_speed():
    s, ends = frozen_shaper()
    chunk, chunks = 128 * 1024, 4
    one_s = chunks * chunk * 8 / 40e6
    last: dict[str, float] = {}
    for _ in range(chunks):
        for direction in ("up", "down"):
            s.transmit(chunk, direction)
            last[direction] = ends[-1]
    assert last == {"up": pytest.approx(one_s), "down": pytest.approx(one_s)}  # not 2 * one_s: a lane each


def test_senders_on_threads_share_the_lane_without_losing_a_slot():
    """The lane's reservation under its lock: 2 threads x 8 chunks end exactly where 16 chunks in a row would."""
    s, ends = frozen_shaper()
    chunk, chunks = 128 * 1024, 8
    threads = [threading.Thread(target=lambda: [s.transmit(chunk, "up") for _ in range(chunks)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ends) == pytest.approx([(k + 1) * chunk * 8 / 40e6 for k in range(2 * chunks)])


@pytest.mark.slow
def test_real_time_20mb_at_50mbit_takes_3_2_s():
    s = LinkShaper(LinkProfile(up_mbps=50.0, down_mbps=50.0))
    payload = 20_000_000
    t0 = time.monotonic()
    sent = 0
    while sent < payload:
        n = min(MiB, payload - sent)
        s.transmit(n, "up")
        sent += n
    elapsed = time.monotonic() - t0
    assert elapsed == pytest.approx(3.2, rel=0.15)
    assert s.bytes_sent["up"] == payload


# --- latency and jitter -----------------------------------------------------------------------------------


def test_latency_and_jitter_stay_in_bounds_and_are_seeded():
    profile = LinkProfile(up_mbps=0, down_mbps=0, latency_ms=50.0, jitter_ms=10.0)
    clock = FakeClock()
    s = shaper(profile, clock, seed=7)
    for _ in range(2000):
        s.start_message("down")
    delays = clock.sleeps
    assert all(0.040 <= d <= 0.060 for d in delays)
    assert min(delays) < 0.041 and max(delays) > 0.059  # jitter really spans the range
    assert statistics.fmean(delays) == pytest.approx(0.050, abs=0.001)

    again = FakeClock()
    s2 = shaper(profile, again, seed=7)
    for _ in range(2000):
        s2.start_message("down")
    assert again.sleeps == delays
    other = FakeClock()
    shaper(profile, other, seed=8).start_message("down")
    assert other.sleeps[0] != delays[0]


def test_latency_without_jitter_is_exact():
    clock = FakeClock()
    shaper(LinkProfile(up_mbps=0, down_mbps=0, latency_ms=90.0), clock).start_message("up")
    assert clock.sleeps == [pytest.approx(0.090)]


# --- loss -------------------------------------------------------------------------------------------------


def test_loss_costs_what_the_cost_model_expects():
    # 100 kB chunks at 80 Mbit/s (10 ms each), 20 ms one way (40 ms RTT), 20% loss.
    profile = LinkProfile(up_mbps=80.0, down_mbps=80.0, latency_ms=20.0, loss=0.2)
    chunk, chunks = 100_000, 4000
    clock = FakeClock()
    s = shaper(profile, clock, seed=3)
    for _ in range(chunks):
        s.transmit(chunk, "up")
    elapsed = clock.now - 1000.0
    expected = transfer_time_s(profile, chunk * chunks, "up", chunk_bytes=chunk) - profile.latency_ms / 1e3
    lossless = chunk * chunks * 8 / 80e6
    assert expected == pytest.approx(lossless / 0.8 + chunks * 0.040 * 0.25)
    # Seeded, so deterministic; the tolerance is ~3 standard deviations of the sum.
    assert elapsed == pytest.approx(expected, rel=0.06)
    assert elapsed > 1.8 * lossless
    assert s.bytes_sent["up"] == chunk * chunks
    assert s.bytes_retransmitted["up"] / s.bytes_sent["up"] == pytest.approx(0.25, rel=0.1)


def test_transfer_time_formula():
    p = LinkProfile(up_mbps=50.0, down_mbps=25.0, latency_ms=100.0, loss=0.5)
    nbytes = 3 * MiB + 1  # 4 chunks
    assert transfer_time_s(p, nbytes, "up") == pytest.approx(0.1 + nbytes * 8 / 50e6 * 2 + 4 * 0.2 * 1)
    assert transfer_time_s(p, nbytes, "down") == pytest.approx(0.1 + nbytes * 8 / 25e6 * 2 + 4 * 0.2 * 1)
    wan = LinkProfile(up_mbps=50.0, down_mbps=50.0)
    assert transfer_time_s(wan, 20_000_000, "up") == pytest.approx(3.2)
    with pytest.raises(ValueError, match="direction"):
        transfer_time_s(wan, 1, "sideways")


# --- outages ----------------------------------------------------------------------------------------------


def test_outage_raises_link_down_then_recovers():
    profile = LinkProfile(up_mbps=8.0, down_mbps=8.0, latency_ms=10.0, outages=((10.0, 5.0),))
    clock = FakeClock(start=0.0)
    s = shaper(profile, clock)
    s.start_message("up")
    s.transmit(1000, "up")
    clock.now = 11.0
    with pytest.raises(LinkDown, match="outage"):
        s.transmit(1000, "up")
    with pytest.raises(LinkDown):
        s.start_message("down")
    assert s.is_down()
    clock.now = 15.0  # the window is [10, 15)
    assert not s.is_down()
    s.start_message("down")
    s.transmit(1000, "down")
    assert s.bytes_sent == {"up": 1000, "down": 1000}


def test_transfer_in_flight_fails_when_the_outage_begins():
    profile = LinkProfile(up_mbps=8.0, down_mbps=8.0, outages=((10.0, 5.0),))
    clock = FakeClock(start=0.0)
    s = shaper(profile, clock)
    clock.now = 9.5
    with pytest.raises(LinkDown):
        s.transmit(1_000_000, "up")  # needs 1 s, the link goes down after 0.5 s
    assert clock.now == pytest.approx(10.0)
    assert s.bytes_sent["up"] == 0


def test_partition_raises_until_healed():
    clock = FakeClock()
    s = shaper(LinkProfile(up_mbps=8.0, down_mbps=8.0), clock)
    s.set_partitioned(True)
    with pytest.raises(LinkDown, match="partition"):
        s.transmit(10, "up")
    s.set_partitioned(False)
    s.transmit(10, "up")
    assert s.bytes_sent["up"] == 10
    assert isinstance(LinkDown("x"), ConnectionError)


def test_bad_call_arguments():
    s = shaper(UNSHAPED, FakeClock())
    with pytest.raises(ValueError, match="direction must be 'up' or 'down'"):
        s.transmit(10, "sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        s.transmit(-1, "up")


# --- profiles ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"up_mbps": -1}, "link.up_mbps must be > 0, or 0 or inf for unshaped (got -1)"),
        ({"down_mbps": float("nan")}, "link.down_mbps must be a number (got nan)"),
        ({"up_mbps": True}, "link.up_mbps must be a number (got True)"),
        ({"loss": 1.0}, "link.loss must be in [0, 1) (got 1)"),
        ({"loss": -0.1}, "link.loss must be in [0, 1) (got -0.1)"),
        ({"latency_ms": -5}, "link.latency_ms must be finite and >= 0 (got -5)"),
        ({"latency_ms": 5, "jitter_ms": 6}, "link.jitter_ms must be in [0, latency_ms=5] (got 6)"),
        ({"outages": ((1.0,),)}, "link.outages[0] must be a [start_s, duration_s] pair"),
        ({"outages": ((1.0, 0.0),)}, "link.outages[0][1] (duration_s) must be finite and > 0 (got 0)"),
        ({"outages": ((-1.0, 2.0),)}, "link.outages[0][0] (start_s) must be finite and >= 0 (got -1)"),
    ],
)
def test_profile_validation(kwargs, message):
    args = {"up_mbps": 10.0, "down_mbps": 10.0, **kwargs}
    with pytest.raises(LinkProfileError) as e:
        LinkProfile(**args)
    assert str(e.value).startswith(message)
    assert isinstance(e.value, ValueError)


def test_profile_normalises_values():
    p = LinkProfile(up_mbps=10, down_mbps=20, outages=[[5, 1], [1, 2]])
    assert p.up_mbps == 10.0 and isinstance(p.up_mbps, float)
    assert p.outages == ((1.0, 2.0), (5.0, 1.0))
    assert p.rtt_s == 0.0
    assert hash(p) == hash(LinkProfile(up_mbps=10.0, down_mbps=20.0, outages=((1, 2), (5, 1))))


def test_shipped_profiles_load():
    wan = load_link_profiles(REPO / "configs/links/wan3.toml")
    assert set(wan) == {"us-east", "eu-west", "ap-south", "default"}
    assert wan["us-east"].up_mbps == 100.0 and wan["us-east"].rtt_s == pytest.approx(0.080)
    assert wan["ap-south"].up_mbps == 50.0 and wan["ap-south"].rtt_s == pytest.approx(0.180)
    assert profile_for(wan, "eu-west") is wan["eu-west"]
    assert profile_for(wan, "somewhere-else") is wan["default"]
    assert profile_for({}, "x") is UNSHAPED
    for name in ("lan.toml", "flaky.toml"):
        assert "default" in load_link_profiles(REPO / "configs/links" / name)
    assert load_link_profiles(REPO / "configs/links/flaky.toml")["ap-south"].outages == ((60.0, 60.0),)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "links.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[links.a]\nup_mbs = 1\ndown_mbps = 1\n", "links.a.up_mbs: unknown key (did you mean 'up_mbps'?)"),
        ("[link.a]\nup_mbps = 1\n", "link: unknown key (did you mean 'links'?)"),
        (
            "[links.a]\nup_mbps = 1\ndown_mbps = 1\nloss = 'high'\n",
            "links.a.loss must be a number (got 'high')",
        ),
        ("[links.a]\ndown_mbps = 1\n", "links.a.up_mbps: missing"),
        ("[default]\nup_mbps = 1\ndown_mbps = -2\n", "default.down_mbps must be > 0"),
        ("[links.a]\nup_mbps = 1\ndown_mbps = 1\nloss = 1.5\n", "links.a.loss must be in [0, 1) (got 1.5)"),
        ("[links.default]\nup_mbps = 1\ndown_mbps = 1\n", "links.default: reserved name"),
        ("links = 3\n", "links must be a table"),
        ("[links]\na = 3\n", "links.a must be a table"),
        ("[links.a\n", "invalid TOML"),
    ],
)
def test_profile_file_errors(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(LinkProfileError) as e:
        load_link_profiles(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ")
    assert message in text
    assert "\n" not in text


def test_missing_profile_file(tmp_path):
    with pytest.raises(LinkProfileError, match="link profile file not found"):
        load_link_profiles(tmp_path / "nope.toml")


def test_profile_file_roundtrip(tmp_path):
    path = _write(
        tmp_path,
        "[links.x]\nup_mbps = 5\ndown_mbps = 7.5\nlatency_ms = 30\njitter_ms = 3\nloss = 0.01\noutages = [[1, 2]]\n",
    )
    assert load_link_profiles(path) == {
        "x": LinkProfile(5.0, 7.5, latency_ms=30.0, jitter_ms=3.0, loss=0.01, outages=((1.0, 2.0),))
    }
