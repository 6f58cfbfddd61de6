"""Shared fixtures: small configs and corpora that tests make for themselves (never the shared data)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from diloco.harness.procs import Federation, wait_until

REPO = Path(__file__).resolve().parent.parent

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
"""The suite's models are tiny: compiling them is most of a test's time on 2 cores, running them is not. These flags
make XLA's CPU compiler skip its expensive optimizations (about a third less CPU for a tiny simulate). Set here,
before JAX starts, in this process's XLA_FLAGS, which every child inherits (`diloco.harness.procs.devices_env` keeps them),
so all processes of a test compile alike and the bit-identity tests compare like with like. The product's own runs
(README, `diloco bench`) are compiled as usual."""
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()

JAX_CACHE = Path(tempfile.mkdtemp(prefix="diloco-tests-xla-cache-"))
"""One persistent XLA compilation cache for this test session (removed at exit): most tests build the same tiny
models, and compiling their steps is most of what a JAX process costs on 2 cores, so a process (or an in-process
run) that compiles what an earlier one did loads the executable instead. It changes no computation: a cache hit is
the executable the compiler would have produced. Tests opt in (`child_env(jax_cache=True)`, `shared_jax_cache`);
the pytest process itself uses it for its own in-process runs (`pytest_configure`)."""
atexit.register(shutil.rmtree, JAX_CACHE, ignore_errors=True)
JAX_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # Two processes may compile the same step at once, and one may read the other's entry while it is being
    # written: JAX then warns on stderr and compiles instead. Only that warning is silenced, so that the tests
    # that read a child's stderr line by line see what the product printed.
    "PYTHONWARNINGS": ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS", ""), "ignore:Error reading persistent compilation cache"])
    ),
}
"""Environment of a child process that shares JAX_CACHE."""


def pytest_configure(config: pytest.Config) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", str(JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def shared_jax_cache(monkeypatch: pytest.MonkeyPatch) -> Path:
    """For tests whose children are started by product code (a benchmark's Federation inherits this process's
    environment): they share JAX_CACHE for the test's duration."""
    for key, value in JAX_CACHE_ENV.items():
        monkeypatch.setenv(key, value)
    return JAX_CACHE


TINY_TOML = """
[run]
name = "test"
seed = 0

[model]
kind = "transformer"
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64

[data]
kind = "text"
path = "{corpus}"
val_fraction = 0.1

[train]
rounds = 3
inner_steps = 4
batch_size = 8
eval_batches = 2
checkpoint_every = 1
log_every = 2

[inner]
lr = 3e-3
warmup_steps = 2

[islands]
count = 2
"""


def cut_after_round(run_dir: Path, round_: int) -> None:
    """Leave in a `simulate` run dir what a kill right after round `round_`'s checkpoint leaves: later checkpoints and
    the summary never written (the resume tests of the sequential, streaming and vectorized paths)."""
    for store in (run_dir / "checkpoints").iterdir():
        for step in store.iterdir():
            if step.name.isdigit() and int(step.name) > round_:
                shutil.rmtree(step)
    (run_dir / "summary.json").unlink()


