"""``tiered-kv copy`` run by an operator while an engine serves from the stores it copies between
(its LMDB disk tier warming its Redis, or into another engine's store): a block the engine
withdraws meanwhile is never re-created, the destination engine's namespace record (its restore
estimates) is never replaced, and a block is never stored under a namespace record that
contradicts it. Real LMDB under tmp_path, a real redis-server, the engine in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli
from tests.cli.test_lying_blocks_cli import build
from tests.store.helpers import NS, keys_for, load, make_store, payloads
from tests.store.test_restore_costs import observe
from tiered_kv.admin.evict_copy import copy
from tiered_kv.admin.opening import open_tier
from tiered_kv.store.records import COSTS_MEMBER, namespace_key

ROOT = Path(__file__).resolve().parents[2]

ENGINE_WITHDRAWS = textwrap.dedent("""
    # the engine learns block 1 was computed over a failed load: it withdraws it from every tier
    # (its disk, the source, and its Redis, the destination); with "recompute" it then stores the
    # KV it recomputed (other values) in every tier
    import sys
    from pathlib import Path
    from tests.store.helpers import keys_for, make_store, payloads
    with make_store(Path(sys.argv[1]), remote_url=sys.argv[2]) as store:
        key = keys_for(3)[1:2]
        store.invalidate(key).result(30)
        if sys.argv[3] == "recompute":
            store.save(key, payloads(store, 1, seed=7))
        assert store.flush(30)
