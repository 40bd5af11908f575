"""vLLM's sleep mode for the tiered-kv connector (vLLM 0.33: ``supports_sleep_mode``,
``unregister_kv_caches``, ``restore_kv_caches``).

What vLLM 0.33 does (``v1/worker/gpu_worker.py``, ``v1/engine/core.py``): ``sleep(level >= 1)``
pauses the scheduler (aborting or draining requests, then resetting its prefix cache and
calling the connector's ``reset_cache``), synchronizes the device, calls
``unregister_kv_caches()`` on the worker-role connector and lets the sleep-mode backend release
device memory: the KV cache's pages are unmapped and their contents discarded (level 1 keeps the
weights in host RAM, level 2 drops them). ``wake_up(tags)`` maps fresh pages at the *same*
virtual addresses, then calls ``restore_kv_caches()`` when ``kv_cache`` is among the tags;
``discard(tags)`` with ``kv_cache`` calls ``unregister_kv_caches()`` too. Neither call takes an
argument: the KV tensors vLLM registered stay the same Python objects. vLLM documents both as
idempotent and promises transfers are drained before ``unregister_kv_caches``.
``supports_sleep_mode(kv_transfer_config)`` is a classmethod read when a config with
``enable_sleep_mode`` is verified; False stops start-up.

What they mean for an offload connector (no NIC registration, a store outside device memory):

- ``supports_sleep_mode``: yes. The store (host slab, disk, Redis) does not live in the device
  memory sleep releases, and outlives it: after wake-up vLLM's prefix cache is empty and the
  first requests are served from the store.
- ``unregister_kv_caches``: device->host copies still in flight are waited for and committed
  (their source pages are about to be unmapped), then the worker's layout is *parked*: while
  parked every device copy is refused (:class:`KVCachesUnregistered`); an async load that lands
  meanwhile is reported as a load error (vLLM recomputes it), never written into unmapped
  memory. Blocks already in the store stay there.
- ``restore_kv_caches``: the parked layout comes back. The tensors kept their addresses, shapes
  and dtype, so the layout detected at registration still describes them; the namespace (model,
  geometry, dtype, weights) is unchanged, so stored blocks are served again as they were.

Sleep itself changes no weights. A loop that loads *new* weights while the engine sleeps (RL
training) makes stored KV stale for the new weights; the namespace only changes with
``model_revision`` or the weight files, so such a deployment needs a new ``model_revision``
(hence a new connector) per weight version.
"""

from __future__ import annotations

import logging
from typing import Any

from tiered_kv.errors import TieredKVError

log = logging.getLogger(__name__)


class KVCachesUnregistered(TieredKVError, RuntimeError):
    """A device copy was asked for while vLLM's KV cache memory is released (sleep mode)."""


class ParkedLayout:
    """Stands in for the worker's KV layout between ``unregister_kv_caches`` and
    ``restore_kv_caches``. Its device is ``meta`` (no memory behind it), so the worker takes its
    plain path and reaches a copy at once; every copy (``gather``, ``scatter``, ...) raises."""

    def __init__(self, layout: Any) -> None:
        self.layout = layout  # the registered layout, brought back by restore_kv_caches

    @property
    def device(self):
        import torch

        return torch.device("meta")

    @property
    def dtype(self):
        return self.layout.dtype

    @property
    def name(self) -> str:
        return f"{getattr(self.layout, 'name', 'layout')} (unregistered)"

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "layout":
            raise AttributeError(attr)
        raise KVCachesUnregistered(
            f"tiered-kv: no device copy ({attr}) while vLLM's KV caches are unregistered (sleep mode); "
            "restore_kv_caches() brings them back")


def supports_sleep_mode(kv_transfer_config: Any = None) -> bool:
    """Our store lives outside the device memory sleep mode releases: always supported."""
    return True


def is_unregistered(worker: Any) -> bool:
    return isinstance(getattr(worker, "layout", None), ParkedLayout)


def unregister_kv_caches(worker: Any) -> bool:
    """Before vLLM releases the KV cache memory: commit in-flight saves, then park the layout.
    ``worker`` is the :class:`~tiered_kv.connector.worker.ConnectorWorker` (None on the
    scheduler role: nothing to do). Idempotent. True when this call parked the layout."""
    if worker is None or worker.layout is None or is_unregistered(worker):
        return False
    layout = worker.layout
    if layout.device.type == "cuda":
        import torch

        torch.cuda.synchronize(layout.device)  # engine-stream scatters of our loads included
    worker.flush_copies()  # every device->host copy committed: its source pages go next
    worker.layout = ParkedLayout(layout)
    log.info("tiered-kv: KV caches unregistered (vLLM sleep mode); the store keeps its blocks")
    return True


def restore_kv_caches(worker: Any) -> bool:
    """After vLLM mapped the KV cache memory again: bring the parked layout back (same tensors,
    same addresses, same namespace). Idempotent. True when this call restored it."""
    if worker is None or not is_unregistered(worker):
        return False
    worker.layout = worker.layout.layout
    log.info("tiered-kv: KV caches restored after wake-up (%s layout on %s)",
             getattr(worker.layout, "name", "?"), worker.layout.device)
    return True
