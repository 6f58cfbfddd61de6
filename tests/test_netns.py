"""Kernel-shaped links (diloco/harness/netns.py): namespace life cycle, tbf really on lo, and real TCP timing under it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco.harness.netns import (
    LinkError,
    ShapedLink,
    list_namespaces,
    measure_goodput_mbit,
    netns_available,
    remove_stale_namespaces,
    shaped_namespace,
)
from diloco.harness.procs import wait_until

_OK, _WHY = netns_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"kernel-shaped namespaces unavailable here: {_WHY}")

# A prefix of our own, so that concurrent runs by other developers never count as our leftovers.
PREFIX = f"dltest{os.getpid()}"


def ours() -> list[str]:
    return [n for n in list_namespaces() if n.startswith(PREFIX + "-")]


@pytest.fixture
def no_leftovers() -> object:
    yield
    assert ours() == [], "a shaped namespace outlived its context"


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_namespace_has_lo_up_with_tbf_and_is_removed() -> None:
    link = ShapedLink(rate_mbit=37.5)
    with shaped_namespace(link, PREFIX) as ns:
        assert ns.name.startswith(PREFIX + "-") and ns.name in list_namespaces()
        lo = ns.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True, check=True).stdout
        assert "UP" in lo.split("<", 1)[1].split(">", 1)[0] and f"mtu {link.mtu} " in lo
        qdisc = ns.qdisc()
        assert "qdisc tbf" in qdisc and "rate 37500Kbit" in qdisc, qdisc
        # The host's loopback is untouched: no tbf there.
        host = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" not in host
        name = ns.name
    assert name not in list_namespaces()


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("exc", [KeyError, KeyboardInterrupt])
def test_namespace_removed_after_exception_and_its_processes_killed(exc: type[BaseException]) -> None:
    with pytest.raises(exc), shaped_namespace(ShapedLink(rate_mbit=10), PREFIX) as ns:
        sleeper = ns.popen([sys.executable, "-c", "import time; time.sleep(60)"])
        # `ip netns exec` execs: the Popen pid is the process inside
        wait_until(lambda: sleeper.pid in ns.pids(), "the sleeper inside the namespace", 60)
        name = ns.name
        raise exc("boom")
    assert name not in list_namespaces()
    assert sleeper.wait(timeout=5) is not None and sleeper.returncode != 0


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_names_are_unique() -> None:
    link = ShapedLink(rate_mbit=10)
    with shaped_namespace(link, PREFIX) as a, shaped_namespace(link, PREFIX) as b:
        assert a.name != b.name
        assert {a.name, b.name} <= set(ours())
    assert ours() == []


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_tcp_transfer_takes_bytes_over_rate() -> None:
    """5 MB at 50 Mbit/s should take 0.8 s; tbf also counts headers and ACKs (~6% at MTU 1500)."""
    nbytes, rate = 5_000_000, 50.0
    with shaped_namespace(ShapedLink(rate_mbit=rate), PREFIX) as ns:
        goodput = measure_goodput_mbit(ns, nbytes)
    seconds = nbytes * 8 / (goodput * 1e6)
    expected = nbytes * 8 / (rate * 1e6)
    print(f"\n5 MB at {rate} Mbit/s: {seconds:.3f} s (expected {expected:.3f} s), goodput {goodput:.1f} Mbit/s")
    assert abs(seconds - expected) / expected < 0.15, (seconds, expected)


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_concurrent_flows_share_the_rate() -> None:
    """Loopback has one egress queue: two flows together get ~the link rate, not twice it."""
    rate = 50.0
    with shaped_namespace(ShapedLink(rate_mbit=rate), PREFIX) as ns:
        aggregate = measure_goodput_mbit(ns, 4_000_000, flows=2)
    print(f"\n2 flows x 2 MB at {rate} Mbit/s: aggregate {aggregate:.1f} Mbit/s")
    assert 0.8 * rate < aggregate < 1.1 * rate, aggregate


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_stale_namespaces_of_dead_creators_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = f"{PREFIX}-{dead.pid}-deadbeef", f"{PREFIX}-{os.getpid()}-livebeef"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert remove_stale_namespaces(PREFIX) == [stale]
        assert stale not in list_namespaces() and live in list_namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_leftovers")
def test_unshaped_loopback_is_much_faster() -> None:
    """Control for the timing test: the same transfer on an effectively unlimited link is not rate-bound,
    so the 0.8 s above comes from tbf, not from Python or the machine."""
    with shaped_namespace(ShapedLink(rate_mbit=10_000, burst_bytes=1 << 20, limit_bytes=8 << 20), PREFIX) as ns:
        goodput = measure_goodput_mbit(ns, 5_000_000)
    print(f"\nunshaped loopback: {goodput:.0f} Mbit/s")
    assert goodput > 150, goodput


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"rate_mbit": 0}, "rate_mbit"),
        ({"rate_mbit": 10, "burst_bytes": 1000}, "burst_bytes"),
        ({"rate_mbit": 10, "limit_bytes": 1000}, "limit_bytes"),
        ({"rate_mbit": 10, "mtu": 100}, "mtu"),
    ],
)
def test_bad_link_names_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(LinkError, match=field):
        ShapedLink(**kw)
