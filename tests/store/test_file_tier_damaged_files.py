"""A file:// disk tier whose files were damaged behind the store's back: one holding another key's
honest block (copied over it: a valid block that lies about which key it is), one cut in half,
one of zero length (a machine crash after an unsynced rename), one shorter than a header. The
file medium hands back whatever bytes are there; the codec's header check (key, namespace,
lengths) makes each a counted ``corrupt`` miss, and the tier drops it. Real files under tmp_path."""

from __future__ import annotations

import shutil

import torch

from storage_backends.file_layout import file_of
from tests.store.helpers import keys_for, load, make_store, payloads


def test_a_file_holding_another_keys_block_or_cut_short_is_a_corrupt_miss_never_served(tmp_path):
    root = tmp_path / "files"
    keys = keys_for(6)
    with make_store(tmp_path, disk={"url": f"file://{root}"}) as store:
        data = payloads(store, 6)
        store.save(keys, data)
        store.flush()
        ns = store.tier("disk").ns
    files = [file_of(root, ns + k) for k in keys]
    shutil.copyfile(files[0], files[1])  # key 0's block under key 1's name
    files[2].write_bytes(files[2].read_bytes()[: files[2].stat().st_size // 2])
    files[3].write_bytes(b"")
    files[4].write_bytes(files[4].read_bytes()[:10])
    with make_store(tmp_path, disk={"url": f"file://{root}"}) as store:
        ok, outs = load(store, keys)
        assert ok == [True, False, False, False, False, True]
        assert torch.equal(outs[0], data[0]) and torch.equal(outs[5], data[5])
        assert not torch.equal(outs[1], data[0]), "key 0's block was served as key 1's"
        assert store.metrics.tiers["disk"].misses["corrupt"] == 4
    assert [f.exists() for f in files] == [True, False, False, False, False, True]
