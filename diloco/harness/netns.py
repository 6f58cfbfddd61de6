"""Kernel-shaped WAN links: processes in a private network namespace (`diloco bench utilization --kernel-link`,
tests/test_netns.py, tests/test_kernel_shaped.py).

Why: the in-process link shaper in `transport` models a WAN in Python; this module makes the *kernel* do
it, so real gRPC processes talking over real TCP sockets see a real bottleneck (TCP congestion control,
queueing, head-of-line blocking and all). Each `shaped_namespace()` is a fresh Linux network namespace
(`ip netns add`) whose loopback carries a token-bucket filter (`tc qdisc add dev lo root tbf`, see
tc-tbf(8)); processes started through `Namespace.popen`/`run` talk to each other over 127.0.0.1 inside it.
(`netem` is not available on this kernel; `tbf` is.) Only the namespace's own loopback is touched: the
host's interfaces, addresses and qdiscs are never modified.

Loopback has ONE egress queue: a request and its reply, data and its TCP ACKs, and every concurrent flow
(both directions) all pass through the same tbf, so they share `rate_mbit` rather than getting it each,
like a half-duplex link. A push of N bytes takes about N*8/rate seconds; two islands pushing at once take
about twice as long; a pull racing a push shares the rate too. Measured goodput is a few percent under the
nominal rate because tbf counts Ethernet/IP/TCP headers and the ACKs (about 6% at MTU 1500).

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `tc` (iproute2). `netns_available()` tells,
once per process, whether this machine can do it and why not; tests skip on it, the benchmark refuses with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LinkError",
    "Namespace",
    "NetnsUnavailable",
    "ShapedLink",
    "list_namespaces",
    "measure_goodput_mbit",
    "netns_available",
    "remove_stale_namespaces",
    "shaped_namespace",
]

_ETH_HEADER = 14  # tbf counts the (fake) Ethernet header that loopback frames carry
_CMD_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """A shaped namespace cannot be made here (not root, no `ip`/`tc`, EPERM, no sch_tbf...)."""


class LinkError(ValueError):
    """A `ShapedLink` field is out of range (user mistake; the message names the field)."""


@dataclass(frozen=True)
class ShapedLink:
    """A token-bucket link, as put on the namespace's loopback."""

    rate_mbit: float
    """Long-run rate of the link in Mbit/s (1e6 bit/s), shared by everything in the namespace."""

    burst_bytes: int = 32 * 1024
    """Bucket size: how many bytes may leave back to back at full speed after the link was idle. A transfer
    of N bytes finishes up to burst/N early (32 KiB on 5 MB: 0.7%); a bigger bucket is less accurate and
    less WAN-like, a much smaller one makes the kernel's timer wake per packet (32 KiB = 1.3 ms at 200 Mbit/s,
    26 ms at 10 Mbit/s). Must hold one whole packet (mtu + 14 bytes), or tbf drops it."""

    limit_bytes: int = 1024 * 1024
    """Queue bytes tbf may hold waiting for tokens before it drops (the router's buffer). 1 MiB is 0.84 s at
    10 Mbit/s, 42 ms at 200 Mbit/s: deep enough that one TCP flow rarely sees a drop (a drop on loopback
    costs a retransmit and makes timings noisy), shallow enough that a small RPC behind a bulk push is not
    stuck for seconds. Must be at least burst_bytes."""

    mtu: int = 1500
    """MTU set on the namespace's loopback. Linux's default there is 65536, which would make every packet
    64 KiB: at 10 Mbit/s one packet holds the link for 52 ms and flows cannot interleave. 1500 is what a WAN
    carries."""

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0 or self.rate_mbit > 100_000:
            raise LinkError(f"rate_mbit must be in (0, 100000], got {self.rate_mbit!r}")
        if not 576 <= self.mtu <= 65536:
            raise LinkError(f"mtu must be in [576, 65536], got {self.mtu!r}")
        if self.burst_bytes < self.mtu + _ETH_HEADER:
            raise LinkError(
                f"burst_bytes must hold one packet (mtu + {_ETH_HEADER} = {self.mtu + _ETH_HEADER}), "
                f"got {self.burst_bytes!r}"
            )
        if self.limit_bytes < self.burst_bytes:
            raise LinkError(f"limit_bytes must be >= burst_bytes ({self.burst_bytes}), got {self.limit_bytes!r}")

    @property
    def rate_bit(self) -> int:
        return round(self.rate_mbit * 1e6)

    def tc_args(self) -> list[str]:
        """Arguments after `tc qdisc add dev lo root` that install this link."""
        return [
            "tbf",
            "rate",
            f"{self.rate_bit}bit",
            "burst",
            str(self.burst_bytes),
            "limit",
            str(self.limit_bytes),
        ]


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an iproute2 command; on failure raise NetnsUnavailable with its stderr (the 'why')."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {e}") from e
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {msg}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (`ip netns list`), without the `(id: N)` suffix."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Namespace:
    """A live, shaped network namespace; start processes in it with `wrap`, `popen` or `run`."""

    def __init__(self, name: str, link: ShapedLink) -> None:
        self.name = name
        self.link = link

    def __repr__(self) -> str:
        return f"Namespace({self.name!r}, {self.link!r})"

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` prefixed so that it runs inside this namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        """`subprocess.Popen` inside the namespace; `kw` as for Popen."""
        return subprocess.Popen(self.wrap(argv), **kw)

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """`subprocess.run` inside the namespace; `kw` as for run."""
        return subprocess.run(self.wrap(argv), **kw)

    def pids(self) -> list[int]:
        """Processes currently inside the namespace."""
        out = _run(["ip", "netns", "pids", self.name], check=False).stdout
        return [int(tok) for tok in out.split() if tok.isdigit()]

    def qdisc(self) -> str:
        """`tc qdisc show dev lo` inside the namespace (to check what is installed)."""
        return _run(self.wrap(["tc", "qdisc", "show", "dev", "lo"])).stdout

    def kill_all(self, grace_s: float = 1.0) -> None:
        """SIGTERM every process in the namespace, then SIGKILL what is left after `grace_s`."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.02)


def _create(name: str, link: ShapedLink) -> Namespace:
    _run(["ip", "netns", "add", name])
    ns = Namespace(name, link)
    try:
        _run(["ip", "-n", name, "link", "set", "lo", "mtu", str(link.mtu), "up"])
        _run(ns.wrap(["tc", "qdisc", "add", "dev", "lo", "root", *link.tc_args()]))
    except BaseException:
        _delete(ns)
        raise
    return ns


def _delete(ns: Namespace) -> None:
    """Kill what runs inside, then remove the namespace (a namespace with live processes would outlive
    `ip netns del` anonymously, holding its sockets)."""
    try:
        ns.kill_all()
    finally:
        _run(["ip", "netns", "del", ns.name], check=False)


def _unique_name(prefix: str) -> str:
    # The creator's pid lets `remove_stale_namespaces` tell leftovers of dead runs from live ones.
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@functools.cache
def netns_available() -> tuple[bool, str]:
    """(True, "ok") when shaped namespaces work here, else (False, why). Tries it once per process."""
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not on PATH"
    try:
        ns = _create(_unique_name("diloco-probe"), ShapedLink(rate_mbit=10))
        _delete(ns)
    except NetnsUnavailable as e:
        return False, str(e)
    return True, "ok"


@contextlib.contextmanager
def shaped_namespace(link: ShapedLink, name_prefix: str = "diloco") -> Iterator[Namespace]:
    """A fresh namespace `<prefix>-<pid>-<random>` with lo up and `link` on it; always removed on exit
    (exceptions and KeyboardInterrupt included), after killing any process still inside."""
    if not name_prefix or not all(c.isalnum() or c in "-_" for c in name_prefix):
        raise LinkError(f"name_prefix must be non-empty [A-Za-z0-9_-], got {name_prefix!r}")
    ok, why = netns_available()
    if not ok:
        raise NetnsUnavailable(why)
    ns = _create(_unique_name(name_prefix), link)
    try:
        yield ns
    finally:
        _delete(ns)


def remove_stale_namespaces(name_prefix: str = "diloco") -> list[str]:
    """Delete `<prefix>-<pid>-*` namespaces whose creating process is dead (left by a killed run).
    Namespaces of live processes (another developer's test) are left alone. Returns the names removed."""
    removed = []
    for name in list_namespaces():
        head, sep, rest = name.partition(f"{name_prefix}-")
        pid = rest.split("-", 1)[0]
        if head or not sep or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # creator alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete(Namespace(name, ShapedLink(rate_mbit=1)))
        removed.append(name)
    return removed


_SERVER = """
import selectors, socket, sys, time
flows, each = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(flows)
print(srv.getsockname()[1], flush=True)
conns = [srv.accept()[0] for _ in range(flows)]
sel = selectors.DefaultSelector()
got = {}
for c in conns:
    sel.register(c, selectors.EVENT_READ)
    got[c] = 0
t0 = time.monotonic()
for c in conns:  # start every sender at once, so concurrent flows really overlap
    c.sendall(b"g")
open_ = len(conns)
while open_:
    for key, _ in sel.select():
        b = key.fileobj.recv(1 << 20)
        got[key.fileobj] += len(b)
        if not b or got[key.fileobj] >= each:
            sel.unregister(key.fileobj)
            open_ -= 1
elapsed = time.monotonic() - t0
print(elapsed, sum(got.values()), flush=True)
"""

_CLIENT = """
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
assert s.recv(1) == b"g"
buf = memoryview(b"\\x5a" * (1 << 20))
left = n
while left > 0:
    left -= s.send(buf[: min(left, len(buf))])
s.shutdown(socket.SHUT_WR)
s.recv(1)  # wait for the server to hang up: it has everything
"""


def measure_goodput_mbit(ns: Namespace, nbytes: int, flows: int = 1, timeout: float = 60.0) -> float:
    """Send `nbytes` over TCP 127.0.0.1 between processes inside `ns`; return payload Mbit/s.

    `flows` client processes each send nbytes // flows to one server at the same moment; the server times
    from its "go" to the last byte of the last flow, so the figure includes slow start (the connections
    are already open). The result is the aggregate rate: on a shaped loopback it stays at about the link
    rate however many flows share it."""
    if nbytes <= 0 or flows <= 0 or nbytes < flows:
        raise ValueError(f"need nbytes >= flows > 0, got nbytes={nbytes}, flows={flows}")
    each = nbytes // flows
    server = ns.popen([sys.executable, "-c", _SERVER, str(flows), str(each)], stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"goodput server did not start (printed {port!r})")
        clients = [
            ns.popen([sys.executable, "-c", _CLIENT, port, str(each)], stderr=subprocess.PIPE, text=True)
            for _ in range(flows)
        ]
        out, _ = server.communicate(timeout=timeout)
        elapsed_s, got = out.split()
        if int(got) != each * flows:
            raise RuntimeError(f"goodput server received {got} of {each * flows} bytes")
        for c in clients:
            _, err = c.communicate(timeout=timeout)
            if c.returncode != 0:
                raise RuntimeError(f"goodput client failed: {err.strip()}")
        return each * flows * 8 / float(elapsed_s) / 1e6
    finally:
        for proc in (*clients, server):
            proc.kill()
            proc.wait()
