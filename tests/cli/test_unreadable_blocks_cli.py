"""An LMDB store whose segment file was cut short (a crash, a disk that filled, a bad copy): its
index still lists the blocks that lay past the new end, but their values cannot be read.
``copy`` reports each such block as unreadable and exits 1 (as for corrupt blocks), never as
"gone since the scan"; ``show`` says the block is unreadable, not that it vanished. Real LMDB
stores under tmp_path, the real CLI."""

from __future__ import annotations

import os
from pathlib import Path

from storage_backends.file_dir import FileBackend
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_segments import unpack_place
from tests.cli.conftest import cli
from tests.store.helpers import NS, keys_for, make_store, payloads

N = 8


def cut_store(tmp_path: Path) -> tuple[str, list[bytes], list[bytes]]:
    """A store of N blocks, each in a segment file, with the file holding the last one cut
    halfway through it; (its URL, every block's storage key, the keys of the blocks cut off)."""
    keys = keys_for(N)
    disk = {"capacity": "64MiB", "options": {"segment_min": "1KiB"}}  # every block in a segment
    with make_store(tmp_path, disk=disk) as store:
        store.save(keys, payloads(store, N))
        store.flush()
        url = store.tier("disk").backend.url.split("?", 1)[0]
    stored = [NS.digest() + k for k in keys]
    backend = LmdbBackend(url.split("://", 1)[1], capacity="64MiB", record_access=False)
    try:
        with backend.env.begin() as txn:
            places = {k: unpack_place(txn.get(k, db=backend._db.tables.places)) for k in stored}
        last = max(places.values(), key=lambda p: p.offset + p.length)
        segment = backend.values.files.files()[last.segment]
    finally:
        backend.close()
    end = last.offset + last.length // 2
    os.truncate(segment, end)
    cut = [k for k, p in places.items() if p.segment == last.segment and p.offset + p.length > end]
    return url, stored, cut


def test_regression_copy_from_a_cut_segment_reported_no_lost_blocks_and_exited_0(tmp_path):
    """``copied 7 of 8 blocks``, ``corrupt_skipped: []``, exit 0 and not a word about the block
    its segment no longer holds: the copy took an unreadable value for one deleted meanwhile."""
    url, stored, cut = cut_store(tmp_path)
    assert cut, "the cut reaches at least the last block"

    report = cli("copy", url, f"file://{tmp_path}/export", "--json")

    assert report.code == 1, "copy exits 1 when it skips blocks"
    doc = report.json()
    assert doc["copied"] == N - len(cut) and doc["blocks"] == N
    assert doc["unreadable_skipped"] == [k.hex() for k in sorted(cut)]
    assert all("cut short" in why for why in doc["unreadable_details"].values())
    target = FileBackend(f"{tmp_path}/export", create=False)
    try:
        assert target.contains_many(stored) == [k not in cut for k in stored]
    finally:
        target.close()

    text = cli("copy", url, f"file://{tmp_path}/again")
    assert text.code == 1 and "Traceback" not in text.out + text.err
    lines = [line for line in text.out.splitlines() if line.startswith("skipped unreadable block")]
    assert sorted(line.split()[3].rstrip(":") for line in lines) == [k.hex() for k in sorted(cut)]


def test_regression_show_of_a_block_its_segment_no_longer_holds_said_it_vanished(tmp_path):
    url, _, cut = cut_store(tmp_path)

    text = cli("show", url, cut[0].hex())

    assert text.code == 1 and "vanished" not in text.out + text.err
    [line] = text.out.splitlines()
    assert cut[0].hex() in line and "unreadable" in line and "cut short" in line
    doc = cli("show", url, cut[0].hex(), "--json")
    assert doc.code == 1
    assert (doc.json()["valid"], doc.json()["reason"]) == (False, "unreadable")


def test_a_block_deleted_since_the_scan_is_still_no_problem_of_the_copy(tmp_path, monkeypatch):
    """The other reason a value reads as absent: the store no longer lists it. Not reported."""
    url, stored, cut = cut_store(tmp_path)
    gone = [k for k in stored if k not in cut][0]
    real_scan = LmdbBackend.scan

    def scan_then_delete(self, prefix=b""):  # another process deletes it right after the scan
        keys = list(real_scan(self, prefix))
        self.delete_many([gone])
        return iter(keys)

    monkeypatch.setattr(LmdbBackend, "scan", scan_then_delete)
    doc = cli("copy", url, f"file://{tmp_path}/export", "--json").json()
    assert gone.hex() not in doc["unreadable_skipped"] + doc["corrupt_skipped"]
    assert doc["unreadable_skipped"] == [k.hex() for k in sorted(cut)]
