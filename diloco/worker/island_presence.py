"""An island's presence with the coordinator: the heartbeats that renew its lease, and the presence call it holds
from its join to its Leave.

    heartbeat   every third of the lease, and at once when asked (`beat`): names the island's round and step;
                the reply says the run's state, or that the island was declared lost (it joins again)
    attend      one call held open (transport/presence.py): if the process or its host dies, the coordinator sees
                the call break and counts the island lost within about a second, not a lease

Both run on daemon threads of their own, beside the training loop, and never raise: the coordinator being away is
the loop's to notice (its own calls retry and give up).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from diloco.coordinator.membership import REJOIN
from diloco.run.rundir import RunDir
from transport import diloco_pb2 as pb
from transport.client import NOT_A_MEMBER, IslandClient, Presence
from transport.errors import TransportError

PRESENCE_RETRY_S = (0.2, 2.0)
"""The pause before the presence call is opened again after it ended, doubling from the first to the second while
calls keep ending at once (a coordinator restarting, or not yet counting us a member). The first is well inside
quorum.reconnect_grace_s, so a call broken by a blip is replaced before the coordinator counts the island lost."""


def next_pause(pause: float, held_s: float) -> float:
    """The pause before the next presence call, after one held `held_s` seconds that followed a pause of `pause`:
    the shortest after a call that lasted, doubled (up to the longest) after one that ended at once."""
    shortest, longest = PRESENCE_RETRY_S
    return shortest if held_s > longest else min(2 * pause, longest)


class IslandPresence:
    """Heartbeats and the presence call of one island. `state` is the run's state as the last heartbeat heard it."""

    def __init__(
        self,
        client: IslandClient,
        rd: RunDir,
        who: dict[str, str],
        where: Callable[[], tuple[int, int]],
        join_request: Callable[[], pb.JoinRequest],
    ) -> None:
        """`who`: the run and island every request names. `where`: the island's round (-1: none yet) and inner step,
        told with each heartbeat. `join_request`: how the island joins again once declared lost."""
        self.client, self.rd, self.who = client, rd, who
        self._where, self._join_request = where, join_request
        self.state = "starting"
        self._stop = threading.Event()
        self._beat = threading.Event()
        """Set to send a heartbeat now (`_heartbeats`)."""
        self._call: Presence | None = None
        """The newest presence call (`_attend`), closed by `end`."""
        self._lock = threading.Lock()
        self._left = threading.Event()
        """Set once the island has left (`end`): no presence call is opened again."""

    def attend(self) -> None:
        """Hold the presence call from now until `end`, on a thread of its own (`_attend`)."""
        threading.Thread(target=self._attend, name="presence", daemon=True).start()

    def start_heartbeats(self, lease_s: float) -> None:
        """Renew the lease from now until `stop`, on a thread of its own (`_heartbeats`)."""
        threading.Thread(target=self._heartbeats, args=(lease_s,), daemon=True).start()

    def beat(self) -> None:
        """Send a heartbeat now: an island that adopted a plain commit says so with its new round (the coordinator
        evaluates that commit only once its islands have moved on: docs/architecture.md, "Commits off the critical
        path")."""
        self._beat.set()

    def stop(self) -> None:
        """No heartbeat after this one (the island is done, or leaving)."""
        self._stop.set()
        self._beat.set()

    def end(self) -> None:
        """After the Leave: end the presence call (the coordinator sees it break, which the Leave made moot)."""
        with self._lock:
            self._left.set()
            if self._call is not None:
                self._call.close()

    def heartbeat(self) -> None:
        """One heartbeat. Declared lost (the island stalled): join again, keeping the island's own state. The
        coordinator away: nothing (the training loop's retries handle it)."""
        round_, step = self._where()
        try:
            reply = self.client.heartbeat(pb.HeartbeatRequest(**self.who, round=max(round_, 0), step=step))
            if reply.state == REJOIN:
                self.client.join(self._join_request())
                self.rd.log("rejoined", round=reply.round, island=self.who["island"])
            else:
                self.state = reply.state
        except TransportError:
            pass

    def _heartbeats(self, lease_s: float) -> None:
        """Renew the lease every third of it, and at once when `beat` was called."""
        while True:
            self._beat.wait(max(lease_s / 3, 0.2))
            self._beat.clear()
            if self._stop.is_set():
                return
            self.heartbeat()

    def _attend(self) -> None:
        """Hold the presence call until `end`. A call that ends while the island runs (the coordinator restarted,
        the link blipped, the island was not yet a member: a heartbeat is sent at once, which joins again) is opened
        again after a pause (`next_pause`)."""
        pause = PRESENCE_RETRY_S[0]
        while True:
            with self._lock:
                if self._left.is_set():
                    return
                self._call = call = self.client.attend(pb.AttendRequest(**self.who))
            opened = time.monotonic()
            if call.wait() == NOT_A_MEMBER:
                self.beat()  # a heartbeat now learns the same and joins again (`heartbeat`)
            pause = next_pause(pause, time.monotonic() - opened)
            if self._left.wait(pause):
                return
