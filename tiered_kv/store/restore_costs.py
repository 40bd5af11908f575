"""Running estimates of what restoring stored blocks and recomputing them cost (no torch here:
the scheduler half reads them).

Users of other KV caches report hits slower than recomputing (an 8k-token file hit in 2.45 s
against a 1.7 s prefill). The restore policy (:mod:`tiered_kv.connector.restore_policy`) weighs
the two per request; this module keeps the figures it weighs, learnt from what this engine did:

- **restore from a tier** ("host" for blocks already in host memory, else the lower tier's name):
  ``seconds = latency + bytes * per_byte`` (latency, and throughput ``1 / per_byte``);
- **prefill in an engine step**: ``seconds = per_step + per_token * new_tokens + per_pair * pairs``
  where ``pairs`` is the step's attention work, :func:`attention_work` summed over its requests
  (the query-key pairs a causal prefill attends: what grows with the context).

Each is a least-squares fit with non-negative coefficients (exact: every face of the orthant is
tried, :func:`_nnls`) over recent observations. Recent, by size: the newest ``KEEP_PER_CLASS``
observations of each power-of-two size class are kept, so a stream of small decode steps cannot
push the few long prefills out of the fit. A tier's restores age, though: a size class that none of
its last ``STALE_RESTORES`` restores refreshed is dropped (a tier that turned fast while the
prompts turned short was otherwise judged by its slow era for ever, and loaded from only by
probes, whose sizes refresh no old class). From ``TRIM`` observations on, those that miss the
fit by more than three times the median miss (a step stalled by a collection, a first call
compiling kernels; at most ``1 / TRIM`` of them, the worst) are dropped and the fit repeated. Below ``min_samples`` observations of a
tier (or of steps) its estimate is not given out (None): the policy then loads, as it would
without estimates. Tests pin estimates with :meth:`RestoreCosts.set_restore` /
:meth:`RestoreCosts.set_prefill` instead of timing anything.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEEP_PER_CLASS = 8  # newest observations kept per power-of-two size class
TRIM = 8  # from TRIM observations, outliers (at most 1/TRIM of them) are dropped before the final fit
STALE_RESTORES = 32 * KEEP_PER_CLASS  # a tier's size class no restore refreshed in this many is dropped

# the faces tried, preferred first where fits tie (an exact fit of too few points): the full
# model, then the models that grow with the size (they extrapolate; a constant does not)
_FACES = {2: ((0, 1), (1,), (0,)),
          3: ((0, 1, 2), (0, 1), (1, 2), (1,), (0, 2), (2,), (0,))}


def attention_work(context: int, new: int) -> int:
    """Query-key pairs ``new`` tokens attend after ``context`` tokens, causally:
    ``new * context + new * (new + 1) / 2``."""
    return new * context + new * (new + 1) // 2


@dataclass(frozen=True)
class RestoreEstimate:
    """Restoring ``n`` bytes from one tier: ``latency_s + n * per_byte_s`` seconds."""

    latency_s: float
    per_byte_s: float
    observed: int  # restores observed (a pinned estimate: how many it stands for)

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.per_byte_s

    @property
    def bytes_per_s(self) -> float | None:
        """Throughput (None: unbounded, all latency)."""
        return 1.0 / self.per_byte_s if self.per_byte_s > 0 else None


@dataclass(frozen=True)
class PrefillEstimate:
    """An engine step computing ``t`` new tokens with attention work ``w`` (:func:`attention_work`):
    ``per_step_s + t * per_token_s + w * per_pair_s`` seconds."""

    per_step_s: float
    per_token_s: float
    per_pair_s: float
    observed: int

    def seconds(self, new_tokens: int, work: int) -> float:
        return self.per_step_s + new_tokens * self.per_token_s + work * self.per_pair_s


class _Series:
    """Observations ``(x..., seconds)`` of one quantity, bounded per size class, and their fit."""

    def __init__(self, width: int, stale_after: int | None = None) -> None:
        self.width = width  # features besides the constant
        self.stale_after = stale_after  # observations after which a class none refreshed is dropped
        self.classes: dict[int, deque] = {}
        self._refreshed: dict[int, int] = {}  # size class -> ``observed`` at its newest observation
        self.observed = 0
        self.pinned: tuple[float, ...] | None = None
        self._fit: tuple[float, ...] | None = None

    def add(self, xs: tuple[int, ...], seconds: float) -> None:
        size = max(int(xs[0]), 0).bit_length()
        self.classes.setdefault(size, deque(maxlen=KEEP_PER_CLASS)).append((*xs, seconds))
        self.observed += 1
        self._refreshed[size] = self.observed
        if self.stale_after is not None:
            for old in [c for c, n in self._refreshed.items() if self.observed - n > self.stale_after]:
                del self.classes[old], self._refreshed[old]
        self._fit = None

    def samples(self) -> list[tuple]:
        return [s for size in sorted(self.classes) for s in self.classes[size]]

    def coefficients(self) -> tuple[float, ...] | None:
        if self.pinned is not None:
            return self.pinned
        if self._fit is None:
            samples = self.samples()
            self._fit = _robust_fit(samples, self.width) if samples else None
        return self._fit

    def dump(self) -> dict:
        out: dict = {"observed": self.observed, "samples": [list(s) for s in self.samples()]}
        if self.pinned is not None:
            out["pinned"] = list(self.pinned)
        fit = self.coefficients()
        if fit is not None:
            out["fit"] = [round(c, 12) for c in fit]  # for readers; recomputed on load
        return out

    @classmethod
    def load(cls, data: Mapping, width: int, stale_after: int | None = None) -> _Series:
        series = cls(width)
        for s in data.get("samples", ()):
            if _valid(s, width + 1):
                series.add(tuple(int(v) for v in s[:-1]), float(s[-1]))
        series.observed = max(int(data.get("observed", 0)), series.observed)
        series.stale_after = stale_after  # (what a record holds ages from now on)
        series._refreshed = dict.fromkeys(series.classes, series.observed)
        pinned = data.get("pinned")
        if pinned is not None and _valid(pinned, width + 1):
            series.pinned = tuple(float(v) for v in pinned)
        return series


class RestoreCosts:
    """Restore estimates per tier and the engine's prefill estimate. Thread-safe: the worker
    observes from the forward path and the pool's threads, the scheduler reads."""

    def __init__(self, min_samples: int = 3) -> None:
        self.min_samples = min_samples
        self._lock = threading.Lock()
        self._restore: dict[str, _Series] = {}
        self._steps = _Series(2)
        self.changes = 0  # bumped by every change (the record keeper writes when it moved)

    # -- observing ---------------------------------------------------------------------------------
    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        """One load served entirely from ``tier``: ``nbytes`` payload bytes in the engine's
        memory ``seconds`` after the load started."""
        if nbytes > 0 and _finite(seconds):
            with self._lock:
                self._restore.setdefault(tier, _Series(1, STALE_RESTORES)).add((int(nbytes),), float(seconds))
                self.changes += 1

    def observe_step(self, new_tokens: int, attention_work: int, seconds: float) -> None:
        """One engine step that computed ``new_tokens`` tokens with ``attention_work`` pairs
        (:func:`attention_work` summed over its requests) and waited for no load."""
        if new_tokens > 0 and attention_work >= 0 and _finite(seconds):
            with self._lock:
                self._steps.add((int(new_tokens), int(attention_work)), float(seconds))
                self.changes += 1

    # -- injecting (tests, tools) ----------------------------------------------------------------
    def set_restore(self, tier: str, latency_s: float, bytes_per_s: float | None,
                    observed: int | None = None) -> None:
        """Pin ``tier``'s estimate (``bytes_per_s`` None: unbounded); observations no longer move
        it. ``observed`` (default: the floor) is what the floor compares."""
        with self._lock:
            series = self._restore.setdefault(tier, _Series(1, STALE_RESTORES))
            series.pinned = (float(latency_s), 1.0 / bytes_per_s if bytes_per_s else 0.0)
            series.observed = self.min_samples if observed is None else observed
            self.changes += 1

    def set_prefill(self, per_step_s: float, per_token_s: float, per_pair_s: float = 0.0,
                    observed: int | None = None) -> None:
        """Pin the prefill estimate (see :meth:`set_restore`)."""
        with self._lock:
            self._steps.pinned = (float(per_step_s), float(per_token_s), float(per_pair_s))
            self._steps.observed = self.min_samples if observed is None else observed
            self.changes += 1

    # -- estimates ---------------------------------------------------------------------------------
    def restore_estimate(self, tier: str) -> RestoreEstimate | None:
        """``tier``'s estimate whatever its observations (None: nothing known)."""
        with self._lock:
            series = self._restore.get(tier)
            fit = series.coefficients() if series is not None else None
            return None if fit is None else RestoreEstimate(*fit, observed=series.observed)

    def prefill_estimate(self) -> PrefillEstimate | None:
        with self._lock:
            fit = self._steps.coefficients()
            return None if fit is None else PrefillEstimate(*fit, observed=self._steps.observed)

    def restore_seconds(self, tier_bytes: Mapping[str, int]) -> float | None:
        """Predicted seconds to restore ``tier_bytes`` (tier -> bytes; one load per tier, one
        after the other); None when a tier with bytes is below the floor."""
        total = 0.0
        for tier, nbytes in tier_bytes.items():
            if nbytes <= 0:
                continue
            est = self.restore_estimate(tier)
            if est is None or est.observed < self.min_samples:
                return None
            total += est.seconds(nbytes)
        return total

    def prefill_seconds(self, new_tokens: int, attention_work: int) -> float | None:
        """Predicted seconds of a step computing ``new_tokens`` with ``attention_work`` pairs;
        None below the floor."""
        est = self.prefill_estimate()
        if est is None or est.observed < self.min_samples:
            return None
        return est.seconds(new_tokens, attention_work)

    def restores_observed(self) -> dict[str, int]:
        """Restores observed per tier (a pinned estimate: what it stands for)."""
        with self._lock:
            return {t: s.observed for t, s in self._restore.items()}

    def steps_observed(self) -> int:
        with self._lock:
            return self._steps.observed

    # -- persistence (tiered_kv.store.records) ------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything needed to continue: per tier and for steps, the observations kept, how many
        were made and any pinned estimate (plain JSON types)."""
        with self._lock:
            return {"restore": {t: s.dump() for t, s in sorted(self._restore.items())},
                    "prefill": self._steps.dump()}

    def restore_snapshot(self, data: Mapping) -> None:
        """Replace every estimate by those of ``data`` (:meth:`snapshot`'s form; what does not
        read as such is left out)."""
        tiers = data.get("restore")
        restore = {str(t): _read(s, 1, STALE_RESTORES) for t, s in (tiers.items() if isinstance(tiers, Mapping) else ())}
        restore = {t: s for t, s in restore.items() if s is not None}
        steps = _read(data.get("prefill"), 2) or _Series(2)
        with self._lock:
            self._restore, self._steps = restore, steps
            self.changes += 1

    def empty(self) -> bool:
        with self._lock:
            return not self._steps.observed and not any(s.observed for s in self._restore.values())


def _read(data, width: int, stale_after: int | None = None) -> _Series | None:
    """A series from its :meth:`_Series.dump` (None: not one)."""
    try:
        return _Series.load(data, width, stale_after) if isinstance(data, Mapping) else None
    except (TypeError, ValueError, OverflowError):  # (an infinite count: JSON reads Infinity)
        return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def _valid(values, n: int) -> bool:
    return isinstance(values, (list, tuple)) and len(values) == n and all(_finite(v) for v in values)


def _robust_fit(samples: Sequence[tuple], width: int) -> tuple[float, ...]:
    """Coefficients (constant first) of the non-negative least-squares fit of ``samples``; from
    ``TRIM`` samples on, refitted without the outliers (residual over three times the median, at
    most ``1 / TRIM`` of the samples)."""
    coef = _nnls(samples, width)
    if len(samples) >= TRIM:
        misses = sorted((abs(_predict(coef, s[:-1]) - s[-1]), i) for i, s in enumerate(samples))
        bound = 3 * misses[len(misses) // 2][0] + 1e-9
        out = {i for miss, i in misses[len(misses) - len(misses) // TRIM:] if miss > bound}
        if out:
            coef = _nnls([s for i, s in enumerate(samples) if i not in out], width)
    return coef


def _predict(coef: Sequence[float], xs: Sequence[float]) -> float:
    return coef[0] + sum(c * x for c, x in zip(coef[1:], xs))


def _nnls(samples: Sequence[tuple], width: int) -> tuple[float, ...]:
    """Least squares ``seconds ~ c0 + c1 x1 (+ c2 x2)`` with every ``c >= 0``: the best of the
    unconstrained fits on each face of the orthant that land inside it (the optimum is one)."""
    k = width + 1
    rows = [(1.0, *map(float, s[:-1])) for s in samples]
    # seconds scaled too: squares of a figure past 1e154 (a corrupt record) were infinite, no face
    # fitted and every coefficient stayed 0 (recomputing predicted free: nothing was loaded)
    y_scale = max(float(s[-1]) for s in samples) or 1.0
    ys = [float(s[-1]) / y_scale for s in samples]
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    rows = [tuple(v / sc for v, sc in zip(r, scale)) for r in rows]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    yty = sum(y * y for y in ys)
    best, best_err = [0.0] * k, yty
    for face in _FACES[k]:
        sol = _solve([[gram[i][j] for j in face] for i in face], [aty[i] for i in face])
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for i, c in zip(face, sol):
            coef[i] = c
        err = yty - 2 * sum(c * a for c, a in zip(coef, aty)) + sum(
            coef[i] * gram[i][j] * coef[j] for i in range(k) for j in range(k))
        if err < best_err - 1e-9 * yty:
            best, best_err = coef, err
    return tuple(c * y_scale / sc for c, sc in zip(best, scale))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    tiny = 1e-12 * max(max(abs(v) for v in row[:n]) for row in m) if n else 0.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= tiny:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
