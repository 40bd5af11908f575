"""The blocks bench_cluster moves, encoded as the store's remote tier stores them.

Two kinds, numpy only (no torch): ``llama8b-2MiB``, a Llama-3-8B block of 16 tokens in bf16
(``[32 layers, K/V, 16, 8 KV heads, 128]``), and ``demo-128KiB``, the demo model's block
(``[8, 2, 16, 2, 64]`` float32). Values are drawn like real KV: every (layer, K/V, head, channel)
has its own mean and log-normal scale, a few channels per head are outliers. Each block is
encoded by the codec the remote tier writes (``auto`` resolved for the store's workers, as the
store resolves it) and framed in the store's layer groups, under the stored key ``namespace
digest + block key``; the payload / stored ratio of those bytes is the codec ratio reported."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiered_kv.config import TieredKVConfig
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store import codec_choice
from tiered_kv.store.codec import BlockCodec, BlockLayout
from tiered_kv.store.layer_frames import layer_segments

# name -> (layers, KV heads, head_dim, dtype); 16 tokens per block
KINDS: dict[str, tuple[int, int, int, str]] = {
    "llama8b-2MiB": (32, 8, 128, "bfloat16"),
    "demo-128KiB": (8, 2, 64, "float32"),
}
BLOCK_TOKENS = 16


@dataclass
class Encoded:
    """One kind's blocks as stored: keys (namespace digest + block key), stored bytes, and the
    codec facts the report needs."""

    kind: str
    keys: list[bytes]
    blobs: list[bytes]
    payload_bytes: int  # of one block
    codec: str  # the codec that wrote the blobs
    segments: int  # frames per block
    namespace: Namespace
    block_codec: BlockCodec
    raw: list[np.ndarray]

    @property
    def stored_bytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    @property
    def ratio(self) -> float:
        """Payload bytes per stored byte (1.0 or a little under for ``raw``: the header)."""
        return len(self.blobs) * self.payload_bytes / self.stored_bytes


def namespace_of(kind: str, tag: str) -> Namespace:
    layers, heads, dim, dtype = KINDS[kind]
    return Namespace(model_id=f"bench-cluster/{kind}/{tag}", num_layers=layers, num_kv_heads=heads,
                     head_dim=dim, block_size=BLOCK_TOKENS, dtype=dtype)


def kv_like(n: int, shape: tuple[int, ...], dtype: str, seed: int) -> list[np.ndarray]:
    """``n`` blocks of ``shape`` as flat uint8 arrays of ``dtype`` (bfloat16 or float32) values."""
    rng = np.random.default_rng(seed)
    stat = (shape[0], shape[1], 1, shape[3], shape[4])
    mean = rng.standard_normal(stat, dtype=np.float32) * 0.5
    scale = np.exp(rng.standard_normal(stat, dtype=np.float32) * 0.5)
    outlier = rng.random(stat) < 3 / shape[4]
    mean = np.where(outlier, mean * 20, mean)
    scale = np.where(outlier, scale * 20, scale)
    out = []
    for _ in range(n):
        v = (rng.standard_normal(shape, dtype=np.float32) * scale + mean).astype(np.float32)
        if dtype == "bfloat16":  # the top half of each float32 (truncation, as cheap as it gets)
            v = (v.view(np.uint32) >> 16).astype("<u2")
        out.append(np.ascontiguousarray(v).reshape(-1).view(np.uint8))
    return out


def remote_codec(override: str | None = None) -> tuple[str, int, int, int]:
    """(codec, level, layer groups, workers) the store's remote tier writes with by default; the
    codec ``override`` replaces the configured one (``auto`` is resolved here)."""
    cfg = TieredKVConfig()
    setting = override or cfg.remote.codec
    return codec_choice.choose(setting, cfg.workers), cfg.remote.level, cfg.layer_groups, cfg.workers


def encode_blocks(kind: str, n: int, tag: str, codec: str, level: int, layer_groups: int,
                  seed: int = 1) -> Encoded:
    """``n`` blocks of ``kind`` encoded as the remote tier stores them."""
    layers, heads, dim, dtype = KINDS[kind]
    ns = namespace_of(kind, tag)
    shape = ns.block_shape
    raw = kv_like(n, shape, dtype, seed)
    payload = raw[0].nbytes
    segments = layer_segments(ns, BlockLayout(dtype, shape).raw_len, layer_groups)
    block_codec = BlockCodec(codec, level)
    tokens = np.random.default_rng(seed + 7).integers(0, 128_000, size=n * BLOCK_TOKENS).tolist()
    keys = block_keys(ns, tokens)
    digest = ns.digest()
    blobs = [bytes(block_codec.encode(r, dtype=dtype, shape=shape, namespace=digest, key=k,
                                      segments=segments)) for r, k in zip(raw, keys)]
    return Encoded(kind, [digest + k for k in keys], blobs, payload, codec, len(segments or (0,)), ns,
                   block_codec, raw)


def ratio_with(enc: Encoded, codec: str, level: int, layer_groups: int, sample: int = 8) -> float:
    """The payload / stored ratio ``codec`` would give on the first ``sample`` blocks (context:
    what compression would save in memory and network)."""
    ns, dtype = enc.namespace, enc.namespace.dtype
    segments = layer_segments(ns, enc.payload_bytes, layer_groups)
    c = BlockCodec(codec, level)
    digest = ns.digest()
    stored = sum(len(c.encode(r, dtype=dtype, shape=ns.block_shape, namespace=digest,
                              key=k[len(digest):], segments=segments))
                 for r, k in zip(enc.raw[:sample], enc.keys[:sample]))
    return min(sample, len(enc.raw)) * enc.payload_bytes / stored
