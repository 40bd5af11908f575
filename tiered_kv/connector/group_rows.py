"""One request's device blocks per KV group, read the way entries are stored (no torch here).

Engines with several KV cache groups give a request one block table per group (vLLM's hybrid
allocator: ``([ids of group 0], [ids of group 1], ...)``). A token block ``i`` is stored from
the *row* of its blocks in every token group; a state group's table names the block that holds
the request's running state (the last one). ``-1`` is "no block": the engine keeps nothing of
that group there (a sliding window's blocks behind the window).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.kv_groups import KVGroup, state_groups, token_groups

NO_BLOCK = -1


class GroupRows:
    def __init__(self, groups: Sequence[KVGroup], block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(groups):
            raise ValueError(f"expected block ids for {len(groups)} KV groups, got {len(block_ids)} lists")
        self.ids = [list(ids) for ids in block_ids]
        self.token = token_groups(tuple(groups))
        self.kinds = [g.kind for g in groups]
        self.state = state_groups(tuple(groups))

    def extend(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Add a step's new blocks (one list per group)."""
        if len(block_ids) != len(self.ids):
            raise ValueError(f"expected block ids for {len(self.ids)} KV groups, got {len(block_ids)} lists")
        for table, new in zip(self.ids, block_ids):
            table.extend(new)

    def __len__(self) -> int:
        return min(len(self.ids[g]) for g in self.token)

    def _row(self, i: int) -> tuple[int, ...]:
        return tuple(self.ids[g][i] if i < len(self.ids[g]) else NO_BLOCK for g in self.token)

    def row(self, i: int) -> tuple[int, ...] | None:
        """Block ``i`` in every token group (None: no group keeps a block there)."""
        row = self._row(i)
        return row if any(b >= 0 for b in row) else None

    def full_rows(self, start: int, stop: int) -> list[tuple[int, ...] | None]:
        """Rows ``start..stop-1``; None where some token group keeps no block (not storable)."""
        rows = [self._row(i) for i in range(start, stop)]
        return [r if all(b >= 0 for b in r) else None for r in rows]

    def refs(self) -> list[int]:
        """One block id per token block, for what tracks blocks by one id (failed loads): a group
        that keeps every block (full attention, MLA) when there is one; sliding-window ids are
        freed and reused while the request runs."""
        keeps = [j for j, g in enumerate(self.token) if self.kinds[g] in ("full", "mla")]
        rows = (self._row(i) for i in range(len(self)))
        if keeps:
            return [r[keeps[0]] for r in rows]
        return [next((b for b in r if b >= 0), NO_BLOCK) for r in rows]

    def state_ids(self) -> tuple[int, ...]:
        """The block holding the running state in each state group (empty: some group has none)."""
        last = [self.ids[g][-1] if self.ids[g] else NO_BLOCK for g in self.state]
        return tuple(last) if all(b >= 0 for b in last) else ()
