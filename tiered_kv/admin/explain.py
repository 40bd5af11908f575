"""``explain``: for one prompt, which of its blocks each tier holds and why the reuse stops where
it stops (the first block no tier can serve, with its reason) — the same chained keys, order of
tiers and validation the store uses, without loading anything into an engine — and what the
restore policy would load of them (``restore``: :mod:`tiered_kv.connector.restore_policy`
deciding from the estimates the store persisted in its namespace record, offline; blocks are taken
to come from the lower tier holding them, as after a restart: the host tier is a process's).
Given the engine's config (:class:`BlockKeys`), blocks are opened as its replicas open them: with
its ``encryption_secret`` (a plain block ``unencrypted``, one sealed under another secret
``wrong_key``) or without one (a sealed block ``no_key``); from a bare URL the reader's secret
is unknown, and a sealed block whose framing is sound counts as served."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from tiered_kv.admin.block_checks import check_block
from tiered_kv.admin.catalog import Namespaces, block_digests, metas_of, namespaces, resolve_namespace
from tiered_kv.admin.opening import Tier
from tiered_kv.connector.restore_policy import Decision, RestorePolicy
from tiered_kv.errors import BackendUnavailable, ConfigError, CorruptBlock, TokenError
from tiered_kv.keys import Namespace, block_keys
from tiered_kv.store.cost_records import ANY, read_costs
from tiered_kv.store.restore_costs import RestoreCosts
from tiered_kv.store.tenant_cipher import TenantCipher

_SEPARATORS = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class RestoreOptions:
    """The restore settings an engine would run with (a config's, or the command line's)."""

    policy: str = "cost"  # cost | always
    min_samples: int = 3
    layerwise: bool | str = "auto"  # True | False | "auto" (layer-wise on accelerators)
    layer_groups: int = 8
    load_async: bool = False
    device: str = "cuda"  # the device type the engine's KV cache lives on (settles "auto")

    def __post_init__(self) -> None:  # the floors the config holds restore_min_samples and layer_groups to
        for option, value in (("--min-samples", self.min_samples), ("--layer-groups", self.layer_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{option} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, config, **overrides) -> RestoreOptions:
        """A config's settings (None: the defaults), with the ``overrides`` that are not None."""
        base = cls() if config is None else cls(config.restore_policy, config.restore_min_samples,
                                                config.layerwise_loads, config.layer_groups)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class BlockKeys:
    """How an engine of a config opens sealed blocks: under its secret's key of each block's
    tenant, or (``cipher`` None: no secret) not at all, a ``no_key`` miss there. (explain used to
    call every sealed block served whatever the config said, and a plain one where the engine
    encrypts: those replicas miss them all, and remove the plain ones.)"""

    cipher: TenantCipher | None = None

    @classmethod
    def of(cls, config) -> BlockKeys:
        secret = config.encryption_secret
        return cls(None if secret is None else TenantCipher(secret.reveal()))

    def tenants(self, backend, keys: list[bytes], ns: Namespace) -> list[tuple[bytes, ...]]:
        """Per key, the tenants whose key may open it: the one its medium stores it for (LMDB,
        files), then the namespace's (a medium that keeps none; a copy through one kept none)."""
        if self.cipher is None:
            return [()] * len(keys)
        metas = metas_of(backend, keys)
        return [tuple(dict.fromkeys([bytes(m.get("tenant") or b""), ns.tenant])) if isinstance(m, dict)
                else (ns.tenant,) for m in metas]

    def check(self, key: bytes, value, ns: Namespace, tenants: tuple[bytes, ...]) -> None:
        """``value`` checked as this engine reads it (CorruptBlock with the reason it counts)."""
        if self.cipher is None:
            check_block(key, value, ns, keyless=False)
            return
        for i, tenant in enumerate(tenants):
            try:
                check_block(key, value, ns, sealing=self.cipher.sealing(tenant))
                return
            except CorruptBlock as exc:
                if exc.reason != "wrong_key" or i == len(tenants) - 1:
                    raise


