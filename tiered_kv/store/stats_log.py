"""A one-line summary of a store's traffic, logged every ``metrics_log_interval`` seconds.

For operators without a Prometheus scraper: what each tier served and missed (by reason) and the
bytes it took in and gave out since the previous line, the bytes queued, and store events
(dropped saves, failed writes, ...). Logged at INFO through ``tiered_kv.store.stats_log``.

A line is made of the store's own counters and queues only (:func:`traffic`): never of
``store.stats()``, which asks every medium for its figures (Redis ``INFO`` and a key sample, a
file tier's walk of its directory) that the line does not show; a hung Redis held every line
for its timeout.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tiered_kv.units import format_size

log = logging.getLogger(__name__)


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def summary_line(snap: dict[str, Any], previous: dict[str, Any] | None = None) -> str:
    """What changed between ``previous`` (or the start) and ``snap``, both :func:`traffic` (or
    ``store.stats()``, which holds the same and more)."""
    before_tiers = (previous or {}).get("tiers", {})
    parts = []
    for tier, now in snap["tiers"].items():
        was = before_tiers.get(tier, {})
        hits = now["hits"] - was.get("hits", 0)
        misses = _delta(now["misses"], was.get("misses", {}))
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(misses.items()))
        parts.append(f"{tier} {hits} hits / {sum(misses.values())} misses"
                     + (f" ({reasons})" if reasons else "")
                     + f", in {format_size(now['bytes_in'] - was.get('bytes_in', 0))}"
                     + f", out {format_size(now['bytes_out'] - was.get('bytes_out', 0))}")
    queued = snap.get("queued_bytes", {})
    parts.append(f"queued save {format_size(queued.get('save', 0))} / load {format_size(queued.get('load', 0))}")
    events = _delta(snap.get("events", {}), (previous or {}).get("events", {}))
    if events:
        parts.append("events " + ", ".join(f"{e} {n}" for e, n in sorted(events.items())))
    return "; ".join(parts)


def traffic(store: Any) -> dict[str, Any]:
    """What :func:`summary_line` reads of ``store``, from memory: its counters and queued bytes."""
    snap = store.metrics.snapshot()
    snap["queued_bytes"] = store.pool.queued_bytes()
    return snap


class StatsLogger:
    """A daemon thread logging :func:`summary_line` of ``store`` every ``interval`` seconds."""

    def __init__(self, store: Any, interval: float) -> None:
        self.store, self.interval = store, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered-kv-stats-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        previous, said = None, False
        while not self._stop.wait(self.interval):
            # any failure skips this line only: one raised out of here ended the thread, and with
            # it every later line (a logging filter or handler of the application that failed once)
            try:
                snap = traffic(self.store)
                log.info("tiered-kv %s: %s", self.store.namespace.model_id, summary_line(snap, previous))
                previous = snap  # (a line not logged: the next one covers its interval too)
            except Exception as exc:
                try:  # said once at WARNING (a line per interval would flood the log), then at DEBUG
                    log.log(logging.DEBUG if said else logging.WARNING,
                            "tiered-kv stats line skipped: %s: %s", type(exc).__name__, exc)
                except Exception:  # (the same failing filter: nothing more to do about it here)
                    pass
                said = True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
