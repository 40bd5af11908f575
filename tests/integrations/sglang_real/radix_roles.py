"""One side of the persistence scenarios, run in its own process: SGLang's radix-cache test kit
(``sglang.test.kits.unified_radix_cache``) driving a real ``UnifiedRadixCache`` with HiCache and
an L3 backend attached through ``--hicache-storage-backend dynamic``.

    python -m tests.integrations.sglang_real.radix_roles produce|serve|consume <settings.json>

The settings file holds one job, or ``{"jobs": [...]}``: several independent servers run one after
the other in the process (each its own radix cache, controller and backend instance), and the
process prints one result per job. Each job names its ``storage_dir``; ``backend_config`` replaces
top-level keys of the backend's extra config (a shared Redis, no disk tier, ...), and
``prefetch_timeout_base`` / ``prefetch_timeout_per_ki_token`` go where SGLang reads them.

``produce`` inserts a sequence, fills its KV with random values (saved to ``expected``), backs it
up to host and writes it to L3 with the kit's helpers, then exits. ``serve`` (radix_serve.py)
lets SGLang's write policy decide when pages reach L3. ``consume`` (a new process, same storage)
prefetches the sequence from L3 under the job's prefetch policy, loads what arrived back to the
device and reports how many tokens came from L3 and whether they are bit-exact. The kit's own
``_init_hicache`` only wires the ``file`` backend; ``Role._init_hicache`` wires ``dynamic`` the
same way (single-rank topology, prefetch threshold 1, non-pinned host pool); the kit's device is
"cpu" and device<->host copies are cpu_copies' torch ones.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
import unittest
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _role_class(settings: dict):
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig
    from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

    from tests.integrations.sglang_real import cpu_copies
    from tests.integrations.sglang_real.backends import BACKENDS

    cpu_copies.install()
    # The kit asks SGLang for the accelerator; there is none here, and the device pool is on CPU.
    import sglang.test.kits.unified_radix_cache.fixtures as kit_fixtures

    kit_fixtures.get_device = lambda: "cpu"
    spec = next(b for b in BACKENDS if b.id == settings["backend"])
    cfg = CacheConfig(page_size=settings["page_size"], components=(ComponentType.FULL,), num_layers=4,
                      full_attention_layer_ids=(0, 1, 2, 3))

    class Role(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
        def runTest(self):  # unittest needs one; the roles call the kit's helpers directly
            pass

        def _init_hicache(self, cache, *, write_policy=settings["write_policy"], **_):
            from unittest import mock

            import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler
            from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
            from sglang.srt.runtime_context import get_parallel
            from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
            from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin

            topology = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
            topology.__enter__()
            self.addCleanup(topology.__exit__, None, None, None)
            real_cls = assembler.get_mha_host_pool_cls

            def unpinned(info):  # CPU torch cannot pin memory
                cls = real_cls(info)
                return lambda *a, **k: cls(*a, **{**k, "pin_memory": False})

            patcher = mock.patch.object(assembler, "get_mha_host_pool_cls", side_effect=unpinned)
            patcher.start()
            self.addCleanup(patcher.stop)
            extra = spec.extra_config(Path(settings["storage_dir"]), interface_v1=settings["interface_v1"],
                                      prefetch_threshold=1, **_sglang_keys(settings))
            extra.update(settings.get("backend_config") or {})
            server_args = ServerArgs(
                model_path="dummy", served_model_name="tiny-test-model", page_size=self.cfg.page_size,
                hicache_io_backend="kernel",
                hicache_mem_layout=settings["layout"], hicache_write_policy=write_policy,
                hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra),
                hicache_storage_prefetch_policy=settings["prefetch_policy"])
            server_args._mamba_cache_chunk_size = max(CHUNK_SIZE, self.cfg.page_size)
            set_global_server_args_for_scheduler(server_args)
            cache.init_hicache(server_args, cache.cache_init_params)
            self.addCleanup(drop_hicache_atexit_pin, cache)
            self.addCleanup(cache.release_host_resources)
            if not settings.get("tree_writes"):  # the helpers decide what is backed up, not the tree
                cache.write_through_threshold = 1 << 30
            cache.load_back_threshold = 0
            cc = cache.cache_controller
            cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
            self.addCleanup(cc._stop_storage_threads)

    Role.cfg = cfg
    return Role


def _sglang_keys(settings: dict) -> dict:
    """Extra-config keys SGLang itself reads (and pops) for the prefetch stop policy."""
    keys = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token")
    return {k: settings[k] for k in keys if k in settings}


def _full_kv(role, allocator, indices) -> list[torch.Tensor]:
    pool = role._get_full_kv_pool(allocator)
    return [b[indices].clone() for layer in range(pool.start_layer, pool.end_layer)
            for b in (pool.get_key_buffer(layer), pool.get_value_buffer(layer))]


def _randomize(role, allocator, indices, seed: int) -> None:
    pool = role._get_full_kv_pool(allocator)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(pool.start_layer, pool.end_layer):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buf[indices] = torch.randn(buf[indices].shape, generator=gen).to(buf.dtype)


def produce(settings: dict) -> dict:
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    role = _role_class(settings)()
    try:
        cache, allocator, rtp = build_fixture(role.cfg)
        role._init_hicache(cache)
        seq = settings["tokens"]
        role._insert(cache, allocator, rtp, seq)
        leaf = match_prefix(cache, seq).last_device_node
        indices = cache.path_device_indices(leaf)
        _randomize(role, allocator, indices, seed=settings.get("seed", 11))
        torch.save(_full_kv(role, allocator, indices), settings["expected"])
        role._backup_node(cache, leaf)
        role._write_path_to_l3(cache, leaf)
        role._flush_l3_backups(cache)
        hashes = role._all_page_hashes(cache, leaf)
        return {"stored_pages": role._storage_exists_count(cache, hashes), "pages": len(hashes)}
    finally:
        role.doCleanups()


def consume(settings: dict) -> dict:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    from tests.integrations.sglang_real.scheduler_steps import prefetch

    role = _role_class(settings)()
    try:
        cache, allocator, _ = build_fixture(role.cfg)
        role._init_hicache(cache)
        seq = settings["tokens"]
        before = match_prefix(cache, seq)
        prefetch(cache, seq, CacheRequestHandle("consumer", 0), admit=settings.get("admit", "at_once"))
        after = match_prefix(cache, seq)
        result = {"device_before": before.device_prefix_len, "host_before": before.host_hit_length,
                  "host_hit": after.host_hit_length, "device_prefix": after.device_prefix_len}
        if after.host_hit_length:
            role._load_back_node(cache, after.last_host_node)
        final = match_prefix(cache, seq)
        indices = cache.path_device_indices(final.last_device_node)
        got = _full_kv(role, allocator, indices)
        want = torch.load(settings["expected"])
        from tests.integrations.sglang_real.kv_bits import first_tokens, same_bits

        result["loaded_tokens"] = int(indices.numel())
        result["bit_exact"] = same_bits(got, first_tokens(want, int(indices.numel())))
        return result
    finally:
        role.doCleanups()


def _one(run, job: dict) -> dict:
    """One job of several: its failure is its own result, the next job still runs."""
    try:
        return run(job)
    except Exception:
        return {"error": traceback.format_exc()}


def main(argv: list[str]) -> int:
    from tests.integrations.sglang_real.radix_serve import serve

    logging.basicConfig(level=logging.WARNING)
    phase, path = argv
    settings = json.loads(Path(path).read_text())
    run = {"produce": produce, "serve": serve, "consume": consume}[phase]
    if "jobs" in settings:
        out = [_one(run, job) for job in settings["jobs"]]
    else:
        out = run(settings)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
