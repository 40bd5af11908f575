"""Layer-wise loads: a step's sync loads arrive layer group by layer group, each frame checked
before the engine's blocks get a byte of it; a frame that fails makes its block a load error
(the layers before it were checked, the ones after never written); an engine that does not wait
for every layer gets its blocks recomputed, never read before they arrived."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.connector.engine_helpers import GREEDY, connector, engine, prompt, reference
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec
from tiered_kv.connector.worker import ConnectorWorker
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store import TieredStore
from tiered_kv.store.codec import BlockCodec

NS = Namespace(model_id="layerwise", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_dim=128,
               block_size=16)  # 64 KiB a layer: a frame per layer (frames are at least 64 KiB)
BLOCKS = 6


def _config(path, **over) -> TieredKVConfig:
    return TieredKVConfig.from_dict({"host": {"capacity": "16MiB"}, "workers": 2, "layerwise_loads": True,
                                     "disk": {"url": f"lmdb://{path}", "capacity": "64MiB"}, **over})


def _payloads(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(NS.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]


def _stored(tmp_path, **over) -> tuple[list[bytes], list[torch.Tensor]]:
    keys = block_keys(NS, list(range(BLOCKS * NS.block_size)))
    payloads = _payloads(BLOCKS)
    with TieredStore(_config(tmp_path / "db", **over), NS) as store:
        store.save(keys, payloads)
        store.flush()
    return keys, payloads


def _worker(tmp_path, **over) -> tuple[ConnectorWorker, torch.Tensor]:
    store = TieredStore(_config(tmp_path / "db", **over), NS)  # empty host tier: every block from disk
    worker = ConnectorWorker(store)
    kv = torch.zeros((2, NS.num_layers, 16, NS.block_size, NS.num_kv_heads, NS.head_dim), dtype=torch.bfloat16)
    worker.register_kv_caches(kv)
    return worker, kv


def _engine_block(kv: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block`` of the engine buffer in the canonical [L, 2, bs, H, D] order."""
    return kv[:, :, block].transpose(0, 1)


def _start(worker: ConnectorWorker, keys, block_ids) -> None:
    worker.bind_connector_meta(ConnectorMeta(loads=[LoadSpec("r", tuple(keys), tuple(block_ids), False)]))
    worker.start_load_kv()


def layers_arrive_in_order(worker: ConnectorWorker, kv: torch.Tensor, keys, payloads, block_ids) -> None:
    """Load ``keys`` into ``block_ids``: when each layer's wait returns, that layer and those
    before it of every block are the payloads; no load errors; every block from the disk."""
    assert worker.streams_layers  # (a whole-block load would pass the checks below too)
    _start(worker, keys, block_ids)
    for layer in range(NS.num_layers):
        worker.wait_for_layer_load(layer)
        for b, p in zip(block_ids, payloads):
            assert torch.equal(_engine_block(kv, b)[: layer + 1], p[: layer + 1])
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.load_stats["r"] == {"disk": BLOCKS}
    worker.close()
    worker.store.close()


def test_each_layer_is_in_the_engine_blocks_when_its_wait_returns(tmp_path):
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    layers_arrive_in_order(worker, kv, keys, payloads, [3, 9, 4, 11, 0, 7])


def test_a_corrupt_later_frame_fails_its_block_after_the_checked_layers_only(tmp_path):
    keys, payloads = _stored(tmp_path)
    victim = keys[2]

    def flip_last_frame(storage_key: bytes, value: bytes):
        if not storage_key.endswith(victim):
            return None
        block = BlockCodec.segments(value)
        assert len(block.bounds) == 8  # layer_groups 8 over 8 layers: a frame per layer
        return value[:-1] + bytes([value[-1] ^ 0x40])  # the last byte lies in the last frame

    assert rewrite_stored_blocks(tmp_path / "db", flip_last_frame) == 1
    worker, kv = _worker(tmp_path)
    block_ids = [1, 2, 3, 4, 5, 6]
    _start(worker, keys, block_ids)
    for layer in range(NS.num_layers):
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == {3}
    got = _engine_block(kv, 3)
    # a layer of it is the checked frame, or untouched (when the failure was known before it was
    # copied); the failed frame never reached the engine
    assert all(torch.equal(got[layer], payloads[2][layer]) or not got[layer].any() for layer in range(7))
    assert not got[7].any()
    for b, p in zip(block_ids, payloads):
        if b != 3:
            assert torch.equal(_engine_block(kv, b), p)
    assert worker.store.metrics.misses("corrupt") == 1
    worker.close()
    worker.store.close()


