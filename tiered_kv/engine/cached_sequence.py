"""One interface between the model's cached resources and the cache managers (AutoDeploy-style).

:class:`CachedSequenceInterface` collects every layer's resource handlers
(:mod:`.cache_resources`), checks which ones one manager can own, creates that manager and hands
every layer its views:

- **paged** handlers equal to the first one share the manager's block pool (full-attention K/V or
  MLA latents); any other paged handler gets a pool of its own next to its layer;
- **SSM** handlers equal to the first one are managed; a **causal-conv** handler is managed when
  its layer's SSM is and it has the conv width that SSM implies,
  ``conv_dim = head_dim*num_heads + 2*n_groups*d_state`` (the manager lays a layer's state out
  from the SSM's sizes); **generic** state handlers are never managed;
- with managed state the manager is a :class:`~.state_cache_manager.HybridCacheManager` (KV +
  state slots), otherwise a KV-only :class:`~.kv_cache_manager.KVCacheManager`.

A resource allocated next to its layer works, but the manager does not own it and no connector
can store it: :attr:`CachedSequenceInterface.local_reasons` says why, and
:meth:`CachedSequenceInterface.check_storable` refuses a connector while any state is local.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tiered_kv.dtypes import torch_dtype
from tiered_kv.engine.cache_resources import (
    CausalConvHandler,
    LatentHandler,
    PagedKVHandler,
    ResourceHandler,
    SSMStateHandler,
    check_handler,
)
from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.kv_cache_manager import KVCacheManager, paged_layer_view, paged_pool_shape
from tiered_kv.engine.state_cache_manager import HybridCacheManager, StateLayout
from tiered_kv.errors import ConfigError
from tiered_kv.kv_groups import KVGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resource:
    """One handler of one layer."""

    name: str  # module path and resource name, e.g. "model.layers.0.mixer.conv_state"
    layer: nn.Module  # the module that uses it (has bind_cache)
    key: str  # the resource's name in the layer
    handler: ResourceHandler  # what it needs


def collect_resources(model: nn.Module) -> list[Resource]:
    """Every caching module's handlers, in module order."""
    found = []
    for path, module in model.named_modules():
        declare = getattr(module, "cache_resources", None)
        if declare is None:
            continue
        for key, handler in declare().items():
            check_handler(f"{path}.{key}", handler)
            found.append(Resource(f"{path}.{key}", module, key, handler))
    return found