def write_corpus(path: Path, n_bytes: int = 40_000, seed: int = 0) -> Path:
    """A learnable byte corpus: words drawn from a small vocabulary, so loss falls well below log(256)."""
    rng = np.random.default_rng(seed)
    words = ["the", "island", "round", "delta", "outer", "inner", "model", "wan", "link", "loss", "step"]
    text = " ".join(words[i] for i in rng.integers(0, len(words), size=n_bytes // 4))
    path.write_bytes(text.encode()[:n_bytes])
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


@pytest.fixture
def tiny_config(tmp_path: Path, corpus: Path) -> Path:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML.format(corpus=corpus))
    return cfg


def child_env(devices: int = 1, jax_cache: bool = False) -> dict[str, str]:
    """Environment for a child JAX process with `devices` CPU devices (set before JAX starts), sharing the
    session's XLA compilation cache with `jax_cache`."""
    from diloco.harness.procs import devices_env  # keeps this process's XLA_FLAGS (TEST_XLA_FLAGS)

    env = {**os.environ, **devices_env(devices)}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if jax_cache:
        env.update(JAX_CACHE_ENV)
    return env


def fails(capsys: pytest.CaptureFixture[str], args: list[str], expected: str, code: int = 2) -> None:
    """`diloco ARGS` in this process ends with exit code `code` (2: a user error) and one `diloco: error:` line
    holding `expected`."""
    from diloco.cli import main

    assert main(args) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and expected in err, err
    assert "\n" not in err and "Traceback" not in err


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`diloco ARGS` as a child process sharing the session's XLA compilation cache."""
    return subprocess.run(
        [sys.executable, "-m", "diloco.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(jax_cache=True),
        cwd=cwd or REPO,
    )


# -- one real `diloco launch`, shared ----------------------------------------------------------------------------

LAUNCH_SECRETS = {"island-0": "envsecret-7f3a9c1e55", "island-1": "litsecret-0b8d4e2a66"}
"""The shared launch's island secrets: island-0's reaches launch in an environment variable (T_LAUNCH_S0), island-1's
as a literal in a command-line override."""
LAUNCH_OVERRIDES = [
    "train.rounds=3",
    "quorum.min_islands=2",
    "codec.uplink=int8",
    "codec.downlink=int8",
    "network.pull_wait_s=2",
    "islands.devices=2",
    "islands.shard_params=true",
]
"""The shared launch's run beyond the tiny config; min_islands = count: every round holds every island, as in the
one-process simulation. Each island's 2 devices hold its parameters split (FSDP), so the leaves whose shards hold
whole int8 blocks are pushed as pieces (pytrees/pieces.py) over the real wire."""


@dataclass(frozen=True)
class SharedLaunch:
    """A finished `diloco launch` of the tiny config with island secrets, what was seen while it ran, and a
    `diloco simulate` of the same run that ran beside it."""

    config: Path
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str
    processes: dict[int, tuple[list[str], dict[str, str]]]
    """Every process launch started, as /proc showed it while it ran: {pid: (argv, environ)}."""
    probes: dict[str, str]
    """How the coordinator answered island-0's Status with the right secret but without mutual TLS: the status code
    per way of calling ("plaintext", "tls_without_client_cert"), or "OK"."""
    simulate_dir: Path
    simulate_returncode: int
    simulate_stderr: str


def processes_under(marker: str) -> dict[int, tuple[list[str], dict[str, str]]]:
    """{pid: (argv, environ)} of the live `diloco.cli` processes whose command line mentions `marker` (a run dir)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if marker not in " ".join(argv) or "diloco.cli" not in argv:
                continue
            raw = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        found[int(entry.name)] = (argv, env)
    return found


def _status_code(address: str, tls_ca: Path | None) -> str:
    """The code of island-0's Status (right secret, no client certificate), over plaintext or TLS."""
    from transport.auth import TlsConfig
    from transport.config import TransportConfig
    from transport.errors import TransportError
    from transport.grpc_client import GrpcTransport

    tls = TlsConfig(ca_file=str(tls_ca)) if tls_ca else None
    once = TransportConfig(max_attempts=1, rpc_timeout_s=5)
    with GrpcTransport(address, "island-0", LAUNCH_SECRETS["island-0"], config=once, tls=tls) as client:
        try:
            client.status()
        except TransportError as exc:
            return exc.code.name
    return "OK"


@pytest.fixture(scope="session")
def shared_launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedLaunch]:
    """One `diloco launch` (coordinator, and a supervisor and a worker per island, over mutual TLS) shared by the
    tests that read it: test_secure_defaults (no secret leaks into argv, environments, files or output) and
    test_federation (it ends with the parameters of `diloco simulate`, which runs beside it). Each launch costs a
    set of process starts; the two checks only read what it did and left."""
    tmp = tmp_path_factory.mktemp("shared-launch")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    run_dir, simulate_dir = tmp / "launch", tmp / "simulate"
    env = {
        **child_env(jax_cache=True),
        "T_LAUNCH_S0": LAUNCH_SECRETS["island-0"],
        "DILOCO_SECRET_5": "stale-secret-91c2",
    }
    secrets = f'network.secrets=["env:T_LAUNCH_S0", "{LAUNCH_SECRETS["island-1"]}"]'
    cli = [sys.executable, "-m", "diloco.cli"]
    with (tmp / "simulate.err").open("w+") as simulate_err:
        simulate = subprocess.Popen(
            [*cli, "simulate", str(config), "--run-dir", str(simulate_dir), "--no-progress", *LAUNCH_OVERRIDES],
            env=child_env(2, jax_cache=True),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=simulate_err,
            start_new_session=True,
        )
        launch = subprocess.Popen(
            [*cli, "launch", str(config), "--run-dir", str(run_dir), "--no-progress", *LAUNCH_OVERRIDES, secrets],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        seen: dict[int, tuple[list[str], dict[str, str]]] = {}
        probes: dict[str, str] = {}

        def every_process_seen() -> bool:
            """Records the launch's processes as they appear; True once each role is there (or the launch ended)."""
            if launch.poll() is not None:
                return True
            seen.update({pid: p for pid, p in processes_under(str(run_dir)).items() if pid != launch.pid})
            address_file = run_dir / "coordinator.addr"
            if not probes and address_file.exists():
                address = address_file.read_text()
                probes["plaintext"] = _status_code(address, None)
                probes["tls_without_client_cert"] = _status_code(address, run_dir / "tls" / "ca.crt")
            roles = [
                argv[argv.index("--name") + 1] if "--name" in argv else " ".join(argv[3:4]) for argv, _ in seen.values()
            ]
            wanted = {"coordinator": 1, **dict.fromkeys(LAUNCH_SECRETS, 2)}  # a supervisor and a worker per island
            return bool(probes) and all(roles.count(role) >= n for role, n in wanted.items())

        try:
            wait_until(every_process_seen, "every process of the launch", 300, 0.05)
            out, err = launch.communicate(timeout=300)
            simulate.wait(timeout=300)
        finally:
            for proc in (launch, simulate):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        simulate_err.seek(0)
        yield SharedLaunch(
            config,
            run_dir,
            launch.returncode,
            out,
            err,
            seen,
            probes,
            simulate_dir,
            simulate.returncode,
            simulate_err.read(),
        )


# -- federations of real processes (tests/test_federation.py, tests/test_elastic.py) ----------------------------

H = 4
"""Inner steps per round: tiny, the tests are about the protocol, not the loss."""
TOKENS = 8 * 16 * H
"""Tokens one island trains on per round (batch 8 x seq_len 16 x H): the aggregation weight."""
FAST = [
    f"train.inner_steps={H}",
    "train.checkpoint_every=1",
    "quorum.lease_s=3",
    "quorum.min_deadline_s=1",
    "quorum.max_deadline_s=20",
    "network.pull_wait_s=2",
    "transport.max_attempts=3",
    "transport.backoff_max_s=1",
    "network.coordinator_wait_s=60",
    "network.connect_timeout_s=120",
    "codec.uplink=int8",
    "codec.downlink=int8",
]
"""Short leases and deadlines so faults are detected in seconds, retries that give up late."""
WAIT_S = 150.0
"""How long any single condition may take to come true on a slow, loaded machine."""
ENV = {
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "PYTHONWARNINGS": JAX_CACHE_ENV["PYTHONWARNINGS"],
}
"""The children import this checkout's diloco and run JAX on the CPU (sharing the session's XLA cache)."""


@pytest.fixture
def federation(tmp_path: Path, tiny_config: Path) -> Iterator[Callable[..., Federation]]:
    """Federations of the tiny config (diloco.harness.procs, the harness `launch` uses), each child in its own process
    group (cleanup reaches a supervisor's worker too) and all sharing one persistent XLA compilation cache;
    `pause_at` names where processes stop and wait for the test (diloco/faults.py: WHO:POINT:ROUND)."""
    made: list[Federation] = []

    def make(*overrides: str, pause_at: Sequence[str] = ()) -> Federation:
        fed = Federation(
            tiny_config,
            [*FAST, *overrides],
            tmp_path / f"fed{len(made)}",
            cwd=REPO,
            env=ENV,
            jax_cache=JAX_CACHE,
            pause_at=pause_at,
        )
        made.append(fed)
        return fed

    yield make
    for fed in made:
        fed.stop(grace_s=0.0)
