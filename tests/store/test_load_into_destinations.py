"""``load_into`` destinations a caller gets wrong are refused with a typed error before any byte
moves: one buffer named for two different keys (both were reported loaded, and two pool jobs could
write a mix of the two blocks into it), and arrays that are not tensors (AttributeError from deep
in the copy). Views of one pool, and one key asked twice into one buffer, still load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.errors import BlockMismatch


def test_regression_a_load_into_one_buffer_for_two_keys_reported_both_loaded(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(2)
        blocks = payloads(store, 2)
        store.save(keys, blocks)
        out = torch.zeros(store.shape, dtype=store.dtype)
        with pytest.raises(BlockMismatch, match="one destination for two different keys"):
            store.load_into(keys, [out, out])
        assert store.load_into([keys[0], keys[0]], [out, out]) == [True, True]  # (one key twice: its bytes)
        assert torch.equal(out, blocks[0])
        pool = torch.zeros((2, *store.shape), dtype=store.dtype)
        assert store.load_into(keys, list(pool.unbind(0))) == [True, True]  # views of one pool
        assert all(torch.equal(a, b) for a, b in zip(pool.unbind(0), blocks))


def test_regression_a_load_into_numpy_arrays_raised_attribute_error(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(1)
        store.save(keys, payloads(store, 1))
        with pytest.raises(BlockMismatch, match="must be torch tensors, got ndarray"):
            store.load_into(keys, [np.zeros(store.shape, dtype=np.float16)])


def test_a_sparse_destination_is_refused_as_a_block_of_another_kind_not_a_torch_error(tmp_path):
    """The destinations' buffers are first told apart by their data pointers; a sparse tensor has
    none (torch raises): it is then asked in full and refused by type, as before."""
    with make_store(tmp_path) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        sparse = torch.zeros(store.shape, dtype=store.dtype).to_sparse()
        with pytest.raises(BlockMismatch):
            store.load_into(keys, [torch.zeros(store.shape, dtype=store.dtype), sparse])


def test_a_view_of_another_shape_at_a_destinations_address_is_refused_by_shape_not_as_one_buffer(tmp_path):
    """Two destinations that start at one address are asked in full: a view of another shape is
    another element (refused further on as a block of another shape, never as one buffer)."""
    with make_store(tmp_path) as store:
        keys = keys_for(2)
        blocks = payloads(store, 2)
        store.save(keys, blocks)
        out = torch.zeros(store.shape, dtype=store.dtype)
        with pytest.raises(BlockMismatch) as refused:
            store.load_into(keys, [out, out.view(-1)])
        assert "one destination for two different keys" not in str(refused.value)
