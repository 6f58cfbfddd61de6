"""Island data: sources, IID shards and non-IID paths, validation split, deterministic resumable batches,
synthetic corpus, and every user error. Each test writes its own small files in tmp_path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from islands import data
from islands.data import BatchStream, DataConfig, DataError, eval_batches, load_sources, synthetic_tokens


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
    shards, val = load_sources(DataConfig(path=str(tmp_path / "a.txt"), val_fraction=0.25, shard_block_tokens=0), 2, 256, 0)
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
        ({"kind": "csv", "path": "x"}, ["data.kind must be one of text, tokens, synthetic (got 'csv')"]),
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
    assert_one_line(err, f"data.path {missing!r}: no such file or directory")
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
