"""Saves planned in a request's step marked ``no_save`` and handed to the workers one plan later.

vLLM may schedule a new request under an id whose previous request finished unheld just before:
that step's ``finished_req_ids`` names the id for the old request, and a worker holding a save
of the new one in that step reports the id in ``finished_sending`` (vLLM then freed the new,
running request's blocks). Such a step's saves are planned as usual (its tokens still count as
the step's work) but go out with the next plan:

- the request finished meanwhile (within that step): the engine holds its blocks for them
  (``request_finished`` -> True) and the next step's ``finished_req_ids`` names the id for this
  request, whose saves the workers then hold: the report is the right one. Such saves always go
  out (a request held for saves no worker got would never be reported, its blocks never freed);
- the request runs on: its token blocks stay as they were, except where a KV group frees blocks
  while it runs (sliding window, chunked local attention: they may belong to another request by
  the next step's forward), then its saves are dropped (a miss); a running state is rewritten by
  the next step, so a state entry is left out;
- the request was preempted, or a block its saves read or were computed over failed to load:
  dropped (vLLM took the blocks back; the worker would drop KV computed over a failed load).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tiered_kv.connector.meta import SaveSpec
from tiered_kv.keys import Namespace

log = logging.getLogger(__name__)


class HeldSaves:
    def __init__(self, namespace: Namespace) -> None:
        # a group whose blocks go back to the engine while the request runs
        self._frees_blocks = any(g.kind in ("sliding", "chunked") for g in namespace.groups)
        self._held: dict[str, SaveSpec] = {}  # request -> the saves of its no_save step
        self._finished: set[str] = set()  # held requests the engine finished (their blocks held)

    def hold(self, spec: SaveSpec) -> None:
        self._held[spec.request_id] = spec

    def pending(self) -> list[SaveSpec]:
        """The saves held now (for what names the blocks a plan saves)."""
        return list(self._held.values())

    def finished(self, request_id: str) -> bool:
        """The request finished before its held saves went out: True when it has some (the
        engine must hold its blocks until the workers report them)."""
        if request_id not in self._held:
            return False
        self._finished.add(request_id)
        return True

    def drop(self, request_id: str) -> None:
        """The request's blocks went back to the engine (preempted)."""
        if request_id not in self._finished:
            self._held.pop(request_id, None)

    def drop_failed(self, failed: set[int]) -> None:
        """Blocks failed to load: held saves that read them or were computed over them go nowhere."""
        for rid, spec in list(self._held.items()):
            if rid not in self._finished and not failed.isdisjoint((*spec.context_block_ids, *spec.block_ids)):
                del self._held[rid]

    def release(self) -> list[tuple[SaveSpec, bool]]:
        """The held saves that go out with this plan, each with whether its request finished (the
        id may name a newer request by now: it has no part in these); the others are dropped.
        Called once per plan, before the plan's own saves (a request planned anew under the same
        id holds again)."""
        out = []
        for rid, spec in self._held.items():
            if rid not in self._finished:
                if self._frees_blocks:
                    log.debug("request %s: its first step's saves are dropped (windowed blocks)", rid)
                    continue
                spec = replace(spec, state_key=None, state_ids=())  # (its state is rewritten by now)
            if spec.keys or spec.state_key:
                out.append((spec, rid in self._finished))
        self._held, self._finished = {}, set()
        return out
