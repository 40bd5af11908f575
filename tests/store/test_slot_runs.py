"""Small blocks saved into (or loaded from) consecutive host slots are copied a run of slots at
a time, one torch call per piece of a run, wherever the blocks lie in the caller's memory; the
blocks in no run still one by one; the bytes are the same either way, and a block of another
shape never reaches past its own slot."""

import numpy as np
import pytest
import torch

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.host_slots import RUN_PIECE_BLOCKS


def spy_on_runs(store) -> list[int]:
    """The block counts of the runs the store's copier is handed (recorded, then copied)."""
    counts: list[int] = []
    real = store.copier.copy_runs

    def copy_runs(runs, **kw):
        counts.extend(len(blocks) for _, blocks in runs)
        return real(runs, **kw)

    store.copier.copy_runs = copy_runs
    return counts


def test_blocks_scattered_in_the_callers_memory_go_to_and_from_consecutive_slots_a_run_at_a_time(tmp_path):
    with make_store(tmp_path, host="4MiB", disk=None) as store:
        runs = spy_on_runs(store)
        pool = torch.stack(payloads(store, 160, seed=3))
        blocks = list(pool.unbind(0))
        # reversed pairs, a gap, a strided view (not contiguous) and separate tensors
        given = [blocks[i] for i in [1, 0, 3, 2] + list(range(6, 160))]
        given[10] = blocks[16].transpose(-1, -2).contiguous().transpose(-1, -2)  # other strides
        given[30] = given[30].clone()  # the same bytes elsewhere
        keys = keys_for(len(given))
        store.save(keys, given)
        assert sum(runs) == len(given), "some blocks were not copied in runs"
        assert max(runs) == RUN_PIECE_BLOCKS
        runs.clear()
        out = torch.zeros((len(given), *store.shape), dtype=store.dtype)
        dests = list(out.unbind(0))[::-1]  # destinations in reverse order: still one run of slots
        assert store.load_into(keys, dests) == [True] * len(given)
        assert sum(runs) == len(given), "some blocks were not loaded in runs"
        assert all(torch.equal(d, g) for d, g in zip(dests, given))


def test_a_run_ends_where_the_slots_stop_being_consecutive(tmp_path):
    with make_store(tmp_path, host="1MiB", disk=None) as store:  # 64 slots of 16 KiB
        first = keys_for(64)
        store.save(first, payloads(store, 64, seed=1))
        # two holes in the slab, freed so that they are handed out lowest slot first
        store.host.delete_many(first[40:45][::-1] + first[10:20][::-1])
        given = payloads(store, 15, seed=2)
        keys = keys_for(15, first_token=64 * 16)
        runs = spy_on_runs(store)
        store.save(keys, given)
        assert sorted(runs) == [5, 10], "a run went across a hole"
        out = [torch.zeros(store.shape, dtype=store.dtype) for _ in given]
        assert store.load_into(keys, out) == [True] * 15
        assert all(torch.equal(o, g) for o, g in zip(out, given))
        assert store.load_into(first[20:40], [torch.zeros(store.shape, dtype=store.dtype) for _ in range(20)]) == [True] * 20


def test_slots_larger_than_a_block_are_filled_a_run_at_a_time_and_read_back_right():
    from storage_backends.host import HostBackend
    from tests.store.helpers import NS
    from tiered_kv.store.host_copy import HostCopier
    from tiered_kv.store.host_slots import HostSlots

    block = 16 << 10
    host = HostBackend(capacity=40 * (block + 4096), slot_bytes=block + 4096, pinned=False)  # wider slots
    slots = HostSlots(host, NS, HostCopier(2, min_bytes=0))
    runs = spy_on_runs(slots)
    g = torch.Generator().manual_seed(4)
    given = [torch.randn(slots.shape, generator=g).to(slots.dtype) for _ in range(30)]
    host.slab.numpy().fill(0x5A)  # the slots' tails: must stay as they were
    slots.copy_blocks(list(range(5, 35)), given, into_slots=True)
    assert sum(runs) == 30
    out = [torch.zeros(slots.shape, dtype=slots.dtype) for _ in given]
    slots.copy_blocks(list(range(5, 35)), out, into_slots=False)
    assert all(torch.equal(o, g) for o, g in zip(out, given))
    tails = host.slab[5:35, block:]
    assert bool((tails == 0x5A).all()), "a run wrote into the gap after a block"
    assert bool((host.slab[:5] == 0x5A).all()) and bool((host.slab[35:] == 0x5A).all())


