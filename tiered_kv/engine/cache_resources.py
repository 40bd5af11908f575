"""Cache resource handlers: what one layer asks the engine to keep for it, described, not allocated.

A layer that caches something lists its resources (:meth:`cache_resources`, name -> handler);
:class:`~tiered_kv.engine.cached_sequence.CachedSequenceInterface` collects them from the whole
model, decides which ones a cache manager owns (and the store may save) and which are allocated
next to the layer, and hands every layer its views (:meth:`bind_cache`). Two kinds:

- **paged** handlers keep something per token, in the engine's blocks: full-attention K and V
  (:class:`PagedKVHandler`) or an MLA latent (:class:`LatentHandler`);
- **state** handlers keep a fixed-size state per running sequence, in one slot of the sequence:
  an SSM state (:class:`SSMStateHandler`), a causal-conv state (:class:`CausalConvHandler`) or
  anything else (:class:`GenericStateHandler`, never managed).

The handlers are plain frozen descriptions (no torch tensors), so two of them compare equal
exactly when their memory would look alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import ClassVar, Protocol

import torch

from tiered_kv.errors import ConfigError


@dataclass(frozen=True)
class ResourceHandler:
    """One cached resource of one layer."""

    dtype: str  # element dtype of the resource

    paged: ClassVar[bool] = False  # per token in blocks (True) or per sequence in a slot (False)

    @property
    def shape(self) -> tuple[int, ...]:
        """Per token (paged) or per sequence (state)."""
        raise NotImplementedError

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class PagedKVHandler(ResourceHandler):
    """Full-attention K and V per token: ``(2, num_kv_heads, head_dim)``."""

    num_kv_heads: int = 1  # KV heads of the layer
    head_dim: int = 1  # per-head width

    paged: ClassVar[bool] = True

    @property
    def shape(self) -> tuple[int, ...]:
        return (2, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class LatentHandler(ResourceHandler):
    """One MLA vector per token, the same for every head: ``(latent_dim,)``."""

    latent_dim: int = 1  # normed c_kv followed by the RoPE'd key part

    paged: ClassVar[bool] = True

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.latent_dim,)


@dataclass(frozen=True)
class SSMStateHandler(ResourceHandler):
    """A Mamba2 SSM state per sequence: ``(num_heads, head_dim, d_state)``."""

    num_heads: int = 1  # SSM heads
    head_dim: int = 1  # channels per head
    d_state: int = 1  # state width per channel
    n_groups: int = 1  # groups sharing B and C (fixes the conv width the manager expects)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.d_state)

    @property
    def expected_conv_dim(self) -> int:
        """The conv channels a Mamba2 layer of this SSM has: x, B and C."""
        return self.head_dim * self.num_heads + 2 * self.n_groups * self.d_state


@dataclass(frozen=True)
class CausalConvHandler(ResourceHandler):
    """A causal depthwise conv's last ``kernel_size - 1`` inputs: ``(conv_dim, kernel_size - 1)``."""

    conv_dim: int = 1  # conv channels
    kernel_size: int = 2  # conv width K

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.conv_dim, self.kernel_size - 1)


@dataclass(frozen=True)
class GenericStateHandler(ResourceHandler):
    """Any other per-sequence state (allocated next to its layer; never stored)."""

    dims: tuple[int, ...] = (1,)  # the state's shape

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dims)


class CachingLayer(Protocol):
    """What a layer that caches implements."""

    def cache_resources(self) -> dict[str, ResourceHandler]: ...

    def bind_cache(self, name: str, view: torch.Tensor) -> None: ...


def check_handler(name: str, handler: ResourceHandler) -> None:
    """A handler's sizes must be positive (a ConfigError names the resource)."""
    if not handler.shape or any(not isinstance(s, int) or s <= 0 for s in handler.shape):
        raise ConfigError(f"cache resource {name}: shape must be positive sizes, got {handler.shape!r}")
