"""The host tier's slab: made with every page touched, by threads of the tier's own, never by
torch's OpenMP pool (whose threads then spin for milliseconds on the cores the first copies
need), and zeroed whatever memory it was made from."""

from __future__ import annotations

import mmap

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


class _CudaRuntime:
    """CUDA's runtime calls the slab makes (there is no GPU here): what was registered, and when
    it was unregistered, checked against the memory that is still mapped."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        assert ptr in self.registered, "unregistered memory it never registered"
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, error) -> str:
        return f"error {int(error)}"


@pytest.fixture
def cuda_runtime(monkeypatch) -> _CudaRuntime:
    import torch

    runtime = _CudaRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    return runtime


def test_regression_a_pinned_slab_of_slots_not_a_power_of_two_locked_the_next_power_of_two(cuda_runtime):
    # torch's pinned allocator rounds every request up to a power of two: Llama-70B's 5 MiB slots
    # at host.capacity = 64GiB locked 128 GiB (here: 3 slots of 5 MiB would lock 16 MiB)
    slab = host_slab.new_slab(3, 5 << 20, pinned=True)
    assert cuda_runtime.registered == {slab.data_ptr(): 15 << 20}  # what was asked, in place
    assert slab.data_ptr() % mmap.PAGESIZE == 0 and slab.shape == (3, 5 << 20)
    assert int(slab.count_nonzero()) == 0  # touched, as a pageable slab is


def test_a_pinned_tier_unregisters_its_slab_when_it_closes(cuda_runtime, monkeypatch):
    import gc

    monkeypatch.setattr("storage_backends.host.want_pinned", lambda pinned: True)
    tier = HostBackend(capacity=1 << 20, slot_bytes=64 * KiB)
    (ptr,) = cuda_runtime.registered
    gc.disable()  # (not waiting for a collection)
    try:
        tier.close()
        assert cuda_runtime.unregistered == [ptr]
    finally:
        gc.enable()


def test_a_pinned_slab_stays_registered_while_a_view_uses_it(cuda_runtime):
    import gc

    slab = host_slab.new_slab(8, 64 * KiB, pinned=True)
    ptr, view = slab.data_ptr(), slab[2:4]
    del slab
    gc.collect()
    assert cuda_runtime.unregistered == []
    del view
    assert cuda_runtime.unregistered == [ptr]  # with the last view, before the memory is unmapped


def test_a_slab_cuda_refuses_to_lock_is_a_config_error_naming_the_setting(cuda_runtime, monkeypatch):
    from tiered_kv.errors import ConfigError

    monkeypatch.setattr(cuda_runtime, "cudaHostRegister", lambda ptr, size, flags: 2)
    with pytest.raises(ConfigError, match=r"host\.capacity.*page-locked.*error 2.*host\.pinned"):
        host_slab.new_slab(4, 64 * KiB, pinned=True)


def test_a_pinned_slab_is_not_copied_into_forked_children(cuda_runtime):
    # the kernel copies DMA-pinned private pages into a child at fork (a 64 GiB slab: 64 GiB);
    # the slab is marked so no child gets it ("dc" among the mapping's flags)
    slab = host_slab.new_slab(4, 64 * KiB, pinned=True)
    start = slab.data_ptr()
    flags = None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None and "dc" in flags, flags
