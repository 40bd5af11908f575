"""Saves and loads leave no reference cycles behind: every object a call makes is freed when
its last reference goes, so the cyclic GC has nothing to find. Cycles made by every call (a
future's callback naming that future) were found by the GC's full collections, each of which
stopped the process for ~70 ms with an engine's objects loaded: a warm restore of 512 MiB ran at
half its pace in the round one fell in. Real stores on tmp_path; the GC is off while the calls
run and asked afterwards what it would have collected."""

from __future__ import annotations

import gc

import pytest

from tests.store.helpers import keys_for, load, load_staged, make_store, payloads


@pytest.fixture
def gc_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cyclic_garbage() -> int:
    """Objects only the cyclic GC would free (found and freed now)."""
    return gc.collect()


@pytest.mark.parametrize("codec", ["raw", "zstd+shuffle"])
def test_regression_saves_and_loads_left_reference_cycles_for_the_gc_to_collect(tmp_path, gc_off, codec):
    with make_store(tmp_path, disk={"codec": codec}) as store:
        keys, data = keys_for(24), payloads(store, 24)
        store.save(keys[:8], data[:8])  # (the store's own first-use objects settle)
        store.flush()
        load(store, keys[:8])
        cyclic_garbage()

        for start in range(8, 24, 4):
            store.save(keys[start : start + 4], data[start : start + 4])
        store.flush()
        assert cyclic_garbage() == 0, "saves left cycles"

        store.host.delete_many(keys)  # loads come from the disk tier
        ok, _ = load(store, keys)
        assert ok == [True] * 24
        assert cyclic_garbage() == 0, "direct loads left cycles"

        store.host.delete_many(keys)
        ok, _ = load_staged(store, keys)
        assert ok == [True] * 24
        assert cyclic_garbage() == 0, "staged loads left cycles"
