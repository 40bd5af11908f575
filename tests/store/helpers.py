"""Small builders shared by the store scenarios."""

from __future__ import annotations

import torch

from tiered_kv.config import TieredKVConfig
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store import TieredStore

NS = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2,
               head_dim=32, block_size=16)  # 16 KiB blocks


def payloads(store: TieredStore, n: int, seed: int = 0) -> list[torch.Tensor]:
    """KV-like blocks: per-channel scales so they compress like real KV."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(store.shape[-2:], generator=g) * 4
    return [(torch.randn(store.shape, generator=g) * scale).to(store.dtype) for _ in range(n)]


def keys_for(n_blocks: int, ns: Namespace = NS, first_token: int = 0) -> list[bytes]:
    return block_keys(ns, list(range(first_token, first_token + n_blocks * ns.block_size)))


def make_store(tmp_path=None, *, ns: Namespace = NS, host: str = "1MiB",
               disk: str | dict | None = "64MiB", remote_url: str | None = None, **overrides) -> TieredStore:
    """A store with a host tier, an LMDB tier under ``tmp_path`` (``disk``: its capacity, or a
    dict of disk settings) and optionally a Redis tier."""
    cfg: dict = {"host": {"capacity": host}, "workers": 2}
    if disk is not None and tmp_path is not None:
        cfg["disk"] = {"url": f"lmdb://{tmp_path}/lmdb", "capacity": "64MiB"}
        cfg["disk"].update(disk if isinstance(disk, dict) else {"capacity": disk})
    if remote_url is not None:
        cfg["remote"] = {"url": remote_url, "timeout": 0.5, "retries": 1}
    for section, values in overrides.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return TieredStore(TieredKVConfig.from_dict(cfg), ns)


def load(store: TieredStore, keys: list[bytes]) -> tuple[list[bool], list[torch.Tensor]]:
    """``load_into`` plain CPU blocks: lower-tier blocks are decoded straight into them."""
    outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
    return store.load_into(keys, outs), outs


def load_staged(store: TieredStore, keys: list[bytes]) -> tuple[list[bool], list[torch.Tensor]]:
    """The engines' path: lease, load into host slots (promotion), copy out, release."""
    plan = store.load(store.prepare_load(keys))
    try:
        plan.wait(30)
        outs = [store.slot_tensor(s).clone() if s is not None else None for s in plan.slots]
        return plan.ok, outs
    finally:
        store.release(plan)


def rewrite_stored_blocks(path, edit) -> int:
    """Apply ``edit(storage key, value) -> new value or None (leave it)`` to every stored block of
    the LMDB directory ``path``, behind the store's back (through the medium, which keeps large
    values in segment files: the store's own tiers are closed); how many were rewritten."""
    from storage_backends.lmdb_disk import LmdbBackend

    n = 0
    with LmdbBackend(path, capacity=1 << 40, record_access=False) as b:
        for key in sorted(b.scan()):
            value = b.get_many([key])[0] if len(key) == 32 else None
            if value is None or value[:4] != b"TKVB":
                continue
            new = edit(key, value)
            if new is not None:
                assert b.put_many([(key, new)], tenant=b.entry_meta(key)["tenant"]) == [True]
                n += 1
    return n
