"""`diloco bench churn`: islands admitted and retired against one coordinator process, and what that leaves behind.

The coordinator of the config's run (started as `diloco coordinator` starts it, with an operator secret) takes
`cycles` cycles of: the operator admits a new island with a fresh 256-bit secret (`Admit`, as `diloco admit` sends
it), the island joins with that secret, and the operator retires it (`Retire`). No island trains, so the first round
stays open and nothing but the roster changes. Bounded state (docs/architecture.md, "Elastic federation") means the
coordinator's resident memory, RUN_DIR/roster.json and the Status answer are, after the cycles, what they were once
the first `warm_up` cycles had filled what is bounded (the retired islands listed, the allocator's pools): within
10 % (`within_10pct`). The figures before the first cycle are reported too.

Run: ``diloco bench churn CONFIG [--cycles 1000] [--warm-up 100] [--run-dir DIR] [key=value ...]`` (JSON on stdout).
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco import RELEASE
from diloco.bench.errors import BenchError
from diloco.bench.federation import _federation
from diloco.bench.load import Sample
from diloco.config import config_digest, load_config
from transport import diloco_pb2 as pb
from transport.auth import OPERATOR_KEY, secret_digest
from transport.config import TransportConfig
from transport.grpc_client import GrpcTransport, OperatorClient

WITHIN = 0.10
"""How far the end may be from the warm figures."""


def _cycle(address: str, operator: OperatorClient, run_id: str, join: pb.JoinRequest, name: str) -> None:
    """Admit `name` with a fresh secret, join with it, retire it."""
    secret = secrets.token_hex(32)
    operator.admit(pb.AdmitRequest(run_id=run_id, island=name, secret_sha256=secret_digest(secret)))
    island = GrpcTransport(address, name, secret, config=TransportConfig(max_attempts=1, rpc_timeout_s=30))
    try:
        join.island = name
        island.join(join)
    finally:
        island.close()
    operator.retire(pb.RetireRequest(run_id=run_id, island=name, reason="churn"))


def _figures(pid: int, roster: Path, operator: OperatorClient) -> dict[str, float]:
    return {
        "rss_mib": round(Sample.of(pid).rss_kib / 1024, 1),
        "roster_bytes": roster.stat().st_size if roster.exists() else 0,
        "status_bytes": operator.status().ByteSize(),
    }


def run_churn_bench(config: str, overrides: list[str], run_dir: Path, cycles: int, warm_up: int) -> dict[str, Any]:
    if cycles < 1 or not 0 < warm_up < cycles:
        raise BenchError(f"--cycles must be >= 1 and --warm-up in [1, cycles) (got {cycles}, {warm_up})")
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        secret_file = Path(tmp) / "operator"
        operator_secret = secrets.token_hex(32)
        secret_file.write_text(operator_secret)
        overrides = [
            *overrides,
            f"network.operator_secret=file:{secret_file}",
            f"islands.admissions_per_minute={cycles + 1}",
        ]
        cfg = load_config(config, overrides)
        join = pb.JoinRequest(
            run_id=cfg.run.name, last_round=-1, config_digest=bytes.fromhex(config_digest(cfg)), release=RELEASE
        )
        with _federation(config, overrides, run_dir) as fed:
            address = fed.start_coordinator()
            assert fed.coordinator is not None
            pid, roster = fed.coordinator.pid, run_dir / "roster.json"
            with OperatorClient(address, [(OPERATOR_KEY, operator_secret)]) as operator:
                before = _figures(pid, roster, operator)
                t0 = time.monotonic()
                for i in range(warm_up):
                    _cycle(address, operator, cfg.run.name, join, f"churn-{i}")
                warm = _figures(pid, roster, operator)
                t1 = time.monotonic()
                for i in range(warm_up, cycles):
                    _cycle(address, operator, cfg.run.name, join, f"churn-{i}")
                end = _figures(pid, roster, operator)
                t2 = time.monotonic()
                detail = operator.status().detail_json
    within = all(abs(end[k] - warm[k]) <= WITHIN * warm[k] for k in warm)
    return {
        "cycles": cycles,
        "warm_up": warm_up,
        "before": before,
        "warm": warm,
        "end": end,
        "within_10pct": within,
        "ms_per_cycle": round(1000 * (t2 - t0) / cycles, 1),
        "ms_per_cycle_after_warm_up": round(1000 * (t2 - t1) / (cycles - warm_up), 1),
        "retired_total": json.loads(detail)["roster"]["retired_total"],
    }
