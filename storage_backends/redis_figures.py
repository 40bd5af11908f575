"""What ``RedisBackend.stats()`` reports of the server (:mod:`storage_backends.redis_remote`):
INFO of every master, and our share of the keys from a SCAN sample (exact for a small database).
"""

from __future__ import annotations

from typing import Any

ENTRY_SAMPLE = 10_000  # keys a SCAN samples before extrapolating with the key count
SCAN_PAGE = 1000  # keys per SCAN page


def server_facts(client: Any, prefix: bytes) -> dict:
    """``entries``: keys under ``prefix``, exact when the database holds at most
    ``ENTRY_SAMPLE`` keys, else their share of a sample that many times the key count; with
    the masters' memory, eviction and expiry figures summed."""
    info = client.info()  # a cluster of several nodes answers {node: info}
    nodes = [info] if "redis_version" in info else list(info.values())
    nodes = [n for n in nodes if n.get("role") == "master"] or nodes
    total = sum(v.get("keys", 0) for n in nodes for k, v in n.items()
                if k.startswith("db") and isinstance(v, dict))
    seen = ours = 0
    for name in client.scan_iter(count=SCAN_PAGE):
        seen, ours = seen + 1, ours + name.startswith(prefix)
        if seen >= ENTRY_SAMPLE:
            break
    exact = seen < ENTRY_SAMPLE
    return {"entries": ours if exact else round(ours * total / seen), "entries_exact": exact,
            "server_keys": total, "used_memory": sum(n.get("used_memory", 0) for n in nodes),
            "maxmemory": sum(n.get("maxmemory", 0) for n in nodes),
            "server_version": nodes[0].get("redis_version") if nodes else None,
            "maxmemory_policy": nodes[0].get("maxmemory_policy") if nodes else None,
            "server_evicted_keys": sum(n.get("evicted_keys", 0) for n in nodes),
            "server_expired_keys": sum(n.get("expired_keys", 0) for n in nodes)}
