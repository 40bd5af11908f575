"""The maintenance commands run by an operator in a second process against the LMDB store an
engine's TieredStore serves from: the engine is never served a wrong block nor handed an error
for what the tool did, and the tool never removes a block the engine stored after the tool looked
(real LMDB under tmp_path; the tool, or the engine, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.store.helpers import keys_for, load, load_staged, make_store, payloads, rewrite_stored_blocks
from tiered_kv.admin.opening import open_tier
from tiered_kv.admin.verify import verify_tier

ROOT = Path(__file__).resolve().parents[2]
TOOL = "import sys; from tiered_kv.cli import main; sys.exit(main(sys.argv[1:]))"


def other_process(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run by a Python process of its own, in the repository."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


ENGINE_RECOMPUTES = textwrap.dedent("""
    # the engine's step: it loads block 1, finds it corrupt (a counted miss; the block is removed),
    # recomputes it and stores it again, flushed
    import sys
    from pathlib import Path
    from tests.store.helpers import keys_for, load_staged, make_store, payloads
    with make_store(Path(sys.argv[1])) as store:
        key = keys_for(2)[1:]
        assert load_staged(store, key)[0] == [False]
        assert store.metrics.tiers["disk"].misses["corrupt"] == 1
        store.save(key, payloads(store, 2)[1:])
        assert store.flush(30) and store.tier("disk").contains(key) == [True]
""")


def test_regression_verify_fix_deleted_the_good_block_an_engine_stored_after_the_scan_found_it_corrupt(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path) as store:
        data = payloads(store, 3)
        store.save(keys, data)
        assert store.flush(30)
        target = store.tier("disk").ns + keys[1]

    def flip(key, value):
        return None if key != target else value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:]

    assert rewrite_stored_blocks(tmp_path / "lmdb", flip) == 1
    tier = open_tier(f"lmdb://{tmp_path}/lmdb")
    steps = []

    def engine_steps_once_every_block_was_checked(done, total):
        steps.append(other_process(ENGINE_RECOMPUTES, str(tmp_path)))

    try:
        report = verify_tier(tier, fix=True, progress=engine_steps_once_every_block_was_checked)
    finally:
        tier.close()
    assert len(steps) == 1  # (one batch: after it, the fix)
    assert report["problems"]["corrupt"] == 1 and report["ok"], report
    with make_store(tmp_path) as store:
        assert store.tier("disk").contains(keys) == [True] * 3, "the engine's recomputed block was deleted"
        ok, outs = load(store, keys)
        assert ok == [True] * 3 and all(torch.equal(o, d) for o, d in zip(outs, data))


def test_verify_fix_still_removes_a_corrupt_block_nobody_replaced(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 3))
        assert store.flush(30)
        target = store.tier("disk").ns + keys[1]
    assert rewrite_stored_blocks(tmp_path / "lmdb", lambda k, v: None if k != target else v[:-1] + b"\0") == 1
    tier = open_tier(f"lmdb://{tmp_path}/lmdb")
    try:
        report = verify_tier(tier, fix=True)
    finally:
        tier.close()
    assert report["problems"]["corrupt"] == 1 and report["ok"] and report["actions"][0].startswith("removed 1 of 1")
    with make_store(tmp_path) as store:
        assert store.tier("disk").contains(keys) == [True, False, True]


@pytest.mark.parametrize("values", ["in_lmdb_pages", "in_segment_files"])
def test_blocks_a_second_process_evicts_after_the_engine_looked_them_up_and_leased_them_are_counted_misses(
        tmp_path, values):
    """The engine's lookup promised the blocks and its loads leased them (pins are its own
    process's); ``tiered-kv evict`` in another process removes them before the loads read: every
    block is a counted ``absent`` miss on every load path, nothing raised, nothing leaked."""
    keys = keys_for(4)
    segment_min = "1MiB" if values == "in_lmdb_pages" else "1KiB"
    with make_store(tmp_path, disk={"url": f"lmdb://{tmp_path}/lmdb?segment_min={segment_min}"}) as store:
        data = payloads(store, 4)
        store.save(keys, data)
        assert store.flush(30)
        store.host.delete_many(keys)  # the blocks come from disk
        assert store.lookup(keys) == 4
        staged, layered = store.prepare_load(keys), store.prepare_load(keys)
        report = json.loads(other_process(TOOL, "evict", f"lmdb://{tmp_path}/lmdb", "--older-than", "0s",
                                          "--json").stdout)
        assert report["tiers"][0]["evicted_blocks"] == 4
        try:
            store.load(staged).wait(30)
            store.loader.load(layered, layered=True).wait(30)
        finally:
            store.release(staged)
            store.release(layered)
        for plan in (staged, layered):
            assert plan.ok == [False] * 4 and plan.reasons == ["absent"] * 4
        assert layered.progress.over == [True] * 4
        ok, _ = load(store, keys)  # the synchronous path, straight into the caller's blocks
        assert ok == [False] * 4
        assert store.metrics.tiers["disk"].misses == {"absent": 12}
        assert store.lookup(keys) == 0 and store.host.stats().extra["leased"] == 0
        store.save(keys, data)  # recomputed and stored again: served as before
        assert store.flush(30)
        store.host.delete_many(keys)
        ok, outs = load_staged(store, keys)
        assert ok == [True] * 4 and all(torch.equal(o, d) for o, d in zip(outs, data))


ENGINE_OF_THE_SALTED_NAMESPACE = textwrap.dedent("""
    # a serving engine of the salted namespace: its first write rewrites the older version's
    # record without the salt, its close writes the restore estimates it learned into it
    import dataclasses, sys
    from pathlib import Path
    from tests.store.helpers import NS, keys_for, make_store, payloads
    from tests.store.test_restore_costs import observe
    salted = dataclasses.replace(NS, cache_salt=sys.argv[2])
    with make_store(Path(sys.argv[1]), ns=salted) as store:
        store.save(keys_for(6, salted)[4:], payloads(store, 2))
        observe(store)
""")


def test_regression_verify_fix_put_back_the_salted_record_it_had_scanned_over_the_one_an_engine_wrote_since(
        tmp_path):
    # verify read an older version's record (the salt in it) in its scan; an engine then rewrote
    # the record without the salt and with its restore estimates; the fix wrote the record as the
    # scan had read it, less the salt: the engine's estimates were gone
    from tests.cli.test_salted_records import SALT, SALTED, legacy_record, salted_store
    from tiered_kv.store.records import COSTS_MEMBER, namespace_key

    salted_store(tmp_path)
    legacy_record(tmp_path / "lmdb")
    tier = open_tier(f"lmdb://{tmp_path}/lmdb")
    engines = []

    def an_engine_serves_once_every_entry_was_checked(done, total):
        engines.append(other_process(ENGINE_OF_THE_SALTED_NAMESPACE, str(tmp_path), SALT))

    try:
        report = verify_tier(tier, fix=True, progress=an_engine_serves_once_every_entry_was_checked)
        (record,) = tier.backend.get_many([namespace_key(SALTED.digest())])
    finally:
        tier.close()
    assert len(engines) == 1 and report["ok"], report
    assert SALT.encode() not in bytes(record)
    assert COSTS_MEMBER in json.loads(bytes(record)), "the engine's estimates were written over"
