"""Secure by default, checked the way a hostile tester would: real processes, real sockets, the bytes on disk.

* A coordinator without secrets stays on loopback unless told `--insecure`; with secrets, Status needs them.
* TLS and mutual TLS from the config's `network.tls_*` keys, end to end (a coordinator process, `diloco status`).
* Secrets never reach a run directory, a log or another island: the whole run dir of a real `diloco launch` (the
  session's shared one, tests/conftest.py) is searched for the secret bytes, and each island process's environment
  is read from /proc while it runs.
* Everything a run creates is private to the user (umask 077 in `diloco.cli.main`, inherited by children).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.config import config_digest, dump_toml, load_config, to_dict
from diloco.harness.procs import wait_until
from tests.conftest import LAUNCH_SECRETS, REPO, SharedLaunch, child_env, run_cli
from tests.test_auth_tls import make_test_pki

WAIT_S = 150.0


# -- what leaves a process: references, never values -------------------------------------------------------------


def test_dumps_and_digest_carry_references_not_secrets(tiny_config: Path, tmp_path: Path) -> None:
    secrets = 'network.secrets=["env:S0", "hunter2-literal"]'
    a = load_config(tiny_config, [secrets, "network.tls_cert=/a.crt", "network.tls_key=/a.key"])
    dumped = dump_toml(to_dict(a)) + json.dumps(to_dict(a))
    assert "hunter2" not in dumped and "/a.crt" not in dumped and "tls_" not in dumped
    assert to_dict(a)["network"]["secrets"] == ["env:S0", "<literal secret redacted>"]
    # Another literal value and other TLS files (an island's own): the same run, the same digest ...
    b = load_config(tiny_config, ['network.secrets=["env:S0", "other-literal"]', "network.tls_ca=/ca.crt"])
    assert config_digest(a) == config_digest(b)
    # ... but another reference is another config: the digest covers where each secret lives.
    c = load_config(tiny_config, ['network.secrets=["env:S9", "hunter2-literal"]'])
    assert config_digest(a) != config_digest(c)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_dir_is_private_and_umask_restored(tiny_config: Path, tmp_path: Path) -> None:
    from diloco.cli import main

    previous = os.umask(0o022)  # a typical login umask: without diloco's own, files would be 0644
    try:
        run_dir = tmp_path / "runs" / "sim"
        assert main(["simulate", str(tiny_config), "--run-dir", str(run_dir), "--no-progress", "train.rounds=1"]) == 0
        assert os.umask(0o022) == 0o022  # main() gave the caller its umask back
    finally:
        os.umask(previous)
    paths = [run_dir.parent, *run_dir.rglob("*")]
    assert any(p.is_file() and "checkpoints" in p.parts for p in paths)  # orbax's files are among them
    public = [f"{p} {stat.S_IMODE(p.stat().st_mode):o}" for p in paths if p.stat().st_mode & 0o077]
    assert public == []


# -- a coordinator process: loopback rule, --insecure, TLS and mTLS from config keys, Status credentials -----------


def _coordinator(config: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "coordinator", str(config), "--run-dir", str(run_dir), "--quiet", *args],
        env={**child_env(jax_cache=True), **(env or {})},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _address(proc: subprocess.Popen, run_dir: Path) -> str:
    def alive() -> None:
        assert proc.poll() is None, proc.communicate()

    wait_until((run_dir / "coordinator.addr").exists, "the coordinator's address", WAIT_S, 0.1, alive)
    return (run_dir / "coordinator.addr").read_text()


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_open_coordinator_exits_2_unless_insecure(tiny_config: Path, tmp_path: Path, stopped: list) -> None:
    refused = run_cli("coordinator", str(tiny_config), "--listen", "0.0.0.0:0", "--run-dir", str(tmp_path / "no"))
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and refused.stderr.startswith(
        "diloco: error: refusing to listen on 0.0.0.0:0 without island secrets"
    ), refused.stderr
    assert not (tmp_path / "no").exists()

    proc = _coordinator(tiny_config, tmp_path / "yes", "--listen", "0.0.0.0:0", "--insecure")
    stopped.append(proc)
    port = _address(proc, tmp_path / "yes").rpartition(":")[2]
    status = run_cli("status", f"127.0.0.1:{port}", "--json")  # no secrets: no credentials needed
    assert status.returncode == 0 and json.loads(status.stdout)["run_id"] == "test", status.stderr
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "diloco: warning: --insecure: listening on 0.0.0.0:0 without island secrets" in err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_mutual_tls_and_status_credentials_from_config_keys(tiny_config: Path, tmp_path: Path, stopped: list) -> None:
    pki = make_test_pki(tmp_path, island="island-0")
    for key in pki.glob("*.key"):
        key.chmod(0o600)
    config = tmp_path / "tls.toml"
    config.write_text(
        tiny_config.read_text()
        + f"""
