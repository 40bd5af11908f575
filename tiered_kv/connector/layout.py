"""Engine KV layouts: gather device blocks into canonical block tensors and scatter them back.

Canonical block payload: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``. Supported
engine layouts, detected from shapes (unknown ones are refused with a ConfigError at start-up):

- ``engine``: one buffer ``[2, L, num_blocks, block_size, H, D]`` (our reference engine);
- ``block_major``: one pool ``[num_blocks, L, 2, block_size, H, D]`` (TensorRT-LLM-like; a
  trailing ``block_size*H*D`` or ``H*D`` may be flattened);
- ``layers_nb2``: per-layer tensors ``[num_blocks, 2, block_size, H, D]`` (vLLM CPU / flash);
- ``layers_2nb``: per-layer tensors ``[2, num_blocks, block_size, H, D]`` (older vLLM);
- ``layers_head_major``: per-layer ``[num_blocks, H, block_size, 2*D]``, memory ``[blocks, H, K|V,
  block_size, D]`` (vLLM 0.32's CPU attention backend).

All moves are batched: one ``index_select`` / ``index_copy_`` per layer or per buffer, never a
Python loop per block; a run of consecutive blocks is one strided copy (``scatter_span``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tiered_kv.connector import block_copy
from tiered_kv.errors import ConfigError
from tiered_kv.keys import Namespace


class KVLayout:
    name = "layout"

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.block = ns.block_shape

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[n, L, 2, bs, H, D]`` copy of the device blocks ``block_ids``."""
        raise NotImplementedError

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[n, L, 2, bs, H, D]`` into the device blocks ``block_ids``."""
        raise NotImplementedError

    def scatter_layers(self, block_ids: torch.Tensor, src: torch.Tensor, first: int) -> None:
        """Write ``src`` ``[n, k, 2, bs, H, D]`` into layers ``first .. first + k - 1`` of the
        device blocks ``block_ids`` (a layer-wise load)."""
        raise NotImplementedError

    def scatter_span(self, first_id: int, src: torch.Tensor, first: int = 0) -> None:
        """Write ``src`` ``[n, k, 2, bs, H, D]`` (any strides: a view of host slots) into layers
        ``first .. first + k - 1`` of the consecutive device blocks ``first_id .. first_id + n - 1``.
        Layouts whose blocks are slices override this with one strided copy."""
        ids = torch.arange(first_id, first_id + src.shape[0], device=self.device)
        self.scatter_layers(ids, src, first)


class EngineLayout(KVLayout):
    name = "engine"

    def __init__(self, ns: Namespace, kv: torch.Tensor) -> None:
        super().__init__(ns)
        self.kv = kv
        triton = block_copy.use_triton(kv.device) and kv.is_contiguous()
        self._gather = block_copy.gather_triton if triton else block_copy.gather_torch
        self._scatter = block_copy.scatter_triton if triton else block_copy.scatter_torch

    device = property(lambda self: self.kv.device)
    dtype = property(lambda self: self.kv.dtype)

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self._gather(self.kv, block_ids)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        self._scatter(self.kv, block_ids, as_engine_dtype(src, self.kv.dtype))

    def scatter_layers(self, block_ids: torch.Tensor, src: torch.Tensor, first: int) -> None:
        block_copy.scatter_torch(self.kv[:, first : first + src.shape[1]], block_ids,
                                 as_engine_dtype(src, self.kv.dtype))

    def scatter_span(self, first_id: int, src: torch.Tensor, first: int = 0) -> None:
        n, k = src.shape[:2]
        self.kv[:, first : first + k, first_id : first_id + n].copy_(as_engine_dtype(src, self.kv.dtype).transpose(0, 2))


class BlockMajorLayout(KVLayout):
    name = "block_major"

    def __init__(self, ns: Namespace, pool: torch.Tensor) -> None:
        super().__init__(ns)
        self.pool = pool
        self.view = pool.view(pool.shape[0], *self.block)

    device = property(lambda self: self.pool.device)
    dtype = property(lambda self: self.pool.dtype)

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.view.index_select(0, block_ids)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        self.view.index_copy_(0, block_ids, as_engine_dtype(src, self.pool.dtype))

    def scatter_layers(self, block_ids: torch.Tensor, src: torch.Tensor, first: int) -> None:
        self.view[:, first : first + src.shape[1]].index_copy_(0, block_ids, as_engine_dtype(src, self.pool.dtype))

    def scatter_span(self, first_id: int, src: torch.Tensor, first: int = 0) -> None:
        n, k = src.shape[:2]
        self.view[first_id : first_id + n, first : first + k].copy_(as_engine_dtype(src, self.pool.dtype))


class LayerListLayout(KVLayout):
    """Per-layer tensors, blocks on dim 0 (``nb2``) or dim 1 (``2nb``)."""

    def __init__(self, ns: Namespace, layers: Sequence[torch.Tensor], block_dim: int) -> None:
        super().__init__(ns)
        self.layers = list(layers)
        self.block_dim = block_dim
        self.name = "layers_nb2" if block_dim == 0 else "layers_2nb"

    device = property(lambda self: self.layers[0].device)
    dtype = property(lambda self: self.layers[0].dtype)

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        parts = [t.index_select(self.block_dim, block_ids) for t in self.layers]
        stacked = torch.stack(parts, dim=1)  # nb2: [n, L, 2, ...]; 2nb: [2, L, n, ...]
        return stacked if self.block_dim == 0 else stacked.permute(2, 1, 0, 3, 4, 5).contiguous()

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        self.scatter_layers(block_ids, src, 0)

    def _parts(self, src: torch.Tensor, first: int):
        """Per layer of ``src`` (from layer ``first``): the engine's tensor and ``src``'s part
        for it, in that tensor's dtype and dimension order."""
        for j in range(src.shape[1]):
            t = self.layers[first + j]
            part = as_engine_dtype(src[:, j], t.dtype)
            yield t, part if self.block_dim == 0 else part.transpose(0, 1)

    def scatter_layers(self, block_ids: torch.Tensor, src: torch.Tensor, first: int) -> None:
        for t, part in self._parts(src, first):
            t.index_copy_(self.block_dim, block_ids, part)

    def scatter_span(self, first_id: int, src: torch.Tensor, first: int = 0) -> None:
        for t, part in self._parts(src, first):
            t.narrow(self.block_dim, first_id, src.shape[0]).copy_(part)


