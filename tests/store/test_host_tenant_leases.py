"""A load leases a host entry only for the tenant that stored it; a block another load of the same
tenant commits while this one waits for it is leased, never taken for another tenant's, and
counted as a host hit of the load that leased it."""

from __future__ import annotations

import time

from tests.store.helpers import keys_for, make_store, payloads


def test_a_block_committed_between_a_failed_lease_and_its_state_is_leased_not_wrong_key(tmp_path):
    """Two requests sharing a prefix in one step: the other load commits the block right after
    this load's lease failed (still reserved) and before it asked the block's state, which is
    then "ready"; that is this tenant's block, not another tenant's (``wrong_key``)."""
    with make_store(tmp_path) as store:
        host, loader = store.loader.host, store.loader
        key, tenant = keys_for(1)[0], store.loader.saver.tenant
        assert host.reserve_many([key], tenant=tenant)[0] is not None  # the other load promotes it
        real, calls = host.pin_many, []

        def pin_then_the_other_load_commits(keys, t=None):
            out = real(keys, t)
            if not calls:
                host.commit_many([key])
            calls.append(out)
            return out

        host.pin_many = pin_then_the_other_load_commits
        pinned, why = loader._pin_promoted(key, tenant, time.monotonic() + 1)
        assert (pinned is not None, why) == (True, "")
        host.unpin_many([key])


def test_regression_blocks_a_load_leased_from_another_loads_promotion_were_counted_nowhere(tmp_path):
    """Two requests of one step loading the same stored prefix: the load that promoted a block
    counted a disk hit; the other, leasing the promoted block, counted neither hit nor miss, so
    the hit counters showed half of what was served."""
    keys = keys_for(6)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 6))
        assert store.flush(30)
    with make_store(tmp_path) as store:  # a restart: the blocks are on disk only
        plans = [store.prepare_load(keys) for _ in range(2)]  # both planned before either loads
        try:
            for plan in plans:
                store.load(plan)
            for plan in plans:
                plan.wait(30)
                assert plan.ok == [True] * len(keys)
            snap = store.metrics.snapshot()["tiers"]
            assert sum(t["hits"] for t in snap.values()) == 2 * len(keys)
            assert snap["host"]["hits"] == len(keys) and snap["disk"]["hits"] == len(keys)
        finally:
            for plan in plans:
                store.release(plan)
