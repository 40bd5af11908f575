"""Small blocks that lie back to back in the caller's memory (views of one engine pool) and in
consecutive host slots are copied a stretch at a time; every other block still one by one, and
the bytes are the same either way."""

import torch

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.host_slots import RUN_PIECE_BYTES


def spy_on_stretches(store) -> list[int]:
    """The sizes of the stretches the store's copier is handed (recorded, then copied)."""
    sizes: list[int] = []
    real = store.copier.copy

    def copy(pairs):
        sizes.extend(dst.nbytes for dst, _ in pairs)
        return real(pairs)

    store.copier.copy = copy
    return sizes


def test_views_of_one_pool_go_to_and_from_consecutive_slots_a_stretch_at_a_time(tmp_path):
    with make_store(tmp_path, host="4MiB", disk=None) as store:
        stretches = spy_on_stretches(store)
        pool = torch.stack(payloads(store, 96))  # 96 blocks of 16 KiB, back to back
        keys = keys_for(96)
        store.save(keys, list(pool.unbind(0)))
        assert stretches and sum(stretches) == pool.nbytes, "the pool was not saved in stretches"
        assert max(stretches) <= RUN_PIECE_BYTES
        stretches.clear()
        out = torch.zeros_like(pool)
        assert store.load_into(keys, list(out.unbind(0))) == [True] * 96
        assert sum(stretches) == pool.nbytes, "the pool was not loaded in stretches"
        assert torch.equal(out, pool)


def test_blocks_that_are_not_back_to_back_are_copied_one_by_one_and_land_right(tmp_path):
    with make_store(tmp_path, host="4MiB", disk=None) as store:
        stretches = spy_on_stretches(store)
        pool = torch.stack(payloads(store, 40, seed=3))
        blocks = list(pool.unbind(0))
        # reversed pairs, a gap, a strided view (not contiguous) and separate tensors
        order = [1, 0, 3, 2] + list(range(6, 20)) + [22] + list(range(24, 40))
        given = [blocks[i] for i in order]
        given[10] = blocks[16].transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
        given[30] = blocks[order[30]].clone()  # the same bytes elsewhere
        keys = keys_for(len(given))
        store.save(keys, given)
        # runs: order[4:10] (6 blocks), order[11:18] (7), order[19:30] (11), order[31:] (4)
        assert sorted(stretches) == sorted(n * blocks[0].nbytes for n in (6, 7, 11, 4))
        out = torch.zeros((len(given), *store.shape), dtype=store.dtype)
        assert store.load_into(keys, list(out.unbind(0))) == [True] * len(given)
        assert all(torch.equal(o, g) for o, g in zip(out.unbind(0), given))


def test_a_stretch_ends_where_the_slots_stop_being_consecutive(tmp_path):
    with make_store(tmp_path, host="1MiB", disk=None) as store:  # 64 slots of 16 KiB
        first = keys_for(64)
        store.save(first, payloads(store, 64, seed=1))
        # two holes in the slab, freed so that they are handed out lowest slot first
        store.host.delete_many(first[40:45][::-1] + first[10:20][::-1])
        pool = torch.stack(payloads(store, 15, seed=2))
        keys = keys_for(15, first_token=64 * 16)
        stretches = spy_on_stretches(store)
        store.save(keys, list(pool.unbind(0)))
        assert sorted(stretches) == [5 * pool[0].nbytes, 10 * pool[0].nbytes], "a stretch ran across a hole"
        out = torch.zeros_like(pool)
        assert store.load_into(keys, list(out.unbind(0))) == [True] * 15
        assert torch.equal(out, pool)


def test_a_block_of_the_wrong_shape_inside_a_stretch_is_still_refused(tmp_path):
    with make_store(tmp_path, host="1MiB", disk=None) as store:
        pool = torch.stack(payloads(store, 8))
        keys = keys_for(8)
        store.save(keys, list(pool.unbind(0)))
        outs = list(torch.zeros_like(pool).unbind(0))
        outs[4] = torch.zeros(3, dtype=store.dtype)  # the caller's bug
        try:
            store.load_into(keys, outs)
        except RuntimeError:
            pass
        else:
            raise AssertionError("a destination of the wrong shape was accepted")


def test_a_strided_block_at_the_very_address_a_run_would_continue_from_is_copied_alone(tmp_path):
    """Runs are found from the blocks' addresses first, then each block in one is checked: the
    first and the last block of the batch, right where a stretch would begin or end, may lie
    there without being plain."""
    with make_store(tmp_path, host="4MiB", disk=None) as store:
        stretches = spy_on_stretches(store)
        pool = torch.stack(payloads(store, 13, seed=5))  # (the 13th: room for the last view's reach)
        given = list(pool.unbind(0))[:12]
        shape, stride = pool[0].shape, list(pool[0].stride())
        stride[-1], stride[-2] = stride[-2], stride[-1]  # the last two dims' strides swapped
        block = pool[0].numel()
        for i in (0, 11):  # same address, same shape, other strides: not plain
            given[i] = torch.as_strided(pool, shape, stride, storage_offset=i * block)
        keys = keys_for(12)
        store.save(keys, given)
        assert stretches == [10 * pool[0].nbytes]
        out = torch.zeros_like(pool[:12])
        assert store.load_into(keys, list(out.unbind(0))) == [True] * 12
        assert all(torch.equal(o, g) for o, g in zip(out.unbind(0), given))
