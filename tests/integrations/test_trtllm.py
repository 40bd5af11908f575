"""The TensorRT-LLM adapter driven in the executor's exact call order (tensorrt_llm is not
installed here; ``trtllm_executor`` stands in for PyExecutor with the same fields and order)."""

from __future__ import annotations

import os
import random

import lmdb
import pytest

from tests.integrations.trtllm_executor import (
    BS,
    Executor,
    KvCacheConfig,
    LlmArgs,
    store_llm_args,
    write_model_config,
)
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker

HANG_GUARD_S = 120  # only so a scheduler stuck on the hung Redis fails the test instead of hanging it


@pytest.fixture
def llm_args(tmp_path, monkeypatch):
    return store_llm_args(tmp_path, monkeypatch)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def run(llm_args, prompts: dict[int, list[int]], *, budget: int = 64, connector: bool = True):
    """One engine (connector halves opened and closed around it): outputs, executor."""
    if connector:
        sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    else:
        sched = worker = _NoConnector()
    ex = Executor(sched, worker, max_tokens_per_step=budget)
    for rid, p in prompts.items():
        ex.add(rid, p)
    try:
        return ex.run(), ex
    finally:
        if connector:
            sched.close()
            worker.close()


class _NoConnector:
    """Scheduler and worker halves that do nothing: the reference run."""

    def get_num_new_matched_tokens(self, request, n):
        return 0, False

    def update_state_after_alloc(self, request, block_ids):
        pass

    def build_connector_meta(self, so):
        return None

    def request_finished(self, request, block_ids):
        return False

    def __getattr__(self, name):
        return lambda *a, **k: ([], []) if name == "get_finished" else None


PROMPTS = {1: prompt(30, 1), 2: prompt(17, 2), 3: prompt(24, 3)}  # 24 = exactly 6 blocks


def matched(ex) -> dict[int, tuple[int, bool]]:
    return {rid: detail for _, event, rid, detail in ex.log if event == "matched"}


def test_new_requests_hit_every_full_block_but_the_last_tokens_and_outputs_match(llm_args):
    reference, _ = run(llm_args, PROMPTS, connector=False)
    first, ex1 = run(llm_args, PROMPTS)
    assert first == reference
    assert all(m == (0, False) for m in matched(ex1).values())
    second, ex2 = run(llm_args, PROMPTS)
    assert second == reference
    assert matched(ex2) == {1: (28, False), 2: (16, False), 3: (20, False)}
    # only the unmatched tail of each prompt and the generated tokens were computed
    assert ex2.computed_tokens == (30 - 28) + (17 - 16) + (24 - 20) + 3 * 2


def test_chunked_prefill_saves_every_chunk_and_a_second_engine_hits_them(llm_args):
    reference, _ = run(llm_args, PROMPTS, connector=False)
    first, ex1 = run(llm_args, PROMPTS, budget=6)  # 6 tokens a step: chunks end mid-block
    assert first == reference
    assert ex1.step_no > 10
    second, ex2 = run(llm_args, PROMPTS, budget=6)
    assert second == reference
    assert {rid: m[0] for rid, m in matched(ex2).items()} == {1: 28, 2: 16, 3: 20}


