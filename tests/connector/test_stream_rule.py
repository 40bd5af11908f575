"""CUDA stream safety, checked without a GPU: every device tensor the worker's side stream uses
is allocated on that stream (or recorded on it with ``record_stream``).

The caching allocator reuses a freed block on the stream that allocated it without waiting for
other streams; a tensor allocated on the compute stream and read by the side stream can be
handed out again while the side stream still reads it. Here torch.cuda's streams, events and
CUDA allocations are replaced by stand-ins that remember which stream was current when each
tensor was made, and the layout the worker copies through is a CPU one that claims to be CUDA
and checks every tensor it is handed."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.store.helpers import NS, keys_for, make_store
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec
from tiered_kv.connector.worker import ConnectorWorker

_current = threading.local()


class FakeStream:
    def __init__(self, device=None, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        self.waited = (*getattr(self, "waited", ()), event)

    def synchronize(self) -> None:
        pass


COMPUTE = FakeStream(name="compute")


def current_stream(device=None) -> FakeStream:
    return getattr(_current, "stream", COMPUTE)


class stream_context:
    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        self.prev = current_stream()
        _current.stream = self.stream
        return self

    def __exit__(self, *exc) -> None:
        _current.stream = self.prev


class FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.synchronized = True


class CheckingLayout:
    """A CPU layout that says it is on CUDA and checks the stream rule for every input."""

    name = "checking"

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv  # [blocks, L, 2, bs, H, D]
        self.violations: list[str] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def _check(self, what: str, t: torch.Tensor) -> None:
        now = current_stream()
        made = getattr(t, "_made_on", None)
        if made is not now and now not in getattr(t, "_recorded_on", ()):
            self.violations.append(f"{what} made on {getattr(made, 'name', made)}, used on {now.name}")

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        self._check("gather block ids", block_ids)
        return self.kv.index_select(0, block_ids)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        self._check("scatter block ids", block_ids)
        self._check("scattered blocks", src)
        self.kv.index_copy_(0, block_ids, src)


@pytest.fixture
def fake_cuda(monkeypatch):
    real_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        on_cuda = device is not None and torch.device(device).type == "cuda"
        out = real_tensor(data, *args, **kwargs)
        if on_cuda:
            out._made_on = current_stream()
        return out

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            out = self.clone()  # a copy "on the device", made on the current stream
            out._made_on = current_stream()
            return out
        return real_to(self, *args, **kwargs)

    def record_stream(self, stream) -> None:
        self._recorded_on = (*getattr(self, "_recorded_on", ()), stream)

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


def test_block_ids_the_side_stream_gathers_with_are_allocated_on_the_side_stream(fake_cuda):
    store = make_store(None)
    try:
        worker = ConnectorWorker(store)
        kv = torch.randn(8, *store.shape).to(store.dtype)
        layout = CheckingLayout(kv)
        worker.layout, worker._stream = layout, torch.cuda.Stream()
        keys = keys_for(3, NS)
        worker.bind_connector_meta(ConnectorMeta(saves=[SaveSpec("r", tuple(keys), (5, 2, 7), 0)]))
        worker.wait_for_save()
        worker.flush_copies()
        assert layout.violations == []
        stored = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, stored) == [True] * 3
        assert all(torch.equal(s, kv[b]) for s, b in zip(stored, (5, 2, 7)))
    finally:
        store.close()


def test_blocks_a_load_copies_to_the_device_are_made_on_the_load_stream_and_handed_to_the_engines(fake_cuda, monkeypatch):
    """The copies run on the load stream (not behind the engine's queued work); the scatter runs
    on the engine's stream, which waits for them, and the copied tensor is recorded on it."""
    store = make_store(None)
    try:
        worker = ConnectorWorker(store)
        kv = torch.zeros(8, *store.shape).to(store.dtype)
        layout = CheckingLayout(kv)
        worker.layout, worker._stream, worker._load_stream = layout, torch.cuda.Stream(), torch.cuda.Stream(name="load")
        made = []

        def to_device(slots, device):  # the slab's bytes, "on the device", made where it runs
            out = store.slots.gather(slots)
            out._made_on = current_stream()
            made.append(out)
            return out

        monkeypatch.setattr(store.slots, "to_device", to_device)
        keys = keys_for(3, NS)
        blocks = [torch.full(store.shape, float(i + 1)).to(store.dtype) for i in range(3)]
        store.save(keys, blocks)
        worker.bind_connector_meta(ConnectorMeta(loads=[LoadSpec("r", tuple(keys), (6, 1, 4), False)]))
        worker.start_load_kv()
        assert made and made[0]._made_on is worker._load_stream
        assert COMPUTE in made[0]._recorded_on and getattr(COMPUTE, "waited", ())
        assert layout.violations == []
        assert all(torch.equal(kv[b], blk) for b, blk in zip((6, 1, 4), blocks))
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        store.close()


def test_regression_a_failed_gather_freed_host_slots_its_queued_copies_still_wrote(fake_cuda, monkeypatch):
    """A gather that failed after ``fill`` queued its non-blocking copies (a device error) freed
    the batch's host slots at once: the next block given those slots would be overwritten by the
    copies still running. The side stream is synchronized before the slots go."""
    store = make_store(None)
    try:
        worker = ConnectorWorker(store)
        worker.layout, worker._stream = CheckingLayout(torch.randn(8, *store.shape).to(store.dtype)), torch.cuda.Stream()
        pending = []  # copies "queued" on the side stream and not finished
        worker._stream.synchronize = pending.clear

        def fill(slots, data, non_blocking=False):
            pending.extend(slots)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        freed_with_copies_pending = []
        commit = store.commit_save

        def commit_save(batch, ok=True):
            if not ok:
                freed_with_copies_pending.append(list(pending))
            return commit(batch, ok)

        monkeypatch.setattr(store.slots, "fill", fill)
        monkeypatch.setattr(store, "commit_save", commit_save)
        keys = keys_for(3, NS)
        worker.bind_connector_meta(ConnectorMeta(saves=[SaveSpec("r", tuple(keys), (5, 2, 7), 0)]))
        worker.wait_for_save()
        assert freed_with_copies_pending == [[]]  # aborted once, after its copies were done
        assert store.metrics.snapshot()["events"]["saves_failed"] == 3
    finally:
        store.close()