def test_an_engine_that_skips_layer_waits_gets_every_block_recomputed_then_whole_loads(tmp_path):
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    _start(worker, keys[:3], [1, 2, 3])
    worker.wait_for_save()  # a forward that never called wait_for_layer_load
    assert worker.get_block_ids_with_load_errors() == {1, 2, 3}
    assert worker.layerwise is False
    _start(worker, keys[:3], [1, 2, 3])  # whole loads from now on: complete before the forward
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(_engine_block(kv, b), p) for b, p in zip([1, 2, 3], payloads))
    worker.close()
    worker.store.close()


def test_auto_loads_whole_blocks_into_a_cpu_engine(tmp_path):
    # the pool's reads and checks share the forward's cores on a CPU engine: layer-wise loads
    # measured 1.1-1.3x slower there (bench_e2e), so "auto" loads whole blocks before the forward
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path, layerwise_loads="auto")
    assert not worker.streams_layers
    _start(worker, keys[:3], [1, 2, 3])
    assert all(torch.equal(_engine_block(kv, b), p) for b, p in zip([1, 2, 3], payloads))  # before any wait
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.close()
    worker.store.close()


def test_a_reference_engine_on_cpu_predicts_whole_loads_with_auto(tmp_path):
    conn = connector(tmp_path / "db", layer_groups=4)  # layerwise_loads = "auto", the default
    engine(conn)  # registers its CPU caches
    assert not conn.worker.streams_layers and not conn.scheduler.restore.overlap
    conn.close()
    conn = connector(tmp_path / "db", layer_groups=4, layerwise_loads=True)
    engine(conn)
    assert conn.worker.streams_layers and conn.scheduler.restore.overlap == (conn.scheduler.restore.groups > 1)
    conn.close()


def test_after_an_engine_skipped_layer_waits_the_scheduler_predicts_whole_loads(tmp_path):
    conn = connector(tmp_path / "db", layerwise_loads=True)
    engine(conn)  # registers its caches
    ns = conn.store.namespace
    keys = block_keys(ns, list(range(2 * ns.block_size)))
    conn.store.save(keys, [torch.ones(conn.store.shape, dtype=conn.store.dtype)] * 2)
    assert conn.scheduler.restore.layerwise
    conn.bind_connector_meta(ConnectorMeta(loads=[LoadSpec("r", tuple(keys), (1, 2), False)]))
    conn.start_load_kv()
    conn.wait_for_save()  # a forward that never called wait_for_layer_load
    assert not conn.worker.streams_layers and not conn.scheduler.restore.layerwise
    conn.close()


def test_blocks_stored_in_one_frame_and_host_hits_load_layer_by_layer_too(tmp_path):
    keys, payloads = _stored(tmp_path, layer_groups=1)  # an older store: one frame per block
    worker, kv = _worker(tmp_path)
    worker.store.save(keys[:2], payloads[:2])  # these two are host hits
    _start(worker, keys, range(6))
    for layer in range(NS.num_layers):
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(_engine_block(kv, b), p) for b, p in zip(range(6), payloads))
    assert worker.load_stats["r"] == {"host": 2, "disk": 4}
    worker.close()
    worker.store.close()


