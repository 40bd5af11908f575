"""The request ids an engine said started loading, until their async load is reported done.

An engine passes ids to ``get_finished`` (``started_loading_req_ids``); the worker reports each id
once its async load is done. An id whose load never starts here (a request aborted before its
load was started, a load planned with no blocks, an id of a request another connector loads)
would be kept for the life of the process, so ids are aged by ``start_load_kv`` calls (never by
time) and dropped once they went through :data:`UNLOADED_STARTS_KEPT` of them without a load.

Tolerance: an id may arrive *before* the metadata carrying its load is bound (TensorRT-LLM can pass
it in the ``get_finished`` of the step before the one whose ``start_load_kv`` starts the load;
vLLM and our engine pass it after that step's ``start_load_kv``). The first ``start_load_kv``
after its arrival is the one expected to start the load; one more is allowed on top as a margin,
then the id goes. A dropped id is remembered (the last :data:`DROPPED_KEPT`): should its load
start later after all, the id is taken back and the load reported when done, since the engine
did pass the id and waits for it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

UNLOADED_STARTS_KEPT = 2  # start_load_kv calls an id may see without its load before it is dropped
DROPPED_KEPT = 4096  # dropped ids remembered, should their load start late


class StartedLoads:
    """Ids passed as started loading and not reported loaded yet."""

    def __init__(self) -> None:
        self._ages: dict[str, int] = {}  # id -> start_load_kv calls seen without its load
        self._dropped: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ages)

    def __contains__(self, rid: object) -> bool:
        return rid in self._ages

    def arrived(self, ids: Iterable[str]) -> None:
        """The engine passed ``ids`` as started loading (again, for an id it passes every step)."""
        for rid in ids:
            self._ages.setdefault(rid, 0)
            self._dropped.pop(rid, None)

    def loads_started(self, loads: Mapping[str, object]) -> None:
        """After ``start_load_kv`` registered its async loads (``loads``: request id -> load):
        a dropped id whose load started is taken back; an id still without a load ages, and goes
        once it is :data:`UNLOADED_STARTS_KEPT` calls old."""
        for rid in [r for r in loads if r in self._dropped]:  # (the loads in flight: few)
            del self._dropped[rid]
            self._ages[rid] = 0
            log.info("request %s: its async load started after its id was dropped; it is reported when done", rid)
        gone = []
        for rid in self._ages:
            if rid in loads:
                self._ages[rid] = 0
            else:
                self._ages[rid] += 1
                if self._ages[rid] >= UNLOADED_STARTS_KEPT:
                    gone.append(rid)
        for rid in gone:
            del self._ages[rid]
            self._dropped[rid] = None
        while len(self._dropped) > DROPPED_KEPT:
            self._dropped.popitem(last=False)
        if gone:
            log.debug("%d started-loading ids had no async load here after %d steps; dropped",
                      len(gone), UNLOADED_STARTS_KEPT)

    def ready(self, loads: Mapping[str, object]) -> list[str]:
        """Ids whose async load in ``loads`` (request id -> load with a ``plan``) is done, sorted."""
        return sorted(r for r in self._ages if r in loads and loads[r].plan.done())  # type: ignore[attr-defined]

    def reported(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self._ages.pop(rid, None)