def test_a_destination_of_the_wrong_shape_inside_a_run_is_refused(tmp_path):
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        given = payloads(store, 8)
        keys = keys_for(8)
        store.save(keys, given)
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in given]
        outs[4] = torch.zeros(3, dtype=store.dtype)  # the caller's bug
        with pytest.raises(ValueError):
            store.load_into(keys, outs)
        assert outs[4].shape == (3,), "the caller's tensor was resized"


def test_a_block_larger_than_the_slot_never_overwrites_the_next_slots_block(tmp_path):
    """torch.stack into a run of slots resizes its ``out`` to fit the blocks it is given: a
    batch of blocks of twice the elements would have been written across the next slots, which
    hold other keys' blocks. Such a batch is copied block by block, and the copy is refused."""
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        first = keys_for(8)
        kept = payloads(store, 8, seed=1)
        store.save(first, kept)
        store.host.delete_many(first[2:4][::-1])  # slots 2 and 3 free, slot 4 still held
        wrong = [torch.ones((2 * store.shape[0], *store.shape[1:]), dtype=store.dtype)] * 2  # the caller's bug
        with pytest.raises(ValueError):
            store.save(keys_for(2, first_token=8 * 16), wrong)
        out = [torch.zeros(store.shape, dtype=store.dtype) for _ in range(4)]
        assert store.load_into(first[4:], out) == [True] * 4
        assert all(torch.equal(o, k) for o, k in zip(out, kept[4:])), "a neighbouring slot was overwritten"


def test_a_save_whose_keys_are_partly_stored_already_puts_each_new_block_under_its_own_key(tmp_path):
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        keys = keys_for(12)
        given = payloads(store, 12, seed=6)
        store.save(keys[3:6] + keys[9:], given[3:6] + given[9:])
        runs = spy_on_runs(store)
        store.save(keys, [torch.zeros_like(g) if i in (3, 4, 5, 9, 10, 11) else g for i, g in enumerate(given)])
        assert sum(runs) == 6  # only the new keys' blocks were copied (slots 6..11: one run)
        out = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, out) == [True] * 12
        assert all(torch.equal(o, g) for o, g in zip(out, given)), "a block went under another key"


def test_a_save_with_fewer_blocks_than_keys_is_refused_and_stores_nothing(tmp_path):
    """A run copies ``blocks[pos:pos + count]``: one block short, and torch.stack would have
    filled one slot less than the run and the last key would have been published over whatever
    its slot held before."""
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        keys = keys_for(8)
        with pytest.raises(ValueError):
            store.save(keys, payloads(store, 7))
        assert store.lookup(keys) == 0
        with pytest.raises(ValueError):
            store.slots.copy_blocks([0, 1, 2], payloads(store, 2), into_slots=True)


def test_a_block_of_a_shape_that_broadcasts_is_refused_not_spread_over_its_slot(tmp_path):
    """``copy_`` broadcasts: a block holding only K (``[L, 1, ...]``) would have been stored
    with its K copied over V, and served as a whole block."""
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        half = torch.ones((store.shape[0], 1, *store.shape[2:]), dtype=store.dtype)
        keys = keys_for(2)
        with pytest.raises(ValueError):
            store.save(keys, [half, half.clone()])
        assert store.lookup(keys) == 0


