"""KV cache groups: what a model keeps per token block when it is not one full-attention K/V
(MLA latents, sliding-window and chunked-local layers, recurrent state). No torch here.

A namespace with ``groups`` stores two kinds of entry under one chain of content keys:

- a **block entry** under ``key_i``: every token group's part for block ``i``, concatenated in
  group order. Token groups are ``full``, ``sliding``, ``chunked`` (K and V per token:
  ``[layers, 2, block_size, H, D]``) and ``mla`` (one latent + RoPE part per token:
  ``[layers, block_size, D]``);
- a **state entry** under :func:`state_key` ``(key_i)``: every ``state`` group's part (SSM and
  causal-conv state, ``[layers, *shape]``) as it was at the *end* of block ``i``. It exists only
  where the engine was stopped exactly at that boundary, so a prefix hit ends on a block whose
  state is held.

Both kinds have the namespace's entry size: the larger of the two, the smaller padded with zero
bytes. (A part per group and key would keep slots smaller but cost a lookup per group; vLLM's
hybrid allocator gives every layer the same page size, so the two kinds come out nearly equal.)
A whole entry carries one checksum; a hit therefore either gets every part of its blocks or none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from math import prod

from tiered_kv.dtypes import itemsize
from tiered_kv.errors import ConfigError

TOKEN_KINDS = ("full", "sliding", "chunked", "mla")  # parts per token block
STATE_KINDS = ("state",)  # a part per block boundary
KINDS = TOKEN_KINDS + STATE_KINDS
STATE_TAG = b"\x00tiered-kv state"


@dataclass(frozen=True)
class KVGroup:
    """Layers that page their KV alike (one of an engine's KV cache groups)."""

    kind: str  # one of KINDS
    num_layers: int  # layers in the group
    shape: tuple[int, ...]  # per layer: (2, H, D) per token (full/sliding/chunked), (D,) per token (mla), the state's shape (state)
    dtype: str  # element dtype of the group's tensors ("int8" for raw state pages)
    block_size: int  # tokens per engine block of the group (state groups: the engine's allocation unit)
    window: int = 0  # sliding window or attention chunk in tokens (sliding, chunked); 0 otherwise
    layout: str = ""  # the engine's memory layout of the group's tensors (part of the identity)
    members: str = ""  # which of the model's layers the group holds, in order (a digest; "": not named)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"KV group kind must be one of {list(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.shape or any(s <= 0 for s in self.shape):
            raise ConfigError(f"KV group shape must be positive sizes, got {self.shape!r}")
        for name in ("num_layers", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KV group {name} must be a positive integer, got {value!r}")
        itemsize(self.dtype)
        if self.kind in ("full", "sliding", "chunked") and (len(self.shape) != 3 or self.shape[0] != 2):
            raise ConfigError(f"a {self.kind} group's shape is (2, heads, head_dim), got {self.shape!r}")
        if self.kind == "mla" and len(self.shape) != 1:
            raise ConfigError(f"an mla group's shape is (latent_dim,), got {self.shape!r}")
        if (self.kind in ("sliding", "chunked")) != (self.window > 0):
            raise ConfigError(f"a {self.kind} group {'needs' if self.kind in ('sliding', 'chunked') else 'has no'} "
                              f"window, got {self.window!r}")

    def __repr__(self) -> str:
        """The dataclass's repr, ``members`` only when set: a namespace's digest is over its groups'
        reprs, and groups that name no members (SGLang's, TensorRT-LLM's, ours) keep the digest, and
        so the stored blocks and namespace records, they had before the field."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "members" or self.members]
        return f"KVGroup({', '.join(shown)})"

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS

    def part_nbytes(self, block_size: int) -> int:
        """Bytes of this group's part of one entry (block entry: ``block_size`` tokens)."""
        per_layer = prod(self.shape) * itemsize(self.dtype)
        return self.num_layers * per_layer * (1 if self.is_state else block_size)

    def part_shape(self, block_size: int) -> tuple[int, ...]:
        """The part as a tensor: ``[L, 2, bs, H, D]``, ``[L, bs, D]`` or ``[L, *state]``."""
        if self.is_state:
            return (self.num_layers, *self.shape)
        if self.kind == "mla":
            return (self.num_layers, block_size, self.shape[0])
        return (self.num_layers, 2, block_size, self.shape[1], self.shape[2])

    @classmethod
    def from_dict(cls, data: dict) -> KVGroup:
        """The inverse of :meth:`describe` (namespace records, namespace files)."""
        try:
            return cls(kind=data["kind"], num_layers=data["layers"], shape=tuple(data["shape"]),
                       dtype=data["dtype"], block_size=data["block_size"], window=data.get("window", 0),
                       layout=data.get("layout", ""), members=data.get("members", ""))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"a KV group needs kind, layers, shape, dtype and block_size: {exc}") from None

    def describe(self) -> dict:
        out = {"kind": self.kind, "layers": self.num_layers, "shape": list(self.shape),
               "dtype": self.dtype, "block_size": self.block_size}
        if self.window:
            out["window"] = self.window
        if self.layout:
            out["layout"] = self.layout
        if self.members:
            out["members"] = self.members
        return out


@dataclass(frozen=True)
class EntryPlan:
    """Where each group's part lies in an entry (byte offsets), and the entry's size."""

    offsets: tuple[int, ...]  # per group of the namespace: byte offset in its kind of entry
    sizes: tuple[int, ...]  # per group: bytes of its part
    token_nbytes: int  # bytes of a block entry's parts
    state_nbytes: int  # bytes of a state entry's parts (0: no state groups)
    entry_nbytes: int  # every entry's size: the larger of the two, a multiple of the dtype size


def entry_plan(groups: tuple[KVGroup, ...], block_size: int, dtype: str) -> EntryPlan:
    offsets, sizes, ends = [], [], {False: 0, True: 0}
    for g in groups:
        size = g.part_nbytes(block_size)
        offsets.append(ends[g.is_state])
        sizes.append(size)
        ends[g.is_state] += size
    unit = itemsize(dtype)
    entry = max(ends.values())
    entry += -entry % unit
    return EntryPlan(tuple(offsets), tuple(sizes), ends[False], ends[True], entry)


def check_groups(groups: tuple[KVGroup, ...], block_size: int) -> None:
    """A namespace's groups: at least one token group, all paging ``block_size`` tokens."""
    if not any(not g.is_state for g in groups):
        raise ConfigError("a namespace's KV groups need at least one token group (attention or MLA): "
                          "keys cover token blocks")
    for g in groups:
        if not g.is_state and g.block_size != block_size:
            raise ConfigError(f"every token group pages {block_size} tokens per block (the key block); "
                              f"a {g.kind} group pages {g.block_size}")


def token_groups(groups: tuple[KVGroup, ...]) -> list[int]:
    """Indices of the token groups (a block entry's parts), in order."""
    return [i for i, g in enumerate(groups) if not g.is_state]


def state_groups(groups: tuple[KVGroup, ...]) -> list[int]:
    """Indices of the state groups (a state entry's parts), in order."""
    return [i for i, g in enumerate(groups) if g.is_state]


def state_key(hasher, key: bytes) -> bytes:
    """The key of the state entry at the end of the block ``key`` (same namespace, same tiers)."""
    return hasher(key + STATE_TAG)
