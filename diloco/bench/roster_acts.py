"""The operator's acts on a live federation, and the exactly-once audit of its records: what `bench elastic` and
`bench churn-soak` both do.

`admit_and_start` admits an island as `diloco admit` does (its kit written here, its secret's digest sent with the
operator's credential over gRPC) and starts it with its secret; `retire_and_wait` retires one as `diloco retire`
does and waits for its process to be refused and end with one line; `chunk_audit` counts what the coordinator's
`chunks_layout` and `chunks_consumed` records say was consumed, repeated, lost and left unread, source by source
(diloco/run/chunk_ledger.py, `ConsumptionCheck`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.harness.procs import Federation
from diloco.ops.roster_ops import admit_island, retire_island
from diloco.run.chunk_ledger import ConsumptionCheck

OPERATOR_ENV = "DILOCO_OPERATOR_SECRET"
"""The variable that holds the operator's secret for the benchmarks' federations (`network.operator_secret`)."""
RETIRED_LINE = "not on this run's roster"
"""What a retired island's last line says when it is refused."""


def admit_and_start(
    fed: Federation,
    name: str,
    kits: Path,
    timeout_s: float,
    args: Sequence[str] = (),
    pushed: bool = False,
    poll_s: float = 0.05,
) -> None:
    """The operator admits `name` (its kit in `kits`) and starts it with its secret and `args` (more of its command
    line: `data.own_path=...`); returns once the coordinator logged its join, or with `pushed` its first push (the
    coordinator's records read every `poll_s`)."""
    kit = admit_island(fed.address, fed.cfg.run.name, name, f"env:{OPERATOR_ENV}", kits, None)
    fed.start_island(name, args=["--secret", kit["secret"], *args])
    event, what = ("push", "pushed") if pushed else ("island_joined", "joined")
    fed.wait_for(lambda: any(e["island"] == name for e in fed.events(event)), timeout_s, f"{name} {what}", poll_s)


def retire_and_wait(fed: Federation, name: str, reason: str, timeout_s: float) -> None:
    """The operator retires `name`; its process is refused at its next call and ends with exit code 2 and one line
    saying so (anything else is a BenchError)."""
    fed.killed.add(name)  # its refused process ends with code 2, as it should: no failure of the federation
    retire_island(fed.address, fed.cfg.run.name, name, reason, None, f"env:{OPERATOR_ENV}")
    proc = fed.processes()[name]
    fed.wait_for(lambda: proc.poll() is not None, timeout_s, f"{name} to stop once retired")
    if proc.returncode != 2 or RETIRED_LINE not in fed.last_line(name):
        raise BenchError(f"retired {name} ended with code {proc.returncode}: {fed.last_line(name)}")


def chunk_audit(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Exactly-once over the committed rounds, from the coordinator's records: consumed, repeated, lost and unread
    sequences in all and per source (`by_source`: `corpus`, each own source by its digest), the corpus's sequences
    per epoch and the passes over it read whole."""
    check = ConsumptionCheck()
    for event in events:
        check.add(event)
    if check.layout is None:
        raise BenchError("the run recorded no chunks_layout: its consumption cannot be checked")
    return {
        **check.result().summary(),
        "by_source": {source: part.summary() for source, part in check.by_source().items()},
        "sequences_per_epoch": check.layout["sequences"],
        "complete_epochs": check.complete_epochs(),
    }