class HeadMajorLayout(KVLayout):
    """Per-layer tensors ``[blocks, H, bs, 2*D]`` whose memory is ``[blocks, H, K|V, bs, D]``
    (vLLM's CPU attention backend: each head's K rows, then its V rows)."""

    name = "layers_head_major"

    def __init__(self, ns: Namespace, layers: Sequence[torch.Tensor]) -> None:
        super().__init__(ns)
        self.layers = list(layers)
        H, bs, D = ns.num_kv_heads, ns.block_size, ns.head_dim
        self.views = [t.view(t.shape[0], H, 2, bs, D) for t in self.layers]

    device = property(lambda self: self.layers[0].device)
    dtype = property(lambda self: self.layers[0].dtype)

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        parts = [v.index_select(0, block_ids).permute(0, 2, 3, 1, 4) for v in self.views]
        return torch.stack(parts, dim=1)  # [n, L, 2, bs, H, D]

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        self.scatter_layers(block_ids, src, 0)

    def _parts(self, src: torch.Tensor, first: int):
        """Per layer of ``src`` (from layer ``first``): the engine's view and ``src``'s part for
        it, in that view's dtype and ``[n, H, K|V, bs, D]`` order."""
        for j in range(src.shape[1]):
            v = self.views[first + j]
            yield v, as_engine_dtype(src[:, j], v.dtype).permute(0, 3, 1, 2, 4)

    def scatter_layers(self, block_ids: torch.Tensor, src: torch.Tensor, first: int) -> None:
        for v, part in self._parts(src, first):
            v.index_copy_(0, block_ids, part)

    def scatter_span(self, first_id: int, src: torch.Tensor, first: int = 0) -> None:
        for v, part in self._parts(src, first):
            v[first_id : first_id + src.shape[0]].copy_(part)


