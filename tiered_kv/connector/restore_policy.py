"""Cost-aware restore: how much of a request's stored prefix is worth loading (no torch here).

A stored hit is not always faster than recomputing it: an 8k-token file hit has been measured
at 2.45 s against a 1.7 s prefill, a disk onboarding at 40 s against 0.9 s. For each request the
scheduler half asks :meth:`RestorePolicy.decide` how many of the ``n`` stored blocks after the
device prefix to claim; loading the first ``K`` (each from the tier it is in) and recomputing
the rest is predicted to reach the first token after

    R(K) = costs.restore_seconds({tier: bytes of the first K blocks in that tier})
    C(K) = costs.prefill_seconds(new, attention_work(context, new))
           with context = device prefix + K blocks, new = prompt tokens - context
    T(0) = C(0)
    T(K) = max(R, C) + min(R, C) / G    sync loads streamed layer group by layer group (config
                                        ``layerwise_loads``; "auto": on an
                                        accelerator), G = the frames a block is stored
                                        in (``layer_groups``, none under 64 KiB: a 128 KiB block
                                        has 2): a two-stage pipeline, group g computes while
                                        group g+1 arrives
    T(K) = R + C                        whole loads before the forward, async loads (they
                                        complete between steps, then the prefill runs), or
                                        blocks of one frame (they arrive whole)

(:mod:`tiered_kv.store.restore_costs` has the estimates: latency + bytes / throughput per tier,
per-step + per-token + per-attention-pair for the engine). The claim is the allowed ``K`` with the
least ``T(K)``; a tie (within ``margin``, by default none) goes to the larger ``K``. A margin
toward loading loses: bench_restore's throttled Redis, its first blocks predicted 1-8% slower than
recomputing them, loaded them inside a 10% margin (1.68 s against 1.29 s recomputing) and, one
block, inside a 2% margin (a lone GET paid a latency its estimate, fitted from whole-prompt
loads only, did not have: 1.88 s against 1.38 s). A model with recurrent state may only stop where a state entry is held
(``cuts``). Loads everything: policy ``always``; estimates below the floor (``restore_min_samples``
observations of a tier in the prefix, or of engine steps); and, every ``probe_every``-th time it
would skip, once (a *probe*: a tier judged slow is never loaded from again otherwise, so its
estimate could never recover). Skipped blocks are counted once per allocation
(:meth:`RestorePolicy.settle`), per tier, as misses ``slower_than_recompute``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from math import prod

from tiered_kv.config import layerwise_on
from tiered_kv.dtypes import itemsize
from tiered_kv.keys import Namespace
from tiered_kv.store.layer_frames import frame_count
from tiered_kv.store.restore_costs import PrefillEstimate, RestoreEstimate, attention_work

log = logging.getLogger(__name__)

SLOWER = "slower_than_recompute"  # the miss reason of skipped blocks
MARGIN = 0.0  # a load predicted within this fraction of the best TTFT is a tie, and made
PROBE_EVERY = 32  # every 32nd decision that would skip loads everything instead
SkipCounter = Callable[[Mapping[str, int], int, bool], None]  # (blocks per tier, tokens, probe)


@dataclass(frozen=True)
class Decision:
    """How much of one request's stored prefix to load, and why."""

    stored_blocks: int  # blocks held after the device prefix (already cut to a state block)
    load_blocks: int  # blocks to claim
    reason: str  # always | below_floor | load_is_faster | slower_than_recompute | probe | nothing_stored
    block_size: int = 0
    restore_s: float | None = None  # predicted restore of the claimed blocks
    recompute_s: float | None = None  # predicted prefill of the tokens left to compute
    ttft_s: float | None = None  # predicted TTFT of this claim
    load_all_s: float | None = None  # predicted TTFT loading every stored block
    recompute_all_s: float | None = None  # predicted TTFT loading nothing
    skipped: tuple[tuple[str, int], ...] = ()  # (tier, blocks) stored but not claimed
    detail: str = ""

    @property
    def skipped_blocks(self) -> int:
        return self.stored_blocks - self.load_blocks

    @property
    def skipped_tokens(self) -> int:
        return self.skipped_blocks * self.block_size

    def as_dict(self) -> dict:
        out = asdict(self)
        out["skipped"] = dict(self.skipped)
        out.update(load_tokens=self.load_blocks * self.block_size, skipped_tokens=self.skipped_tokens)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


