"""Bad input at the command line: one line naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.cli import main
from tests.conftest import TINY_TOML, run_cli, write_corpus


def _config(tmp_path: Path, corpus: Path, extra: str = "") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(TINY_TOML.format(corpus=corpus) + extra)
    return path


def _fails(capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and expected in err, err
    assert "\n" not in err and "Traceback" not in err


def test_broken_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = ")
    _fails(capsys, ["simulate", str(bad)], f"config file '{bad}' is not valid TOML")


def test_unknown_key(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["simulate", str(tiny_config), "model.d_modle=8"], "did you mean 'model.d_model'?")


def test_missing_data_file(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.txt"
    _fails(capsys, ["simulate", str(tiny_config), f"data.path={missing}", "--run-dir", str(tmp_path / "r")],
           str(missing))  # fmt: skip


def test_empty_data_file(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _fails(capsys, ["simulate", str(tiny_config), f"data.path={empty}"], "empty")


def test_data_shorter_than_one_sequence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = write_corpus(tmp_path / "short.txt", n_bytes=12)
    _fails(capsys, ["simulate", str(_config(tmp_path, short))], "seq_len")


def test_more_islands_than_the_data_allows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "small.txt", n_bytes=400)
    _fails(capsys, ["simulate", str(_config(tmp_path, corpus)), "islands.count=40"], "too few for 40 islands")


def test_custom_model_that_does_not_import(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["simulate", str(tiny_config), "model.kind=custom", "model.entry=nosuch_pkg.mod:build"],
           "model.entry 'nosuch_pkg.mod:build': cannot import module")  # fmt: skip


def test_devices_the_process_does_not_have(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(capsys, ["simulate", str(tiny_config), "islands.devices=64"], "islands.devices is 64")


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
