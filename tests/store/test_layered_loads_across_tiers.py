"""A layer-wise load reads a block's frames as they arrive and names each checked one ready; the
engine copies a layer as soon as it is named. A block that then fails in its tier is not read
again from a later tier into the same place: that tier's own failed check cleared frames the
engine had been told were ready (and a good copy could differ from what was copied); the block
is a miss, reported, and recomputed. A whole-block load still falls through to the next tier."""

from __future__ import annotations

import torch

from tiered_kv.config import TieredKVConfig
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec
from tiered_kv.connector.worker import ConnectorWorker
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store import TieredStore
from tiered_kv.store.codec import BlockCodec

NS = Namespace(model_id="layerwise", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_dim=128,
               block_size=16)  # 64 KiB a layer: a frame per layer
KEY = block_keys(NS, list(range(NS.block_size)))[0]
PAYLOAD = torch.randn(NS.block_shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def three_tiers(tmp_path) -> TieredStore:
    cfg = {"host": {"capacity": "16MiB"}, "workers": 1, "layer_groups": 8,
           "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB", "codec": "raw"},
           "tiers": [{"name": "t2", "url": f"file://{tmp_path}/t2", "codec": "raw"},
                     {"name": "t3", "url": f"file://{tmp_path}/t3", "codec": "raw"}]}
    return TieredStore(TieredKVConfig.from_dict(cfg), NS)


def flip_in_frame(tier, frame: int) -> None:
    (value,) = tier.backend.get_many([tier.ns + KEY])
    lo, hi = BlockCodec.segments(value).span(frame)
    flipped = bytearray(value)
    flipped[(lo + hi) // 2] ^= 0x40
    tier.backend.delete_many([tier.ns + KEY])
    assert tier.backend.put_many([(tier.ns + KEY, bytes(flipped))]) == [True]


def stored_in_three_tiers(tmp_path) -> None:
    with three_tiers(tmp_path) as store:
        store.save([KEY], [PAYLOAD])
        store.flush(10)
        assert [t.contains([KEY]) for t in store.tiers] == [[True]] * 3


def test_regression_a_later_tiers_failed_check_cleared_a_layer_already_named_ready(tmp_path):
    stored_in_three_tiers(tmp_path)
    with three_tiers(tmp_path) as store:  # a fresh process: the host tier is empty
        flip_in_frame(store.tier("disk"), 7)  # frames 0..6 arrive checked, then the block fails
        flip_in_frame(store.tier("t2"), 1)  # a read of it would clear frame 1 in place
        asked = []
        for name in ("t2", "t3"):
            tier = store.tier(name)
            tier.read_layered = lambda *a, _read=tier.read_layered, _n=name, **kw: (asked.append(_n), _read(*a, **kw))[1]
        plan = store.loader.load(store.prepare_load([KEY]), layered=True)
        plan.wait(10)
        try:
            assert plan.ok == [False] and plan.reasons == ["corrupt"], "the block is reported failed"
            assert asked == [], "a block with layers named ready was read again into the same slot"
            layer = store.block_nbytes // NS.num_layers
            assert plan.progress.ready[0] == 7 * layer and plan.progress.over == [True]
        finally:
            store.release(plan)
        assert store.tier("t3").contains([KEY]) == [True], "the good copies stay for whole loads"
        whole = store.prepare_load([KEY])
        store.load(whole).wait(10)
        try:
            assert whole.ok == [True] and whole.served == ["t3"], "a whole-block load falls through"
            assert torch.equal(store.slot_tensor(whole.slots[0]), PAYLOAD)
        finally:
            store.release(whole)


def test_a_block_that_failed_after_layers_were_named_ready_is_reported_to_the_engine(tmp_path):
    stored_in_three_tiers(tmp_path)
    with three_tiers(tmp_path) as store:
        flip_in_frame(store.tier("disk"), 7)
        flip_in_frame(store.tier("t2"), 1)
        worker = ConnectorWorker(store)
        kv = torch.zeros((2, NS.num_layers, 4, NS.block_size, NS.num_kv_heads, NS.head_dim),
                         dtype=torch.bfloat16)
        worker.register_kv_caches(kv)
        worker.layerwise = True  # layerwise_loads = true (auto loads whole blocks on a CPU engine)
        assert worker.streams_layers
        worker.bind_connector_meta(ConnectorMeta(loads=[LoadSpec("r", (KEY,), (2,), False)]))
        worker.start_load_kv()
        for layer in range(NS.num_layers):
            worker.wait_for_layer_load(layer)
        worker.wait_for_save()
        errors = worker.get_block_ids_with_load_errors()
        got = kv[:, :, 2].transpose(0, 1)
        garbage = [n for n in range(NS.num_layers) if not torch.equal(got[n], PAYLOAD[n]) and got[n].any()]
        worker.close()
        assert errors == {2}, "the block is reported failed (the engine recomputes it)"
        assert garbage == [], f"layers {garbage} hold bytes that are neither the block's nor untouched"