def test_a_layerwise_read_asks_the_disk_for_every_first_frame_before_any_later_one(tmp_path):
    """A cold page cache is filled in the order the engine needs it: every block's head (header
    and table) asked for and read before a frame, then every block's first frame, then each
    later frame as its pass starts (with the whole block asked for up front, every block was
    read before layer 0 could run); every part read is one asked for first."""
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    disk = worker.store.tier("disk")
    asked: list[list[list[tuple[int, int, int]]]] = []  # per visit, what it asked for, call by call
    reads: list[list[tuple[int, int, int]]] = []  # per visit, the parts read, in order
    real_visit = disk.backend.visit_ranges

    def recording_visit(keys, visitor):
        calls, done = [], []
        asked.append(calls)
        reads.append(done)

        def recorded(sizes, reader):
            class Recorder:
                def advise(self, ranges):
                    calls.append(list(ranges))
                    return reader.advise(calls[-1])

                def read(self, i, start, into):
                    done.append((i, start, start + memoryview(into).nbytes))
                    return reader.read(i, start, into)
            visitor(sizes, Recorder())
        return real_visit(keys, recorded)

    disk.backend.visit_ranges = recording_visit
    layers_arrive_in_order(worker, kv, keys, payloads, [3, 9, 4, 11, 0, 7])
    frames = disk.segments
    assert frames is not None and len(frames) == NS.num_layers  # a frame per layer
    assert sum(len(calls[0]) for calls in asked) == BLOCKS
    for calls, done in zip(asked, reads):
        heads, passes = calls[0], calls[1:]
        assert {(start, end) for _, start, end in heads} == {(0, disk.head_bytes)}  # header and table
        assert len(passes) == len(frames)  # then one call per frame, in order
        for j, ranges in enumerate(passes):
            assert sorted(i for i, _, _ in ranges) == sorted(i for i, _, _ in heads)  # every block of the job
            assert {end - start for _, start, end in ranges} == {frames[j]}  # stored raw: exactly frame j
            assert len({start for _, start, _ in ranges}) == 1  # same place in every block
        assert done == heads + [r for ranges in passes for r in ranges]  # read as asked, in that order


@pytest.mark.parametrize("layerwise", [True, False])
def test_reference_engine_outputs_are_identical_with_layerwise_and_whole_loads(tmp_path, layerwise):
    prompts = [prompt(300, seed=5), prompt(170, seed=6)]
    conn = connector(tmp_path / "db", layerwise_loads=layerwise)
    engine(conn).generate(prompts, GREEDY)
    conn.close()
    conn = connector(tmp_path / "db", layerwise_loads=layerwise)
    out = engine(conn).generate(prompts, GREEDY)
    assert [o.num_external_tokens for o in out] == [288, 160]
    assert [o.output_token_ids for o in out] == reference(prompts)
    assert conn.worker.layerwise is layerwise  # the engine waited for every layer
    conn.close()


def test_reference_engine_recomputes_blocks_whose_last_frame_is_corrupt(tmp_path):
    prompts = [prompt(200, seed=7)]
    conn = connector(tmp_path / "db", layerwise_loads=True)
    engine(conn).generate(prompts, GREEDY)
    conn.close()
    flipped = rewrite_stored_blocks(tmp_path / "db", lambda k, v: v[:-1] + bytes([v[-1] ^ 1]))
    assert flipped == 200 // 16
    conn = connector(tmp_path / "db", layerwise_loads=True)
    [out] = engine(conn).generate(prompts, GREEDY)
    assert out.output_token_ids == reference(prompts)[0]
    assert conn.store.metrics.misses("corrupt") == 200 // 16
    conn.close()