def parse_token_ids(text: str, source: str = "--token-ids") -> list[int]:
    """Token ids from ``1,2,3``, whitespace-separated text or a JSON list."""
    text = text.strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in _SEPARATORS.split(text) if t]
    except ValueError as exc:
        raise TokenError(f"{source}: expected integers separated by commas or spaces, or a JSON list: {exc}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TokenError(f"{source}: expected a list of integers")
    if not ids:
        raise TokenError(f"{source}: no token ids")
    return ids


def read_tokens(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read tokens from {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read tokens from {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_token_ids(text, path)


def _merged(tiers: list[Tier]) -> tuple[Namespaces, list[bytes]]:
    found = Namespaces()
    digests: set[bytes] = set()
    for tier in tiers:
        part = namespaces(tier.backend)
        found.known.update(part.known)
        found.broken.update(part.broken)
        digests.update(block_digests(tier.backend.scan()))
    return found, sorted(digests)


def explain(tiers: list[Tier], tokens: list[int], namespace: str | None = None,
            lora: str | None = None, restore: RestoreOptions | None = None,
            keys_of: BlockKeys | None = None) -> dict:
    found, digests = _merged(tiers)
    digest = resolve_namespace(namespace, found, digests)
    ns = found.known.get(digest)
    if ns is None:
        raise ConfigError(f"namespace {digest.hex()} has no record in this store: pass --namespace "
                          "FILE.json with its fields (Namespace.describe())")
    keys = block_keys(ns, tokens, lora=lora)
    bs = ns.block_size
    status: list[dict[str, str]] = [{} for _ in keys]  # per block: tier -> "ok" | reason
    details: list[dict[str, str]] = [{} for _ in keys]  # per block: tier -> why it failed its checks
    for tier in tiers:
        _probe(tier, ns, digest, keys, status, details, keys_of)
    claimable = max(0, (len(tokens) - 1) // bs)  # the engine always computes the last token
    blocks, first_miss = [], None
    for i, (key, st) in enumerate(zip(keys, status)):
        served = next((t for t in st if st[t] == "ok"), None)
        blocks.append({"index": i, "tokens": [i * bs, (i + 1) * bs], "key": key.hex(),
                       "tier": served, "status": st})
        if served is None and first_miss is None:
            reasons = [r for r in st.values() if r != "absent"] or ["absent"]
            first_miss = {"index": i, "tokens": [i * bs, (i + 1) * bs], "reason": reasons[0],
                          "detail": "; ".join(f"{t}: {r}" + (f" ({details[i][t]})" if t in details[i] else "")
                                              for t, r in st.items())}
    run = first_miss["index"] if first_miss else len(keys)
    matched, cuts = min(run, claimable), None
    if ns.has_state and matched:  # a hybrid model resumes only where the recurrent state is held
        held = _states(tiers, ns, digest, keys[:matched], blocks, keys_of)
        cuts = [i + 1 for i in range(matched) if held[i]]
        with_state = next((i + 1 for i in reversed(range(matched)) if held[i]), 0)
        if with_state < matched:
            first_miss = {"index": with_state, "tokens": [with_state * bs, (with_state + 1) * bs],
                          "reason": "no_state", "detail": f"no valid recurrent-state entry at the end of block "
                          f"{matched - 1} or any block before it back to {with_state}"}
            matched = with_state
    if first_miss is None and len(tokens) % bs:
        first_miss = {"index": len(keys), "tokens": [len(keys) * bs, len(tokens)],
                      "reason": "partial_block", "detail": "only full blocks are stored"}
    elif first_miss is None:  # every full block is stored: the last one is not claimed
        first_miss = {"index": claimable, "tokens": [claimable * bs, len(tokens)], "reason": "last_token",
                      "detail": "the engine always computes the last prompt token itself"}
    tiers_used: dict[str, int] = {}
    for b in blocks[:matched]:
        tiers_used[b["tier"]] = tiers_used.get(b["tier"], 0) + 1
    return {
        "namespace": digest.hex(), "model_id": ns.model_id, "block_size": bs, "tokens": len(tokens),
        "full_blocks": len(keys), "claimable_blocks": claimable, "matched_blocks": matched,
        "matched_tokens": matched * bs, "stored_blocks": sum(b["tier"] is not None for b in blocks),
        "tier_blocks": tiers_used, "tiers": [t.name for t in tiers], "first_miss": first_miss,
        "restore": _restore(tiers, ns, digest, [b["tier"] for b in blocks[:matched]], len(tokens), cuts,
                            restore or RestoreOptions()),
        "blocks": blocks,
    }


def _restore(tiers: list[Tier], ns: Namespace, digest: bytes, where: list[str], prompt: int,
             cuts: list[int] | None, options: RestoreOptions) -> dict:
    """The restore policy's decision for the ``where`` (tier per matched block) of a prompt of
    ``prompt`` tokens, from the estimates in the namespace record of the first tier holding some."""
    costs = RestoreCosts(options.min_samples)
    record, names = None, {}
    for machine in (None, ANY):  # this machine's estimates, else the latest written (another class of machine's)
        for tier in tiers:  # each record names the tier it is in as its store called it
            doc = read_costs([(tier.name, tier.backend)], digest, machine)
            if doc is not None:
                record = record or doc
                names.setdefault(tier.name, str(doc.get("tier") or tier.name))
        if record is not None:
            break
    if record is not None:
        costs.restore_snapshot(record)
    policy = RestorePolicy.for_namespace(costs, ns, layerwise=options.layerwise, device=options.device,
                                         layer_groups=options.layer_groups,
                                         lmdb_tiers=[names.get(t.name, t.name) for t in tiers
                                                     if str(t.backend.url).startswith("lmdb:")],
                                         load_async=options.load_async, probe_every=0)
    if not where:
        decision = Decision(0, 0, "nothing_stored", ns.block_size)
    else:
        decision = policy.evaluate(len(where), lambda: [names.get(t, t) for t in where], 0, prompt, cuts,
                                   load_all=options.policy == "always")
        if options.policy == "always" and decision.reason == "below_floor":
            decision = replace(decision, reason="always")
    if record is None and decision.reason == "below_floor":
        decision = replace(decision, detail="no estimates: no engine has written its restore costs here")
    out = {"policy": options.policy, **decision.as_dict(), "layerwise": policy.layerwise,
           "engine_device": options.device, "overlap": policy.overlap,
           "layer_groups": policy.groups, "min_samples": options.min_samples,
           "record_written": record.get("written") if record else None,
           "record_machine": record.get("machine") if record else None, "estimates": _estimates(costs)}
    return out


def _estimates(costs: RestoreCosts) -> dict:
    restore = {}
    for tier, n in costs.restores_observed().items():
        est = costs.restore_estimate(tier)
        if est is not None:
            restore[tier] = {"latency_s": est.latency_s, "bytes_per_s": est.bytes_per_s, "observed": n}
    prefill = costs.prefill_estimate()
    return {"restore": restore, "prefill": None if prefill is None else {
        "per_step_s": prefill.per_step_s, "per_token_s": prefill.per_token_s,
        "per_pair_s": prefill.per_pair_s, "observed": prefill.observed}}


def _states(tiers: list[Tier], ns: Namespace, digest: bytes, keys: list[bytes], blocks: list[dict],
            keys_of: BlockKeys | None) -> list[bool]:
    """Whether some tier holds a valid state entry at the end of each block (recorded per block)."""
    state_keys = [ns.state_key(k) for k in keys]
    status: list[dict[str, str]] = [{} for _ in keys]
    details: list[dict[str, str]] = [{} for _ in keys]
    for tier in tiers:
        _probe(tier, ns, digest, state_keys, status, details, keys_of)
    held = []
    for b, st in zip(blocks, status):
        b["state"] = next((t for t in st if st[t] == "ok"), None)
        held.append(b["state"] is not None)
    return held


def _probe(tier: Tier, ns: Namespace, digest: bytes, keys: list[bytes], status: list[dict],
           details: list[dict], keys_of: BlockKeys | None = None) -> None:
    """Per key: ``ok`` when ``tier`` holds a valid block of ``ns`` (its dtype and shape) that
    the engine (``keys_of``; None: any reader) can open, else the reason the store would count
    (and, for a block that fails its checks, why)."""
    try:
        present = tier.backend.contains_many([digest + k for k in keys])
        todo = [i for i, p in enumerate(present) if p]
        values = tier.backend.get_many([digest + keys[i] for i in todo])
        tenants = keys_of.tenants(tier.backend, [digest + keys[i] for i in todo], ns) if keys_of else []
    except BackendUnavailable:
        for st in status:
            st[tier.name] = f"{tier.name}_unavailable"
        return
    for i in range(len(keys)):
        status[i][tier.name] = "absent"
    for n, (i, value) in enumerate(zip(todo, values)):
        if value is None:
            continue  # evicted since
        try:  # as the store decodes it: against the namespace's block, before allocating
            if keys_of is None:
                check_block(digest + keys[i], value, ns)
            else:
                keys_of.check(digest + keys[i], value, ns, tenants[n])
            status[i][tier.name] = "ok"
        except CorruptBlock as exc:
            status[i][tier.name] = exc.reason
            details[i][tier.name] = exc.detail