""")


def engine(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", ENGINE_WITHDRAWS, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def lmdb(path) -> LmdbBackend:
    return LmdbBackend(path, capacity=1 << 40, record_access=False)


@pytest.mark.parametrize("then", ["withdraw", "recompute"])
def test_regression_copy_re_created_in_the_destination_a_block_the_engine_withdrew_while_it_was_copied(
        tmp_path, redis_url, then):
    # the engine's Redis came back empty; the operator warms it from the engine's disk. The copy
    # read block 1, the engine withdrew it from both tiers, then the copy put it into Redis: a
    # withdrawn (wrong) block was served from Redis, over the one the engine had recomputed too
    keys = keys_for(3)
    with make_store(tmp_path) as store:
        data = payloads(store, 3)
        store.save(keys, data)
        assert store.flush(30)
        recomputed = payloads(store, 1, seed=7)[0]
    src, dst = open_tier(f"lmdb://{tmp_path}/lmdb", name="source"), open_tier(redis_url, name="destination")
    read = src.backend.get_many
    engines = []

    def read_then_the_engine_withdraws(batch):
        values = read(batch)
        if any(len(k) == 32 for k in batch) and not engines:  # the blocks' first read
            engines.append(engine(str(tmp_path), redis_url, then))
        return values

    src.backend.get_many = read_then_the_engine_withdraws
    try:
        report = copy(src, dst)
    finally:
        src.close()
        dst.close()
    assert len(engines) == 1
    with make_store(tmp_path, disk=None, remote_url=redis_url) as served:  # Redis alone serves
        ok, outs = load(served, keys)
    assert ok[0] and ok[2] and torch.equal(outs[0], data[0]) and torch.equal(outs[2], data[2])
    assert not ok[1] or torch.equal(outs[1], recomputed), "Redis served the block the engine withdrew"
    assert report["changed_at_source"] == [(NS.digest() + keys[1]).hex()] and report["copied"] == 2


def engine_store(path: Path, first: int, n: int, *, estimates: bool) -> str:
    with make_store(path) as store:
        store.save(keys_for(first + n)[first:], payloads(store, n, seed=first))
        if estimates:
            observe(store)
        assert store.flush(30)
    return f"lmdb://{path}/lmdb"


def record(url: str) -> dict:
    with lmdb(url.split("://", 1)[1]) as backend:
        return json.loads(bytes(backend.get_many([namespace_key(NS.digest())])[0]))


def test_regression_copy_into_an_engines_store_replaced_its_namespace_record_and_so_its_restore_estimates(
        tmp_path):
    engine_url = engine_store(tmp_path / "engine", 0, 4, estimates=True)
    source_url = engine_store(tmp_path / "source", 4, 4, estimates=False)
    own = record(engine_url)
    assert COSTS_MEMBER in own and COSTS_MEMBER not in record(source_url)

    result = cli("copy", source_url, engine_url, "--json")

    assert result.code == 0, result.out + result.err
    assert record(engine_url) == own, "the engine's record (its estimates) was written over"
    report = result.json()
    assert (report["copied"], report["namespace_records"], report["namespace_records_kept"]) == (4, 0, 1)
    with make_store(tmp_path / "engine") as store:  # a restarted engine starts from its own figures
        assert store.costs.restores_observed() == {"disk": 3, "host": 3}
        assert store.lookup(keys_for(8)) == 8


def test_regression_copy_put_a_source_record_that_does_not_decode_over_the_destinations_good_one(tmp_path):
    engine_url = engine_store(tmp_path / "engine", 0, 4, estimates=False)
    source_url = engine_store(tmp_path / "source", 4, 4, estimates=False)
    with lmdb(tmp_path / "source" / "lmdb") as backend:
        backend.put_many([(namespace_key(NS.digest()), b'{"model_id": "test-llama"')])  # cut short
    own = record(engine_url)

    result = cli("copy", source_url, engine_url, "--json")

    report = result.json()
    assert report["copied"] == 4 and report["namespace_records"] == 0
    assert list(report["broken_namespace_records"]) == [NS.digest().hex()]
    [tier] = cli("inspect", engine_url, "--json").json()["tiers"]
    assert tier["broken_namespace_records"] == {}, "the destination's good record was replaced by a broken one"
    assert record(engine_url) == own and tier["namespaces"][NS.digest().hex()]["model_id"] == NS.model_id


def test_a_source_record_that_does_not_decode_is_not_carried_into_a_new_store(tmp_path):
    source_url = engine_store(tmp_path / "source", 0, 4, estimates=False)
    with lmdb(tmp_path / "source" / "lmdb") as backend:
        backend.put_many([(namespace_key(NS.digest()), b"not json")])
    result = cli("copy", source_url, f"lmdb://{tmp_path}/new", "--json")
    assert result.json()["copied"] == 4 and result.json()["namespace_records"] == 0
    text = cli("copy", source_url, f"lmdb://{tmp_path}/again")  # and in words, one line naming it
    assert f"skipped source namespace record {NS.digest().hex()}:" in text.out, text.out + text.err
    [tier] = cli("inspect", f"lmdb://{tmp_path}/new", "--json").json()["tiers"]
    assert (tier["blocks"], tier["namespace_records"], tier["broken_namespace_records"]) == (4, 0, {})


def test_regression_copy_stored_a_block_of_another_shape_under_the_destinations_record_when_the_source_had_none(
        tmp_path):
    # the source kept no record for the namespace, so its blocks were checked with their size
    # bounded only: a block of half the layers landed beside the destination's record, exit 0
    source_url, keys = build(tmp_path / "source", "lmdb", {1: "fewer_layers"}, record=False)
    engine_url = engine_store(tmp_path / "engine", 8, 2, estimates=False)

    result = cli("copy", source_url, engine_url, "--json")

    assert result.code == 1, result.out + result.err
    report = result.json()
    assert report["corrupt_skipped"] == [keys[1].hex()] and report["copied"] == 3
    with lmdb(tmp_path / "engine" / "lmdb") as backend:
        assert backend.contains_many(keys) == [True, False, True, True]
    assert cli("verify", engine_url).code == 0


def test_a_destination_record_an_older_version_wrote_with_the_salt_keeps_its_estimates_and_loses_the_salt(
        tmp_path):
    from tests.cli.test_salted_records import SALT, SALTED, salted_store

    source_url = salted_store(tmp_path / "source")
    dest_url = salted_store(tmp_path / "dest")
    key = namespace_key(SALTED.digest())
    estimates = {"format": 1, "tier": "disk", "written": 1.0, "restore": {}, "prefill": {}}
    with lmdb(tmp_path / "dest" / "lmdb") as backend:  # the older version's record, its estimates in it
        legacy = {**SALTED.describe(), COSTS_MEMBER: estimates}
        assert backend.put_many([(key, json.dumps(legacy, sort_keys=True).encode())]) == [True]

    result = cli("copy", source_url, dest_url, "--overwrite", "--json")

    assert result.code == 0, result.out + result.err
    with lmdb(tmp_path / "dest" / "lmdb") as backend:
        value = bytes(backend.get_many([key])[0])
    assert SALT.encode() not in value and json.loads(value)[COSTS_MEMBER] == estimates
    report = result.json()
    assert (report["namespace_records"], report["namespace_records_kept"]) == (0, 1)
