"""A request that names its own tenant (vLLM's per-request ``cache_salt``) has its blocks
stored as that tenant's, so quotas and usage follow the request, not the process."""

from __future__ import annotations

import torch

from tests.store.helpers import NS
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import build_connector
from tiered_kv.integrations.common import RequestStep, RequestView, StepOutput
from tiered_kv.keys import tenant_label

BS = NS.block_size


def test_blocks_saved_for_two_salted_requests_count_against_their_own_tenants(tmp_path):
    config = TieredKVConfig.from_dict({"host": {"capacity": "4MiB"},
                                       "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB"}})
    conn = build_connector(config, NS)
    pool = torch.ones(2, NS.num_layers, 32, BS, NS.num_kv_heads, NS.head_dim, dtype=torch.bfloat16)
    conn.register_kv_caches(pool)
    steps = []
    for rid, salt, blocks, first in (("a", "alice", 3, 0), ("b", "bob", 1, 8)):
        tokens = list(range(first * 1000, first * 1000 + blocks * BS + 1))
        view = RequestView(rid, tokens, len(tokens), f"salt={salt}", salt)
        ids = list(range(first, first + blocks + 1))
        conn.scheduler.get_num_new_matched_tokens(view, 0)
        conn.scheduler.update_state_after_alloc(view, ids, 0)
        steps.append(RequestStep(rid, tokens, ids, 0, len(tokens)))
    meta = conn.scheduler.build_connector_meta(StepOutput(steps, []))
    assert {s.request_id: s.tenant for s in meta.saves} == {"a": tenant_label("alice"), "b": tenant_label("bob")}
    conn.worker.bind_connector_meta(meta)
    conn.worker.start_load_kv()
    conn.worker.wait_for_save()
    conn.store.flush()
    host, disk = conn.store.host.tenant_usage(), conn.store.tier("disk").backend.tenant_usage()
    block = conn.store.block_nbytes
    assert host == {tenant_label("alice"): 3 * block, tenant_label("bob"): block}
    assert disk[tenant_label("alice")] > disk[tenant_label("bob")] > 0
    conn.close()
