"""Tensor parallel: the scheduler's promise binds every rank.

Each rank stores its own shard of a block under its own namespace; the scheduler computes one
chain of keys and looks blocks up beside one rank, or none. A block is promised only when every
rank can load it, and a request whose promised load failed is not promised it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from tests.integrations.vllm_engine import kv_cache_config, vllm_config
from tests.store.helpers import NS, make_store
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector.scheduler import ConnectorScheduler
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.common import RequestView
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector
from tiered_kv.keys import block_keys
from tiered_kv.store.lower_index import LowerTierIndex

REPO = Path(__file__).resolve().parents[2]
TP = replace(NS, tp_size=2)
TOKENS = list(range(100, 100 + 4 * NS.block_size + 1))


def _write_rank(tmp_path: Path, rank: int, skip: tuple[int, ...] = ()) -> None:
    """One worker process of rank ``rank`` saves the prompt's blocks (but ``skip``) and exits."""
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from dataclasses import replace
        from pathlib import Path
        from tests.store.helpers import NS, make_store, payloads
        from tiered_kv.keys import block_keys
        tp = replace(NS, tp_size=2)
        keys = block_keys(tp, {TOKENS!r})  # the scheduler's chain: the same on every rank
        store = make_store(Path({str(tmp_path)!r}), ns=replace(tp, tp_rank={rank}))
        data = payloads(store, len(keys), seed={rank})
        keep = [i for i in range(len(keys)) if i not in {skip!r}]
        store.save([keys[i] for i in keep], [data[i] for i in keep])
        store.close()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _index(tmp_path: Path) -> LowerTierIndex:
    config = TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{tmp_path}/lmdb", "capacity": "64MiB"},
                                       "lookup_timeout": "2s"})
    return LowerTierIndex(config, TP)


def test_a_block_one_rank_never_stored_is_not_promised_to_any_rank(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1, skip=(2,))  # rank 1's save of block 2 was dropped
    keys = block_keys(TP, TOKENS)
    index = _index(tmp_path)
    try:
        assert index.lookup(keys) == 2  # rank 0 alone holds 4: promising 4 would fail on rank 1
    finally:
        index.close()
    with make_store(tmp_path, ns=TP, lookup_timeout="2s") as rank0:  # the worker's store as index
        assert rank0.lookup(keys) == 2
        assert rank0.locate(keys) == ["disk"] * 4  # where rank 0's own copies are


def test_every_rank_holding_every_block_is_a_full_promise(tmp_path):
    _write_rank(tmp_path, 0)
    _write_rank(tmp_path, 1)
    index = _index(tmp_path)
    try:
        assert index.lookup(block_keys(TP, TOKENS)) == 4
    finally:
        index.close()


class _EverythingStored:
    """An index that keeps saying the blocks are there (a rank's copy that cannot be loaded)."""

    def lookup(self, keys):
        return len(keys)

    def lease(self, lease_id, keys, tenant=None):
        pass

    def drop_lease(self, lease_id):
        pass


def _promised_async_load() -> tuple[ConnectorScheduler, RequestView]:
    """A scheduler that promised request "r" its four stored blocks, loaded asynchronously."""
    sched = ConnectorScheduler(_EverythingStored(), TP, load_async=True)
    request = RequestView("r", TOKENS, len(TOKENS), None)
    assert sched.get_num_new_matched_tokens(request, 0) == (4 * TP.block_size, True)
    sched.update_state_after_alloc(request, list(range(5)), 4 * TP.block_size)
    return sched, request


def test_a_request_whose_async_load_failed_is_not_promised_the_same_blocks_again():
    sched, request = _promised_async_load()
    # the load failed at block 0: the engine puts the request back with nothing computed and
    # asks again; promising the same blocks would fail the same way, forever
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_completed_async_load_does_not_stop_later_matches_after_preemption():
    sched, request = _promised_async_load()
    sched.update_state_after_alloc(request, list(range(5)), 0)  # the load completed
    sched.request_preempted("r")
    assert sched.get_num_new_matched_tokens(request, 0) == (4 * TP.block_size, True)


def test_a_worker_that_cannot_read_its_tp_rank_refuses_to_start_instead_of_guessing_rank_0(tmp_path):
    cfg = vllm_config({"disk": {"url": f"lmdb://{tmp_path}/db"}})
    cfg.parallel_config.tensor_parallel_size = 2
    try:
        TieredKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    except ConfigError as exc:
        assert "tensor_parallel_size=2" in str(exc) and "rank" in str(exc)
    else:
        raise AssertionError("a TP=2 worker started as rank 0 without knowing its rank")
