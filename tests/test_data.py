"""Island data: sources, IID shards and non-IID paths, validation split, deterministic resumable batches,
synthetic corpus, the built-in stdlib: corpus, one-island loading, and every user error. Each test writes its own
small files in tmp_path or reads small standard-library packages (json, email), never the shared data."""

from __future__ import annotations

import math
import os
import sysconfig

import numpy as np
import pytest

from islands import data
from islands.data import (
    BatchStream,
    DataConfig,
    DataError,
    eval_batches,
    load_sources,
    stdlib_files,
    synthetic_tokens,
)

STDLIB = sysconfig.get_paths()["stdlib"]


def write_tokens(path, values, dtype="uint16"):
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


def assert_one_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    text = str(err.value)
    assert "\n" not in text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


# ---------------------------------------------------------------- batches


def test_batches_are_windows_of_the_shard_and_deterministic():
    tokens = np.arange(1000, dtype=np.uint32)
    a = BatchStream(tokens, batch_size=6, seq_len=9, seed=3, stream_id=1)
    b = BatchStream(tokens, batch_size=6, seq_len=9, seed=3, stream_id=1)
    for _ in range(5):
        x, y = a.next(), b.next()
        assert x.dtype == np.int32 and x.shape == (6, 10)
        np.testing.assert_array_equal(x, y)
        # arange tokens: a window is 10 consecutive ids starting at its offset, inside the shard
        np.testing.assert_array_equal(x, x[:, :1] + np.arange(10))
        assert x.min() >= 0 and x.max() < 1000
    assert a.cursor == 5


def test_streams_differ_by_island_and_seed():
    tokens = np.arange(10_000, dtype=np.uint32)
    base = BatchStream(tokens, 8, 16, seed=0, stream_id=0).batch_at(4)
    assert not np.array_equal(base, BatchStream(tokens, 8, 16, seed=0, stream_id=1).batch_at(4))
    assert not np.array_equal(base, BatchStream(tokens, 8, 16, seed=1, stream_id=0).batch_at(4))
    assert not np.array_equal(base, BatchStream(tokens, 8, 16, seed=0, stream_id=0).batch_at(5))


def test_resumed_stream_neither_repeats_nor_skips():
    tokens = np.arange(5000, dtype=np.uint16)
    fresh = BatchStream(tokens, 4, 8, seed=11, stream_id=2)
    for _ in range(7):
        fresh.next()
    resumed = BatchStream(tokens, 4, 8, seed=11, stream_id=2, cursor=fresh.cursor)
    for _ in range(5):
        np.testing.assert_array_equal(fresh.next(), resumed.next())
    assert resumed.cursor == fresh.cursor == 12
    # batch_at is pure: asking for an old batch does not move or depend on the cursor
    np.testing.assert_array_equal(resumed.batch_at(3), BatchStream(tokens, 4, 8, 11, 2).batch_at(3))
    assert resumed.cursor == 12


def test_batch_windows_reach_both_ends_of_a_small_shard():
    tokens = np.arange(12, dtype=np.uint16)  # 3 possible windows of 10
    stream = BatchStream(tokens, batch_size=64, seq_len=9, seed=0, stream_id=0)
    starts = {int(s) for s in stream.batch_at(0)[:, 0]}
    assert starts == {0, 1, 2}


def test_eval_batches_are_fixed_and_evenly_spaced():
    val = np.arange(1000, dtype=np.uint16)
    batches = eval_batches(val, n_batches=3, batch_size=4, seq_len=15)
    assert len(batches) == 3 and all(b.shape == (4, 16) and b.dtype == np.int32 for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 1000 - 16  # first and last windows touch both ends
    assert np.all(np.diff(starts) > 0)
    again = eval_batches(val, 3, 4, 15)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again, strict=True))


# ---------------------------------------------------------------- sources


