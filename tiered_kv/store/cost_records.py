"""The store's restore and prefill estimates (:class:`~tiered_kv.store.restore_costs.RestoreCosts`)
kept in the namespace record of each lower tier (:mod:`tiered_kv.store.records`), per class of
machine, as the record's member ``restore_costs``::

    {...the namespace's fields..., "restore_costs": {"format": 2, "machines": {
        "<class key>": {"machine": "x86_64, 64 cpus, ..., 8 x NVIDIA H200", "tier": "disk",
                        "written": 1764000000.0,
                        "restore": {"disk": {"observed": 12, "samples": [[nbytes, seconds], ...],
                                             "fit": [latency_s, per_byte_s]}, "host": {...}},
                        "prefill": {"observed": 40, "samples": [[new_tokens, attention_work, seconds], ...],
                                    "fit": [per_step_s, per_token_s, per_pair_s]}},
        ...}}}

Per class of machine (:mod:`tiered_kv.store.machine_class`): what a restore and a prefill cost
belongs to the hardware, and replicas on other hardware share a Redis or a shared file store; a
store and the scheduler's index read only their own class's entry (format 1 records held one
entry of no known machine: not read, the store learns afresh). A record keeps the
``MAX_MACHINES`` most recently written classes; a writer puts its entry in beside the others it
reads (two classes writing at the same moment may drop one another's latest entry once).

``tier``: the name the writing store gave the tier holding it, so a tool that opened that tier
by URL knows which estimates are its; ``pinned`` beside ``samples``: an injected estimate;
``fit`` is for readers, recomputed from the samples on load. Inside the namespace record rather
than under a key of its own, because tools take any other entry for an orphan (``verify --fix``
removes it, ``inspect`` counts it as foreign) and ``copy`` carries namespace records only; a
namespace's readers ignore members that are not namespace fields. :class:`CostsKeeper` writes
its entry into the record of every lower tier holding one, at most every ``COSTS_SAVE_S``
seconds when the estimates moved and at flush / close, reads it back from the first tier holding
one when a store or the scheduler's index opens (a restarted engine starts with the last run's
figures), and, for the index (which cannot observe), every ``COSTS_REFRESH_S`` seconds after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

from tiered_kv.errors import BackendError, CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.machine_class import machine_class
from tiered_kv.store.records import COSTS_MEMBER, dump_doc, namespace_key, parse_doc, record_doc

log = logging.getLogger(__name__)

COSTS_FORMAT = 2
COSTS_SAVE_S = 60.0  # a store writes its estimates at most this often (and at flush / close)
COSTS_REFRESH_S = 60.0  # the scheduler's lookup index reads them back this often
START_READ_WAIT_S = 1.0  # a store's start-up waits this long for its estimates (a hung tier: not longer)
MAX_MACHINES = 8  # classes of machine a record keeps estimates of (the most recently written)
ANY = "any"  # read_costs(machine=ANY): the most recently written entry, of whatever machine


def encode_costs(namespace: Namespace, snapshot: Mapping, tier: str, held=None) -> bytes:
    """The namespace record carrying :meth:`RestoreCosts.snapshot` as this machine's entry (with
    tier and time), beside the other machines' entries of ``held`` (the record stored now, if
    any, when it reads)."""
    key, description = machine_class()
    machines = {}
    if held is not None:
        try:
            machines = _machines(held)
        except CorruptBlock:
            pass  # (rewritten whole)
    machines[key] = {"machine": description, "tier": tier, "written": round(time.time(), 3), **snapshot}
    newest = sorted(machines, key=lambda k: _written(machines[k]), reverse=True)[:MAX_MACHINES]
    doc = record_doc(namespace)
    doc[COSTS_MEMBER] = {"format": COSTS_FORMAT, "machines": {k: machines[k] for k in sorted(newest)}}
    return dump_doc(doc)


def decode_costs(value: bytes, machine: str | None = None) -> dict | None:
    """The entry of ``machine`` (a class key; None: this machine's; ``ANY``: the most recently
    written) in a namespace record (None: none); CorruptBlock when unreadable."""
    machines = _machines(value)
    if machine == ANY:
        return max(machines.values(), key=_written, default=None)
    return machines.get(machine or machine_class()[0])


def read_costs(tiers: Sequence[tuple[str, object]], digest: bytes, machine: str | None = None) -> dict | None:
    """The entry of ``machine`` (:func:`decode_costs`) in the namespace record of the first of
    ``tiers`` (name, medium) holding one."""
    key = namespace_key(digest)
    for name, backend in tiers:
        try:
            value = backend.get_many([key])[0]
            costs = decode_costs(value, machine) if value is not None else None
            if costs is not None:
                return costs
        except (BackendError, CorruptBlock) as exc:
            log.debug("%s tier: restore costs not read: %s", name, exc)
    return None


def _machines(value) -> dict:
    """Class key -> entry, of the estimates a namespace record carries ({}: none, or of format 1)."""
    try:
        doc = parse_doc(value)
    except (ValueError, TypeError) as exc:
        raise CorruptBlock(f"unreadable namespace record: {exc}") from None
    costs = doc.get(COSTS_MEMBER) if isinstance(doc, dict) else None
    if costs is None or (isinstance(costs, dict) and costs.get("format") == 1):
        return {}
    if not isinstance(costs, dict) or costs.get("format") != COSTS_FORMAT or not isinstance(costs.get("machines"), dict):
        raise CorruptBlock("restore costs of another format")
    return {str(k): v for k, v in costs["machines"].items() if isinstance(v, dict)}


def _written(entry: Mapping) -> float:
    written = entry.get("written")
    return float(written) if isinstance(written, (int, float)) and not isinstance(written, bool) else 0.0


class CostsKeeper:
    """Keeps ``costs`` (a RestoreCosts) and this machine's entry in ``namespace``'s record in the
    lower ``tiers`` (name, medium) in step. ``writes``: a store, which reads the estimates when
    created (its worker's start-up), observes and writes (every ``every`` seconds when they
    moved, and on :meth:`save`); else the scheduler's index, which reads them on its thread at
    once and every ``every`` seconds after (never on the scheduler's path: a remote tier may be
    slow to answer; ``loaded`` is set once the first read is done)."""

    def __init__(self, costs, namespace: Namespace, tiers: Sequence[tuple[str, object]], *, writes: bool,
                 every: float) -> None:
        self.costs, self.namespace, self.tiers, self.writes = costs, namespace, list(tiers), writes
        self.digest = namespace.digest()
        self._written = -1  # costs.changes when last written or read
        self._seen: float | None = None  # "written" of the entry last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.loaded = threading.Event()
        background = bool(self.tiers) and every > 0
        if writes and background:  # (read on a thread: a hung tier held the engine's start-up
            # for its timeout x tries; past the wait the store starts without them, they come later)
            before = costs.changes  # (a read answering after the wait must not undo what was seen since)
            threading.Thread(target=self.load, args=(before,), daemon=True, name="tiered-kv-costs-read").start()
            self.loaded.wait(START_READ_WAIT_S)
        elif writes or not background:
            self.load()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(every,), daemon=True,
                                            name="tiered-kv-costs")
            self._thread.start()

    def load(self, unchanged_since: int | None = None) -> bool:
        """Replace the estimates by this machine's entry in the record (when there is one, newer
        than the last read); with ``unchanged_since``, only while the estimates have not moved
        since that count (a store's first read that answered late: what the store observed
        meanwhile is newer, and is written over the record's entry instead)."""
        try:
            doc = read_costs(self.tiers, self.digest)
            if doc is None or doc.get("written") == self._seen:
                return False
            if unchanged_since is not None and self.costs.changes != unchanged_since:
                log.info("restore costs read late; the estimates observed since start are kept")
                return False
            self.costs.restore_snapshot(doc)
            self._seen, self._written = doc.get("written"), self.costs.changes
            return True
        except Exception as exc:  # estimates are an optimisation: never a reason not to start
            log.warning("restore costs not read: %r", exc)
            return False
        finally:
            self.loaded.set()

    def save(self) -> bool:
        """Write the estimates when they moved since the last write (or read), as this machine's
        entry in the namespace record of every tier holding one (a tier holding nothing of the
        namespace gets none)."""
        with self._lock:
            changes = self.costs.changes
            # (not before the record was read: this machine's entry there would be overwritten)
            if not self.writes or not self.loaded.is_set() or changes == self._written or self.costs.empty():
                return False
            snapshot, key = self.costs.snapshot(), namespace_key(self.digest)
            for name, backend in self.tiers:
                try:
                    held = backend.get_many([key])[0]
                    if held is not None:
                        backend.put_many([(key, encode_costs(self.namespace, snapshot, name, held))])
                except Exception as exc:  # (a down tier: the blocks' own writes report it)
                    log.debug("%s tier: restore costs not written: %r", name, exc)
            self._written = changes
            return True

    def _run(self, every: float) -> None:
        wait = every if self.loaded.is_set() else 0.0  # the index's first read: at once
        while not self._stop.wait(wait):
            wait = every
            try:
                self.save() if self.writes else self.load()
            except Exception as exc:  # a closing medium: the next round (or close) tries again
                log.debug("restore costs: %r", exc)

    def close(self) -> None:
        """Stop the thread (the owner saves once more while its media are open)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
