"""The vLLM adapter with vLLM's hybrid allocator on (SupportsHMA): an interleaved sliding-window +
full-attention model (two KV cache groups, Gemma-style), driven the way vLLM 0.32 drives a
connector. Its loads are asynchronous, and a load that fails is reported as a failed request
(vLLM cannot map block ids back to requests when a model has several groups)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.vllm_engine import (
    BS,
    DIM,
    HEADS,
    CachedRequestData,
    FullAttentionSpec,
    NewRequestData,
    Request,
    SchedulerOutput,
    vllm_config,
)
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector

NB = 32
PROMPT = list(range(300, 300 + 6 * BS + 1))


@dataclass
class SlidingWindowSpec:
    block_size: int = BS
    num_kv_heads: int = HEADS
    head_size: int = DIM
    dtype: torch.dtype = torch.float32
    sliding_window: int = 2 * BS


def kv_cache_config(sliding_only=False):
    if sliding_only:  # Mistral-style: one sliding-window group
        return SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["l0", "l1", "l2", "l3"])])
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["l0", "l2"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["l1", "l3"])])


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return tuple(list(g) for g in self.ids)


def engine(tmp_path, seed=None, sliding_only=False):
    extra = {"disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB"}, "host": {"capacity": "4MiB"}}
    config = vllm_config(extra)
    sched = TieredKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(sliding_only))
    worker = TieredKVConnector(config, KVConnectorRole.WORKER, kv_cache_config(sliding_only))
    gen = torch.Generator().manual_seed(seed or 0)
    kv = {name: (torch.randn(NB, 2, BS, HEADS, DIM, generator=gen) if seed else torch.zeros(NB, 2, BS, HEADS, DIM))
          for name in ("l0", "l1", "l2", "l3")}
    worker.register_kv_caches(kv)
    return sched, worker, kv


def step(sched, worker, new=(), scheduled=None, finished=()):
    so = SchedulerOutput(list(new), CachedRequestData(), scheduled or {}, set(finished), set())
    worker.bind_connector_metadata(sched.build_connector_meta(so))
    worker.start_load_kv()
    worker.wait_for_save()
    results = worker.get_transfer_results(set(finished))
    worker.clear_connector_metadata()
    return results


def fill(tmp_path, sliding_only=False):
    sched, worker, kv = engine(tmp_path, seed=7, sliding_only=sliding_only)
    req = Request("a", PROMPT, 1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14])[: 1 if sliding_only else 2]
    sched.update_state_after_alloc(req, Blocks(ids), 0)
    step(sched, worker, [NewRequestData("a", PROMPT, ids, 0)], {"a": len(PROMPT)})
    assert sched.request_finished_all_groups(req, ids) == (True, None)  # held until saved
    assert step(sched, worker, finished={"a"}).finished_sending == {"a"}
    sched.shutdown()
    worker.shutdown()
    return kv, ids


def load(tmp_path, sliding_only=False):
    sched, worker, kv = engine(tmp_path, sliding_only=sliding_only)
    req = Request("b", PROMPT, 1)
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (6 * BS, True)  # several groups, or a sliding window: loads are asynchronous
    ids = ([0, 0, 0, 0, 20, 21, 22], [15, 16, 17, 18, 19, 23, 24])[: 1 if sliding_only else 2]  # 0: null
    sched.update_state_after_alloc(req, Blocks(ids), n)
    results = step(sched, worker)
    deadline = time.monotonic() + 10
    while "b" not in results.finished_recving and time.monotonic() < deadline:
        time.sleep(0.01)
        results = step(sched, worker)
    errors = worker.get_block_ids_with_load_errors()
    sched.shutdown()
    worker.shutdown()
    return kv, ids, results, errors


def test_interleaved_groups_load_every_kept_block_and_leave_the_null_block_alone(tmp_path):
    a, ids_a = fill(tmp_path)
    b, ids_b, results, errors = load(tmp_path)
    assert results.finished_recving == {"b"} and not results.failed_recving and not errors
    for name in ("l1", "l3"):  # full attention: all six claimed blocks
        for i in range(6):
            assert torch.equal(b[name][ids_b[1][i]], a[name][ids_a[1][i]])
    for name in ("l0", "l2"):  # sliding window: the blocks the engine keeps
        for i in (4, 5):
            assert torch.equal(b[name][ids_b[0][i]], a[name][ids_a[0][i]])
        assert not b[name][0].any()  # the null block is never written


@pytest.mark.parametrize("sliding_only", [False, True], ids=["sliding+full", "sliding only"])
def test_a_corrupt_block_fails_the_whole_request_through_failed_recving_not_block_ids(tmp_path, sliding_only):
    # one sliding group too: rolled back to a failed block, vLLM would recompute over null blocks
    fill(tmp_path, sliding_only)

    def flip(key, value):  # every stored block: whichever one the load reads first fails
        return value[:-3] + bytes([value[-3] ^ 0x10]) + value[-2:]

    assert rewrite_stored_blocks(tmp_path / "db", flip) == 6
    b, ids_b, results, errors = load(tmp_path, sliding_only)
    assert results.failed_recving == {"b"} and "b" in results.finished_recving
    assert errors == set()  # vLLM raises on block ids from a model with several groups


def test_regression_an_engine_grouping_the_layers_otherwise_was_served_blocks_into_other_layers(tmp_path):
    # same specs, same shapes, the layers grouped the other way round (another vLLM, another
    # layer pattern): each stored part would land in other layers than the ones that computed it
    fill(tmp_path)
    swapped = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["l1", "l3"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["l0", "l2"])])
    config = vllm_config({"disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB"}, "host": {"capacity": "4MiB"}})
    sched = TieredKVConnector(config, KVConnectorRole.SCHEDULER, swapped)
    try:
        assert sched.get_num_new_matched_tokens(Request("b", PROMPT, 1), 0) == (0, False)
    finally:
        sched.shutdown()
    renamed = SimpleNamespace(kv_cache_groups=[  # a prefix renamed alone keeps the namespace
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["model.layers.0.attn", "model.layers.2.attn"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["model.layers.1.attn", "model.layers.3.attn"])])
    moved = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["lm.model.layers.0.attn", "lm.model.layers.2.attn"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["lm.model.layers.1.attn", "lm.model.layers.3.attn"])])
    namespaces = []
    for groups in (renamed, moved):
        sched = TieredKVConnector(config, KVConnectorRole.SCHEDULER, groups)
        namespaces.append(sched.namespace.digest())
        sched.shutdown()
    assert namespaces[0] == namespaces[1]