def test_iid_blocks_are_dealt_disjointly_and_cover_the_train_split(tmp_path):
    n = 10_007
    path = write_tokens(tmp_path / "corpus.bin", np.arange(n), "uint32")
    cfg = DataConfig(kind="tokens", path=path, token_dtype="uint32", val_fraction=0.1, shard_block_tokens=100)
    shards, val = load_sources(cfg, n_islands=3, vocab_size=n, seed=0, seq_len=8)
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n - len(val)))  # disjoint, covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 100  # balanced to one block
    # every island samples the whole corpus, not one region of it
    assert all(s.min() < 1000 and s.max() > n - len(val) - 1000 for s in shards)
    again, _ = load_sources(cfg, n_islands=3, vocab_size=n, seed=0, seq_len=8)
    other, _ = load_sources(cfg, n_islands=3, vocab_size=n, seed=1, seq_len=8)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))  # deterministic for the seed
    assert not all(np.array_equal(a, b) for a, b in zip(shards, other, strict=True))


def test_contiguous_shards_are_disjoint_and_cover_the_train_split(tmp_path):
    n = 10_007
    path = write_tokens(tmp_path / "corpus.bin", np.arange(n), "uint32")
    cfg = DataConfig(kind="tokens", path=path, token_dtype="uint32", val_fraction=0.1, shard_block_tokens=0)
    shards, val = load_sources(cfg, n_islands=3, vocab_size=n, seed=0, seq_len=8)
    assert len(val) == int(n * 0.1)
    np.testing.assert_array_equal(np.concatenate([*shards, val]), np.arange(n))  # disjoint and covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(isinstance(s, np.memmap) for s in [*shards, val])  # a single file is never copied


def test_uint16_tokens_and_vocab_boundary(tmp_path):
    values = np.array([0, 1, 2, 65535, 7] * 40)
    path = write_tokens(tmp_path / "t16.bin", values, "uint16")
    shards, val = load_sources(DataConfig(kind="tokens", path=path), 1, vocab_size=65536, seed=0)
    np.testing.assert_array_equal(np.concatenate([shards[0], val]), values)
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(kind="tokens", path=path), 1, vocab_size=65535, seed=0)
    assert_one_line(err, repr(path), "token id 65535 at index 3", "model.vocab_size (65535)")


def test_text_is_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 4)
    shards, val = load_sources(
        DataConfig(path=str(tmp_path / "a.txt"), val_fraction=0.25, shard_block_tokens=0), 2, 256, 0
    )
    assert shards[0].dtype == np.uint8
    np.testing.assert_array_equal(np.concatenate([*shards, val]), np.tile(np.arange(256), 4))
    np.testing.assert_array_equal(val, np.arange(256))


def test_directory_reads_all_files_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 100)
    (tmp_path / "a.txt").write_bytes(b"A" * 100)
    (tmp_path / ".hidden").write_bytes(b"H" * 100)
    (tmp_path / "sub").mkdir()
    shards, val = load_sources(DataConfig(path=str(tmp_path), val_fraction=0.5), 1, 256, 0)
    assert bytes(shards[0]) == b"A" * 100 and bytes(val) == b"B" * 100


def test_glob_reads_matching_files_in_order(tmp_path):
    for name, byte in [("x2.txt", b"2"), ("x1.txt", b"1"), ("y.log", b"!")]:
        (tmp_path / name).write_bytes(byte * 50)
    shards, val = load_sources(DataConfig(path=str(tmp_path / "x*.txt"), val_fraction=0.5), 1, 256, 0)
    assert bytes(shards[0]) == b"1" * 50 and bytes(val) == b"2" * 50


def test_non_iid_paths_give_each_island_its_source(tmp_path):
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"src{i}.txt"))
        (tmp_path / f"src{i}.txt").write_bytes(bytes([65 + i]) * (100 + 100 * i))
    shards, val = load_sources(DataConfig(paths=paths, val_fraction=0.1), 3, 256, 0, seq_len=4)
    assert [bytes(s) for s in shards] == [b"A" * 90, b"B" * 180, b"C" * 270]
    assert bytes(val) == b"A" * 10 + b"B" * 20 + b"C" * 30  # all tails, island order


