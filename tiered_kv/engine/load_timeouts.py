"""Async loads the connector did not report in time (``EngineConfig.load_timeout_s``).

A connector reports an async load finished through ``get_finished``; one that never does (a worker
that lost it, a bug) would keep its request waiting for ever, holding its blocks. Past the
deadline the request gives the load up and computes those tokens itself, from its device prefix
hit. The load may still complete later and write the blocks and state slot it was given, so the
request moves onto fresh ones (:meth:`~.kv_cache_manager.KVCacheManager.set_aside`) and the old
ones stay out of use until the connector reports the request id as loaded; only then are they
freed. The connector learns the request's new block ids from a second ``update_state_after_alloc``
with 0 external tokens (the call vLLM makes after an async load). A load never reported keeps its
blocks set aside for good (counted in :attr:`LoadTimeouts.num_blocks`, logged).
"""

from __future__ import annotations

import logging

from tiered_kv.engine.connector_api import ConnectorScheduler
from tiered_kv.engine.kv_cache_manager import KVCacheManager, SetAside
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class LoadTimeouts:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, connector: ConnectorScheduler | None) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.connector = connector
        self._aside: dict[str, SetAside] = {}  # request id -> what its abandoned load may still write

    def holds(self, request_id: str) -> bool:
        """Whether a load of ``request_id`` was given up on and has not been reported since."""
        return request_id in self._aside

    @property
    def num_blocks(self) -> int:
        """Device blocks kept out of use for loads given up on."""
        return sum(len(a.block_ids) for a in self._aside.values())

    def reported(self, request_ids) -> None:
        """The connector reported these loads finished: what they wrote can be reused."""
        for request_id in request_ids:
            aside = self._aside.pop(request_id, None)
            if aside is not None:
                self.kv.release_set_aside(aside)
                logger.info("%s: the load given up on was reported; %d blocks are free again",
                            request_id, len(aside.block_ids))

    def give_up_overdue(self) -> list[str]:
        """Give up the loads past their deadline (those the pool can move off now); their ids."""
        given_up = []
        for request in self.scheduler.overdue_loads():
            if self._give_up(request):
                given_up.append(request.request_id)
        return given_up

    def _give_up(self, request: Sequence) -> bool:
        aside = self.kv.set_aside(request, request.pending_load_blocks)
        if aside is None:  # (tried again next step: finishing requests free blocks and slots)
            logger.debug("%s: its load is overdue, no free blocks to move it onto yet", request.request_id)
            return False
        self._aside[request.request_id] = aside
        logger.warning("%s: its async load of %d blocks was not reported in time; computing those "
                       "tokens (the blocks it loads into stay unused until it is reported, %d in all)",
                       request.request_id, len(aside.block_ids), self.num_blocks)
        request.pending_load_blocks = []
        request.num_external_tokens = 0
        request.num_computed_tokens = request.num_cached_tokens
        request.load_deadline = None
        self.scheduler.loaded(request)
        if self.connector is not None:
            self.connector.update_state_after_alloc(self.scheduler.view(request),
                                                    self.scheduler.block_ids(request), 0)
        return True