def test_the_bytes_of_a_batch_of_destinations_are_their_own_memory_wherever_each_lies():
    from tiered_kv.store.host_slots import bytes_of, bytes_of_each

    pool = torch.zeros(6, 2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():  # an engine's pool is often made in inference mode
        other = torch.zeros(2, 8, dtype=torch.bfloat16)
    outs = [pool[4], pool[1], other, pool[5]]  # out of order, one from elsewhere
    rows = bytes_of_each(outs)
    assert [r.nbytes for r in rows] == [o.nbytes for o in outs]
    for i, row in enumerate(rows):
        row[:] = i + 1  # written through to each destination's own bytes, nowhere else
    for i, out in enumerate(outs):
        assert (out.view(torch.uint8) == i + 1).all()
        assert np.array_equal(bytes_of(out), rows[i])
    assert (pool[[0, 2, 3]].view(torch.uint8) == 0).all()
    assert bytes_of_each([]) == []


def test_a_strided_destination_never_gets_the_bytes_that_follow_its_first_element():
    from tiered_kv.store.host_slots import bytes_of_each

    pool = torch.zeros(6, 2, 8, dtype=torch.bfloat16)
    column = pool[:, 0]  # in the pool's storage, but not its nbytes from its first element on
    rows = bytes_of_each([pool[0], column])
    rows[1][:] = 9
    assert (pool.view(torch.uint8) == 0).all(), "a write meant for the column landed in pool[0]"


def test_a_later_block_of_another_shape_in_a_run_is_refused_and_nothing_past_the_run_changes(tmp_path):
    """A save's run is stacked after a check of its first block and every block's dtype only:
    a later block of twice the elements is refused by torch before any copy into the run, and
    the save then says which block, as one whose first block is wrong does."""
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        first = keys_for(8)
        kept = payloads(store, 8, seed=1)
        store.save(first, kept)
        store.host.delete_many(first[2:4][::-1])  # slots 2 and 3 free, slot 4 still held
        wrong = payloads(store, 2, seed=2)
        wrong[1] = torch.ones((2 * store.shape[0], *store.shape[1:]), dtype=store.dtype)  # the caller's bug
        runs = spy_on_runs(store)
        keys = keys_for(2, first_token=8 * 16)
        with pytest.raises(ValueError, match="shape"):
            store.save(keys, wrong)
        assert runs == [2], "the run was not tried first"
        assert store.lookup(keys) == 0
        out = [torch.zeros(store.shape, dtype=store.dtype) for _ in range(4)]
        assert store.load_into(first[4:], out) == [True] * 4
        assert all(torch.equal(o, k) for o, k in zip(out, kept[4:])), "a neighbouring slot was overwritten"


@pytest.mark.parametrize("slot_numbers, wrong_at, wrong_shape", [
    ([2, 3, 10, 11], (2, 3), "double"),  # a later piece (a run after a gap) all of another shape
    ([2, 5], (1,), "k_only"),  # a block in no run, of a shape ``copy_`` would broadcast
    ([2, 3, 10, 11], (2, 3), "permuted"),  # the same elements in another shape
])
def test_a_save_checks_each_pieces_first_block_and_each_block_in_no_run(slot_numbers, wrong_at, wrong_shape):
    """``torch.stack`` compares a piece's blocks with that piece's first only, and a block in
    no run goes to ``_foreach_copy_``: checking the batch's first block alone let a later
    piece of twice the elements overwrite other keys' slots and a K-only block be broadcast."""
    from storage_backends.host import HostBackend
    from tests.store.helpers import NS
    from tiered_kv.store.host_copy import HostCopier
    from tiered_kv.store.host_slots import HostSlots

    block = 16 << 10
    host = HostBackend(capacity=16 * block, slot_bytes=block, pinned=False)
    slots = HostSlots(host, NS, HostCopier(2, min_bytes=0))
    shape = slots.shape
    wrong = {"double": (2 * shape[0], *shape[1:]), "k_only": (shape[0], 1, *shape[2:]),
             "permuted": (shape[1], shape[0], *shape[2:])}[wrong_shape]
    given = [torch.ones(wrong if i in wrong_at else shape, dtype=slots.dtype) for i in range(len(slot_numbers))]
    host.slab.numpy().fill(0x5A)
    with pytest.raises(ValueError, match="shape"):
        slots.copy_blocks(slot_numbers, given, into_slots=True)
    untouched = [s for s in range(16) if s not in slot_numbers]
    assert bool((host.slab[untouched] == 0x5A).all()), "a slot outside the batch was written"
