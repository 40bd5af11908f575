"""Plain torch copies in place of SGLang's CUDA-only device<->host KV copy kernels.

SGLang's host pools move KV between the device pool and the host pool with ``sgl_kernel``'s
``kvcacheio`` kernels (or JIT CUDA kernels); neither exists on a CPU-only machine. This module
replaces exactly those two methods per host pool class, ``backup_from_device_all_layer`` and
``load_to_device_per_layer``, with indexed torch copies that address the same host slots for
each host layout. Everything else (the controllers, the storage threads, the host pools' own page
views ``get_data_page`` / ``set_from_flat_data_page`` / ``get_page_buffer_meta``, the radix tree)
is SGLang's code, unchanged. ``install()`` is idempotent and is called by the test conftest and
by the radix-cache role processes.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_INSTALLED = False


def _mha_host_rows(host, kv: int, layer: int, idx: torch.Tensor):
    """(view, index) such that ``view[index]`` is the [n, heads, head_dim] host rows of tokens
    ``idx`` in ``layer``; ``kv`` is 0 for K, 1 for V."""
    buf = host.kv_buffer[kv]
    ps = host.page_size
    if host.layout == "layer_first":  # [L, size, H, D]
        return buf[layer], (idx,)
    if host.layout == "page_first":  # [size, L, H, D]
        return buf[:, layer], (idx,)
    if host.layout == "page_first_direct":  # [pages, L, ps, H, D]
        return buf[:, layer], (idx // ps, idx % ps)
    if host.layout == "page_head":  # [pages, H, ps, L, D]
        return buf[:, :, :, layer], (idx // ps, slice(None), idx % ps)
    raise ValueError(f"no CPU copy for MHA host layout {host.layout!r}")


def _mla_host_rows(host, layer: int, idx: torch.Tensor):
    """(view, index) such that ``view[index]`` is the [n, 1, kv_cache_dim] host rows."""
    buf = host.kv_buffer
    ps = host.page_size
    if host.layout == "layer_first":  # [L, size, 1, dim]
        return buf[layer], (idx,)
    if host.layout == "page_first":  # [size, L, 1, dim]
        return buf[:, layer], (idx,)
    if host.layout == "page_first_direct":  # [pages, L, ps, 1, dim]
        return buf[:, layer], (idx // ps, idx % ps)
    raise ValueError(f"no CPU copy for MLA host layout {host.layout!r}")


def _as_index(indices) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64)


def _mha_backup(self, device_pool, host_indices, device_indices, io_backend):
    h, d = _as_index(host_indices), _as_index(device_indices)
    for layer in range(self.layer_num):
        for kv, device_buffers in ((0, self.device_k_buffers), (1, self.device_v_buffers)):
            view, index = _mha_host_rows(self, kv, layer, h)
            view[index] = device_buffers[layer][d].to(view.device)


def _mha_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    h, d = _as_index(host_indices), _as_index(device_indices)
    for kv, device_buffers in ((0, self.device_k_buffers), (1, self.device_v_buffers)):
        view, index = _mha_host_rows(self, kv, layer_id, h)
        target = device_buffers[layer_id]
        target[d] = view[index].to(target.device)


def _mla_backup(self, device_pool, host_indices, device_indices, io_backend):
    h, d = _as_index(host_indices), _as_index(device_indices)
    for layer in range(self.layer_num):
        view, index = _mla_host_rows(self, layer, h)
        view[index] = self.device_kv_buffers[layer][d].to(view.device)


def _mla_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
    host_layer = self._host_layer_by_controller.get(layer_id)
    if host_layer is None:
        return
    h, d = _as_index(host_indices), _as_index(device_indices)
    view, index = _mla_host_rows(self, host_layer, h)
    target = self.device_kv_buffers[self._buffer_index_by_layer[layer_id]]
    target[d] = view[index].to(target.device)


def install() -> None:
    """Swap the two copy methods of SGLang's MHA and MLA host pools for the torch ones."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    MHATokenToKVPoolHost.backup_from_device_all_layer = _mha_backup
    MHATokenToKVPoolHost.load_to_device_per_layer = _mha_load
    MLATokenToKVPoolHost.backup_from_device_all_layer = _mla_backup
    MLATokenToKVPoolHost.load_to_device_per_layer = _mla_load
    _INSTALLED = True
    log.info("SGLang host pools use plain torch device<->host copies (no CUDA kernels here)")
