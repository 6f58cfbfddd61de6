"""Table tests of the rejection log: truncation, escaping, bursts per kind, suppressed counts per window."""

from __future__ import annotations

import pytest

from diloco.coordinator.rejections import MAX_REASON_CHARS, RejectionLog, clip, kind_of


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bad credentials", "bad credentials"),
        ("x" * 300, "x" * MAX_REASON_CHARS + "... (300 chars)"),
        ("evil\nname\x00", "evil\\nname\\x00"),
    ],
)
def test_clip(text: str, expected: str) -> None:
    assert clip(text) == expected


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("UNAUTHENTICATED: bad credentials for island 'x'", "UNAUTHENTICATED"),
        ("INVALID_ARGUMENT: tokens must be > 0", "INVALID_ARGUMENT"),
        ("Attacker: controlled text", "other"),
        ("no colon at all", "other"),
    ],
)
def test_kind_of(reason: str, kind: str) -> None:
    assert kind_of(reason) == kind


def test_bursts_per_kind_then_counts_and_reports_the_window() -> None:
    log = RejectionLog(burst=2, window_s=10.0)
    written = [log.admit(t, "a", "UNAUTHENTICATED: no") for t in (0.0, 1.0, 2.0, 3.0)]
    assert [w.event is not None for w in written] == [True, True, False, False]
    # another kind has its own burst
    assert log.admit(4.0, "a", "INVALID_ARGUMENT: bad").event is not None
    assert log.flush(5.0) == {}  # the window is still open
    assert log.flush(10.0) == {"UNAUTHENTICATED": 2}
    assert log.flush(11.0) == {}
    # a new window writes again
    assert log.admit(12.0, "a", "UNAUTHENTICATED: no").event is not None


@pytest.mark.slow
def test_a_flood_writes_a_bounded_number_of_events() -> None:
    log = RejectionLog(burst=5, window_s=60.0)
    events = suppressed = 0
    for i in range(100_000):
        admitted = log.admit(i * 0.001, "x" * 10_000, f"INVALID_ARGUMENT: {'y' * 10_000}")
        events += admitted.event is not None
        suppressed += sum(admitted.suppressed.values())
        if admitted.event is not None:
            assert len(admitted.event["reason"]) < MAX_REASON_CHARS + 30
            assert len(admitted.event["island"]) < MAX_REASON_CHARS + 30
    assert events == 5 * 2  # 100 s of flood: two windows
    assert events + suppressed + sum(log.flush(1e9).values()) == 100_000
