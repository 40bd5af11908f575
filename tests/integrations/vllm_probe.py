"""A connector that only records what vLLM hands a ``SupportsHMA`` connector (no data moves).

Loaded like ours (``kv_connector: ProbeConnector``, ``kv_connector_module_path:
tests.integrations.vllm_probe``); ``kv_connector_extra_config``:

- ``log``: file that gets one JSON object per event (both roles append to it);
- ``claim``: tokens to claim as an external hit for every request (rounded down to
  ``claim_align``, capped one token short of the prompt); nothing is loaded, so the KV of claimed
  tokens is whatever the blocks held: only for seeing what vLLM does with a claim;
- ``invalid``: ``[group, index]``: on the first step that loads, report the request's block at
  that index of that group as a load error (to see where vLLM rolls back to);
- ``persist``: a directory: a bare-bones store of its own (one ``torch.save`` file per full prompt
  block and group, keyed by the prompt prefix; attention groups only, null blocks skipped), claims
  the longest stored prefix and copies it back synchronously: a second implementation to tell
  vLLM's behaviour from tiered-kv's.

Per step the worker records, for each scheduled request and each KV cache group, the blocks whose
digest (over the group's layers) changed: ``[index, block id, digest]``, so a reader can see which
block ids a step wrote (the Mamba state's block among them) and compare requests' contents.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


@dataclass
class ProbeMeta(KVConnectorMetadata):
    step: int
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # req -> per group ids
    loads: dict[str, int] = field(default_factory=dict)  # req -> external tokens this step
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req -> prompt (persist mode)
    done: dict[str, int] = field(default_factory=dict)  # req -> tokens computed after this step


def _key(tokens: list[int], group: int) -> str:
    return hashlib.blake2b(json.dumps(tokens).encode(), digest_size=12).hexdigest() + f"-g{group}.pt"


def _spec(group) -> dict:
    spec = group.kv_cache_spec
    out = {"spec": type(spec).__name__, "layers": list(group.layer_names)}
    for name in ("block_size", "sliding_window", "attention_chunk_size", "head_size",
                 "head_size_v", "num_kv_heads", "dtype", "page_size_bytes", "shapes", "dtypes",
                 "mamba_type", "prefix_cacheable", "cache_dtype_str"):
        try:
            value = getattr(spec, name)
        except Exception as exc:  # noqa: BLE001 - record what a property raises
            value = f"<{type(exc).__name__}>"
        if value is not None:
            out[name] = value if isinstance(value, (int, str, bool, float)) else str(value)
    out["enable_kv_transfer"] = getattr(group, "enable_kv_transfer", None)
    return out


class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.path = extra.get("log", "/tmp/vllm_probe.jsonl")
        self.claim = int(extra.get("claim", 0))
        self.claim_align = int(extra.get("claim_align", 1))
        self.invalid = extra.get("invalid")
        self.persist = extra.get("persist")
        self.prompts: dict[str, list[int]] = {}
        self.block = vllm_config.cache_config.block_size
        self.step = 0
        self.loads: dict[str, int] = {}
        self.kv: dict[str, object] = {}
        self.groups: list[list[str]] = []
        self.last: dict[tuple[str, int, int], str] = {}
        self.errors: set[int] = set()
        self.reported = False
        cfg = kv_cache_config
        if cfg is not None:
            self.groups = [list(g.layer_names) for g in cfg.kv_cache_groups]
        sched = vllm_config.scheduler_config
        self.log("init", role=role.name, groups=[_spec(g) for g in cfg.kv_cache_groups] if cfg else None,
                 num_blocks=getattr(cfg, "num_blocks", None),
                 prefix_cacheable_group_ids=list(getattr(cfg, "prefix_cacheable_group_ids", ()) or ()),
                 cache_block_size=vllm_config.cache_config.block_size,
                 prefix_caching=vllm_config.cache_config.enable_prefix_caching,
                 chunked_prefill=getattr(sched, "enable_chunked_prefill", None),
                 max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None),
                 mamba_cache_mode=getattr(vllm_config.cache_config, "mamba_cache_mode", None))

    def log(self, event: str, **fields) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"event": event, **fields}, default=str) + "\n")

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = len(request.prompt_token_ids)
        claim = min(self.claim, n - 1) // self.claim_align * self.claim_align
        if self.persist:
            ends = range(self.block, n, self.block)
            stored = [e for e in ends if os.path.exists(os.path.join(
                self.persist, _key(list(request.prompt_token_ids[:e]), 0)))]
            claim = stored[-1] if stored and stored == list(ends)[:len(stored)] else 0
        claim = max(0, claim - num_computed_tokens)
        self.log("match", req=request.request_id, num_computed_tokens=num_computed_tokens,
                 prompt=n, num_tokens=request.num_tokens, claim=claim)
        return claim, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        ids = [list(g) for g in blocks.get_block_ids()]
        self.log("alloc", req=request.request_id, num_external_tokens=num_external_tokens,
                 block_ids=ids, num_computed_tokens=request.num_computed_tokens)
        if num_external_tokens:
            self.loads[request.request_id] = num_external_tokens
        self.prompts[request.request_id] = list(request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output):
        self.step += 1
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        meta = ProbeMeta(self.step, loads=self.loads)
        self.loads = {}
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in so.num_scheduled_tokens.items():
            meta.done[rid] = starts.get(rid, 0) + n
            if self.persist:
                meta.tokens[rid] = self.prompts.get(rid, [])
            if self._kv_cache_manager is not None:
                meta.tables[rid] = [list(g) for g in self._kv_cache_manager.get_blocks(rid).get_block_ids()]
        self.log("step", step=self.step,
                 new=[{"req": r.req_id, "block_ids": [list(g) for g in r.block_ids],
                       "num_computed_tokens": r.num_computed_tokens} for r in so.scheduled_new_reqs],
                 cached=[{"req": rid, "new_block_ids": nb and [list(g) for g in nb],
                          "num_computed_tokens": nc, "resumed": rid in cached.resumed_req_ids}
                         for rid, nb, nc in zip(cached.req_ids, cached.new_block_ids,
                                                cached.num_computed_tokens)],
                 num_scheduled_tokens=dict(so.num_scheduled_tokens), tables=meta.tables,
                 finished=sorted(so.finished_req_ids), preempted=sorted(so.preempted_req_ids or ()))
        return meta

    def update_connector_output(self, connector_output):
        if connector_output.invalid_block_ids:
            self.log("invalid_seen", ids=sorted(connector_output.invalid_block_ids))

    def request_finished(self, request, block_ids):
        self.log("finished", req=request.request_id, block_ids=list(block_ids))
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        self.log("finished_all_groups", req=request.request_id, block_ids=[list(g) for g in block_ids],
                 num_computed_tokens=request.num_computed_tokens,
                 num_cached=getattr(request, "num_cached_tokens", None))
        return False, None

    # ---- worker side
    def register_kv_caches(self, kv_caches):
        self.kv = dict(kv_caches)
        self.log("register", layers={
            name: {"shape": list(t.shape), "dtype": str(t.dtype), "data_ptr": t.data_ptr(),
                   "storage_ptr": t.untyped_storage().data_ptr(),
                   "storage_bytes": t.untyped_storage().nbytes(), "stride": list(t.stride()),
                   "contiguous": t.is_contiguous()}
            for name, t in kv_caches.items()})

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if meta.loads and self.invalid and not self.reported:
            group, index = self.invalid
            for rid in meta.loads:
                self.errors.add(meta.tables[rid][group][index])
            self.reported = True
            self.log("report_invalid", ids=sorted(self.errors), step=meta.step)

        if self.persist:
            self._load(meta)

    def _blocks(self, meta, rid, upto):
        """(group, index, block id, file) of the request's full prompt blocks below ``upto``."""
        tokens = meta.tokens[rid]
        for g, ids in enumerate(meta.tables[rid]):
            for i, bid in enumerate(ids[: upto // self.block]):
                if bid:
                    yield g, i, bid, os.path.join(self.persist, _key(tokens[: (i + 1) * self.block], g))

    def _load(self, meta):
        import torch

        for rid, n in meta.loads.items():
            for g, _i, bid, path in self._blocks(meta, rid, n):
                for layer, value in zip(self.groups[g], torch.load(path)):
                    self.kv[layer][bid].copy_(value)

    def _save(self, meta):
        import torch

        os.makedirs(self.persist, exist_ok=True)
        for rid, done in meta.done.items():
            upto = min(done, len(meta.tokens.get(rid, [])) - 1)
            for g, _i, bid, path in self._blocks(meta, rid, max(upto, 0)):
                if not os.path.exists(path):
                    torch.save([self.kv[layer][bid].clone() for layer in self.groups[g]], path)

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if self.persist:
            self._save(meta)
        changed = {}
        for rid, table in meta.tables.items():
            per_group = []
            for g, ids in enumerate(table):
                layers = [self.kv[name] for name in self.groups[g]]
                hits = []
                for pos, bid in enumerate(ids):
                    if bid == 0:
                        continue
                    digest = hashlib.blake2b(digest_size=6)
                    for layer in layers:
                        digest.update(layer[bid].contiguous().view(-1).numpy().tobytes())
                    digest = digest.hexdigest()
                    if self.last.get((rid, g, pos)) != digest:
                        hits.append([pos, bid, digest])
                    self.last[(rid, g, pos)] = digest
                per_group.append(hits)
            changed[rid] = per_group
        self.log("written", step=meta.step, changed=changed)

    def get_block_ids_with_load_errors(self):
        out, self.errors = self.errors, set()
        return out

    def get_finished(self, finished_req_ids):
        return None, None


def summary(path: str) -> None:
    """Print the log compactly (python -m tests.integrations.vllm_probe LOG)."""
    with open(path) as fh:
        for line in fh:
            print(line.rstrip()[:600])


if __name__ == "__main__":
    import sys

    summary(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PROBE_LOG", "/tmp/vllm_probe.jsonl"))
