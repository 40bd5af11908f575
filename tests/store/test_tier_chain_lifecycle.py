"""A chain of lower tiers opened, flushed and given up as one: a store that cannot start closes
every tier it opened and stops every thread it started, whichever part failed; a flush makes
every tier durable even when an earlier one's fsync failed; a tier whose policy is ``off`` is
never written, not even with the store's restore-cost estimates."""

from __future__ import annotations

import errno
import os
import sys
import threading

import pytest

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.errors import BackendUnavailable, ConfigError


def archive(tmp_path) -> list[dict]:
    return [{"name": "archive", "url": f"file://{tmp_path}/archive"}]


def started_since(before: set[int]) -> list[str]:
    return [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def test_regression_a_store_refused_for_a_missing_crypto_library_kept_its_tiers_open(tmp_path, monkeypatch):
    # the secret needs the cryptography library: refused when the first tier is made, after every
    # medium of the chain was opened; the LMDB environment stayed open in the process, so the
    # store could not be opened again there ("already open in this process")
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)  # not installed
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="cryptography"):
        make_store(tmp_path, tiers=archive(tmp_path), encryption_secret="s" * 32)
    assert started_since(before) == []
    monkeypatch.delitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead")
    with make_store(tmp_path, tiers=archive(tmp_path)) as store:  # the same directories, at once
        assert [t.name for t in store.tiers] == ["disk", "archive"]
        assert store.lookup(keys_for(1)) == 0


def test_regression_a_host_slab_that_could_not_be_allocated_left_the_transfer_threads_running(
        tmp_path, monkeypatch):
    # torch's allocator refusing a host.capacity the machine cannot give (what it raises then)
    def refused(*_args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("storage_backends.host.new_slab", refused)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="allocate"):
        make_store(tmp_path, tiers=archive(tmp_path))
    assert started_since(before) == [], "the transfer and copy threads of a store that never started"


class FirstSegmentFsyncFails:
    """``os.fdatasync`` of a disk whose writeback of one segment file under ``failing`` fails
    once (EIO); every call is recorded by file path."""

    def __init__(self, monkeypatch, failing: str) -> None:
        self.real, self.failing, self.armed = os.fdatasync, failing, False
        self.files: list[str] = []
        monkeypatch.setattr(os, "fdatasync", self)

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        self.files.append(path)
        if self.armed and path.startswith(self.failing) and path.endswith(".seg"):
            self.armed = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real(fd)


def test_regression_a_failed_flush_of_the_disk_tier_left_the_next_lmdb_tier_unflushed(tmp_path, monkeypatch):
    segments = {"options": {"segment_min": 1024}}  # 16 KiB blocks go to segment files
    tiers = [{"name": "archive", "url": f"lmdb://{tmp_path}/archive", **segments}]
    fsync = FirstSegmentFsyncFails(monkeypatch, failing=f"{tmp_path}/lmdb/")
    with make_store(tmp_path, disk=segments, tiers=tiers) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        assert store.pool.drain(30)
        assert store.tier("archive").contains(keys) == [True, True]
        fsync.armed, fsync.files[:] = True, []

        with pytest.raises(BackendUnavailable):  # the disk's failure is still told
            store.flush()

        assert any(f.startswith(f"{tmp_path}/archive/") for f in fsync.files), (
            "flush stopped at the disk tier: the archive's blocks were never made durable")
        store.flush()  # and the next flush finds nothing failing


def test_regression_a_store_reading_an_off_tier_rewrote_that_tiers_namespace_record(tmp_path):
    # ``off``: a tier filled elsewhere, read only; the reader's restore-cost estimates went into
    # its namespace record at every flush, close and minute
    from tiered_kv.store.records import namespace_key

    golden = [{"name": "golden", "url": f"file://{tmp_path}/golden"}]
    keys = keys_for(2)
    with make_store(tmp_path, disk=None, tiers=golden) as filler:
        data = payloads(filler, 2)
        filler.save(keys, data)
        filler.flush()
        tier = filler.tier("golden")
        record = tier.backend.get_many([namespace_key(tier.ns)])[0]
    with make_store(tmp_path, tiers=[{**golden[0], "policy": "off"}]) as reader:
        ok, _ = load(reader, keys)  # served by the tier it reads
        assert ok == [True, True]
        reader.costs.observe_restore("golden", 2 * reader.block_nbytes, 0.01)  # what its worker observes
        reader.flush()
    with make_store(tmp_path, disk=None, tiers=golden) as filler:
        tier = filler.tier("golden")
        assert tier.backend.get_many([namespace_key(tier.ns)])[0] == record, "written by a reader"
        assert filler.costs.empty()


def test_regression_a_medium_that_failed_to_close_left_the_others_open(tmp_path):
    from tests.store.helpers import make_store

    store = make_store(tmp_path)
    disk, closed = store.tier("disk").backend, []
    close_host = store.host.close

    def broken() -> None:
        raise OSError("EIO closing the environment")

    disk.close = broken
    store.host.close = lambda: (closed.append("host"), close_host())
    store.close()
    assert closed == ["host"]