def test_paths_list_becomes_a_tuple():
    cfg = DataConfig(paths=["a", "b"])
    assert cfg.paths == ("a", "b") and hash(cfg) == hash(DataConfig(paths=("a", "b")))


def test_large_files_are_checked_on_a_sample_that_includes_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FULL_CHECK_TOKENS", 1000)
    monkeypatch.setattr(data, "_CHUNK", 100)
    values = np.zeros(5000, np.uint16)
    values[-1] = 999
    path = write_tokens(tmp_path / "big.bin", values)
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(kind="tokens", path=path), 1, 500, 0)
    assert_one_line(err, "token id 999 at index 4999")


# ---------------------------------------------------------------- synthetic


def conditional_entropy(tokens: np.ndarray) -> float:
    """Empirical H(x_t | x_{t-2}, x_{t-1}) in nats."""
    ctx = tokens[:-2].astype(np.int64) * 65536 + tokens[1:-1]
    _, ctx_counts = np.unique(ctx, return_counts=True)
    _, joint_counts = np.unique(ctx * 65536 + tokens[2:], return_counts=True)
    n = len(tokens) - 2

    def h(counts: np.ndarray) -> float:
        return float(-(counts / n * np.log(counts / n)).sum())

    return h(joint_counts) - h(ctx_counts)


def test_synthetic_is_deterministic_and_learnable():
    a = synthetic_tokens(50_000, vocab_size=256, seed=5)
    assert np.array_equal(a, synthetic_tokens(50_000, 256, 5))
    assert not np.array_equal(a, synthetic_tokens(50_000, 256, 6))
    assert a.min() >= 0 and a.max() < 256 and len(np.unique(a)) <= 32
    assert conditional_entropy(a) < math.log(4) + 1e-6 < math.log(256) / 3
    assert synthetic_tokens(1000, vocab_size=5, seed=0).max() < 5


def test_synthetic_source_splits_like_a_corpus():
    cfg = DataConfig(kind="synthetic", synthetic_tokens=10_000, val_fraction=0.2, shard_block_tokens=0)
    shards, val = load_sources(cfg, 4, 64, seed=1, seq_len=16)
    assert [len(s) for s in shards] == [2000] * 4 and len(val) == 2000
    np.testing.assert_array_equal(np.concatenate([*shards, val]), synthetic_tokens(10_000, 64, 1))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (
            {"kind": "csv", "path": "x"},
            ["data.kind must be one of text, tokens, synthetic, jsonl, parquet (got 'csv')"],
        ),
        ({"kind": "tokens", "path": "x", "token_dtype": "int8"}, ["data.token_dtype must be one of uint16"]),
        ({"path": "x", "val_fraction": 0}, ["data.val_fraction must be a number in (0, 1) (got 0)"]),
        ({"path": "x", "val_fraction": 1.0}, ["data.val_fraction", "(got 1.0)"]),
        ({"path": "x", "val_fraction": "0.1"}, ["data.val_fraction", "(got '0.1')"]),
        (
            {"kind": "synthetic", "synthetic_tokens": 0},
            ["data.synthetic_tokens must be an integer >= 2 (got 0)"],
        ),
        ({"path": "x", "paths": ("a", "b")}, ["data.path and data.paths are both set"]),
        ({"kind": "text"}, ["data.path (or data.paths, one per island) must be set for data.kind = 'text'"]),
        ({"kind": "tokens"}, ["must be set for data.kind = 'tokens'"]),
        ({"kind": "synthetic", "path": "x"}, ["must be empty for data.kind = 'synthetic'"]),
        ({"paths": ("a", "")}, ["data.paths[1] must be a non-empty string (got '')"]),
        ({"paths": "a,b"}, ["data.paths must be a list of strings"]),
    ],
)
def test_config_errors_name_the_key(kwargs, fragments):
    with pytest.raises(DataError) as err:
        DataConfig(**kwargs)
    assert_one_line(err, *fragments)


