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
