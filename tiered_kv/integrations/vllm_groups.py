"""vLLM's KV cache groups as tiered-kv KV groups (no torch here).

With a ``SupportsHMA`` connector vLLM keeps its hybrid allocator on and hands the connector one
KV cache group per kind of layer: full attention, sliding window, chunked local attention, MLA,
Mamba. Each becomes a :class:`~tiered_kv.kv_groups.KVGroup` of the namespace; the layer names of
each group say which registered tensors belong to it. What one stored block cannot follow is
refused with one line naming the spec.

Facts this relies on (vLLM 0.32): token groups share one block size (the hybrid allocator raises
attention blocks to fit Mamba pages, e.g. 32 -> 64); a Mamba group with ``mamba_cache_mode``
``none`` keeps a request's running state in its one block, overwritten every step; a Mamba
layer registers ``int8`` rows ``[blocks, 1, 1, state bytes]`` viewing the start of each padded
page (conv and SSM state as vLLM lays them out); block ``0`` is vLLM's null block (a sliding
window's blocks behind the window, freed right after the step that wrote them). vLLM cannot
take block-level load errors from a model with several groups: loads are asynchronous there and
a failure fails the request's whole load (``failed_recving``; it recomputes from token 0); so do
a single sliding-window group's (resuming at a failed block would read null blocks behind it).

An entry holds each group's layers in the order of its layer names, so which layers a group
holds, and in what order, is part of the namespace (``members``): an engine whose allocator
grouped the layers otherwise (another vLLM, another override of the layer pattern) put each part
of a stored entry into other layers, with nothing to tell. The digest is over the names from
their layer number on (``model.layers.5.self_attn.attn`` -> ``5.self_attn.attn``), so a prefix
renamed alone keeps the namespace.
"""

from __future__ import annotations

import re
from dataclasses import replace
from math import prod
from typing import Any

import xxhash

from tiered_kv.dtypes import ITEMSIZE, dtype_name
from tiered_kv.errors import ConfigError
from tiered_kv.kv_groups import KVGroup

NULL_BLOCK = 0  # vLLM's placeholder block id


def kv_groups(groups: list, dtype_of, source: str) -> tuple[tuple[KVGroup, ...], list[list[str]]]:
    """(our KV groups, the layer names of each) from ``kv_cache_config.kv_cache_groups``;
    ``dtype_of(spec)`` names an attention spec's KV dtype."""
    out, names = [], []
    for group in groups:
        spec, layers = group.kv_cache_spec, list(group.layer_names)
        out.append(replace(_group(spec, len(layers), dtype_of, source), members=_members(layers)))
        names.append(layers)
    sizes = {g.block_size for g in out if not g.is_state}
    if len(sizes) > 1:
        raise ConfigError(f"{source}: the attention KV cache groups page different block sizes {sorted(sizes)}; "
                          "tiered-kv keys one block size")
    if sizes:  # a state group's allocation unit (vLLM: max_model_len) does not change its bytes
        out = [replace(g, block_size=min(sizes)) if g.is_state else g for g in out]
    if not sizes:
        raise ConfigError(f"{source}: the model has no attention KV cache group (state only); tiered-kv "
                          "keys token blocks of an attention group")
    return tuple(out), names


def _members(names: list[str]) -> str:
    """The digest of a group's layer names in order, each from its layer number on (the whole
    name when it has none)."""
    named = [n[m.start(1):] if (m := _NUMBERED.search(n)) else n for n in names]
    return xxhash.xxh3_64_hexdigest("\n".join(named).encode())


_NUMBERED = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # a name's first numeric part (its layer number)


def _group(spec: Any, n_layers: int, dtype_of, source: str) -> KVGroup:
    kind = type(spec).__name__
    bs = int(spec.block_size)
    if kind == "MambaSpec":
        mode = str(getattr(spec, "mamba_cache_mode", "none") or "none")
        if mode != "none":
            raise ConfigError(f"{source}: Mamba state with mamba_cache_mode={mode!r} (vLLM's prefix caching of "
                              "state) is not supported: tiered-kv follows the running state (mode 'none', "
                              "enable_prefix_caching=False)")
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            raise ConfigError(f"{source}: Mamba state with speculative decoding blocks is not supported")
        shapes = [list(s) for s in spec.shapes]
        dtypes = [dtype_name(d) for d in spec.dtypes]
        layout = f"vllm-mamba:{getattr(spec.mamba_type, 'value', spec.mamba_type)}:{shapes}:{dtypes}"
        # the registered tensor of a Mamba layer is the state part of each (padded) page
        content = sum(prod(shape) * ITEMSIZE[dtype_name(d)] for shape, d in zip(spec.shapes, spec.dtypes))
        return KVGroup("state", n_layers, (int(content),), "int8", bs, layout=layout)
    if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MLAAttentionSpec"):
        raise ConfigError(f"{source}: unsupported KV cache spec {kind}; tiered-kv stores full, sliding-window, "
                          "chunked-local and MLA attention and Mamba state")
    if getattr(spec, "page_size_padded", None) or int(getattr(spec, "kv_quant_mode", 0) or 0) >= 2:
        raise ConfigError(f"{source}: {kind} with padded pages or per-token KV scales is not supported")
    dtype = dtype_of(spec)
    heads, head = int(spec.num_kv_heads), int(spec.head_size)
    if kind == "MLAAttentionSpec":
        return KVGroup("mla", n_layers, (head,), dtype, bs)
    if getattr(spec, "head_size_v", None) not in (None, head):
        raise ConfigError(f"{source}: {kind} with head_size_v {spec.head_size_v} != head_size {head} "
                          "(uneven K/V heads) is not supported")
    window = int(getattr(spec, "sliding_window", None) or 0)
    chunk = int(getattr(spec, "attention_chunk_size", None) or 0)
    if window:
        return KVGroup("sliding", n_layers, (2, heads, head), dtype, bs, window=window)
    if chunk:
        return KVGroup("chunked", n_layers, (2, heads, head), dtype, bs, window=chunk)
    return KVGroup("full", n_layers, (2, heads, head), dtype, bs)


def request_level_failures(groups: tuple[KVGroup, ...], n_engine_groups: int) -> bool:
    """Whether a failed load must fail its whole request (vLLM then recomputes it from token 0)
    rather than roll back to the failed block: vLLM cannot map block ids of a model with several
    groups back to requests, and resuming at a failed block needs the sliding window's earlier
    blocks (null, never loaded) or the recurrent state there (never stored)."""
    return n_engine_groups > 1 or any(g.kind in ("sliding", "chunked", "state") for g in groups)


def is_replicated(groups: tuple[KVGroup, ...]) -> bool:
    """Whether every rank holds the same bytes (MLA only): stored once, not per rank."""
    return all(g.kind == "mla" for g in groups)


def group_ids(block_ids: Any, n_groups: int) -> tuple[list[int], ...]:
    """vLLM's per-group block ids with the null block as -1 (``None``: no new blocks)."""
    if not block_ids:
        return tuple([] for _ in range(n_groups))
    if len(block_ids) != n_groups:
        raise ValueError(f"vLLM passed block ids for {len(block_ids)} groups, expected {n_groups}")
    return tuple([-1 if b == NULL_BLOCK else int(b) for b in ids] for ids in block_ids)