def device_ids(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """``block_ids`` as a long tensor on ``device``, without making the host wait: on CUDA it is
    copied from pinned memory, queued on the current stream (torch's host allocator keeps the
    pinned buffer until the copy ran). ``torch.tensor(ids, device=cuda)`` waits for the stream,
    and on the side stream that means for everything the engine queued before the save."""
    ids = torch.tensor(block_ids, dtype=torch.long)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


BYTE_CONTAINERS = (torch.uint8, torch.int8)  # what engines keep fp8 KV in (vLLM: uint8)


def as_engine_dtype(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src`` (namespace dtype) as the engine's tensors hold it: the same values, or the same
    bits when the engine keeps fp8 in a byte tensor (never a value conversion)."""
    return src if src.dtype == dtype else src.view(dtype)


def check_dtype(ns: Namespace, dtype: torch.dtype) -> None:
    """The engine's KV tensors hold the namespace's dtype, or fp8 bytes in a uint8/int8 tensor."""
    got = str(dtype).removeprefix("torch.")
    if got == ns.dtype or (ns.dtype.startswith("float8") and dtype in BYTE_CONTAINERS):
        return
    raise ConfigError(f"the engine's KV tensors are {got} but the namespace says {ns.dtype}; "
                      "stored blocks would be converted, not copied")


def tokens_per_block(ns: Namespace, shape: tuple[int, ...], *, per_layer: bool) -> int | None:
    """Tokens per engine block of a known layout family whose block dimension is not the
    namespace's block size (None: no such family, or the sizes agree)."""
    L, H, D = ns.num_layers, ns.num_kv_heads, ns.head_dim
    found = None
    if per_layer and len(shape) == 5 and 2 in shape[:2] and shape[3:] == (H, D):  # layers_nb2 / _2nb
        found = shape[2]
    elif per_layer and len(shape) == 4 and shape[1] == H and shape[3] == 2 * D:  # layers_head_major
        found = shape[2]
    elif not per_layer and len(shape) == 6 and shape[4:] == (H, D) and (2, L) in (shape[:2], shape[2:0:-1]):
        found = shape[3]  # engine [2, L, blocks, bs, H, D] or block_major [blocks, L, 2, bs, H, D]
    elif not per_layer and len(shape) == 4 and shape[1:3] == (L, 2) and shape[3] % (H * D) == 0:
        found = shape[3] // (H * D)  # block_major with flat blocks
    return found if found is not None and found != ns.block_size else None


def _refuse_other_block_size(ns: Namespace, shape: tuple[int, ...], *, per_layer: bool) -> None:
    tokens = tokens_per_block(ns, shape, per_layer=per_layer)
    if tokens is not None:
        raise ConfigError(f"the engine's KV blocks hold {tokens} tokens (tensor {shape}) but keys cover "
                          f"{ns.block_size} tokens (the namespace block_size); tiered-kv needs one engine "
                          "block per key block")


def make_layout(ns: Namespace, kv: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                declared: str | None = None) -> KVLayout:
    """Detect (or check the ``declared``) layout of the engine's KV tensors; refuse tensors of
    another dtype or another number of tokens per block than the namespace's."""
    L, bs, H, D = ns.num_layers, ns.block_size, ns.num_kv_heads, ns.head_dim
    if isinstance(kv, Mapping):
        kv = list(kv.values())
    if isinstance(kv, torch.Tensor):
        shape = tuple(kv.shape)
        _refuse_other_block_size(ns, shape, per_layer=False)
        check_dtype(ns, kv.dtype)
        if (declared in (None, "engine") and len(shape) == 6 and shape[:2] == (2, L)
                and shape[3:] == (bs, H, D)):
            return EngineLayout(ns, kv)
        per_block = L * 2 * bs * H * D
        if (declared in (None, "block_major") and kv.is_contiguous() and shape[0] > 0
                and kv.numel() == shape[0] * per_block and (len(shape) < 3 or shape[1:3] == (L, 2))):
            return BlockMajorLayout(ns, kv)
        what = f"kv_layout {declared!r} does not fit the" if declared else "unsupported"
        raise ConfigError(f"{what} KV layout {shape} for {L} layers x block {bs} x {H} heads x "
                          f"dim {D}; expected [2, L, blocks, {bs}, {H}, {D}] or [blocks, L, 2, ...]")
    layers = list(kv)
    if len(layers) != L:
        raise ConfigError(f"got {len(layers)} per-layer KV tensors, namespace says {L} layers")
    shape = tuple(layers[0].shape)
    if any(tuple(t.shape) != shape or t.dtype != layers[0].dtype for t in layers):
        raise ConfigError("per-layer KV tensors differ in shape or dtype")
    _refuse_other_block_size(ns, shape, per_layer=True)
    check_dtype(ns, layers[0].dtype)
    if (len(shape) == 4 and shape[1:] == (H, bs, 2 * D) and declared in (None, "layers_head_major")
            and all(t.is_contiguous() for t in layers)):  # (its view reads memory order)
        return HeadMajorLayout(ns, layers)
    if len(shape) == 5 and shape[2:] == (bs, H, D):
        if shape[1] == 2 and declared in (None, "layers_nb2"):
            return LayerListLayout(ns, layers, 0)
        if shape[0] == 2 and declared in (None, "layers_2nb"):
            return LayerListLayout(ns, layers, 1)
    what = f"kv_layout {declared!r} does not fit" if declared else "unsupported"
    raise ConfigError(f"{what} per-layer KV tensors {shape}; supported: [blocks, 2, {bs}, {H}, {D}] "
                      f"(layers_nb2), [2, blocks, {bs}, {H}, {D}] (layers_2nb) or "
                      f"[blocks, {H}, {bs}, {2 * D}] (layers_head_major)")
