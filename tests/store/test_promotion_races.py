"""Two loads of one step want the same stored block (two requests sharing a prefix): one promotes
it into a host slot, the other leases it from there once it is committed. Whatever the other
load or a withdrawal does between this load's looks at the block, the outcome is the one the block
is in: leased when it is committed, a miss named for what happened to it otherwise. Each scenario
forces its interleaving by running the other side at the exact step where another thread could."""

from __future__ import annotations

import time

from tests.store.helpers import keys_for, make_store, payloads


def test_regression_a_block_the_other_load_committed_between_two_looks_at_its_state_was_a_no_room_miss(tmp_path):
    """The wait read the block's state ("reserved": still being promoted), then asked again
    whether it was reserved; the other load committed in between, so it was no longer reserved
    and the block, ready in the host tier, was counted ``no_room`` and recomputed."""
    with make_store(tmp_path) as store:
        host, loader = store.loader.host, store.loader
        key, tenant = keys_for(1)[0], loader.saver.tenant
        assert host.reserve_many([key], tenant=tenant)[0] is not None  # the other load promotes it
        real, seen = host.states_many, []

        def state_then_the_other_load_commits(keys):
            out = real(keys)
            if not seen:
                host.commit_many([key])
            seen.append(out)
            return out

        host.states_many = state_then_the_other_load_commits
        pinned, why = loader._pin_promoted(key, tenant, time.monotonic() + 30)
        assert seen[0] == ["reserved"]
        assert (pinned is not None, why) == (True, "")
        host.unpin_many([key])
        assert store.host.stats().extra["leased"] == 0


def test_regression_a_load_of_a_withdrawn_block_another_load_still_leased_was_counted_no_room(tmp_path):
    """A withdrawn host copy stays until the load leasing it is released; another load of the
    key, which could neither lease it nor reserve a slot for it, called that ``no_room``."""
    with make_store(tmp_path) as store:
        key = keys_for(1)
        store.save(key, payloads(store, 1))
        assert store.flush(10)
        reading = store.prepare_load(key)  # a load in flight leases the host copy
        store.invalidate(key).result(10)  # withdrawn: deleted below, the host copy left to that load
        plan = store.load(store.prepare_load(key))
        try:
            plan.wait(10)
        finally:
            store.release(plan)
            store.release(reading)
        assert plan.ok == [False] and plan.reasons == ["invalidated"]
        assert store.metrics.tiers["host"].misses == {"invalidated": 1}
        assert store.host.stats().extra["leased"] == 0 and store.lookup(key) == 0

