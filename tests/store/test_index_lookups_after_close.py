"""The scheduler's lookup-only index, once closed (an engine shutting down while its scheduler
still steps), answers that nothing is stored and counts the keys as asked after the close, not
as lookup timeouts of tiers that never timed out."""

from __future__ import annotations

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.store.lower_index import LowerTierIndex


def test_regression_lookups_after_the_index_closed_were_counted_as_lookup_timeouts(tmp_path):
    keys = keys_for(4)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 4))
        store.flush()
    cfg = TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/lmdb", "capacity": "64MiB"}})
    index = LowerTierIndex(cfg, NS)
    assert index.lookup(keys) == 4
    index.close()
    assert index.lookup(keys) == 0
    assert index.present(keys) == [False] * 4
    assert index.locate(keys) == [None] * 4
    assert dict(index.misses) == {}, "no tier timed out: the index was closed"
    assert index.unavailable == 0
    assert index.lookups_after_close == 12
    index.close()  # (twice: nothing left to close)
