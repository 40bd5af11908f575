"""A block an engine hands the store that is not one its host slots hold (another shape, a
tensor with no data) is refused with a typed error before any byte is copied: never torch's
RuntimeError raised into the engine, never a neighbouring slot written. Blocks the store can copy
(one that requires grad, an inference tensor as a destination) are copied, whatever the
caller's autograd mode."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.errors import BlockMismatch
from tiered_kv.keys import Namespace

LARGE = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2,
                  head_dim=256, block_size=16)  # 128 KiB blocks: copied one memcpy / copy_ each


def wrong(kind: str, shape, dtype) -> torch.Tensor:
    if kind == "larger":
        return torch.ones((2 * shape[0], *shape[1:]), dtype=dtype)
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.ones(shape, dtype=dtype).to_sparse()


@pytest.mark.parametrize("ns", [NS, LARGE], ids=["small_blocks", "large_blocks"])
@pytest.mark.parametrize("kind", ["larger", "meta", "sparse"])
def test_a_block_of_another_kind_is_a_typed_refusal_not_a_torch_error(ns, kind):
    with make_store(None, ns=ns, host="4MiB", disk=None) as store:
        kept_keys, kept = keys_for(4, ns), payloads(store, 4, seed=1)
        store.save(kept_keys, kept)
        bad = payloads(store, 3, seed=2)
        bad[1] = wrong(kind, store.shape, store.dtype)  # the engine's bug: a block of another kind
        new_keys = keys_for(3, ns, first_token=10_000)
        with pytest.raises(BlockMismatch):
            store.save(new_keys, bad)
        assert store.lookup(new_keys) == 0
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in kept]
        outs[2] = wrong(kind, store.shape, store.dtype)
        with pytest.raises(BlockMismatch):
            store.load_into(kept_keys, outs)
        outs[2] = torch.zeros(store.shape, dtype=store.dtype)
        assert store.load_into(kept_keys, outs) == [True] * 4
        assert all(torch.equal(o, k) for o, k in zip(outs, kept)), "a slot was written by the refused save"


@pytest.mark.parametrize("ns", [NS, LARGE], ids=["small_blocks", "large_blocks"])
def test_blocks_that_require_grad_or_are_inference_tensors_are_copied_not_refused_by_autograd(ns):
    with make_store(None, ns=ns, host="4MiB", disk=None) as store:
        keys, given = keys_for(2, ns), payloads(store, 2, seed=3)
        store.save(keys, [g.clone().requires_grad_() for g in given])
        with torch.inference_mode():  # an engine's buffers are often made in inference mode
            outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, outs) == [True, True]  # (outside inference mode here)
        assert all(torch.equal(o, g) for o, g in zip(outs, given))
        grads = [torch.zeros(store.shape, dtype=store.dtype, requires_grad=True) for _ in keys]
        assert store.load_into(keys, grads) == [True, True]
        assert all(torch.equal(o.detach(), g) for o, g in zip(grads, given))


@pytest.mark.parametrize("non_blocking", [False, True], ids=["index_copy", "per_run"])
@pytest.mark.parametrize("data", ["wider", "narrower", "more_rows", "not_bytes"])
def test_an_engine_block_gathered_larger_than_its_slot_is_refused_typed_and_writes_nothing(data, non_blocking):
    """The connector's worker fills host slots with the bytes its layout gathered from the
    engine's pool: an engine whose blocks are not the namespace's size got torch's error."""
    with make_store(None, host="1MiB", disk=None) as store:
        n, width = 2, store.block_nbytes
        made = {"wider": torch.ones(n, 2 * width, dtype=torch.uint8),
                "narrower": torch.ones(n, width // 2, dtype=torch.uint8),
                "more_rows": torch.ones(n + 1, width, dtype=torch.uint8),
                "not_bytes": torch.ones(n, width // 2, dtype=torch.bfloat16)}[data]
        slab = store.host.slab
        slab.zero_()
        with pytest.raises(BlockMismatch):
            store.slots.fill([0, 1], made, non_blocking=non_blocking)
        assert not bool(slab.any()), "a refused fill wrote into the slab"
        store.slots.fill([0, 1], torch.ones(n, width, dtype=torch.uint8), non_blocking=non_blocking)
        assert bool((store.slots.gather([0, 1]).view(torch.uint8) == 1).all())
