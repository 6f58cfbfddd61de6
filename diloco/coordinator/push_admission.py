"""Push admission: the one place that decides whether a pseudo-gradient joins a sync, and remembers what it decided.

A push reaches the coordinator after the transport checked its bytes (credentials, names, shapes, codecs,
finiteness, the payload digest). What is left is about rounds, and all of it is decided here:

* `admissible` (on a push's first chunk, before its payload is buffered): a key (island, round, fragment) this
  admission accepted before is let through, so a retry after its round closed is answered from `accepted`; any
  other push must be for a round the `RoundRule` still takes;
* `replay` (once the payload is in): a retried duplicate of an accepted push gets the same reply; another payload
  under an accepted key is ALREADY_EXISTS;
* `place`: the rule's base check (Δ was taken from θ_b itself), a contribution dropped before is refused, the
  claimed token weight is capped;
* `enter`: the contribution joins the open sync, or (streaming) waits in `early` for its sync to open;
* `drop` (a commit could not be made with it): its island's contribution leaves the round, its bytes are
  remembered as dropped (the same bytes are refused again), and its key is forgotten, so a new Δ of that island
  for the round is heard. A push is remembered before the tick it sets off, so a commit there that drops it
  forgets it too, and its own reply is the refusal (`refuse_if_dropped`), never a cached "accepted";
* `undo_to` (a commit diverged and was undone with every later one): the reopened sync's contributions as they
  were, every later one forgotten.

Plain and streaming rounds (`SyncRounds`) and Async Local-SGD (`AsyncUpdates`, docs/architecture.md,
"Asynchronous rounds") are two rules behind one interface. The class holds no lock: the coordinator calls it under
its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from diloco.coordinator.rejections import clip
from diloco.run.rounds import OuterLoop, RoundError
from floor.codec import EncodedTensor
from outer_optimizer.asynchronous import discount, staleness_weight
from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.validate import check_round

MAX_DROPPED = 256
"""Digests of dropped contributions remembered per sync (16 bytes each), beyond which the oldest is forgotten."""

PushKey = tuple[str, int, int]
"""(island, round, fragment): what a push is for. An island contributes once per key."""


def contribution_digest(island: str, tensors: Sequence[EncodedTensor], payload_digest: bytes) -> bytes:
    """Who sent which bytes: what identifies a contribution once dropped. SHA-256 (cut to 16 bytes) of the island,
    each tensor's name and size (and a piece's offset), and the payload digest the transport verified as the bytes
    arrived (`transport.chunking.payload_digest`): a few hundred bytes hashed under the coordinator's lock, never the
    payload again."""
    h = hashlib.sha256(island.encode())
    for t in tensors:
        h.update(f"\0{t.name}\0{t.nbytes}".encode() + (f"\0{t.offset}".encode() if t.offset else b""))
    h.update(payload_digest)
    return h.digest()[:16]


def sync_name(round_: int, fragment: int, fragments: int) -> str:
    """How a refusal names a sync: "round r", or "round r fragment p" with streaming."""
    return f"round {round_}{f' fragment {fragment}' if fragments > 1 else ''}"


@dataclass(frozen=True)
class Placement:
    """Where an admitted push goes: the sync position it joins, and (asynchronous) its staleness and weight."""

    position: int
    staleness: int = 0
    weight: float = 1.0


@dataclass(frozen=True)
class Admitted:
    """A push that passed every check, ready to `enter` its sync."""

    key: PushKey
    placement: Placement
    delta: dict[str, np.ndarray]
    tokens: int
    content: bytes
    """Its `contribution_digest`."""


class RoundRule(Protocol):
    """Which round a push may be for, and which θ its Δ must have been taken from."""

    def admissible(self, meta: pb.PushMeta, loop: OuterLoop) -> None:
        """Refuse (`Rejected`) a push whose round this rule does not take now; a first-chunk check."""
        ...

    def place(self, meta: pb.PushMeta, loop: OuterLoop, digest_at: Callable[[pb.PushMeta], str | None]) -> Placement:
        """Check the push's round and `base_digest` against θ (``digest_at(meta)``: the digest its base must have,
        None when unknown) and say where it goes."""
        ...


@dataclass(frozen=True)
class SyncRounds:
    """Plain and streaming DiLoCo: a push is for the open sync or, streaming, one of the P - 1 after it (a fragment
    whose sync in this round is committed already pushes for the next round)."""

    def admissible(self, meta: pb.PushMeta, loop: OuterLoop) -> None:
        check_round(meta.round, loop.round + (1 if meta.fragment < loop.fragment else 0))

    def place(self, meta: pb.PushMeta, loop: OuterLoop, digest_at: Callable[[pb.PushMeta], str | None]) -> Placement:
        P = loop.fragments.count
        position = meta.round * P + meta.fragment
        if not loop.sync <= position < loop.sync + P:  # it may have closed
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pseudo-gradient for {sync_name(meta.round, meta.fragment, P)} but "
                f"{sync_name(loop.round, loop.fragment, P)} is open",
            )
        known = digest_at(meta)
        if known is None or bytes(meta.base_digest) != bytes.fromhex(known):
            of_fragment = f" fragment {meta.fragment}" if P > 1 else ""
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient was not taken from θ_{loop.round}{of_fragment} "
                f"(base_digest {bytes(meta.base_digest).hex()[:16] or 'missing'}); pull the full parameters",
            )
        return Placement(position)


@dataclass(frozen=True)
class AsyncUpdates:
    """Async Local-SGD: a push names the update b whose θ_b its Δ was taken from (`round`); b may be up to
    ``max_staleness`` updates old, and the Δ is weighted (1 + τ)^(-a) by its staleness τ."""

    max_staleness: int
    exponent: float

    def admissible(self, meta: pb.PushMeta, loop: OuterLoop) -> None:
        check_round(meta.round, loop.round, self.max_staleness)

    def place(self, meta: pb.PushMeta, loop: OuterLoop, digest_at: Callable[[pb.PushMeta], str | None]) -> Placement:
        u = loop.round
        if meta.round > u:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient is from "
                f"θ_{meta.round}, ahead of the coordinator's θ_{u}; pull the full parameters",
            )
        if u - meta.round > self.max_staleness:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient is "
                f"{u - meta.round} updates stale, over outer.max_staleness = {self.max_staleness}; pull "
                "the full parameters",
            )
        known = digest_at(meta)  # None: not since this coordinator (re)started
        if known is None or bytes(meta.base_digest) != bytes.fromhex(known):
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient was not taken from θ_{meta.round} (base_digest "
                f"{bytes(meta.base_digest).hex()[:16] or 'missing'}); pull the full parameters",
            )
        staleness = u - meta.round
        return Placement(loop.sync, staleness, staleness_weight(staleness, self.exponent))


class AcceptedPushes:
    """Accepted pushes by key, with the payload digest and the reply of each: what a retried duplicate is answered
    with. The newest ``capacity`` are kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._replies: OrderedDict[PushKey, tuple[bytes, pb.PushReply]] = OrderedDict()

    def __contains__(self, key: PushKey) -> bool:
        return key in self._replies

    def __iter__(self) -> Iterator[PushKey]:
        return iter(list(self._replies))

    def replay(self, key: PushKey, payload_digest: bytes) -> pb.PushReply | None:
        """The reply an accepted push got, for a retry of the same bytes; None for a key not accepted."""
        hit = self._replies.get(key)
        if hit is None:
            return None
        if hit[0] != payload_digest:
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"island {key[0]!r} already pushed a different payload for round {key[1]} fragment {key[2]}",
            )
        return hit[1]

    def remember(self, key: PushKey, payload_digest: bytes, reply: pb.PushReply) -> pb.PushReply:
        """An accepted push's reply, kept for its retries; returned with the payload digest it answers."""
        reply = pb.PushReply(accepted=True, round=reply.round, detail=reply.detail, digest=payload_digest)
        self._replies[key] = (payload_digest, reply)
        while len(self._replies) > self.capacity:
            self._replies.popitem(last=False)
        return reply

    def forget(self, key: PushKey) -> None:
        self._replies.pop(key, None)


