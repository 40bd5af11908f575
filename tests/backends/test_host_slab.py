"""The host tier's slab: made with every page touched, by threads of the tier's own, never by
torch's OpenMP pool (whose threads then spin for milliseconds on the cores the first copies
need), and zeroed whatever memory it was made from."""

from __future__ import annotations

import numpy as np
import pytest
from torch.autograd.profiler import profile

from storage_backends import host_slab
from storage_backends.host import HostBackend

KiB = 1 << 10


def test_opening_a_host_tier_runs_no_torch_op_over_its_slab():
    with profile() as ran:
        tier = HostBackend(capacity=4 << 20, slot_bytes=64 * KiB, pinned=False)
    ops = {event.name for event in ran.function_events}
    assert not ops & {"aten::zero_", "aten::fill_", "aten::copy_"}, ops
    assert int(tier.slab.count_nonzero()) == 0
    tier.close()


def test_a_slab_touched_in_pieces_over_several_threads_is_zero_to_the_last_byte(monkeypatch):
    monkeypatch.setattr(host_slab, "TOUCH_PIECE_BYTES", 64 * KiB)
    used = np.full(1 << 20, 7, np.uint8)  # memory that held something: 16 pieces
    used[-1] = 9
    host_slab.touch(used)
    assert not used.any()


def test_regression_a_host_capacity_this_machine_cannot_give_was_a_raw_allocator_error(tmp_path):
    # torch's allocator refusal (a RuntimeError) came out of the store's start untyped; it is a
    # configuration error naming the setting, and the store that asked started nothing
    from tests.store.helpers import NS
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.errors import ConfigError
    from tiered_kv.store import TieredStore

    with pytest.raises(ConfigError, match="host.capacity: cannot allocate"):
        HostBackend(capacity=1 << 60, slot_bytes=64 * KiB, pinned=False)
    config = TieredKVConfig.from_dict({"host": {"capacity": 1 << 60}, "disk": {"url": f"lmdb://{tmp_path}/d"}})
    with pytest.raises(ConfigError, match="host.capacity"):
        TieredStore(config, NS)
    TieredStore(config.with_overrides(host={"capacity": 4 << 20}), NS).close()  # (its disk was closed)
