"""A block of another dtype than the namespace's is refused (BlockMismatch), never converted:
a cast changes the values, so a block saved that way is not the KV the engine computed (whoever
loads it gets other numbers than a recompute gives), and a load cast into another dtype hands
the engine values it did not store. A refused save is counted (``saves_failed``) and leaves no
slot reserved, written or published, across every chunk of the call."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.errors import BlockMismatch
from tiered_kv.keys import Namespace

LARGE = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2,
                  head_dim=256, block_size=16)  # 128 KiB blocks: copied one memcpy / copy_ each
FP8 = Namespace(model_id="test-llama", dtype="float8_e4m3fn", num_layers=4, num_kv_heads=2,
                head_dim=32, block_size=16)


def fp8_blocks(store, n: int) -> list[torch.Tensor]:
    return [b.to(torch.float32).clamp(-400, 400).to(store.dtype) for b in payloads(store, n)]


def assert_nothing_left(store, keys) -> None:
    """No slot of ``keys`` reserved, published or leased: a save of them now stores every one."""
    assert store.lookup(keys) == 0
    assert store.host.states_many(keys) == [None] * len(keys)
    assert store.host.can_reserve(store.host.num_slots), "a refused save kept host slots"


@pytest.mark.parametrize("ns", [NS, LARGE], ids=["small_blocks", "large_blocks"])
@pytest.mark.parametrize("other", ["float32", "float16", "one_float16"])
def test_a_save_of_another_dtype_is_refused_typed_not_cast_into_the_namespaces(ns, other):
    with make_store(None, ns=ns, host="4MiB", disk=None) as store:
        keys, given = keys_for(3, ns), payloads(store, 3, seed=1)
        if other == "one_float16":  # the engine's bug in one block of the batch
            bad = [given[0], given[1].half(), given[2]]
        else:
            bad = [g.to(getattr(torch, other)) for g in given]
        with pytest.raises(BlockMismatch, match="bfloat16"):
            store.save(keys, bad)
        assert_nothing_left(store, keys)
        assert store.metrics.snapshot()["events"]["saves_failed"] == 3
        store.save(keys, given)  # the blocks of the namespace's dtype are stored as they are
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, outs) == [True] * 3
        assert all(torch.equal(o, g) for o, g in zip(outs, given))


def test_fp8_bytes_handed_to_an_fp8_namespace_are_refused_not_converted_as_integers():
    """uint8 values 0..255 cast to fp8 are not the fp8 bits they held: a save that did that
    stored numbers nobody computed."""
    with make_store(None, ns=FP8, host="4MiB", disk=None) as store:
        keys, given = keys_for(2, FP8), fp8_blocks(store, 2)
        with pytest.raises(BlockMismatch, match="uint8"):
            store.save(keys, [g.view(torch.uint8) for g in given])
        assert_nothing_left(store, keys)


@pytest.mark.parametrize("bad", ["float16", "larger"])
def test_a_save_of_several_chunks_with_one_foreign_block_stores_none_of_its_chunks(bad):
    """A call of more blocks than half the host tier is staged in chunks: the chunks before
    the one holding the refused block were published, and the call raised with them stored."""
    with make_store(None, host="1MiB", disk=None) as store:  # 64 slots: chunks of 32 blocks
        n = store.host.num_slots
        keys, given = keys_for(n, NS), payloads(store, n, seed=2)
        blocks = list(given)
        blocks[-1] = (given[-1].half() if bad == "float16"
                      else torch.ones((2 * store.shape[0], *store.shape[1:]), dtype=store.dtype))
        with pytest.raises(BlockMismatch):
            store.save(keys, blocks)
        assert store.locate(keys) == [None] * n, "a refused save stored some of its chunks"
        assert_nothing_left(store, keys)
        assert store.metrics.snapshot()["events"]["saves_failed"] == n


@pytest.mark.parametrize("ns", [NS, LARGE], ids=["small_blocks", "large_blocks"])
@pytest.mark.parametrize("source", ["host", "disk"])
def test_a_load_into_blocks_of_another_dtype_is_refused_not_converted(tmp_path, ns, source):
    with make_store(tmp_path, ns=ns, host="4MiB") as store:
        keys, given = keys_for(3, ns), payloads(store, 3, seed=3)
        store.save(keys, given)
        store.flush()
        if source == "disk":
            store.host.delete_many(keys)  # staged through host slots: no direct decode into float32
        outs = [torch.zeros(store.shape, dtype=torch.float32) for _ in keys]
        with pytest.raises(BlockMismatch, match="float32"):
            store.load_into(keys, outs)
        assert not any(bool(o.any()) for o in outs), "a refused load wrote converted values"
        ok = store.load_into(keys, [torch.zeros(store.shape, dtype=store.dtype) for _ in keys])
        assert ok == [True] * 3, "a refused load left its blocks leased or lost"


@pytest.mark.parametrize("ns", [NS, LARGE], ids=["small_blocks", "large_blocks"])
def test_a_load_into_an_expanded_destination_is_a_typed_refusal_not_a_torch_error(ns):
    """An expanded tensor writes one element to several places: torch raised its RuntimeError
    into the engine."""
    with make_store(None, ns=ns, host="4MiB", disk=None) as store:
        keys = keys_for(2, ns)
        store.save(keys, payloads(store, 2, seed=4))
        outs = [torch.zeros((*store.shape[:-1], 1), dtype=store.dtype).expand(store.shape) for _ in keys]
        with pytest.raises(BlockMismatch, match="several places"):
            store.load_into(keys, outs)
        transposed = [torch.zeros(store.shape, dtype=store.dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
                      for _ in keys]  # strided but one place per element: loaded as it is
        assert store.load_into(keys, transposed) == [True, True]