class RestorePolicy:
    """Decides claims from ``costs`` (a :class:`~tiered_kv.store.restore_costs.RestoreCosts`,
    None: nothing known) and counts what it skipped through ``count``."""

    def __init__(self, costs, block_bytes: int, block_size: int, *, policy: str = "cost",
                 layerwise: bool = True, layer_groups: int = 8, load_async: bool = False,
                 margin: float = MARGIN, probe_every: int = PROBE_EVERY, count: SkipCounter | None = None,
                 streamed: Sequence[str] = ("host", "disk")) -> None:
        self.costs = costs
        self.block_bytes, self.block_size = block_bytes, block_size
        self.policy = policy if costs is not None else "always"
        self.layerwise, self.load_async = layerwise, load_async
        # tiers whose reads arrive frame by frame (host memory, LMDB's mapped pages); a Redis GET
        # brings whole blocks: its restore ends before the first layer can start
        self.streamed = set(streamed)
        self.groups = max(1, layer_groups)
        self.margin, self.probe_every = margin, probe_every
        self.count = count
        self._skips = 0  # settled decisions that skipped, since the last probe

    @property
    def overlap(self) -> bool:
        """Whether restore runs beside the step's compute: layer-wise sync loads of blocks stored
        in several frames (a block of one frame arrives whole, before its first layer is computed)."""
        return self.layerwise and not self.load_async and self.groups > 1

    def streams_layers(self, on: bool) -> None:
        """The worker loads layer by layer (``on``) or whole blocks: predict that from now on
        (``layerwise_loads = "auto"`` is settled once the engine's device is known)."""
        self.layerwise = bool(on)

    @classmethod
    def for_index(cls, index, namespace: Namespace, *, load_async: bool = False,
                  device: str | None = None, lower_streams: bool = True) -> RestorePolicy:
        """The policy ``index`` is configured for: its ``costs`` and its ``config``'s
        ``restore_policy``, ``layerwise_loads`` and ``layer_groups`` (:meth:`for_namespace`;
        without costs: always). ``lower_streams``: whether LMDB tiers' reads reach the forward
        frame by frame (not where the engine reads lower tiers before the step)."""
        config = getattr(index, "config", None)
        return cls.for_namespace(getattr(index, "costs", None), namespace,
                                 layerwise=getattr(config, "layerwise_loads", True), device=device,
                                 layer_groups=getattr(config, "layer_groups", 8),
                                 lmdb_tiers=[t.name for t in getattr(config, "lower_tiers", ())
                                             if lower_streams and str(t.url).startswith("lmdb:")],
                                 policy=getattr(config, "restore_policy", "cost"), load_async=load_async,
                                 count=getattr(index, "count_restore_skips", None))

    @classmethod
    def for_namespace(cls, costs, namespace: Namespace, *, layerwise, device: str | None, layer_groups: int,
                      lmdb_tiers: Sequence[str], **options) -> RestorePolicy:
        """The policy for ``namespace``'s blocks: loaded layer-wise as the ``layerwise_loads``
        setting ``layerwise`` settles on ``device`` (a device type; None: not known yet), and only
        for plain KV blocks (no KV groups); in the frames they are stored in (from
        ``layer_groups``); host and ``lmdb_tiers`` read frame by frame."""
        raw = itemsize(namespace.dtype) * prod(namespace.block_shape)
        return cls(costs, raw, namespace.block_size,
                   layerwise=layerwise_on(layerwise, device) and not namespace.groups,
                   layer_groups=frame_count(namespace, raw, layer_groups),
                   streamed=("host", *lmdb_tiers), **options)

    def decide(self, stored: int, tiers_of: Callable[[], Sequence[str | None]], first_token: int,
               prompt_tokens: int, cuts: Sequence[int] | None = None) -> Decision:
        """The claim for ``stored`` blocks after ``first_token`` device-held tokens of a prompt of
        ``prompt_tokens``; ``tiers_of()`` gives each block's tier (asked only when needed);
        ``cuts``: the claims allowed (default: any). Side-effect free (:meth:`settle` counts)."""
        if stored <= 0:
            return Decision(0, 0, "nothing_stored", self.block_size)
        if self.policy == "always":
            return Decision(stored, stored, "always", self.block_size)
        return self.evaluate(stored, tiers_of, first_token, prompt_tokens, cuts, probe=True)

    def evaluate(self, stored: int, tiers_of: Callable[[], Sequence[str | None]], first_token: int,
                 prompt_tokens: int, cuts: Sequence[int] | None = None, *, probe: bool = False,
                 load_all: bool = False) -> Decision:
        """The cost policy's decision (see :meth:`decide`); ``load_all``: with the predictions,
        but claiming every block (what ``always`` does, explained); ``probe``: due probes load."""
        bs, floor = self.block_size, self.costs.min_samples
        # each estimate read once: the scheduler index's record keeper replaces them on its thread
        prefill = self.costs.prefill_estimate()
        if prefill is None or prefill.observed < floor:
            seen = 0 if prefill is None else prefill.observed
            return Decision(stored, stored, "below_floor", bs, detail=f"engine steps: {seen} of {floor} observed")
        tiers = list(tiers_of())[:stored]
        restore_of = {}
        for tier in dict.fromkeys(tiers + [None] * (stored - len(tiers))):
            est = None if tier is None else self.costs.restore_estimate(tier)
            if est is None or est.observed < floor:
                seen = 0 if est is None else est.observed
                return Decision(stored, stored, "below_floor", bs,
                                detail=f"{tier or 'an unlocated block'} restores: {seen} of {floor} observed")
            restore_of[tier] = est
        allowed = range(stored) if cuts is None else [k for k in cuts if 0 <= k <= stored]
        predicted = self._predict(tiers, sorted({0, stored, *allowed}), first_token, prompt_tokens,
                                  restore_of, prefill)
        best = min(t for _, _, t in predicted.values())
        k = max(k for k, (_, _, t) in predicted.items() if t <= best * (1 + self.margin))
        reason = "load_is_faster" if k == stored else SLOWER
        if load_all:
            k, reason = stored, "always"
        elif k < stored and probe and self.probe_every > 0 and self._skips >= self.probe_every - 1:
            k, reason = stored, "probe"
        restore, compute, ttft = predicted[k]
        return Decision(stored, k, reason, bs, restore, compute, ttft, predicted[stored][2], predicted[0][2],
                        tuple(Counter(tiers[k:]).items()))

    def _predict(self, tiers: Sequence[str], claims: Sequence[int], first_token: int, prompt_tokens: int,
                 restore_of: Mapping[str, RestoreEstimate], prefill: PrefillEstimate) -> dict[int, tuple[float, float, float]]:
        """Per claim ``K`` in ascending ``claims``: (restore, prefill, predicted TTFT) of loading
        the first ``K`` blocks (each from its tier in ``tiers``, estimated by ``restore_of``) and
        computing the rest of the prompt (``prefill``). One pass over the blocks (a 32k-token
        prompt has 2,048 claims to weigh)."""
        counts: Counter[str] = Counter()
        out, done = {}, 0
        for k in claims:
            counts.update(tiers[done:k])
            done = k
            context = first_token + k * self.block_size
            new = max(prompt_tokens - context, 1)  # the engine computes the last token at least
            compute = prefill.seconds(new, attention_work(context, new))
            if not k:
                out[k] = 0.0, compute, compute
                continue
            restore = sum(restore_of[t].seconds(n * self.block_bytes) for t, n in counts.items())
            if self.overlap and self.streamed.issuperset(counts):
                out[k] = restore, compute, max(restore, compute) + min(restore, compute) / self.groups
            else:
                out[k] = restore, compute, restore + compute
        return out

    def settle(self, decision: Decision, request_id=None) -> None:
        """The engine allocated the request ``decision`` was made for: count what it skipped
        (once per allocation, however often the engine asked)."""
        if decision.reason == "probe":
            self._skips = 0
            log.info("request %s: probing the restore estimates: loading %d blocks predicted slower "
                     "than recomputing", request_id, decision.stored_blocks)
        elif decision.reason == SLOWER:
            self._skips += 1
            log.debug("request %s: %d of %d stored blocks not loaded (predicted TTFT %.3fs, %.3fs "
                      "loading them all)", request_id, decision.skipped_blocks, decision.stored_blocks,
                      decision.ttft_s, decision.load_all_s)
        else:
            return
        if self.count is not None:
            self.count(dict(decision.skipped) if decision.reason == SLOWER else {},
                       decision.skipped_tokens if decision.reason == SLOWER else 0, decision.reason == "probe")