[network]
secrets = ["env:T_SECRET_0", "env:T_SECRET_1"]
tls_cert = "{pki / "server.crt"}"
tls_key = "{pki / "server.key"}"
tls_ca = "{pki / "ca.crt"}"
"""
    )
    (tmp_path / "s0").write_text("secret-zero\n")
    # Secrets and mutual TLS: listening beyond loopback is allowed.
    proc = _coordinator(
        config, tmp_path / "c", "--listen", "0.0.0.0:0", env={"T_SECRET_0": "secret-zero", "T_SECRET_1": "secret-one"}
    )
    stopped.append(proc)
    target = f"localhost:{_address(proc, tmp_path / 'c').rpartition(':')[2]}"
    creds = ["--name", "island-0", "--secret", f"file:{tmp_path / 's0'}"]
    tls = ["--tls-ca", str(pki / "ca.crt")]
    cert = ["--tls-cert", str(pki / "client.crt"), "--tls-key", str(pki / "client.key")]

    ok = run_cli("status", target, "--json", *creds, *tls, *cert)
    assert ok.returncode == 0 and json.loads(ok.stdout)["run_id"] == "test", ok.stderr

    def refused(*args: str) -> str:
        out = run_cli("status", target, "--json", *args)
        assert out.returncode == 2 and out.stdout == "", (args, out.stdout, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
        return out.stderr

    assert "UNAUTHENTICATED: missing island credentials" in refused(*tls, *cert)  # Status needs credentials
    assert "pass --name ISLAND --secret" in refused(*tls, *cert)
    (tmp_path / "bad").write_text("secret-one")  # island-1's secret claimed by island-0
    assert "UNAUTHENTICATED: bad credentials for island 'island-0'" in refused(
        "--name", "island-0", "--secret", f"file:{tmp_path / 'bad'}", *tls, *cert
    )
    assert "UNAVAILABLE" in refused(*creds, *tls)  # mutual TLS: no client certificate, no handshake
    assert "UNAVAILABLE" in refused(*creds)  # plaintext against TLS


# -- a real `diloco launch`: secrets stay out of the run dir, each island holds only its own ------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads process environments from /proc")
def test_launch_keeps_secrets_out_of_the_run_dir_and_apart(shared_launch: SharedLaunch) -> None:
    """The session's shared launch (tests/conftest.py): 3 rounds with island-0's secret in launch's environment
    (T_LAUNCH_S0, beside a stale DILOCO_SECRET_5) and island-1's as a literal override; every child process's argv
    and environment were read from /proc while it ran."""
    run_dir, out, err = shared_launch.run_dir, shared_launch.stdout, shared_launch.stderr
    env_secret, literal_secret = LAUNCH_SECRETS["island-0"], LAUNCH_SECRETS["island-1"]
    assert shared_launch.returncode == 0, err[-3000:]
    seen: dict[str, set[int]] = {"coordinator": set(), "island-0": set(), "island-1": set()}
    for pid, (argv, penv) in shared_launch.processes.items():  # launch itself, which hands them out, excluded
        values = " ".join(f"{k}={v}" for k, v in penv.items())
        assert env_secret not in " ".join(argv) and literal_secret not in " ".join(argv), argv
        assert "stale-secret" not in values and "T_LAUNCH_S0" not in penv, argv
        if "coordinator" in argv:
            seen["coordinator"].add(pid)
            assert penv["DILOCO_SECRET_0"] == env_secret and penv["DILOCO_SECRET_1"] == literal_secret
        elif "island" in argv:
            name = argv[argv.index("--name") + 1]
            seen[name].add(pid)
            own = f"DILOCO_SECRET_{name[-1]}"
            other = next(v for n, v in LAUNCH_SECRETS.items() if n != name)
            assert penv[own] == LAUNCH_SECRETS[name] and other not in values, (name, sorted(penv))
            assert [k for k in penv if k.startswith("DILOCO_SECRET")] == [own], (name, sorted(penv))
    # a supervisor and a worker per island, and the coordinator, all checked
    assert all(len(p) >= (1 if k == "coordinator" else 2) for k, p in seen.items()), seen
    # The right secret without mutual TLS gets no answer: plaintext, and TLS without a client certificate.
    assert shared_launch.probes == {"plaintext": "UNAVAILABLE", "tls_without_client_cert": "UNAVAILABLE"}
    assert json.loads(out)["rounds"] == 3

    leaks = []
    for path in [p for p in run_dir.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        leaks += [f"{path}: {s}" for s in (env_secret, literal_secret) if s.encode() in data]
        if path.suffix != ".crt":
            assert not path.stat().st_mode & 0o077, f"{path} {stat.S_IMODE(path.stat().st_mode):o}"
    assert leaks == []
    assert not [d for d in run_dir.rglob("*") if d.is_dir() and d.stat().st_mode & 0o077]
    assert 'secrets = ["env:DILOCO_SECRET_0", "env:DILOCO_SECRET_1"]' in (run_dir / "config.toml").read_text()
    assert not (run_dir / "tls" / "ca.key").exists()
    assert env_secret not in out + err and literal_secret not in out + err


def test_command_lines_are_recorded_without_literal_secrets() -> None:
    from diloco.config import redact_argv

    argv = [
        "diloco",
        "island",
        "c.toml",
        "--secret",
        "hunter2",
        "--secret=hunter3",
        "--name",
        "island-0",
        'network.secrets=["hunter4", "env:S1"]',
        "network.secrets=hunter5",
        "outer.lr=0.5",
    ]
    safe = redact_argv(argv)
    assert not [a for a in safe if "hunter" in a], safe
    assert safe[:3] == argv[:3] and safe[6:8] == argv[6:8] and safe[-1] == "outer.lr=0.5"
    assert 'network.secrets=["<literal secret redacted>", "env:S1"]' in safe
    assert redact_argv(["diloco", "island", "--secret", "env:S0"]) == ["diloco", "island", "--secret", "env:S0"]