def test_missing_file_empty_glob_and_empty_directory(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=missing), 1, 256, 0)
    assert_one_line(
        err,
        f"data.path {missing!r}: no such file or directory (set data.path=FILE, or data.path=stdlib: for the "
        "built-in corpus)",
    )
    pattern = str(tmp_path / "*.bin")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=pattern), 1, 256, 0)
    assert_one_line(err, f"data.path {pattern!r}: no files match this pattern")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=str(tmp_path / "empty_dir")), 1, 256, 0)
    assert_one_line(err, "empty_dir", "the directory has no files")


def test_empty_file_and_partial_token(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=str(tmp_path)), 1, 256, 0)
    assert_one_line(err, "empty.txt", "is empty")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(kind="tokens", path=str(odd)), 1, 256, 0)
    assert_one_line(err, "odd.bin", "3 bytes, not a whole number of uint16 tokens", "data.token_dtype")


def test_text_byte_beyond_a_small_vocab(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc" * 100)
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=str(tmp_path / "a.txt")), 1, vocab_size=98, seed=0)
    assert_one_line(err, "a.txt", "token id 98 at index 1", "model.vocab_size (98)")


def test_too_many_islands_for_the_data(tmp_path):
    path = write_tokens(tmp_path / "small.bin", np.arange(1000) % 50)
    cfg = DataConfig(kind="tokens", path=path, val_fraction=0.1)
    load_sources(cfg, 10, 256, 0, seq_len=64)  # 90 tokens per shard is enough for 65
    with pytest.raises(DataError) as err:
        load_sources(cfg, 20, 256, 0, seq_len=64)
    assert_one_line(
        err,
        "island 0's training shard has 45 tokens but seq_len + 1 = 65 are needed",
        "900 training tokens are too few for 20 islands",
    )
    shards, _ = load_sources(cfg, 20, 256, 0)  # without seq_len only 2 tokens are needed here...
    with pytest.raises(DataError) as err:  # ...and the stream catches it, naming the island
        BatchStream(shards[19], batch_size=2, seq_len=64, seed=0, stream_id=19)
    assert_one_line(err, "island 19's training shard has 45 tokens but seq_len + 1 = 65 are needed")


def test_validation_split_too_short(tmp_path):
    path = write_tokens(tmp_path / "c.bin", np.zeros(1000))
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(kind="tokens", path=path, val_fraction=0.01), 1, 256, 0, seq_len=64)
    assert_one_line(err, "the validation split has 10 tokens but seq_len + 1 = 65", "data.val_fraction")
    with pytest.raises(DataError) as err:
        eval_batches(np.zeros(10, np.uint16), 2, 2, 64)
    assert_one_line(err, "the validation split has 10 tokens but seq_len + 1 = 65")


def test_non_iid_errors(tmp_path):
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    (tmp_path / "a.txt").write_bytes(b"a" * 1000)
    (tmp_path / "b.txt").write_bytes(b"b" * 20)
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(paths=(a, b)), 3, 256, 0)
    assert_one_line(err, "data.paths has 2 entries but there are 3 islands")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(paths=(a, b)), 2, 256, 0, seq_len=32)
    assert_one_line(err, f"data.paths[1] {b!r}: island 1's training data has 19 tokens", "33 are needed")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(paths=(a, str(tmp_path / "c.txt"))), 2, 256, 0)
    assert_one_line(err, "data.paths[1]", "no such file or directory")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1 (got 0)"),
        ({"seq_len": 0}, "model.seq_len must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0 (got -1)"),
        ({"cursor": -2}, "cursor must be an integer >= 0 (got -2)"),
        ({"cursor": 1.5}, "cursor must be an integer"),
    ],
)
def test_stream_argument_errors(kwargs, fragment):
    args = {"batch_size": 2, "seq_len": 4, "seed": 0, "stream_id": 0, **kwargs}
    with pytest.raises(DataError) as err:
        BatchStream(np.arange(100), **args)
    assert_one_line(err, fragment)


# ---------------------------------------------------------------- built-in corpus (stdlib:)


def rel(path: str) -> str:
    return os.path.relpath(path, STDLIB).replace(os.sep, "/")


