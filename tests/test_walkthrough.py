"""README.md's "Two regions, step by step", run as written on localhost with TLS on: `diloco certs`, a coordinator
with every island's secret from a file and metrics over HTTPS, two supervised islands, `diloco status`, an island
whose processes are all SIGKILLed and started again with the same command, to the end of the run. Then no island
secret appears in any file the run wrote.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from diloco import faults
from diloco.faults import Pauses
from diloco.harness.procs import wait_until
from diloco.run.rundir import read_events
from tests.conftest import REPO, child_env, run_cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CONFIG = str(REPO / "configs" / "two-region.toml")
QUICK = [
    "train.rounds=6",
    "train.inner_steps=5",
    "train.eval_batches=1",
    "quorum.lease_s=3",
    "quorum.min_islands=2",
    "network.coordinator_wait_s=120",
]
"""The walkthrough's config, shortened; every process gets the same overrides (they are part of the run's digest).
Both islands in every round: the run waits for the killed island's return instead of finishing without it."""
NAMES = ("us-east", "eu-west")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(probe: Callable[[], object], what: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 240) -> None:
    def none_died() -> None:
        dead = [p.args for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"exited while waiting for {what}: {dead}"

    wait_until(probe, what, timeout_s, 0.2, none_died)


def _scrape(url: str, trust: ssl.SSLContext, attempts: int = 5) -> str:
    """One scrape as Prometheus makes them, retried as it would at its next interval: a first HTTPS scrape was once
    seen reset by the peer in a full suite run (cause not found; the scrapes after it succeed)."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, context=trust, timeout=10) as page:
                return page.read().decode()
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _tls(name: str) -> list[str]:
    return ["--tls-ca", "kit/ca.crt", "--tls-cert", f"kit/client-{name}.crt", "--tls-key", f"kit/client-{name}.key"]


@pytest.mark.timeout(600)
def test_the_two_region_walkthrough(tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    def start(*args: str) -> subprocess.Popen[bytes]:
        with open(
            tmp_path / f"{args[0]}-{args[args.index('--run-dir') + 1].split('/')[-1]}-{len(processes)}.log", "wb"
        ) as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "diloco.cli", *args, *QUICK],
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(jax_cache=True),
                start_new_session=True,
            )
        processes.append(proc)
        return proc

    # 1. Certificates and secrets.
    made = run_cli("certs", CONFIG, "--out", "kit", "--host", "localhost", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    secrets = {name: (tmp_path / "kit" / "secrets" / name).read_text() for name in NAMES}
    assert all(len(s) == 64 for s in secrets.values())
    # 2. The coordinator: TLS, secrets from files, metrics.
    metrics_port = _free_port()
    coordinator = start(
        "coordinator",
        CONFIG,
        "--listen",
        "127.0.0.1:0",
        "--run-dir",
        "runs/coordinator",
        "--quiet",
        "--tls-cert",
        "kit/server.crt",
        "--tls-key",
        "kit/server.key",
        "--tls-ca",
        "kit/ca.crt",
        "--metrics-port",
        str(metrics_port),
    )
    addr_file = tmp_path / "runs" / "coordinator" / "coordinator.addr"
    _wait(addr_file.exists, "the coordinator to listen", processes)
    address = addr_file.read_text()

    # 3. The islands, supervised, each with its own secret file and certificate.
    def island(name: str) -> subprocess.Popen[bytes]:
        return start(
            "island",
            CONFIG,
            "--name",
            name,
            "--coordinator",
            address,
            "--run-dir",
            f"runs/{name}",
            "--secret",
            f"file:kit/secrets/{name}",
            *_tls(name),
        )

    islands = {name: island(name) for name in NAMES}
    metrics = tmp_path / "runs" / "coordinator" / "metrics.jsonl"
    _wait(lambda: read_events(metrics, "round"), "a committed round", processes)
    saved = tmp_path / "runs" / "eu-west" / "checkpoints"
    _wait(
        lambda: saved.is_dir() and any(p.name.isdigit() for p in saved.iterdir()),
        "eu-west's first checkpoint",
        processes,
    )
    # 5. eu-west's machine dies (supervisor and worker SIGKILLed). Every round needs both islands here, so the run
    # waits for it (and the coordinator serves status and metrics meanwhile).
    os.killpg(islands["eu-west"].pid, signal.SIGKILL)
    islands["eu-west"].wait(timeout=30)
    processes.remove(islands["eu-west"])
    after = len(read_events(metrics, "round"))

    # 4. Status with an island's credentials, and the metrics over HTTPS trusting the federation's CA.
    status = run_cli(
        "status",
        address,
        "--json",
        "--name",
        "us-east",
        "--secret",
        "file:kit/secrets/us-east",
        *_tls("us-east"),
        cwd=tmp_path,
    )
    assert status.returncode == 0, status.stderr
    seen = json.loads(status.stdout)
    assert seen["run_id"] == "two-region" and seen["health"] == "SERVING", seen
    trust = ssl.create_default_context(cafile=str(tmp_path / "kit" / "ca.crt"))
    assert "\ndiloco_round " in _scrape(f"https://127.0.0.1:{metrics_port}/metrics", trust)

    # 5, continued: its broken connection drops it (or its lease), and the same command brings it back.
    _wait(
        lambda: [e for e in read_events(metrics, "island_lost") if e["island"] == "eu-west"],
        "eu-west dropped",
        processes,
    )
    islands["eu-west"] = island("eu-west")
    _wait(
        lambda: coordinator.poll() is not None and all(p.poll() is not None for p in islands.values()),
        "the run to finish",
        processes,
        timeout_s=400,
    )
    assert coordinator.returncode == 0 and all(p.returncode == 0 for p in islands.values())
    summary = json.loads((tmp_path / "runs" / "coordinator" / "summary.json").read_text())
    assert summary["rounds"] == 6, summary
    assert read_events(tmp_path / "runs" / "eu-west" / "metrics.jsonl", "resumed"), "eu-west did not resume"
    assert all(sorted(r["islands"]) == ["eu-west", "us-east"] for r in read_events(metrics, "round")[after:])

    # No secret value in anything the run wrote (run dirs, logs), only in kit/secrets.
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets.values()), path
    for log in tmp_path.glob("*.log"):
        assert not any(s in log.read_text(errors="replace") for s in secrets.values()), log


ELASTIC = [
    "train.rounds=8",
    "train.inner_steps=5",
    "train.eval_batches=1",
    "quorum.lease_s=3",
    "quorum.min_islands=0.5",
    "quorum.min_deadline_s=20",
    "network.coordinator_wait_s=120",
    "network.operator_secret=file:kit/operator",
]
"""The elastic walkthrough's overrides: half of the live islands make a quorum, and the operator's credential."""


@pytest.mark.timeout(600)
@pytest.mark.bench  # 45 s: its steps are each in CI through tests/test_elastic.py; this runs them as README writes them
def test_the_elastic_walkthrough(tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    """README's "A region joins, a region leaves" with mutual TLS on localhost: certificates with the CA's key kept, an
    operator credential, two islands; sa-east admitted while the run goes on (its secret and certificate made by
    `diloco admit`), it joins and pushes; eu-west retired by the operator, its process refused; the run ends with
    us-east and sa-east, and no island secret is in anything the run wrote."""

    # Both islands wait before their push of round 2 until sa-east is in, and eu-west before its push of round 5
    # until it is retired: each step lands where this test says, whatever the machine's speed.
    pauses = Pauses(tmp_path / "pauses")
    held = ["us-east:before_push:2", "eu-west:before_push:2", "eu-west:before_push:5"]
    env = {**child_env(jax_cache=True), faults.ENV_AT: ",".join(held), faults.ENV_DIR: str(pauses.directory)}

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "diloco.cli", *args, *ELASTIC],
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        processes.append(proc)
        return proc

    made = run_cli("certs", CONFIG, "--out", "kit", "--host", "localhost", "--keep-ca-key", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["operator"]["cert"].endswith("client-diloco.operator.crt")
    (tmp_path / "kit" / "operator").write_text(os.urandom(32).hex())
    os.chmod(tmp_path / "kit" / "operator", 0o600)
    server_tls = ["--tls-cert", "kit/server.crt", "--tls-key", "kit/server.key", "--tls-ca", "kit/ca.crt"]
    coordinator = start("coordinator", "coordinator", CONFIG, "--listen", "127.0.0.1:0", "--run-dir",
                        "runs/coordinator", "--quiet", *server_tls)  # fmt: skip
    addr_file = tmp_path / "runs" / "coordinator" / "coordinator.addr"
    _wait(addr_file.exists, "the coordinator to listen", processes)
    address = addr_file.read_text()

    def island(name: str, secret: str, tls: list[str]) -> subprocess.Popen[bytes]:
        return start(name, "island", CONFIG, "--name", name, "--coordinator", address, "--run-dir", f"runs/{name}",
                     "--secret", secret, *tls)  # fmt: skip

    islands = {name: island(name, f"file:kit/secrets/{name}", _tls(name)) for name in NAMES}
    metrics = tmp_path / "runs" / "coordinator" / "metrics.jsonl"
    for entry in held[:2]:
        _wait(lambda entry=entry: pauses.reached(entry), entry, processes)

    # 6. sa-east is admitted while the run goes on, and starts with the credentials admit made.
    operator_tls = ["--tls-ca", "kit/ca.crt", "--tls-cert", "kit/client-diloco.operator.crt",
                    "--tls-key", "kit/client-diloco.operator.key"]  # fmt: skip
    admitted = run_cli("admit", CONFIG, "sa-east", "--coordinator", address, "--out", "kit/sa-east", "--ca-dir",
                       "kit", "--operator-secret", "file:kit/operator", *operator_tls, *ELASTIC, cwd=tmp_path)  # fmt: skip
    assert admitted.returncode == 0, admitted.stderr
    kit = json.loads(admitted.stdout)
    assert kit["tls_cert"] == "kit/sa-east/client-sa-east.crt", kit
    sa_tls = ["--tls-ca", "kit/ca.crt", "--tls-cert", kit["tls_cert"], "--tls-key", kit["tls_key"]]
    islands["sa-east"] = island("sa-east", kit["secret"], sa_tls)
    joined = lambda: [e for e in read_events(metrics, "island_joined") if e["island"] == "sa-east"]  # noqa: E731
    _wait(joined, "sa-east to join", processes)
    for entry in held[:2]:
        pauses.release(entry)
    _wait(lambda: [r for r in read_events(metrics, "round") if "sa-east" in r["islands"]], "sa-east's push", processes)

    # 7. The roster as the operator watches it.
    status = run_cli("status", address, "--json", "--name", "sa-east", "--secret", kit["secret"], *sa_tls,
                     cwd=tmp_path)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["roster"]["admitted"] == ["sa-east"], status.stdout

    # 8. eu-west is retired for good: its process is refused and stops with one line, the run goes on without it.
    _wait(lambda: pauses.reached(held[2]), held[2], processes)
    retired = run_cli("retire", CONFIG, "eu-west", "--coordinator", address, "--reason", "region closed",
                      "--operator-secret", "file:kit/operator", *operator_tls, *ELASTIC, cwd=tmp_path)  # fmt: skip
    assert retired.returncode == 0, retired.stderr
    pauses.release(held[2])
    islands["eu-west"].wait(timeout=240)
    processes.remove(islands["eu-west"])
    assert islands.pop("eu-west").returncode == 2
    assert "not on this run's roster" in (tmp_path / "eu-west.log").read_text()
    _wait(
        lambda: coordinator.poll() is not None and all(p.poll() is not None for p in islands.values()),
        "the run to finish",
        processes,
        timeout_s=400,
    )
    assert coordinator.returncode == 0 and all(p.returncode == 0 for p in islands.values())
    rounds = read_events(metrics, "round")
    assert len(rounds) == 8 and all("eu-west" not in r["islands"] for r in rounds[5:]), rounds
    assert "sa-east" not in rounds[2]["islands"], "round 2 did not wait for the joiner"
    summary = json.loads((tmp_path / "runs" / "coordinator" / "summary.json").read_text())
    assert summary["islands_admitted"] == 1 and summary["islands_retired"] == 1, summary
    secrets = [(tmp_path / "kit" / "secrets" / n).read_text() for n in NAMES]
    secrets += [
        (tmp_path / "kit" / "sa-east" / "sa-east.secret").read_text(),
        (tmp_path / "kit" / "operator").read_text(),
    ]
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file():
            assert not any(s.encode() in path.read_bytes() for s in secrets), path
