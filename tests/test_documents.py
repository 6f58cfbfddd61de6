"""Pre-training on documents as users keep them: JSONL and Parquet shards with a text field (islands/documents.py),
tokenized by the run's tokenizer into a cached token file, and `diloco data prepare` on the same inputs."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from islands.data import DataConfig, DataError, load_sources, open_source
from islands.text import TokenizerText
from tests.conftest import TINY_TOML, fails
from tests.tiny_tokenizer import write_tokenizer

pytestmark = pytest.mark.timeout(60)

DOCS = [f"document {i}: the island trains a model, round {i}" for i in range(40)]


@pytest.fixture
def tokenizer(tmp_path: Path) -> TokenizerText:
    return TokenizerText(write_tokenizer(tmp_path / "tok"), 300, "test")


def write_jsonl(path: Path, records: list[object]) -> Path:
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(lines) if path.suffix == ".gz" else lines)
    return path


def write_parquet(path: Path, texts: list[object], column: str = "text", row_group: int = 7) -> Path:
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group)
    return path


def expected(tokenizer: TokenizerText, docs: list[str]) -> list[int]:
    return [i for d in docs for i in [*tokenizer.encode(d), tokenizer.eos]]


def config(tmp_path: Path, kind: str, path: Path | str, **keys: object) -> DataConfig:
    return DataConfig(kind=kind, path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.1, **keys)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_shards_tokenize_in_order_each_document_ended_by_eos(
    tmp_path: Path, tokenizer: TokenizerText, kind: str
) -> None:
    shards = tmp_path / "data"
    shards.mkdir()
    (shards / "README.md").write_text("a dataset card, not a shard")
    halves = [DOCS[:25], DOCS[25:]]
    for i, docs in enumerate(halves):  # train-00000-of-00002.jsonl.gz, ..., as a dataset repository names them
        name = shards / f"train-{i:05d}-of-00002"
        if kind == "jsonl":
            write_jsonl(name.with_suffix(".jsonl.gz" if i else ".jsonl"), [{"text": d, "n": 1} for d in docs])
        else:
            write_parquet(name.with_suffix(".parquet"), docs)
    want = expected(tokenizer, DOCS)
    for spec in (shards, shards / "train-*"):  # a directory (its shards, not the card) or a glob
        cfg = config(tmp_path, kind, spec)
        src = open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)
        assert np.concatenate([src.train, src.val]).tolist() == want
    (cache,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # both specs name the same shards: one file
    meta = json.loads((cache / "meta.json").read_text())
    first = len(expected(tokenizer, halves[0]))
    assert [s["first_token"] for s in meta["sources"]["shards"]] == [0, first]
    stamp = (cache / "tokens.bin").stat().st_mtime_ns
    shards_, val = load_sources(cfg, 2, 300, 0, seq_len=8, tokenizer=tokenizer)
    assert (cache / "tokens.bin").stat().st_mtime_ns == stamp  # read from the cache, not tokenized again
    assert sum(len(s) for s in shards_) + len(val) == len(want)


def test_a_changed_shard_tokenizes_anew(tmp_path: Path, tokenizer: TokenizerText) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    cfg = config(tmp_path, "jsonl", path)
    before = open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)
    write_jsonl(path, [{"text": d} for d in DOCS[:-1]])
    after = open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)
    assert before.n_train + len(before.val) - len(expected(tokenizer, DOCS[-1:])) == after.n_train + len(after.val)


def _corrupt(path: Path) -> Path:
    write_parquet(path, DOCS)
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\x00" * 64
    path.write_bytes(bytes(data[: len(data) - 20]))  # the footer cut too
    return path


CASES = {
    "a missing field": ("jsonl", lambda d: write_jsonl(d / "a.jsonl", [{"text": "x"}, {"body": "y"}]),
                        "a.jsonl:2: no field 'text' (data.text_field; the record has 'body')"),
    "a wrong type": ("jsonl", lambda d: write_jsonl(d / "a.jsonl", [{"text": 3}]),
                     "a.jsonl:1: field 'text' is a number, not a string"),
    "a line not an object": ("jsonl", lambda d: write_jsonl(d / "a.jsonl", [["text"]]),
                             "a.jsonl:1: not a JSON object (got an array)"),
    "not JSON": ("jsonl", lambda d: (d / "a.jsonl").write_text('{"text": "x"}\n{"text": \n') and d / "a.jsonl",
                 "a.jsonl:2: not JSON"),
    "an empty shard": ("jsonl", lambda d: (d / "a.jsonl").write_text("\n") and d / "a.jsonl",
                       "a.jsonl: an empty shard (no documents)"),
    "a glob matching nothing": ("parquet", lambda d: d / "train-*.parquet", "no files match this pattern"),
    "a Parquet file without the text column": ("parquet", lambda d: write_parquet(d / "a.parquet", DOCS, "content"),
                                               "a.parquet: no column 'text' (data.text_field; the file has 'content', 'id')"),
    "a Parquet column not of strings": ("parquet", lambda d: write_parquet(d / "a.parquet", [1, 2], "text"),
                                        "a.parquet: column 'text' is int64, not a string"),
    "a null document": ("parquet", lambda d: write_parquet(d / "a.parquet", ["x", None]),
                        "a.parquet row 1: field 'text' is null, not a string"),
    "an empty Parquet shard": ("parquet", lambda d: write_parquet(d / "a.parquet", pa.array([], pa.string())),
                               "a.parquet: an empty shard (no documents)"),
    "a corrupt Parquet file": ("parquet", lambda d: _corrupt(d / "a.parquet"), "a.parquet: not a Parquet file"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_documents_are_one_line(tmp_path: Path, tokenizer: TokenizerText, case: str) -> None:
    kind, make, message = CASES[case]
    path = make(tmp_path)
    cfg = config(tmp_path, kind, path)
    with pytest.raises(DataError) as err:
        open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not [p for p in (tmp_path / "cache").glob("*") if p.is_dir()]  # nothing half-written stays in the cache


def test_a_line_longer_than_the_bound_is_refused(
    tmp_path: Path, tokenizer: TokenizerText, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("islands.documents.MAX_LINE_BYTES", 64)
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "short"}, {"text": "x" * 100}])
    cfg = config(tmp_path, "jsonl", path)
    with pytest.raises(DataError, match="a.jsonl:2: a line longer than 64 bytes"):
        open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)


def test_without_a_tokenizer_or_with_a_small_vocabulary_is_one_line(tmp_path: Path, tokenizer: TokenizerText) -> None:
    cfg = config(tmp_path, "jsonl", write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}]))
    with pytest.raises(DataError, match="set data.tokenizer=PATH/tokenizer.json"):
        open_source(cfg, cfg.path, "data.path", 300, 0)
    with pytest.raises(DataError, match=r"has a vocabulary of 300 but model.vocab_size is 256 \(set model.vocab_size"):
        open_source(cfg, cfg.path, "data.path", 256, 0, tokenizer=tokenizer)
    table = config(tmp_path, "parquet", write_parquet(tmp_path / "a.parquet", ["x"]))
    with pytest.raises(DataError, match=r"a.parquet'.*has a vocabulary of 300 but model.vocab_size is 256"):
        open_source(table, table.path, f"data.path {table.path!r}", 256, 0, tokenizer=tokenizer)
    with pytest.raises(DataError, match="data.kind = 'tokens' has it already"):
        DataConfig(kind="tokens", path="x", tokenizer="t.json")


def test_without_pyarrow_the_extra_is_named(
    tmp_path: Path, tokenizer: TokenizerText, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "a.parquet", DOCS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` now raises ImportError
    cfg = config(tmp_path, "parquet", path)
    with pytest.raises(DataError, match=r"pyarrow, which is not installed: pip install 'diloco\[parquet\]'"):
        open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)


def test_data_prepare_reads_the_same_inputs_into_the_same_tokens(tmp_path: Path, tokenizer: TokenizerText) -> None:
    from diloco.cli import main

    path = write_parquet(tmp_path / "a.parquet", DOCS, column="content")
    out = tmp_path / "prepared"
    args = [
        "data",
        "prepare",
        str(path),
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer.path),
        "--text-field",
        "content",
    ]
    assert main([*args, "--no-progress"]) == 0
    assert np.fromfile(out / "tokens.bin", np.uint16).tolist() == expected(tokenizer, DOCS)
    assert (out / "tokenizer_config.json").is_file()  # its EOS and chat template travel with the tokens


def test_simulate_refuses_a_parquet_file_without_the_text_column_in_one_line(
    tmp_path: Path, tokenizer: TokenizerText, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_parquet(tmp_path / "a.parquet", DOCS, column="content")
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML.format(corpus="unused"))
    args = ["simulate", str(cfg), "data.kind=parquet", f"data.path={path}", f"data.tokenizer={tokenizer.path}",
            f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=300", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    fails(capsys, args, "a.parquet: no column 'text' (data.text_field; the file has 'content', 'id')")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_simulate_trains_on_jsonl_shards_with_chunks_read_once(
    tmp_path: Path, tokenizer: TokenizerText, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco.cli import main

    for i in range(2):
        write_jsonl(tmp_path / f"train-{i}.jsonl", [{"text": d} for d in DOCS * 3])
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML.format(corpus="unused"))
    run_dir = tmp_path / "run"
    args = ["simulate", str(cfg), "data.kind=jsonl", f"data.path={tmp_path / 'train-*.jsonl'}",
            f"data.tokenizer={tokenizer.path}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=300",
            "data.sampling=chunks", "data.chunk_sequences=4", "train.rounds=2", "train.checkpoint_every=2",
            "--run-dir", str(run_dir), "--no-progress"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["sequences_consumed"] == 2 * 2 * 4 * 8 and summary["sequences_repeated"] == 0  # exactly once
    from diloco.ops.sample import sample

    result = sample(run_dir, ["the island"], max_new_tokens=8, temperature=0.0)
    assert result["text"] == "tokenizer" and result["stop"] == "<|im_end|>"  # the tokenizer's EOS ends a sample
    ids = result["samples"][0]["tokens"]
    assert tokenizer.eos not in ids[:-1] and result["samples"][0]["continuation"] == tokenizer.decode(
        [i for i in ids if i != tokenizer.eos]
    )


def test_a_post_processors_bos_starts_each_document(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, processors

    path = write_tokenizer(tmp_path / "llama-like")
    raw = Tokenizer.from_file(str(path))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(path))
    tokenizer = TokenizerText(path, 300, "test")
    cfg = config(tmp_path, "jsonl", write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS[:3]]))
    src = open_source(cfg, cfg.path, "data.path", 300, 0, tokenizer=tokenizer)
    want = [i for d in DOCS[:3] for i in [0, *tokenizer.encode(d), tokenizer.eos]]
    assert np.concatenate([src.train, src.val]).tolist() == want


def test_processes_that_meet_at_the_cache_tokenize_once(tmp_path: Path, tokenizer: TokenizerText) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from islands.documents import cached_tokens

    path = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    calls = []
    encode = tokenizer.encode_documents
    tokenizer.encode_documents = lambda texts: calls.append(len(texts)) or encode(texts)  # type: ignore[method-assign]
    with ThreadPoolExecutor(4) as pool:  # a lock held per open file: threads contend as processes do
        dirs = set(pool.map(lambda _: cached_tokens([str(path)], "jsonl", "text", tokenizer, str(tmp_path)), range(4)))
    assert len(dirs) == 1 and sum(calls) == len(DOCS)


def test_data_prepare_trains_a_tokenizer_on_documents(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from diloco.cli import main

    path = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": d} for d in DOCS])
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(path), "--out", str(out), "--train-vocab", "300", "--no-progress"]) == 0
    ids = np.fromfile(out / "tokens.bin", np.uint16).tolist()
    assert Tokenizer.from_file(str(out / "tokenizer.json")).decode(ids) == "".join(DOCS)  # no EOS: it has none


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"text_field": ""}, "data.text_field must name the field"),
        ({"text_field": 3}, r"data.text_field must be a string \(got 3\)"),
        ({"path": "stdlib:"}, "is text: the built-in corpus needs data.kind = 'text'"),
    ],
)
def test_config_mistakes_are_one_line(keys: dict[str, object], message: str) -> None:
    with pytest.raises(DataError, match=message):
        DataConfig(**{"kind": "jsonl", "path": "a.jsonl", **keys})  # type: ignore[arg-type]
