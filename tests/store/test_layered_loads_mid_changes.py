"""Layer-wise loads from a real LMDB tier while the block changes under them, and the odd shapes
of a load: what is pinned. A block replaced by a newer version, deleted, or whose segment file
is unlinked after its first layer group was handed out arrives whole as the version the load
began with (the visit's transaction names its place, and every frame is checked against the
head's table: two versions' groups are never served together). A key asked twice in one load is
served twice, or failed twice when a later group of it is corrupt, and a block that failed half
way is neither kept in host memory nor copied up, also when the plan is released before it was
waited for. A load of no keys is empty. Real stores on tmp_path, nothing mocked."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tiered_kv.config import TieredKVConfig
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store import TieredStore
from tiered_kv.store.codec import BlockCodec

NS = Namespace(model_id="layered-mid", dtype="bfloat16", num_layers=8, num_kv_heads=4, head_dim=128,
               block_size=16)  # 256 KiB blocks: four layer groups of 64 KiB


def store_at(tmp_path, lower_file: bool = False) -> TieredStore:
    cfg: dict = {"host": {"capacity": "16MiB"}, "workers": 2, "layer_groups": 4,
                 "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB", "codec": "raw",
                          "options": {"segment_bytes": "1MiB"}}}  # a few blocks a segment: more than a visit holds
    if lower_file:
        cfg["tiers"] = [{"name": "t2", "url": f"file://{tmp_path}/t2", "codec": "raw"}]
    return TieredStore(TieredKVConfig.from_dict(cfg), NS)


def keys_n(n: int) -> list[bytes]:
    return block_keys(NS, list(range(n * NS.block_size)))


def data_n(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NS.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]


def place_of(store: TieredStore, key: bytes):
    tier = store.tier("disk")
    with tier.backend.env.begin() as txn:
        return tier.backend.values.place_of(txn, tier.ns + key)


def flip_group(tier, key: bytes, group: int) -> None:
    """One bit flipped in layer group ``group`` of ``key``'s stored block (through the medium)."""
    (value,) = tier.backend.get_many([tier.ns + key])
    lo, hi = BlockCodec.segments(value).span(group)
    bad = bytearray(value)
    bad[(lo + hi) // 2] ^= 0x01
    tier.backend.delete_many([tier.ns + key])
    assert tier.backend.put_many([(tier.ns + key, bytes(bad))]) == [True]


@pytest.mark.parametrize("change", ["replaced", "deleted", "segment_unlinked"])
def test_a_block_changed_after_its_first_group_was_handed_out_arrives_whole_as_it_was(tmp_path, change):
    n = 40
    keys, data = keys_n(n), data_n(n)
    newer = data_n(1, seed=9)[0]
    with store_at(tmp_path) as store:
        store.save(keys, data)
        store.flush(10)
        tier = store.tier("disk")
        places = [place_of(store, k) for k in keys]
        assert len({p.segment for p in places}) > 8, "(the scenario) segments past those a visit holds"
        target = 30  # in a sealed segment the visit does not hold
        blob = tier.encode(keys[target], newer.view(torch.uint8).numpy())
        newer_blob = bytes(blob.join()) if hasattr(blob, "join") else bytes(blob)
        passes: list[tuple[list[int], int]] = []

        def act() -> None:  # another thread, as another writer would
            backend = tier.backend
            if change == "segment_unlinked":
                os.unlink(backend.values.files.path_of(places[target].segment))
                return
            backend.delete_many([tier.ns + keys[target]])
            if change == "replaced":
                assert backend.put_many([(tier.ns + keys[target], newer_blob)]) == [True]

        def on_ready(ready: list[int], end: int) -> None:
            passes.append((list(ready), end))
            if len(passes) == 1:
                thread = threading.Thread(target=act)
                thread.start()
                thread.join(60)
                assert not thread.is_alive()

        outs = [bytearray(store.block_nbytes) for _ in keys]
        reasons, _ = tier.read_layered(keys, outs, on_ready)
        assert passes[0][0] == list(range(n)), "(the scenario) every block's first group was handed out"
        got = [torch.frombuffer(o, dtype=torch.bfloat16).view(NS.block_shape) for o in outs]
        assert reasons[target] in (None, "absent")
        if reasons[target] is None:
            assert torch.equal(got[target], data[target]), "groups of two versions served as one block"
        assert all(torch.equal(g, d) for g, d, r in zip(got, data, reasons) if r is None)
        assert store.metrics.misses("corrupt") == 0


def test_a_key_asked_twice_in_one_layered_load_is_served_twice_or_failed_twice(tmp_path):
    keys, data = keys_n(2), data_n(2)
    with store_at(tmp_path) as store:
        store.save(keys, data)
        store.flush(10)
    with store_at(tmp_path) as store:  # a fresh process: the host tier is empty
        asked = [keys[0], keys[1], keys[0]]
        plan = store.loader.load(store.prepare_load(asked), layered=True)
        try:
            plan.wait(30)
            assert plan.ok == [True] * 3
            assert all(torch.equal(store.slot_tensor(plan.progress.slot[i]), data[keys.index(k)])
                       for i, k in enumerate(asked))
        finally:
            store.release(plan)
        store.host.delete_many(keys)
        flip_group(store.tier("disk"), keys[0], 3)  # groups 0-2 check, group 3 does not
        plan = store.loader.load(store.prepare_load(asked), layered=True)
        try:
            plan.wait(30)
            assert plan.ok == [False, True, False], "the corrupt block is reported failed both times"
            layer = store.block_nbytes // NS.num_layers
            assert plan.progress.ready[0] == 6 * layer and plan.progress.over == [True] * 3
        finally:
            store.release(plan)
        assert store.host.states_many([keys[0]]) == [None], "a half-failed block stayed in host memory"


@pytest.mark.parametrize("layered", [True, False], ids=["layered", "whole"])
def test_a_block_that_failed_half_way_is_not_copied_up_even_when_released_before_the_wait(tmp_path, layered):
    keys, data = keys_n(3), data_n(3)
    with store_at(tmp_path, lower_file=True) as store:
        store.save(keys, data)
        store.flush(10)
    with store_at(tmp_path, lower_file=True) as store:
        disk = store.tier("disk")
        disk.backend.delete_many([disk.ns + k for k in keys])  # only t2 holds them
        flip_group(store.tier("t2"), keys[1], 3)
        plan = store.loader.load(store.prepare_load(keys), layered=layered)
        store.release(plan)  # never waited for: the release waits for the jobs
        assert plan.ok == [True, False, True] and plan.served == ["t2", None, "t2"]
        store.flush(10)
        assert disk.contains(keys) == [True, False, True], "only whole, checked blocks are copied up"
        assert store.host.states_many(keys) == ["ready", None, "ready"]


def test_a_load_of_no_keys_is_empty(tmp_path):
    with store_at(tmp_path) as store:
        assert store.load_into([], []) == []
        plan = store.loader.load(store.prepare_load([]), layered=True)
        store.release(plan)
        assert plan.ok == [] and plan.progress.wait(1, 10) and plan.progress.wait_all(10)