class CachedSequenceInterface:
    def __init__(self, resources: list[Resource], model_config: ModelConfig, engine_config: EngineConfig,
                 device: torch.device) -> None:
        self.resources = resources
        self.engine_config = engine_config
        self.device = device
        self.local_reasons: dict[str, str] = {}  # resource name -> why it is not managed
        self.local: dict[str, torch.Tensor] = {}  # resource name -> its own allocation
        self.paged = self._managed_paged()
        self.ssm, self.conv = self._managed_state()
        for name, reason in self.local_reasons.items():
            logger.warning("cache resource %s is allocated locally (not managed, not stored): %s", name, reason)
        page = self.paged[0].handler if self.paged else PagedKVHandler(model_config.dtype, num_kv_heads=1,
                                                                       head_dim=1)
        paged = dict(page=page, num_layers=max(1, len(self.paged)))
        if self.ssm:
            conv = self.conv[0].handler if self.conv else None
            self.state_layout: StateLayout | None = StateLayout(self.ssm[0].handler, conv)  # type: ignore[arg-type]
            self.manager: KVCacheManager = HybridCacheManager(
                model_config, engine_config, device, state_layout=self.state_layout,
                num_state_layers=len(self.ssm), **paged)
        else:
            self.state_layout = None
            self.manager = KVCacheManager(model_config, engine_config, device, **paged)
        self._allocate_local()

    @classmethod
    def from_model(cls, model: nn.Module, model_config: ModelConfig, engine_config: EngineConfig,
                   device: torch.device) -> CachedSequenceInterface:
        return cls(collect_resources(model), model_config, engine_config, device)

    # ---- compatibility -------------------------------------------------------------------------
    def _managed_paged(self) -> list[Resource]:
        paged = [r for r in self.resources if r.handler.paged]
        if not paged:
            return []
        first = paged[0].handler
        for r in paged[1:]:
            if r.handler != first:
                self.local_reasons[r.name] = f"its pages {r.handler} differ from the managed pages {first}"
        return [r for r in paged if r.name not in self.local_reasons]

    def _managed_state(self) -> tuple[list[Resource], list[Resource]]:
        state = [r for r in self.resources if not r.handler.paged]
        ssm = [r for r in state if isinstance(r.handler, SSMStateHandler)]
        if ssm:
            for r in ssm[1:]:
                if r.handler != ssm[0].handler:
                    self.local_reasons[r.name] = f"its SSM state {r.handler} differs from the managed {ssm[0].handler}"
        ssm = [r for r in ssm if r.name not in self.local_reasons]
        spec = ssm[0].handler if ssm else None
        managed_layers = {id(r.layer) for r in ssm}
        conv: list[Resource] = []
        for r in state:
            h = r.handler
            if isinstance(h, SSMStateHandler):
                continue
            if not isinstance(h, CausalConvHandler):
                self.local_reasons[r.name] = "generic state is not managed"
            elif spec is None or id(r.layer) not in managed_layers:
                self.local_reasons[r.name] = "its layer has no managed SSM state"
            elif h.conv_dim != spec.expected_conv_dim:  # type: ignore[union-attr]
                self.local_reasons[r.name] = (
                    f"conv_dim {h.conv_dim} != head_dim*num_heads + 2*n_groups*d_state = "
                    f"{spec.head_dim}*{spec.num_heads} + 2*{spec.n_groups}*{spec.d_state} = "  # type: ignore[union-attr]
                    f"{spec.expected_conv_dim}")  # type: ignore[union-attr]
            elif h.dtype != spec.dtype or (conv and h != conv[0].handler):
                self.local_reasons[r.name] = f"its conv state {h} differs from the managed one"
            else:
                conv.append(r)
        return ssm, conv

    def _allocate_local(self) -> None:
        engine = self.engine_config
        for r in self.resources:
            if r.name not in self.local_reasons:
                continue
            dtype = torch_dtype(r.handler.dtype)
            if r.handler.paged:
                shape = paged_pool_shape(r.handler, 1, engine.num_blocks, engine.block_size)
                self.local[r.name] = paged_layer_view(r.handler, torch.zeros(shape, dtype=dtype, device=self.device), 0)
            else:
                self.local[r.name] = torch.zeros((engine.max_num_seqs, *r.handler.shape), dtype=dtype,
                                                 device=self.device)
                if isinstance(self.manager, HybridCacheManager):
                    self.manager.local_states.append(self.local[r.name])
                else:
                    raise ConfigError(f"cache resource {r.name}: per-sequence state needs a managed SSM state "
                                      f"(there is none to give it slots)")

    # ---- views ---------------------------------------------------------------------------------
    def bind(self) -> None:
        """Hand every layer its views (managed ones into the manager's buffers)."""
        manager = self.manager
        for index, r in enumerate(self.paged):
            r.layer.bind_cache(r.key, manager.get_buffers(index))
        rows = {id(r.layer): i for i, r in enumerate(self.ssm)}
        for r in self.ssm + self.conv:
            views = manager.get_state_buffers(rows[id(r.layer)])  # type: ignore[attr-defined]
            r.layer.bind_cache(r.key, views["ssm_state" if isinstance(r.handler, SSMStateHandler) else "conv_state"])
        for r in self.resources:
            if r.name in self.local:
                r.layer.bind_cache(r.key, self.local[r.name])

    @property
    def has_state(self) -> bool:
        return bool(self.ssm)

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache groups a connector stores: () for full attention alone (the classic
        namespace), an ``mla`` group, or a ``full`` group and a ``state`` group (hybrid)."""
        if not self.paged:
            return ()
        page = self.paged[0].handler
        bs = self.engine_config.block_size
        if isinstance(page, LatentHandler):
            groups = [KVGroup("mla", len(self.paged), page.shape, page.dtype, bs)]
        elif not self.ssm:
            return ()
        else:
            groups = [KVGroup("full", len(self.paged), page.shape, page.dtype, bs)]
        if self.ssm:
            assert self.state_layout is not None
            groups.append(KVGroup("state", len(self.ssm), (self.state_layout.state_elems,),
                                  self.state_layout.ssm.dtype, bs))
        return tuple(groups)

    def connector_caches(self) -> torch.Tensor | list[torch.Tensor]:
        """What ``register_kv_caches`` gets: the KV buffer (no groups), or one buffer per group."""
        if not self.kv_groups():
            return self.manager.kv_cache
        caches = [self.manager.kv_cache]
        if self.ssm:
            caches.append(self.manager.state)  # type: ignore[attr-defined]
        return caches

    def check_storable(self) -> None:
        """Refuse a connector when some cached state would be missing from what it stores."""
        local_state = [n for n in self.local_reasons if not any(r.name == n and r.handler.paged
                                                                 for r in self.resources)]
        if local_state:
            name = local_state[0]
            raise ConfigError(f"cannot store this model's state: {name} is allocated locally "
                              f"({self.local_reasons[name]})")
        local_pages = [n for n in self.local_reasons if n not in local_state]
        if local_pages:
            raise ConfigError(f"cannot store this model's KV: {local_pages[0]} is allocated locally "
                              f"({self.local_reasons[local_pages[0]]})")