def test_generated_tokens_are_saved_so_a_follow_up_turn_hits_them(llm_args):
    turn1 = prompt(21, 7)
    out, _ = run(llm_args, {1: turn1})
    turn2 = turn1 + out[1] + prompt(5, 8)  # 21 + 3 + 5 = 29 tokens
    again, ex = run(llm_args, {2: turn2})
    # prompt + generated tokens but the last one (its KV is never computed) lie in saved blocks
    assert matched(ex)[2][0] == ((21 + 3 - 1) // BS) * BS
    assert again == run(llm_args, {2: turn2}, connector=False)[0]


def test_async_load_completes_through_get_finished_polling(llm_args, monkeypatch):
    reference, _ = run(llm_args, PROMPTS, connector=False)
    run(llm_args, PROMPTS)
    monkeypatch.setenv("TIERED_KV_LOAD_ASYNC", "true")
    outs, ex = run(llm_args, PROMPTS)
    assert outs == reference
    assert matched(ex) == {1: (28, True), 2: (16, True), 3: (20, True)}
    events = [(step, event, rid) for step, event, rid, _ in ex.log]
    for rid in PROMPTS:
        admitted = next(s for s, e, r in events if e == "matched" and r == rid)
        loaded = next(s for s, e, r in events if e == "loaded" and r == rid)
        assert loaded >= admitted  # reported by get_finished after the id was passed in
    # a loading request was not scheduled before it was reported loaded
    assert ex.computed_tokens == (30 - 28) + (17 - 16) + (24 - 20) + 3 * 2


def test_async_save_holds_blocks_through_request_finished_until_reported(llm_args):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        ex = Executor(sched, worker)
        ex.add(1, PROMPTS[1], max_new_tokens=1)
        ex.step()  # the whole prompt in one step, one token sampled: finished
        [(_, _, _, hold)] = [e for e in ex.log if e[1] == "finished"]
        assert hold is True
        # the executor passed the id in get_finished at the end of the step; saves are copied to
        # host slots before wait_for_save returns on CPU, so it is reported in that same call
        assert [e[1] for e in ex.log if e[2] == 1] == ["matched", "finished", "saved"]
        # never reported before the id was passed in, and only once
        held_blocks = [b for b in range(ex.pool.shape[0]) if b not in ex.free]
        assert held_blocks == []
        assert worker.get_finished([], []) == ([], [])  # reported once: not again
        assert worker.get_finished([], []) == ([], [])
    finally:
        sched.close()
        worker.close()


def test_worker_reports_a_held_request_only_after_it_was_passed_in(llm_args):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        ex = Executor(sched, worker)
        ex.add(1, PROMPTS[3], max_new_tokens=1)
        ex.new_saving = set()
        # run the step by hand, holding back the finished id from get_finished this time
        original = ex._get_finished
        ex._get_finished = lambda: None
        ex.step()
        assert 1 in ex.held and ex.requests[1].state == "saving"
        assert worker.get_finished([], []) == ([], [])  # not passed in yet: not reported
        assert ex.requests[1].block_ids  # blocks still held by the engine
        ex._get_finished = original
        ex.step()
        assert 1 not in ex.held and ex.requests[1].block_ids == []
    finally:
        sched.close()
        worker.close()


def _corrupt_block(path, block_key: bytes) -> None:
    """Flip a body byte of the stored block with key ``block_key`` in the LMDB store."""
    env = lmdb.open(str(path), max_dbs=16)
    try:
        db = env.open_db(b"blocks")
        with env.begin(db=db, write=True) as txn:
            [(key, value)] = [(bytes(k), bytes(v)) for k, v in txn.cursor() if bytes(k).endswith(block_key)]
            txn.put(key, value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:], db=db)
    finally:
        env.close()


def test_a_corrupt_block_is_never_promised_and_the_output_still_matches(llm_args, tmp_path):
    prompts = {1: PROMPTS[1]}
    reference, _ = run(llm_args, prompts, connector=False)
    run(llm_args, prompts)  # 30 tokens: blocks 0-6 saved (7 full blocks)
    # the chain's keys, from the scheduler half itself: corrupt the 4th block
    sched = TieredKVScheduler(llm_args)
    try:
        from tests.integrations.trtllm_executor import LlmRequest

        req = LlmRequest(9, PROMPTS[1], 30, 1)
        sched.get_num_new_matched_tokens(req, 0)
        keys = sched.core.keys_of(9)
        sched.request_finished(req, [])
    finally:
        sched.close()
    _corrupt_block(tmp_path / "db", keys[3])

    outs, ex = run(llm_args, prompts)
    assert outs == reference
    assert matched(ex)[1] == (3 * BS, False)  # blocks 0-2 promised; 3 failed validation
    # the recomputed block was saved again: a third engine hits all but the last token's block
    outs3, ex3 = run(llm_args, prompts)
    assert outs3 == reference and matched(ex3)[1] == (28, False)


def test_corrupt_block_miss_is_counted(llm_args, tmp_path):
    run(llm_args, {1: PROMPTS[2]})
    env = lmdb.open(str(tmp_path / "db"), max_dbs=16)
    db = env.open_db(b"blocks")
    with env.begin(db=db, write=True) as txn:
        for k, v in [(bytes(k), bytes(v)) for k, v in txn.cursor()]:
            txn.put(k, v[:-5] + bytes([v[-5] ^ 0xFF]) + v[-4:], db=db)
    env.close()
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        ex = Executor(sched, worker)
        ex.add(1, PROMPTS[2])
        ex.run()
        assert matched(ex)[1] == (0, False)
        assert sched.store.metrics.misses("corrupt") == 4  # 17 tokens: 4 full blocks
    finally:
        sched.close()
        worker.close()


def test_misconfiguration_fails_at_construction_naming_the_key(llm_args, monkeypatch):
    monkeypatch.setenv("TIERED_KV_DISK_URLL", "lmdb:///tmp/x")
    with pytest.raises(ConfigError, match="disk.urll"):
        TieredKVScheduler(llm_args)
    monkeypatch.delenv("TIERED_KV_DISK_URLL")
    monkeypatch.setenv("TIERED_KV_DISK_URL", "nosuch://x")
    with pytest.raises(ConfigError, match="disk.url"):
        TieredKVWorker(llm_args)
    monkeypatch.setenv("TIERED_KV_DISK_URL", "lmdb:///tmp/x")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        TieredKVScheduler(LlmArgs(llm_args.model, llm_args.kv_cache_config, tensor_parallel_size=2))


