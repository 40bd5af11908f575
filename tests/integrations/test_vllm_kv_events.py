"""vLLM's real engine on CPU publishing KV events over ZMQ (``pytest -m vllm``;
``tools/check_vllm.sh`` runs it): a router subscribed to the engine's ``--kv-events-config``
publisher learns from the connector which tier holds which block (``BlockStored`` with
``medium`` "host" and "disk" for the served prompts), and that the host tier let blocks go
(``BlockRemoved``, "host") when it ran out of room. The disk tier is written as the host lets
blocks go (``on_evict``), so which blocks the host evicts follows from its LRU alone: with a
write-through disk it also hung on how far the write-behind had got (a slot still being written
is not evicted, and a save finding every slot so leased is dropped), and some runs evicted
nothing."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.integrations.test_vllm_engine import BLOCK, result

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM's real engine: run tools/check_vllm.sh")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """A subscriber of vLLM's KV event stream, as a cache-aware router runs one."""

    def __init__(self, port: int) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(f"tcp://127.0.0.1:{port}")  # before the engine binds: nothing is missed
        self.events: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                _topic, _seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.events += self.decoder.decode(payload).events

    def close(self) -> list:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        return self.events


def blocks_on_disk(url: str) -> int:
    from tiered_kv.admin.opening import open_tier
    from tiered_kv.admin.verify import verify_tier

    tier = open_tier(url)
    try:
        return verify_tier(tier)["valid_blocks"]
    finally:
        tier.close()


def test_a_router_learns_which_tier_holds_each_block_and_what_the_host_let_go(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    port = free_port()
    router = Router(port)
    # a host tier of eight blocks (32 KiB each), which the served prompts overflow, and a disk
    # tier written as the host lets blocks go (``on_evict``): what the host evicts is decided by
    # its LRU alone, not by how far the write-behind of a write-through disk has got
    extra = {"host": {"capacity": "256KiB"}, "disk": {"policy": "on_evict"}}
    try:
        run = result(tmp_path, "--kv-events", f"tcp://*:{port}", extra=extra)
    finally:
        events = router.close()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    on = {m: {h for e in stored if e.medium == m for h in e.block_hashes} for m in ("host", "disk")}
    # what the router was told the disk holds is what it holds (saves the full host tier had no
    # room to stage were dropped, and counted, not announced)
    assert run["outputs"] and 0 < len(on["disk"]) == blocks_on_disk(f"lmdb://{tmp_path}/store")
    assert on["host"] and all(e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
                              for e in stored)
    gone = {h for e in removed if e.medium == "host" for h in e.block_hashes}
    assert gone and gone <= on["host"]
    assert on["disk"] <= gone  # the disk was written what the host let go, nothing else
    assert not any(e.medium == "disk" for e in removed)  # the disk tier kept every block
