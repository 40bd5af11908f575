"""An LMDB environment of a format this version cannot use is refused in one wording, whichever
path finds it: a writer's open, a read-only open, or the first write after a read-only open."""

from __future__ import annotations

import lmdb
import pytest

from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_tables import FORMAT
from tests.backends.test_lmdb_failure_paths import as_previous_version_left_it
from tiered_kv.errors import BackendUnavailable, ConfigError

MiB = 1 << 20


def set_format(env: lmdb.Environment, found: int) -> None:
    with env.begin(write=True) as txn:
        txn.put(b"format", found.to_bytes(8, "little"), db=env.open_db(b"info", txn=txn))


def test_every_path_refuses_a_newer_format_in_the_same_words(tmp_path):
    path = tmp_path / "db"
    LmdbBackend(path, capacity=MiB).close()
    with lmdb.open(str(path), max_dbs=16) as env:
        set_format(env, 99)
    with pytest.raises(ConfigError) as writer:
        LmdbBackend(path, capacity=MiB)
    with pytest.raises(ConfigError) as reader:
        LmdbBackend.open_read_only(f"lmdb://{path}")
    said = f"lmdb store at {path} has format 99, this version reads {FORMAT}"
    assert str(writer.value) == str(reader.value) == said

    # a read-only open of the previous format, then a newer version's writer moves it on
    with lmdb.open(str(path), max_dbs=16) as env:
        set_format(env, FORMAT)
    as_previous_version_left_it(path)
    tool = LmdbBackend.open_read_only(f"lmdb://{path}")
    try:
        set_format(tool.env, 99)
        with pytest.raises(BackendUnavailable) as first_write:
            tool.put_many([(b"k" * 16, b"v")])
        assert str(first_write.value) == said.replace("reads", "writes")
    finally:
        tool.close()


@pytest.mark.parametrize("opener", ["engine", "tool"])
def test_regression_another_programs_lmdb_environment_was_taken_for_a_new_store_and_written_into(tmp_path, opener):
    """``tiered-kv verify --fix other`` (and an engine pointed at the wrong directory) created
    our tables inside another program's LMDB environment: its main table holds data of its own,
    so it is refused, and left as it was."""
    path = tmp_path / "other"
    with lmdb.open(str(path), max_dbs=4) as env:
        with env.begin(write=True) as txn:
            txn.put(b"their-key", b"their value")
            txn.put(b"x", b"y", db=env.open_db(b"their-table", txn=txn))
    before = (path / "data.mdb").read_bytes()
    with pytest.raises(ConfigError, match="not a tiered-kv store"):
        if opener == "engine":
            LmdbBackend(path, capacity=MiB)
        else:
            LmdbBackend.open_read_only(f"lmdb://{path}")
    assert (path / "data.mdb").read_bytes().rstrip(b"\0") == before.rstrip(b"\0")  # (the lock file changes)
    with lmdb.open(str(path), max_dbs=4, readonly=True) as env, env.begin() as txn:
        assert [bytes(k) for k in txn.cursor().iternext(values=False)] == [b"their-key", b"their-table"]


def test_a_store_of_every_earlier_table_set_is_not_taken_for_another_programs():
    """(Every version kept its data in named tables whose names are among today's.)"""
    from storage_backends.lmdb_tables import Tables

    assert {b"blocks", b"meta", b"lru", b"info"} <= set(Tables.NAMES)