def test_an_unsupported_pool_layout_is_refused_at_registration(llm_args):
    import torch

    worker = TieredKVWorker(llm_args)
    try:
        with pytest.raises(ConfigError, match="unsupported KV layout"):
            worker.register_kv_caches(torch.zeros(8, 3, 2, 64))  # 3 layers, the model has 2
    finally:
        worker.close()


def test_the_llm_api_example_attaches_our_classes_with_a_valid_environment(tmp_path, monkeypatch):
    import importlib
    import importlib.util
    from pathlib import Path

    from tiered_kv.config import TieredKVConfig

    path = Path(__file__).resolve().parents[2] / "examples" / "trtllm_llm_api.py"
    spec = importlib.util.spec_from_file_location("trtllm_llm_api", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # imports no tensorrt_llm until main() runs
    names = example.connector_config_kwargs()
    module = importlib.import_module(names["connector_module"])
    assert getattr(module, names["connector_scheduler_class"]) is TieredKVScheduler
    assert getattr(module, names["connector_worker_class"]) is TieredKVWorker
    config = TieredKVConfig.from_env(example.connector_environment(f"lmdb://{tmp_path}/db"))
    assert config.disk.url == f"lmdb://{tmp_path}/db" and config.host.capacity == 4 << 30


def test_hung_redis_never_stalls_the_trtllm_scheduler_and_outputs_stay_identical(llm_args, monkeypatch, own_redis):
    # landed code waited on every lookup for Redis's own timeout (x 3 tries), per request, per
    # step. Nothing here is timed: Redis's timeout is an hour, so steps that waited on the hung
    # Redis even once could not finish within the hang guard.
    import signal
    import threading

    monkeypatch.delenv("TIERED_KV_DISK_URL")  # blocks live in Redis only (and the host tier)
    monkeypatch.setenv("TIERED_KV_REMOTE_URL", own_redis.url)
    monkeypatch.setenv("TIERED_KV_REMOTE_TIMEOUT", "1h")
    monkeypatch.setenv("TIERED_KV_LOOKUP_TIMEOUT", "50ms")
    reference, _ = run(llm_args, PROMPTS, connector=False)
    first, _ = run(llm_args, PROMPTS)  # fills Redis
    # a new engine (empty host tier), opened while Redis answers (opening reads its cost records)
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    ex = Executor(sched, worker)
    for rid, p in PROMPTS.items():
        ex.add(rid, p)
    outputs: list = []
    steps = threading.Thread(target=lambda: outputs.append(ex.run()), daemon=True)
    remote = sched.store.presence.gates["remote"]
    own_redis.proc.send_signal(signal.SIGSTOP)  # Redis hangs
    try:
        steps.start()
        steps.join(HANG_GUARD_S)
        assert not steps.is_alive(), "the scheduler waited on the hung Redis"
        assert remote._late is not None and not remote._late.done()  # the lookup Redis never answered
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        steps.join(HANG_GUARD_S)
        sched.close()
        worker.close()
    assert first == outputs[0] == reference
    assert all(n == 0 for n, _ in matched(ex).values())  # unanswered Redis: misses, recomputed
    assert remote.timeouts == len(PROMPTS)  # one lookup waited on (the first); the rest skipped the tier


def test_a_request_that_hits_the_host_counts_once_for_admission(tmp_path, monkeypatch):
    """The adapter reads matched blocks to check them before promising them; that check is not
    a request of its own (else a tier admitting after 3 requests would take the 2nd)."""
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIERED_KV_DISK_URL", f"lmdb://{tmp_path}/db")
    monkeypatch.setenv("TIERED_KV_HOST_CAPACITY", "256KiB")
    monkeypatch.setenv("TIERED_KV_DISK_ADMIT_AFTER_HITS", "3")
    write_model_config(tmp_path / "model")
    args = LlmArgs(model=str(tmp_path / "model"), kv_cache_config=KvCacheConfig())
    sched, worker = TieredKVScheduler(args), TieredKVWorker(args)
    executor, store = Executor(sched, worker), sched.store
    prompt = list(range(1, 25))
    entries = []
    for rid in (1, 2, 3):
        executor.add(rid, prompt)
        executor.run()
        store.flush()
        entries.append(store.tier("disk").backend.stats().entries)
    sched.close()
    worker.close()
    assert entries[:2] == [0, 0] and entries[2] > 0
