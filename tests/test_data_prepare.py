"""`diloco data prepare`: text to a prepared token directory, decoded back exactly, trained on, and checked by a run."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.cli import main
from diloco.ops import data_prepare
from islands.prepared import mismatches
from tests.conftest import TINY_TOML, fails

pytest.importorskip("tokenizers")  # the tokenize extra (in dev, so CI has it)

VOCAB = 300

WORDS = [
    "the",
    "island",
    "round",
    "delta",
    "outer",
    "inner",
    "model",
    "wan",
    "link",
    "loss",
    "step",
    "naïve",
    "Ωmega",
    "façade",
    "日本",
    "🎉",
]


def _text(n_words: int, seed: int) -> str:
    """Words and lines of mixed scripts (multi-byte UTF-8, tabs, CRLF): what the tokenizer must give back exactly."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_words // 8):
        lines.append(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=8)))
    return "\n".join(lines) + "\r\n\tend\n"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A directory of two text files, about 60 kB."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes(_text(4000, 0).encode())
    (d / "b.txt").write_bytes(_text(4000, 1).encode())
    return d


@pytest.fixture
def prepared(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "prep"
    assert main(["data", "prepare", str(corpus), "--out", str(out), "--train-vocab", str(VOCAB)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["out"] == str(out) and printed["vocab_size"] == VOCAB
    assert printed["overrides"] == f"data.kind=tokens data.path={out} model.vocab_size={VOCAB}"
    return out


def test_prepare_writes_tokens_that_decode_back_to_the_text(prepared: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer

    meta = json.loads((prepared / "meta.json").read_text())
    tokens = np.fromfile(prepared / "tokens.bin", dtype="<u2")
    files = [str(corpus / "a.txt"), str(corpus / "b.txt")]
    assert meta["format"] == 1 and meta["vocab_size"] == VOCAB and meta["token_dtype"] == "uint16"
    assert meta["tokens"] == len(tokens) > 0 and tokens.max() < VOCAB
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((prepared / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer"]["trained"] and meta["tokenizer"]["requested_vocab"] == VOCAB
    assert [f["path"] for f in meta["sources"]["files"]] == files
    assert meta["sources"]["inputs"] == [str(corpus)]
    assert meta["tool"]["diloco"] and meta["tool"]["tokenizers"]
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    text = "".join(Path(f).read_bytes().decode() for f in files)  # bytes: read_text would turn \r\n into \n
    assert tokenizer.decode(tokens.tolist()) == text
    assert len(tokens) < len(text.encode()) / 2  # merges happened: fewer tokens than bytes


def test_a_given_tokenizer_gives_the_same_tokens(
    prepared: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    again = tmp_path / "again"
    tokenizer = prepared / "tokenizer.json"
    assert main(["data", "prepare", str(corpus / "*.txt"), "--out", str(again), "--tokenizer", str(tokenizer)]) == 0
    capsys.readouterr()
    assert (again / "tokens.bin").read_bytes() == (prepared / "tokens.bin").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    meta = json.loads((again / "meta.json").read_text())
    assert not meta["tokenizer"]["trained"] and meta["tokenizer"]["from"] == str(tokenizer)
    assert meta["tokenizer"]["sha256"] == json.loads((prepared / "meta.json").read_text())["tokenizer"]["sha256"]


@pytest.mark.slow
def test_simulate_trains_on_the_prepared_directory(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TINY_TOML.format(corpus="unused"))
    run_dir = tmp_path / "run"
    args = [
        "simulate",
        str(config),
        "data.kind=tokens",
        f"data.path={prepared}",
        f"model.vocab_size={VOCAB}",
        "train.rounds=2",
        "train.checkpoint_every=0",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert summary["initial_eval_loss"] == pytest.approx(np.log(VOCAB), rel=0.05)  # uniform over the 300 ids
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.vocab_size=256"],
            f"its tokenizer has a vocabulary of {VOCAB} but model.vocab_size is 256 "
            f"(set model.vocab_size={VOCAB} or more)",
        ),
        (
            [f"model.vocab_size={VOCAB}", "data.token_dtype=uint32"],
            "its tokens are uint16 but data.token_dtype is uint32 (set data.token_dtype=uint16)",
        ),
    ],
)
def test_a_run_that_disagrees_with_meta_is_one_line(
    prepared: Path, tmp_path: Path, overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TINY_TOML.format(corpus="unused"))
    run_dir = tmp_path / "run"
    for path in (prepared, prepared / "tokens.bin"):  # the directory, or its tokens.bin with meta.json beside it
        fails(
            capsys,
            ["simulate", str(config), "data.kind=tokens", f"data.path={path}", *overrides, "--run-dir", str(run_dir)],
            expected,
        )
    assert not run_dir.exists()  # refused before the run directory is made


def test_a_prepared_directory_read_as_text_is_one_line(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TINY_TOML.format(corpus=prepared))
    fails(capsys, ["simulate", str(config), "--run-dir", str(tmp_path / "run")], "set data.kind=tokens")


def test_user_mistakes_are_one_line(
    tmp_path: Path, corpus: Path, prepared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "o")
    fails(
        capsys,
        ["data", "prepare", str(tmp_path / "nope.txt"), "--out", out, "--train-vocab", "300"],
        f"input '{tmp_path / 'nope.txt'}': no such file or directory",
    )
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    fails(capsys, ["data", "prepare", str(empty), "--out", out, "--train-vocab", "300"], "the corpus is empty")
    fails(
        capsys,
        ["data", "prepare", str(corpus), "--out", out, "--train-vocab", "255"],
        "--train-vocab must be at least 256",
    )
    fails(
        capsys,
        ["data", "prepare", str(corpus), "--out", str(prepared), "--train-vocab", "300"],
        "already holds a prepared corpus",
    )
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    fails(
        capsys,
        ["data", "prepare", str(latin1), "--out", out, "--train-vocab", "300"],
        f"input file '{latin1}' is not UTF-8 text (byte 3 cannot be decoded)",
    )
    fails(
        capsys,
        ["data", "prepare", str(corpus), "--out", out, "--tokenizer", str(corpus / "a.txt")],
        "is not a Hugging Face tokenizer.json",
    )
    fails(
        capsys,
        ["data", "prepare", str(corpus), "--out", out, "--tokenizer", str(tmp_path / "none.json")],
        "no such file",
    )
    assert not Path(out).exists()


def test_without_the_tokenizers_package_the_extra_is_named(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now raises ImportError
    fails(
        capsys,
        ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--train-vocab", "300"],
        "pip install 'diloco[tokenize]'",
    )


def test_chunks_cut_at_line_ends_and_character_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "日本語のテキスト🎉" * 5 + "\nshort\n" + "naïve façade " * 7 + "\n\nlast line without newline é"
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode())
    for size in (1, 2, 3, 5, 7, 64):
        monkeypatch.setattr(data_prepare, "CHUNK_BYTES", size)
        seen: list[int] = []
        chunks = list(data_prepare.text_chunks(str(path), seen.append))
        assert "".join(chunks) == text and sum(seen) == len(text.encode())
        if size >= 7:  # long enough blocks end at a newline whenever the block holds one
            assert all(c.endswith("\n") for c in chunks[:-1] if "\n" in c)


def test_ids_past_65536_are_stored_as_uint32(prepared: Path, corpus: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from islands.prepared import token_dtype_for

    assert [token_dtype_for(n) for n in (256, 65536, 65537)] == ["uint16", "uint16", "uint32"]
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    files = [str(corpus / "a.txt"), str(corpus / "b.txt")]
    n = data_prepare.encode_files(tokenizer, files, tmp_path / "t32.bin", "uint32", lambda _: None)
    wide = np.fromfile(tmp_path / "t32.bin", dtype="<u4")
    assert n == len(wide) and np.array_equal(wide, np.fromfile(prepared / "tokens.bin", dtype="<u2"))


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "problems"),
    [
        (4096, "uint16", 0),  # exactly the tokenizer's
        (4160, "uint16", 0),  # padded (a multiple of 64): ids the data never holds
        (4095, "uint16", 1),  # too small: the last id would index past the embedding
        (4096, "uint32", 1),
        (100, "uint32", 2),
    ],
)
def test_mismatches_allow_a_padded_vocabulary(vocab_size: int, dtype: str, problems: int) -> None:
    assert len(mismatches({"vocab_size": 4096, "token_dtype": "uint16"}, vocab_size, dtype)) == problems


@pytest.mark.parametrize("vocab", ["4096", -1, True, None])
def test_a_meta_json_with_a_bad_vocab_size_is_one_reason(tmp_path: Path, vocab: object) -> None:
    from islands.prepared import META_FORMAT, read_meta

    path = tmp_path / "meta.json"
    path.write_text(
        json.dumps(
            {
                "format": META_FORMAT,
                "vocab_size": vocab,
                "token_dtype": "uint16",
                "tokens": 1,
                "tokenizer_sha256": "x",
                "sources": [],
            }
        )
    )
    why = read_meta(path)
    assert isinstance(why, str) and "not a count and a dtype name" in why, why
