"""A small SGLang HiCache stack on CPU: a device KV pool, SGLang's real host pool for one layout,
and SGLang's own cache controller (``HiCacheController`` or ``HybridCacheController``) with an L3
backend attached through the ``dynamic`` storage factory.

The rig plays the scheduler's part only where SGLang's radix tree would: it allocates host slots
for a storage hit and hands the prefetch to the controller's I/O thread, and it waits on the
controller's own ack queues (``queue.get`` with a generous hang guard, never a timing check).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.integrations.sglang_real import cpu_copies
from tests.integrations.sglang_real.backends import BackendSpec

log = logging.getLogger(__name__)

PAGE_SIZE = 4
LAYERS = 3
DEVICE_TOKENS = 128
HANG_GUARD_S = 120  # only so a broken thread fails the test instead of hanging it

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # MLA host pool has no page_head


@dataclass
class Fetch:
    """What one prefetch got: tokens SGLang's hit query counted, tokens its I/O thread read into
    the host pool, and the KV those tokens hold once loaded back to the device pool."""
    queried_tokens: int
    read_tokens: int
    kv: list[torch.Tensor]


def device_pool(attention: str, dtype: torch.dtype, *, page_size: int = PAGE_SIZE,
                tokens: int = DEVICE_TOKENS):
    """SGLang's own device KV pool on CPU: MHA (2 heads of 8) or MLA (latent 16 + RoPE 8)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if attention == "mha":
        return MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=2,
                                head_dim=8, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def host_pool(device_pool, layout: str, *, dcp_size: int = 1, dcp_rank: int = 0):
    """SGLang's own host pool mirroring ``device_pool`` in ``layout`` (MLA pools may hold one
    decode-context-parallel shard: ``dcp_size`` / ``dcp_rank``)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = device_pool.get_device_pool_infos()[0].buffer_info
    common = dict(host_to_device_ratio=2.0, host_size=0, page_size=device_pool.page_size, layout=layout,
                  pin_memory=False, device="cpu", device_capacity_tokens=device_pool.size,
                  start_layer=device_pool.start_layer, end_layer=device_pool.end_layer)
    if isinstance(device_pool, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, override_kv_cache_dim=device_pool.kv_cache_dim,
                                    target_layer_num=device_pool.layer_num, dcp_size=dcp_size,
                                    dcp_rank=dcp_rank, **common)
    return get_mha_host_pool_cls(info)(info, **common)


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's storage keys of the pages of ``tokens`` (its chained page hashes)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=page_size)


def random_kv(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random KV of ``dtype``: normal values, or every byte value for byte-typed pools (fp8 KV
    is held as uint8)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(dtype)


def device_kv_layers(device_pool) -> list[torch.Tensor]:
    """Every per-layer device buffer (K then V for MHA, the one latent buffer for MLA)."""
    if hasattr(device_pool, "k_buffer"):
        return list(device_pool.k_buffer) + list(device_pool.v_buffer)
    return list(device_pool.kv_buffer)


class Rig:
    def __init__(self, *, controller: str, attention: str, layout: str, dtype: torch.dtype,
                 backend: BackendSpec, storage_dir: Path, interface_v1: bool = False,
                 write_policy: str = "write_through", page_size: int = PAGE_SIZE,
                 device_tokens: int = DEVICE_TOKENS, tp_rank: int = 0, tp_size: int = 1):
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        cpu_copies.install()
        self._exit = contextlib.ExitStack()
        self.page_size = page_size
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
        # No torch.distributed here (no TP group: SGLang then skips its cross-rank reductions):
        # one rank of ``tp_size`` as SGLang's own unit fixtures force it.
        self._exit.enter_context(get_parallel().override(
            tp_rank=tp_rank, tp_size=tp_size, attn_tp_rank=tp_rank, attn_tp_size=tp_size,
            moe_tp_size=tp_size, pp_rank=0, pp_size=1))
        self.device_pool = device_pool(attention, dtype, page_size=page_size, tokens=device_tokens)
        self.allocator = TokenToKVPoolAllocator(size=device_tokens, dtype=dtype, device="cpu",
                                                kvcache=self.device_pool, need_sort=False)
        self.host_pool = host_pool(self.device_pool, layout)
        self.hybrid = controller == "hybrid"
        extra = backend.extra_config(storage_dir, interface_v1=interface_v1)
        common = dict(write_policy=write_policy, io_backend="kernel", storage_backend="dynamic",
                      model_name="tiny-test-model", storage_backend_extra_config=extra)
        if self.hybrid:
            from sglang.srt.mem_cache.hicache_storage import PoolName
            from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
            from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
            from sglang.srt.mem_cache.pool_host import HostPoolGroup

            group = HostPoolGroup([build_pool_entry(
                name=PoolName.KV, host_pool=self.host_pool, device_pool=self.device_pool,
                layer_mapping={i: i for i in range(LAYERS)}, transfer_layer_id_max=LAYERS, is_anchor=True)])
            self.controller = HybridCacheController(self.allocator, group, page_size, None,
                                                    load_cache_event=threading.Event(),
                                                    transfer_layer_id_max=LAYERS, **common)
        else:
            from sglang.srt.managers.cache_controller import HiCacheController

            self.controller = HiCacheController(self.allocator, self.host_pool, page_size, None,
                                                threading.Event(), **common)
        self._exit.callback(self.controller.detach_storage_backend)
        self._requests = 0

    # -- the scheduler's side -------------------------------------------------------------------
    def page_hashes(self, tokens: list[int]) -> list[str]:
        return page_hashes(tokens, self.page_size)

    def fill_device(self, n_tokens: int, seed: int) -> torch.Tensor:
        """Fresh device slots holding random KV; returns the slot indices."""
        slots = self.allocator.alloc(n_tokens)
        gen = torch.Generator().manual_seed(seed)
        for buf in device_kv_layers(self.device_pool):
            buf[slots] = random_kv(buf[slots].shape, buf.dtype, gen)
        return slots

    def device_kv(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [buf[slots].clone() for buf in device_kv_layers(self.device_pool)]

    def to_host(self, device_slots: torch.Tensor) -> torch.Tensor:
        """Device -> host pool through the controller's write path (L2 backup)."""
        host = self.controller.write(device_slots)
        assert host is not None, "host pool full"
        for ack in self.controller.ack_write_queue:
            ack.finish_event.synchronize()
        self.controller.ack_write_queue.clear()
        return host

    def to_storage(self, host_slots: torch.Tensor, tokens: list[int], pages: range | None = None) -> int:
        """Host -> L3 on the controller's backup thread; returns the tokens it reports stored.
        ``pages`` writes only those pages of the sequence (a hole elsewhere stays unwritten)."""
        hashes = self.page_hashes(tokens)
        pages = pages if pages is not None else range(len(hashes))
        lo, hi = pages.start * self.page_size, pages.stop * self.page_size
        op_id = self.controller.write_storage(host_slots[lo:hi], tokens[lo:hi], hash_value=hashes[pages.start:pages.stop])
        done = self.controller.ack_backup_queue.get(timeout=HANG_GUARD_S)
        assert done.id == op_id
        return done.completed_tokens

    def evict_host(self, host_slots: torch.Tensor) -> None:
        """Drop the pages from the host pool and wipe its memory, so a later read can only come
        from L3."""
        self.controller.evict_host(host_slots)
        buffer = self.host_pool.kv_buffer
        buffer.zero_()

    def check_cut_at_a_hole(self, tokens: list[int], hole: int, seed: int) -> None:
        """Back ``tokens`` up to L3 but for page ``hole``, empty the host pool and prefetch them:
        only the pages before the hole are reported and read, with the bytes written."""
        from tests.integrations.sglang_real.kv_bits import first_tokens, same_bits

        pages = len(tokens) // self.page_size
        slots = self.fill_device(len(tokens), seed=seed)
        want = self.device_kv(slots)
        host = self.to_host(slots)
        assert self.to_storage(host, tokens, pages=range(0, hole)) == hole * self.page_size
        assert self.to_storage(host, tokens, pages=range(hole + 1, pages)) == (pages - hole - 1) * self.page_size
        self.evict_host(host)
        got = self.fetch(tokens)
        assert (got.queried_tokens, got.read_tokens) == (hole * self.page_size, hole * self.page_size)
        assert same_bits(got.kv, first_tokens(want, hole * self.page_size))

    def fetch(self, tokens: list[int]) -> Fetch:
        """Prefetch ``tokens`` from L3 into the host pool, then load what arrived to the device."""
        self._requests += 1
        rid = f"req-{self._requests}"
        cc = self.controller
        if self.hybrid:
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

            op = cc.prefetch(CacheRequestHandle(rid, 0), tokens)
        else:
            op = cc.prefetch(rid, tokens)
        hit = cc.prefetch_hit_queue.get(timeout=HANG_GUARD_S)
        assert hit is op
        queried = op.storage_hit_count
        if queried == 0:
            return Fetch(0, 0, [])
        host_slots = cc.alloc_prefetch_host_buffers(op, queried)
        op.host_indices = host_slots
        cc.prefetch_buffer.put(op)
        read = 0
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=HANG_GUARD_S)
            if ack.completed_tokens is not None:
                read = ack.completed_tokens
            if ack.completed_req:
                break
        kv = self._load(host_slots[:read]) if read else []
        self.host_pool.free(host_slots)
        return Fetch(queried, read, kv)

    def _load(self, host_slots: torch.Tensor) -> list[torch.Tensor]:
        cc = self.controller
        device_slots = cc.load(host_slots)
        assert device_slots is not None, "device pool full"
        cc.start_loading()
        for ack in cc.ack_load_queue:
            ack.finish_event.synchronize()
        cc.ack_load_queue.clear()
        kv = self.device_kv(device_slots)
        self.allocator.free(device_slots)
        return kv

    def close(self) -> None:
        self._exit.close()