def test_stdlib_is_a_deterministic_list_of_library_sources_without_tests():
    files = stdlib_files("", "data.path 'stdlib:'")
    assert files == stdlib_files("", "x")  # deterministic
    names = [rel(f) for f in files]
    assert len(files) > 100 and names == sorted(names)
    assert {"os.py", "json/decoder.py", "email/message.py"} <= set(names)
    for name in names:
        parts = name.split("/")
        assert name.endswith(".py") and not name.startswith(".."), name
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts), name
        assert not parts[-1].startswith("test_") and parts[0] not in {"__hello__.py", "__phello__"}, name
    assert all(os.path.getsize(f) > 0 for f in files)  # empty __init__.py files add nothing


@pytest.mark.parametrize("names", ["json,email", "email, json", "json,email,json"])
def test_stdlib_names_select_package_families(names):
    files = stdlib_files(names, "x")
    tops = {rel(f).split("/")[0] for f in files}
    assert tops == {"email", "json"}
    assert files == stdlib_files("email,json", "x")  # the order of the names does not matter
    cfg = DataConfig(path=f"stdlib:{names}", val_fraction=0.1, shard_block_tokens=0)
    shards, val = load_sources(cfg, 1, 256, 0)
    corpus = b"".join(open(f, "rb").read() for f in files)
    assert bytes(shards[0]) + bytes(val) == corpus and shards[0].dtype == np.uint8


def test_stdlib_module_and_whole_library_load():
    shards, val = load_sources(DataConfig(path="stdlib:os"), 1, 256, 0)
    with open(os.path.join(STDLIB, "os.py"), "rb") as f:
        assert bytes(shards[0]) + bytes(val) == f.read()


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"path": "stdlib:jsn"}, ["data.path 'stdlib:jsn': no standard-library package or module 'jsn'", "'json'?"]),
        (
            {"paths": ("stdlib:json", "stdlib:emial,http")},
            ["data.paths[1] 'stdlib:emial,http'", "'emial'", "did you mean 'email'?"],
        ),
        ({"path": "stdlib:json,zzzqqq"}, ["module 'zzzqqq' in "]),
        ({"path": "stdlib:test"}, ["'test' is test code"]),
        ({"path": "stdlib:email.mime"}, ["'email.mime': name top-level packages or modules only (e.g. 'email')"]),
        ({"path": "stdlib:json,,email"}, ["an empty name in the list"]),
        ({"path": "stdlib:site-packages"}, ["no standard-library package or module 'site-packages'"]),
    ],
)
def test_stdlib_bad_names_are_one_line_naming_the_key(kwargs, fragments):
    n = len(kwargs.get("paths", ())) or 1
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(**kwargs), n, 256, 0)
    assert_one_line(err, *fragments)


def test_stdlib_is_text_only():
    with pytest.raises(DataError) as err:
        DataConfig(kind="tokens", paths=("a.bin", "stdlib:json"))
    assert_one_line(err, "data.paths[1] 'stdlib:json' is text: the built-in corpus needs data.kind = 'text'")


@pytest.mark.parametrize(
    ("non_iid", "fragment"),
    [
        (False, "no such file or directory (set data.path=FILE, or data.path=stdlib: for the built-in corpus)"),
        (True, "no such file or directory (fix data.paths[1]: a FILE, or 'stdlib:NAME,...' for part of the built-in"),
    ],
)
def test_missing_path_names_the_override(tmp_path, non_iid, fragment):
    missing = str(tmp_path / "x.txt")
    cfg = DataConfig(paths=("stdlib:json", missing)) if non_iid else DataConfig(path=missing)
    with pytest.raises(DataError) as err:
        load_sources(cfg, 2 if non_iid else 1, 256, 0)
    assert_one_line(err, repr(missing), fragment)


# ---------------------------------------------------------------- one island's shard (only=)


