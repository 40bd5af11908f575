"""A block a tier admits on its second request earns that tier at the request that reaches it. When
that write does not happen (the save budget refused it, or the tier refused the put: a full disk,
a quota), the next request of the block must queue it again: the tier kept as claimed left a block
requested again and again out of the disk for as long as the host held it, and lost on the host's
eviction."""

from __future__ import annotations

from tests.store.helpers import keys_for, load, make_store, payloads


def _refusing(obj, name: str, refusal):
    """``obj.name`` answers ``refusal(...)`` until the returned switch is cleared."""
    real, on = getattr(obj, name), [True]
    setattr(obj, name, lambda *a, **kw: refusal(*a, **kw) if on[0] else real(*a, **kw))
    return on


def _refuse_puts_of(backend, keys: list[bytes]):
    """The tier refuses every put of ``keys`` (as a full disk does) until the switch is cleared;
    its other writes (the namespace record) go through."""
    real, refusing, refused = backend.put_many, [True], []

    def put_many(blobs, **kwargs):
        if refusing[0] and any(k.endswith(key) for k, _ in blobs for key in keys):
            refused.extend(k for k, _ in blobs)
            return [False] * len(blobs)
        return real(blobs, **kwargs)

    backend.put_many = put_many
    return refusing, refused


def test_regression_an_earned_write_the_disk_refused_kept_the_block_off_the_disk_for_good(tmp_path):
    keys = keys_for(2)
    with make_store(tmp_path, disk={"admit_after_hits": 2}) as store:
        blocks = payloads(store, 2)
        store.save(keys, blocks)  # first request: host only
        disk = store.tier("disk")
        refusing, refused = _refuse_puts_of(disk.backend, keys)  # the disk is full
        store.save(keys, blocks)  # second request: earns the disk, whose put refuses
        store.flush()
        assert len(refused) == 2 and disk.contains(keys) == [False, False]
        refusing[0] = False  # room again
        store.save(keys, blocks)  # third request: written this time
        store.flush()
        assert disk.contains(keys) == [True, True]


def test_regression_an_earned_write_the_save_budget_dropped_kept_the_block_off_the_disk_for_good(tmp_path):
    keys = keys_for(2)
    with make_store(tmp_path, disk={"admit_after_hits": 2}) as store:
        blocks = payloads(store, 2)
        store.save(keys, blocks)
        budget_spent = _refusing(store.pool, "try_submit_save", lambda *a, **kw: None)
        store.save(keys, blocks)  # second request: earns the disk, its write dropped
        store.flush()
        budget_spent[0] = False
        assert store.metrics.events["saves_dropped"] == 2
        assert store.tier("disk").contains(keys) == [False, False]
        store.save(keys, blocks)  # third request: written this time
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True]
        assert store.host.stats().extra["leased"] == 0


def test_regression_an_earned_copy_of_a_block_loaded_from_below_the_budget_dropped_kept_its_claim(tmp_path):
    keys = keys_for(2)
    tiers = [{"name": "ssd2", "url": f"file://{tmp_path}/f", "admit_after_hits": 2}]
    with make_store(tmp_path, disk={"codec": "raw"}, tiers=tiers) as store:
        blocks = payloads(store, 2)
        store.save(keys, blocks)  # the disk admits at once; ssd2 on a second request
        store.flush()
    with make_store(tmp_path, host="64KiB", disk={"codec": "raw"}, tiers=tiers) as store:  # a restart
        assert load(store, keys)[0] == [True, True]  # first request (this process): from the disk
        budget_spent = _refusing(store.pool, "try_submit_save", lambda *a, **kw: None)
        assert load(store, keys)[0] == [True, True]  # second: earns ssd2, its copy dropped
        store.flush()
        budget_spent[0] = False
        assert store.tier("ssd2").contains(keys) == [False, False]
        assert load(store, keys)[0] == [True, True]  # third: copied this time
        store.flush()
        assert store.tier("ssd2").contains(keys) == [True, True]
