"""Delete-if-unchanged on the Redis tier: a Lua script compares each key's value with the bytes
the caller saw and UNLINKs it only when they are equal; Redis runs a script atomically, so a SET
by any client lands before it (compared, and differs) or after it (kept).

One EVAL per batch of keys (at most ``KEYS_PER_CALL`` keys and the backend's ``pipeline_bytes``
of values, or one larger value alone). In a cluster a script's keys must share a slot: a batch
is split by slot, and its scripts go one pipeline per node as the backend routes its GETs and
SETs (:func:`storage_backends.redis_node_pipelines.node_pipelines`, redirections followed). A slot
mid-migration whose keys are split between its two nodes answers a script of several of them
TRYAGAIN (run nowhere): that script's keys go again one script each, which a node serves or
redirects (ASK, followed), so a resharding neither fails the call nor opens the tier's breaker. A
refusal (READONLY, NOSCRIPT, NOPERM) raises BackendError; Redis away BackendUnavailable."""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import TryAgainError

SCRIPT = """
local out = {}
for i, name in ipairs(KEYS) do
  local value = redis.pcall('GET', name)
  if type(value) == 'string' and value == ARGV[i] then
    redis.call('UNLINK', name)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
KEYS_PER_CALL = 1000


def delete_if_unchanged(backend, pairs: Sequence[tuple[bytes, bytes]]) -> list[bool]:
    """Delete each ``(key, value)`` of ``backend`` (a RedisBackend) whose stored value is exactly
    ``value``; per pair whether it was deleted. The keys deleted are told removed, batch by batch."""
    pairs = [(bytes(k), bytes(v)) for k, v in pairs]
    done: list[bool] = []
    try:
        for batch in _batches(pairs, backend.pipeline_bytes):
            deleted = _run(backend, batch)
            done += deleted
            backend._tell("removed", [k for (k, _), d in zip(batch, deleted) if d])
    finally:
        backend._count(deletes=sum(done))
    return done


def _batches(pairs: list[tuple[bytes, bytes]], max_bytes: int):
    start, size = 0, 0
    for i, (_, value) in enumerate(pairs):
        if i > start and (size + len(value) > max_bytes or i - start >= KEYS_PER_CALL):
            yield pairs[start:i]
            start, size = i, 0
        size += len(value)
    if start < len(pairs):
        yield pairs[start:]


def _run(backend, batch: list[tuple[bytes, bytes]]) -> list[bool]:
    """One batch: its scripts (one per slot in a cluster, else one) in one pipeline per node."""
    names = backend.names.names(k for k, _ in batch)
    groups: dict[int, list[int]] = {}

    def send(client) -> list:
        groups.clear()
        for i, name in enumerate(names):  # (here: a cluster's client connects on first use)
            groups.setdefault(client.keyslot(name) if backend.cluster else 0, []).append(i)
        # (routing name, names, values): the backend's pipelines route an item by its first field
        items = [(names[m[0]], [names[i] for i in m], [batch[i][1] for i in m]) for m in groups.values()]
        replies = backend._pipelined(client, items, add, read=False, refusals=True, passed=(TryAgainError,))
        split = [j for j, reply in enumerate(replies) if isinstance(reply, TryAgainError)]
        if split:  # (one key a script: never TRYAGAIN; what still fails raises, as any reply)
            singles = [(name, [name], [value]) for j in split for name, value in zip(items[j][1], items[j][2])]
            answers = iter(backend._pipelined(client, singles, add, read=False, refusals=True))
            for j in split:
                replies[j] = [(next(answers) or [0])[0] for _ in items[j][1]]
        return replies

    def add(pipe, item) -> None:
        pipe.eval(SCRIPT, len(item[1]), *item[1], *item[2])

    replies = backend._call(send)
    done = [False] * len(batch)
    for members, reply in zip(groups.values(), replies):
        for i, flag in zip(members, reply if isinstance(reply, list) else []):
            done[i] = flag == 1
    return done