def make_dir_source(root, name: str, sizes: list[int]) -> str:
    d = root / name
    d.mkdir()
    for j, size in enumerate(sizes):
        (d / f"part{j}.txt").write_bytes(((np.arange(size) * (j + 3) + len(name)) % 251).astype(np.uint8).tobytes())
    return str(d)


def mixed_sources(tmp_path) -> DataConfig:
    """A directory whose validation tail spans files, a single (memmapped) file, and the built-in corpus."""
    single = tmp_path / "one.txt"
    single.write_bytes(b"single file " * 300)
    return DataConfig(paths=(make_dir_source(tmp_path, "d", [3000, 40, 25]), str(single), "stdlib:json"))


ONLY_CASES = {
    "iid-stdlib-blocks": (3, lambda tmp: DataConfig(path="stdlib:json", shard_block_tokens=512)),
    "iid-stdlib-contiguous": (3, lambda tmp: DataConfig(path="stdlib:json", shard_block_tokens=0)),
    "iid-tokens-file": (
        4,
        lambda tmp: DataConfig(kind="tokens", path=write_tokens(tmp / "c.bin", np.arange(20_000) % 256)),
    ),
    "iid-synthetic": (2, lambda tmp: DataConfig(kind="synthetic", synthetic_tokens=5000, shard_block_tokens=64)),
    "non-iid-stdlib": (3, lambda tmp: DataConfig(paths=("stdlib:json", "stdlib:email", "stdlib:http,html"))),
    "non-iid-mixed": (3, mixed_sources),
}


@pytest.mark.parametrize("case", sorted(ONLY_CASES))
def test_only_builds_one_island_bit_identical_to_the_full_split(tmp_path, case):
    n_islands, make = ONLY_CASES[case]
    cfg = make(tmp_path)
    full, full_val = load_sources(cfg, n_islands, 256, seed=7, seq_len=8)
    for i in range(n_islands):
        shards, val = load_sources(cfg, n_islands, 256, seed=7, seq_len=8, only={i})
        np.testing.assert_array_equal(shards[i], full[i])
        assert shards[i].dtype == full[i].dtype and len(shards[i]) > 0
        np.testing.assert_array_equal(val, full_val)
        assert all(len(s) == 0 and s.dtype == full[i].dtype for j, s in enumerate(shards) if j != i)
    none, none_val = load_sources(cfg, n_islands, 256, seed=7, seq_len=8, only=set())  # the coordinator's call
    assert all(len(s) == 0 for s in none)
    np.testing.assert_array_equal(none_val, full_val)


def test_only_reads_other_islands_sources_just_for_their_tails(tmp_path, monkeypatch):
    d0 = make_dir_source(tmp_path, "a", [500, 500])
    d1 = make_dir_source(tmp_path, "b", [2000, 30])  # 5 % of 2030 = 101 tokens: the tail reaches into part0
    d2 = make_dir_source(tmp_path, "c", [2000, 200])  # the tail (110) lies in part1: part0 is never opened
    opened: list[str] = []
    real_open = open

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(data, "open", spy, raising=False)
    cfg = DataConfig(paths=(d0, d1, d2))
    shards, val = load_sources(cfg, 3, 256, 0, seq_len=4, only={0})
    assert os.path.join(d2, "part0.txt") not in opened
    assert {os.path.join(d0, "part0.txt"), os.path.join(d0, "part1.txt"), os.path.join(d1, "part0.txt")} <= set(opened)
    assert len(shards[0]) == 950 and len(val) == 50 + 101 + 110


def test_only_still_checks_every_island_and_its_index(tmp_path):
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_bytes(b"x" * 1000)
    small.write_bytes(b"y" * 20)
    with pytest.raises(DataError) as err:  # island 1 is too small even when island 0 loads alone
        load_sources(DataConfig(paths=(str(big), str(small))), 2, 256, 0, seq_len=32, only={0})
    assert_one_line(err, "island 1's training data has 19 tokens")
    with pytest.raises(DataError) as err:
        load_sources(DataConfig(path=str(big)), 2, 256, 0, only={2})
    assert_one_line(err, "only must hold island indices below n_islands = 2 (got 2)")