@dataclass(frozen=True)
class Held:
    """A contribution in a sync: its push's key and its content digest (and, while early, its Δ and token weight)."""

    key: PushKey
    content: bytes
    delta: dict[str, np.ndarray] | None = None
    tokens: int = 0


class PushAdmission:
    """Admits pushes into syncs and remembers every decision a retry or a later commit needs (module docstring)."""

    def __init__(self, rule: RoundRule, max_tokens: int, remembered: int) -> None:
        self.rule = rule
        self.max_tokens = max_tokens
        """H steps of batch_size sequences of seq_len tokens: a larger claimed weight is a lie (it would give that
        island the whole mean), so it is capped to this."""
        self.accepted = AcceptedPushes(remembered)
        self.pending: dict[str, Held] = {}
        """The contributions of the open sync, by island (island names are bounded to the run's)."""
        self.dropped: dict[bytes, str] = {}
        """Contributions to the open sync dropped at commit (content digest -> why): the same bytes are refused if
        pushed again (an island re-pushing after a lost reply), a retrained Δ from the same island is not. Keyed by
        content, not by name: a name is barred by nothing but its credentials, so a dropped forgery under a real
        island's name must not lock that island out of the round. At most `MAX_DROPPED`; cleared at every commit."""
        self.early: dict[int, dict[str, Held]] = {}
        """Streaming: pushes for the P - 1 syncs after the open one, by position then island, each joining its sync
        when it opens. Bounded by islands x (P - 1)."""

    # -- a push, in the order the coordinator asks --------------------------------------------------------------

    def admissible(self, meta: pb.PushMeta, loop: OuterLoop) -> None:
        """A first-chunk check: an accepted key passes (its retry is answered by `replay`), any other must be for a
        round the rule takes now."""
        if (meta.island, meta.round, meta.fragment) not in self.accepted:
            self.rule.admissible(meta, loop)

    def replay(self, meta: pb.PushMeta, payload_digest: bytes) -> pb.PushReply | None:
        """The reply an accepted push got, for a retry of the same bytes; None for a push not accepted before."""
        return self.accepted.replay((meta.island, meta.round, meta.fragment), payload_digest)

    def place(
        self,
        meta: pb.PushMeta,
        tensors: Sequence[EncodedTensor],
        arrays: Mapping[str, np.ndarray],
        payload_digest: bytes,
        loop: OuterLoop,
        digest_at: Callable[[pb.PushMeta], str | None],
    ) -> Admitted:
        """Every check of a push that is not a replay (its round may have closed while its bytes streamed in);
        nothing changes here."""
        placement = self.rule.place(meta, loop, digest_at)
        content = contribution_digest(meta.island, tensors, payload_digest)
        if content in self.dropped:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {meta.island}'s pseudo-gradient for round {meta.round} was dropped: {self.dropped[content]}",
            )
        # The decoded arrays themselves (read-only; nothing here writes to them), not a copy: the commit runs inside
        # the last push, where a copy would hold that push's Δ twice.
        delta = {name: np.asarray(arrays[name], np.float32) for name in sorted(arrays)}
        tokens = min(int(meta.tokens), self.max_tokens)
        return Admitted((meta.island, meta.round, meta.fragment), placement, delta, tokens, content)

    def enter(self, admitted: Admitted, loop: OuterLoop) -> None:
        """The contribution joins its sync: the open one now, a later one (streaming) when it opens."""
        island, position = admitted.key[0], admitted.placement.position
        weight = admitted.placement.weight
        delta = admitted.delta if weight == 1.0 else discount(admitted.delta, weight)
        if position == loop.sync:
            try:
                loop.submit(island, loop.round, delta, admitted.tokens, fragment=loop.fragment)
            except RoundError as exc:
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            self.pending[island] = Held(admitted.key, admitted.content)
            return
        queued = self.early.setdefault(position, {})
        if island in queued:
            P = loop.fragments.count
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"island {island} already contributed to {sync_name(*divmod(position, P), P)}",
            )
        queued[island] = Held(admitted.key, admitted.content, delta, admitted.tokens)

    def remember(self, key: PushKey, payload_digest: bytes, reply: pb.PushReply) -> pb.PushReply:
        return self.accepted.remember(key, payload_digest, reply)

    def refuse_if_dropped(self, admitted: Admitted) -> None:
        """After the tick its push set off: a contribution that a commit there dropped (`drop` forgot its key) is
        refused, so its island hears at once that the round does not hold it, and may push a new Δ."""
        if admitted.key not in self.accepted:
            island, round_, _ = admitted.key
            why = self.dropped.get(admitted.content, "its round could not be committed with it")
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {island}'s pseudo-gradient for round {round_} was dropped: {why}",
            )

    # -- what commits do to it ----------------------------------------------------------------------------------

    def drop(self, island: str, why: str) -> None:
        """The island's contribution to the open sync could not be committed (the loop withdrew it): refuse its
        bytes from now on, and forget its key so that a new Δ of the island for the sync is heard."""
        held = self.pending.pop(island)
        self.accepted.forget(held.key)
        if len(self.dropped) >= MAX_DROPPED:
            del self.dropped[next(iter(self.dropped))]
        self.dropped[held.content] = clip(why)

    def opened(self, loop: OuterLoop) -> list[tuple[str, str]]:
        """A commit opened the loop's next sync: the old sync's bookkeeping goes, and the pushes that arrived early
        for the new one join it. Returns each island whose early push could not, and why (it is dropped)."""
        self.dropped.clear()
        self.pending.clear()
        refused = []
        for island, held in sorted(self.early.pop(loop.sync, {}).items()):
            assert held.delta is not None
            try:
                loop.submit(island, loop.round, held.delta, held.tokens, fragment=loop.fragment)
            except RoundError as exc:  # checked at its push already; never let it stop a commit
                self.accepted.forget(held.key)
                refused.append((island, str(exc)))
                continue
            self.pending[island] = Held(held.key, held.content)
        return refused

    def snapshot(self) -> tuple[dict[str, Held], dict[bytes, str]]:
        """The open sync's contributions and drops, for `undo_to` should the commit that closes it be undone."""
        return dict(self.pending), dict(self.dropped)

    def undo_to(self, snapshot: tuple[dict[str, Held], dict[bytes, str]], position: int, fragments: int) -> None:
        """A commit at sync ``position`` and every later one were undone: that sync is open again with the
        contributions it had (`snapshot`); pushes for later syncs are forgotten (their islands resync)."""
        self.pending, self.dropped = dict(snapshot[0]), dict(snapshot[1])
        self.early.clear()
        kept = {held.key for held in self.pending.values()}
        for key in self.accepted:
            if key[1] * fragments + key[2] >= position and key not in kept:
                self.accepted.forget(key)