def test_frames_are_layer_groups_of_at_least_64_kib():
    from tiered_kv.store.layer_frames import layer_segments

    llama8b = Namespace(model_id="8b", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    raw = 2 << 20
    assert layer_segments(llama8b, raw, 8) == [256 << 10] * 8
    assert layer_segments(llama8b, raw, 1) is None
    small = Namespace(model_id="s", dtype="bfloat16", num_layers=8, num_kv_heads=2, head_dim=16, block_size=16)
    assert layer_segments(small, 16 << 10, 8) is None  # 2 KiB a layer: one frame
    assert layer_segments(NS, 8 * (64 << 10), 3) == [2 * (64 << 10), 3 * (64 << 10), 3 * (64 << 10)]


@pytest.mark.parametrize("stored, read, cut_after, keep_blobs", [
    ("raw", {}, "the first pass", False),
    ("zstd", {}, "the first pass", False),  # compressed frames: several lie inside the head's range
    ("raw", {"layer_groups": 2}, "the first pass", False),  # a reader framing blocks coarser than they are
    ("raw", {}, "the first pass", True),  # every byte kept: read into the block's own buffer
    ("raw", {}, "the last pass", True),  # after the last frame nothing more is read: all whole
])
def test_regression_a_segment_cut_short_between_layer_passes_killed_the_engine_with_sigbus(
        tmp_path, stored, read, cut_after, keep_blobs):
    """A layer-wise read touched the segment's memory map frame by frame; the file cut short
    between passes (damage, a tool) made a later touch reach pages the file no longer has, and
    SIGBUS ended the process. Frames are now read (``preadv``) when their pass starts: the
    blocks whose bytes are gone are misses (``unreadable``), the others arrive whole. In a
    child process, so a regression fails this test instead of killing the test run."""
    import json
    import subprocess
    import sys
    import textwrap

    disk = {"url": f"lmdb://{tmp_path / 'db'}", "capacity": "64MiB", "codec": stored}
    keys = block_keys(NS, list(range(BLOCKS * NS.block_size)))
    payloads = _payloads(BLOCKS)
    if stored == "zstd":  # values that compress well: frames 1, 2, ... lie inside the head's range
        payloads = [p.round() for p in payloads]
    with TieredStore(_config(tmp_path / "db", disk=disk), NS) as store:
        store.save(keys, payloads)
        store.flush()
    torch.save(payloads, tmp_path / "payloads.pt")
    script = textwrap.dedent(f"""
        import json, os, torch
        from tests.backends.test_lmdb_segments import place_of
        from tests.connector.test_layerwise_loads import NS, _config
        from tiered_kv.keys import block_keys
        from tiered_kv.store import TieredStore
        payloads = torch.load({str(tmp_path / "payloads.pt")!r})
        keys = block_keys(NS, list(range(len(payloads) * NS.block_size)))
        store = TieredStore(_config({str(tmp_path / "db")!r}, **{read!r}), NS)
        disk = store.tier("disk")
        files = disk.backend.values.files
        places = [place_of(disk.backend, disk.ns + k) for k in keys]
        segment = max(set(p.segment for p in places), key=[p.segment for p in places].count)
        order = sorted((p.offset, i) for i, p in enumerate(places) if p.segment == segment)
        victim = places[order[len(order) // 2][1]]  # one in the middle of the file
        cut = (victim.offset + victim.length // 2) // 4096 * 4096  # (a page's end: its rest is zeros)
        lost = [p.segment == segment and p.offset + p.length > cut for p in places]
        outs = [torch.zeros_like(p) for p in payloads]
        passes = []
        def on_ready(ready, end):
            passes.append(ready)
            if len(passes) == ({cut_after == "the first pass"} or NS.num_layers):
                os.truncate(files.path_of(segment), cut)  # the victim cut in half, what follows it gone
        reasons, blobs = disk.read_layered(keys, [o.view(-1).view(torch.uint8).numpy() for o in outs], on_ready,
                                           keep_blobs={keep_blobs})
        print(json.dumps([lost, reasons, [torch.equal(o, p) for o, p in zip(outs, payloads)], len(passes),
                          [b is not None for b in blobs]]))
        store.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lost, reasons, right, passes, kept = json.loads(proc.stdout)
    assert any(lost) and not all(lost), "the cut takes some blocks and leaves others whole"
    if cut_after == "the last pass":
        lost = [False] * len(lost)  # every frame was read and checked before the cut
    assert reasons == ["unreadable" if gone else None for gone in lost]
    assert passes == NS.num_layers and kept == [keep_blobs and not gone for gone in lost]
    assert right == [not gone for gone in lost]


def test_a_wait_for_a_layer_past_the_namespaces_loads_every_layer_and_fails_no_block(tmp_path):
    # an adapter counting layers from 1 (or waiting once with the layer count) asks for layer
    # num_layers: the copy ran past the blocks' end and failed every block of every layer-wise
    # load, step after step (layer-wise loads stayed on)
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    block_ids = [3, 9, 4, 11, 0, 7]  # short runs: the batched copy path
    _start(worker, keys, block_ids)
    worker.wait_for_layer_load(NS.num_layers)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(_engine_block(kv, b), p) for b, p in zip(block_ids, payloads))
    worker.close()
    worker.store.close()
