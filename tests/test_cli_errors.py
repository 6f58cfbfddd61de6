"""Bad input at the command line: one line naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.cli import main
from tests.conftest import TINY_TOML, fails, run_cli, write_corpus


def _config(tmp_path: Path, corpus: Path, extra: str = "") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(TINY_TOML.format(corpus=corpus) + extra)
    return path


def test_broken_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = ")
    fails(capsys, ["simulate", str(bad)], f"config file '{bad}' is not valid TOML")


def test_unknown_key(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, ["simulate", str(tiny_config), "model.d_modle=8"], "did you mean 'model.d_model'?")


def test_missing_data_file(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.txt"
    fails(
        capsys, ["simulate", str(tiny_config), f"data.path={missing}", "--run-dir", str(tmp_path / "r")], str(missing)
    )


def test_empty_data_file(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    fails(capsys, ["simulate", str(tiny_config), f"data.path={empty}"], "empty")


def test_data_shorter_than_one_sequence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = write_corpus(tmp_path / "short.txt", n_bytes=12)
    fails(capsys, ["simulate", str(_config(tmp_path, short))], "seq_len")


def test_more_islands_than_the_data_allows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "small.txt", n_bytes=400)
    fails(capsys, ["simulate", str(_config(tmp_path, corpus)), "islands.count=40"], "too few for 40 islands")


def test_custom_model_that_does_not_import(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["simulate", str(tiny_config), "model.kind=custom", "model.entry=nosuch_pkg.mod:build"],
        "model.entry 'nosuch_pkg.mod:build': cannot import module",
    )


def test_devices_the_process_does_not_have(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, ["simulate", str(tiny_config), "islands.devices=64"], "islands.devices is 64")


def test_stray_argument(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(tiny_config), "stray"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_console_exit_code_and_single_line(tmp_path: Path) -> None:
    out = run_cli("simulate", str(tmp_path / "missing.toml"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"diloco: error: config file '{tmp_path / 'missing.toml'}' does not exist"


# -- federation: bad addresses, ports, names, configs ------------------------------------------------------------


def test_island_name_not_in_config(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["island", str(tiny_config), "--name", "mars", "--coordinator", "127.0.0.1:1"],
        "island 'mars' is not in the config's islands.names (island-0, island-1)",
    )


def test_port_already_in_use(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        fails(
            capsys,
            ["coordinator", str(tiny_config), "--listen", f"127.0.0.1:{port}", "--run-dir", str(tmp_path / "c")],
            f"cannot listen on 127.0.0.1:{port}: Address already in use",
        )


def test_bad_listen_address(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, ["coordinator", str(tiny_config), "--listen", "localhost"], "--listen must be HOST:PORT")


@pytest.mark.slow
def test_coordinator_that_does_not_answer(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails(
        capsys,
        [
            "island",
            str(tiny_config),
            "--name",
            "island-0",
            "--coordinator",
            "127.0.0.1:1",
            "--no-supervise",
            "--run-dir",
            str(tmp_path / "i"),
            "network.connect_timeout_s=1",
            "transport.max_attempts=1",
        ],
        "join 127.0.0.1:1: coordinator did not answer for 1s",
        code=69,  # a bounded wait that ran out: a supervisor starts the island again
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_config_that_differs_from_the_coordinators(tiny_config: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from diloco.harness.procs import wait_until
    from tests.conftest import REPO, child_env

    def alive(proc: subprocess.Popen[bytes]) -> None:
        assert proc.poll() is None, f"the coordinator exited with code {proc.returncode}"

    run_dir = tmp_path / "coord"
    coord = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diloco.cli",
            "coordinator",
            str(tiny_config),
            "--listen",
            "127.0.0.1:0",
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        env=child_env(jax_cache=True),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: (run_dir / "coordinator.addr").exists(),
            "the coordinator's address",
            240,
            check=lambda: alive(coord),
        )
        address = (run_dir / "coordinator.addr").read_text()
        out = run_cli(
            "island",
            str(tiny_config),
            "--name",
            "island-0",
            "--coordinator",
            address,
            "--no-supervise",
            "--run-dir",
            str(tmp_path / "i"),
            "outer.lr=0.5",
            "train.rounds=9",
        )
        assert out.returncode == 2
        assert out.stderr.strip() == (
            "diloco: error: FAILED_PRECONDITION: island island-0's config differs from the coordinator's in: "
            "outer.lr, train.rounds; start both from one config"
        )
        # ... and the coordinator counted the refusal
        status = run_cli("status", address, "--json")
        assert status.returncode == 0 and '"rejected": 1' in status.stdout
    finally:
        coord.kill()
        coord.wait()


# -- secure defaults: where a coordinator listens, which secrets a config may hold, TLS files ---------------------


def test_coordinator_listens_on_loopback_by_default() -> None:
    from diloco.cli import build_parser

    assert build_parser().parse_args(["coordinator", "c.toml"]).listen == "127.0.0.1:50051"


def test_open_coordinator_without_secrets_is_refused(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "c"
    fails(
        capsys,
        ["coordinator", str(tiny_config), "--listen", "0.0.0.0:0", "--run-dir", str(run_dir)],
        "refusing to listen on 0.0.0.0:0 without island secrets (network.secrets) and TLS (network.tls_cert/"
        "tls_key or --tls-cert/--tls-key): anyone who reaches it could join and push into the global model; "
        "listen on 127.0.0.1, configure them, or pass --insecure",
    )
    assert not run_dir.exists()  # refused before anything was created


def test_secrets_without_tls_beyond_loopback_are_refused(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("T_S0", "s0")
    monkeypatch.setenv("T_S1", "s1")
    fails(
        capsys,
        [
            "coordinator",
            str(tiny_config),
            "--listen",
            "[::]:0",
            "--run-dir",
            str(tmp_path / "c"),
            'network.secrets=["env:T_S0", "env:T_S1"]',
        ],
        "refusing to listen on [::]:0 without TLS (network.tls_cert/tls_key or --tls-cert/--tls-key): island "
        "secrets would cross the network in clear",
    )


def test_literal_secret_in_a_config_file_is_refused(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, corpus, '\n[network]\nsecrets = ["env:S0", "hunter2"]\n')
    fails(
        capsys,
        ["simulate", str(path)],
        f"network.secrets[1] in config file '{path}' is a literal secret; write env:VAR or file:PATH",
    )
    assert "hunter2" not in capsys.readouterr().err
    # A run directory's config.toml reused as a config: its placeholder is no secret either.
    path.write_text(TINY_TOML.format(corpus=corpus) + '\n[network]\nsecrets = ["<literal secret redacted>", "env:S"]\n')
    fails(capsys, ["simulate", str(path)], "network.secrets[0] in config file")
    fails(capsys, ["simulate", str(path)], "is the placeholder of a redacted secret")


def test_tls_flags_are_checked_before_anything_starts(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["coordinator", str(tiny_config), "--listen", "127.0.0.1:0", "--run-dir", str(tmp_path / "c")]
    missing = tmp_path / "missing.crt"
    fails(
        capsys,
        [*base, "--tls-ca", str(tmp_path / "ca.crt")],
        "network.tls_cert / --tls-cert is required for a TLS coordinator",
    )
    fails(capsys, [*base, "--tls-cert", str(missing)], "network.tls_cert and network.tls_key must be set together")
    fails(
        capsys,
        [*base, "--tls-cert", str(missing), "--tls-key", str(missing)],
        f"network.tls_cert / --tls-cert: cannot read {missing} (No such file or directory)",
    )
    assert not (tmp_path / "c").exists()


def test_clients_refuse_to_send_a_secret_in_clear(
    tiny_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("T_S0", "s0")
    expected = "refusing to send an island secret in clear to 10.9.8.7:50051: set network.tls_ca (or --tls-ca)"
    fails(
        capsys,
        ["island", str(tiny_config), "--name", "island-0", "--coordinator", "10.9.8.7:50051", "--secret", "env:T_S0"],
        expected,
    )
    fails(capsys, ["status", "10.9.8.7:50051", "--name", "island-0", "--secret", "env:T_S0"], expected)
    fails(capsys, ["status", "127.0.0.1:1", "--name", "island-0"], "--name and --secret go together")


def test_literal_secret_on_the_command_line_warns(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["island", str(tiny_config), "--name", "island-0", "--coordinator", "10.9.8.7:1", "--secret", "hunter2"])
        == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("diloco: warning: --secret is a literal secret on the command line")
    assert lines[1].startswith("diloco: error: refusing to send an island secret in clear") and len(lines) == 2
    assert "hunter2" not in "\n".join(lines)
