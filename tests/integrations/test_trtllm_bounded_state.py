"""A long-running TensorRT-LLM server: thousands of requests through the adapter's two halves in
the executor's order (``trtllm_executor.Executor``), with what TensorRT-LLM's ``PyExecutor`` does
besides finishing a request: a cancel (``_handle_canceled_requests`` -> ``_terminate_request``:
``request_finished`` only for a request the KV cache manager holds, whatever its state, an async
load in flight included), a step whose forward raises (``_handle_errors``: ``wait_for_save``
skipped, every live request terminated), requests the keys cannot name and beam searches.
TensorRT-LLM's request ids are its own counter's (never reused). Every per-request container of
both halves must end bounded by what is live, never by the requests served."""

from __future__ import annotations

import random
from types import SimpleNamespace

from tests.integrations.trtllm_executor import BS, Executor, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker

REQUESTS = 1200
LIVE = 6


class CancellingExecutor(Executor):
    """The stand-in executor plus TensorRT-LLM's cancels and failed steps."""

    def cancel(self, rid: int) -> None:
        req = self.requests[rid]
        if req.state in ("done", "saving"):
            return
        if req.state == "new":  # not in the KV cache manager: get_cache_indices raises, no call
            req.state = "done"
            return
        req.state = "done"  # (finish_by_reason / _handle_errors: GENERATION_COMPLETE, then terminated)
        hold = self.scheduler.request_finished(req, list(req.block_ids))
        self._end(req, hold)  # (an async load in flight stays in new_loading / pending: as TRT-LLM)

    def failed_step(self) -> None:
        """A step whose forward raised: metadata bound and loads started, no wait_for_save; every
        live request that holds blocks ends (``_handle_errors``), then ``get_finished``."""
        self.step_no += 1
        for req in self.requests.values():
            if req.state == "new" and len(self.free) >= -(-req.prompt_len // BS):
                self._add_sequence(req)
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(SimpleNamespace(
            new_requests=[], cached_requests=[])))
        self.worker.start_load_kv(None)
        for req in list(self.requests.values()):
            if req.state in ("context", "generation", "loading"):
                self.cancel(req.request_id)
        self._get_finished()

    def _get_finished(self) -> None:
        saving, loading = sorted(self.new_saving), sorted(self.new_loading)
        self.new_saving, self.new_loading = set(), set()
        saved, loaded = self.worker.get_finished(saving, loading)
        for rid in saved:
            self._free(self.requests[rid])
            self.requests[rid].state = "done"
            del self.held[rid]
        for rid in loaded:  # (TensorRT-LLM sets a cancelled one's state too; it is gone already)
            if self.requests[rid].state == "loading":
                self.requests[rid].state = "context"


def _sizes(sched, worker) -> dict[str, int]:
    core, wcore = sched.core, worker.core
    return {"sched._verified": len(sched._verified), "sched._device_prefix": len(sched._device_prefix),
            "sched._unkeyed": len(sched._unkeyed), "sched._beamed": len(sched._beamed),
            "core._requests": len(core._requests), "core._matched_from": len(core._matched_from),
            "core._decisions": len(core._decisions), "core._gone": len(core._gone),
            "core._loads": len(core._loads), "core._suspect": len(core._suspect),
            "store leases": len(sched.store.loader._leases), "worker._saving": len(worker._saving),
            "worker._async_loads": len(wcore._async_loads), "worker._save_requests": len(wcore._save_requests),
            "worker._finished": len(wcore._finished), "worker.started_loading": len(wcore.started_loading),
            "worker._dropped": len(wcore._dropped),
            "worker._failed_requests": len(wcore._failed_requests), "worker._saves": len(wcore._saves._pending),
            "worker._load_errors": len(wcore._load_errors)}


def _request(ex: CancellingExecutor, rid: int, rng: random.Random) -> None:
    prefix = [1 + (7 * rng.randrange(4) + i) % 97 for i in range(8)]  # 4 shared prefixes: hits
    req = ex.add(rid, prefix + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 9))],
                 max_new_tokens=rng.choice((1, 2, 4)))
    kind = rng.random()
    if kind < 0.05:  # a prompt-tuning table: its keys cannot name its KV
        req.prompt_embedding_table = object()
    elif kind < 0.1:  # a beam search: only its prompt is saved
        req.sampling_config = SimpleNamespace(beam_width=2)


def _soak(tmp_path, monkeypatch, load_async: bool) -> None:
    llm_args = store_llm_args(tmp_path, monkeypatch)
    if load_async:
        monkeypatch.setenv("TIERED_KV_LOAD_ASYNC", "1")
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    rng = random.Random(52)
    try:
        ex = CancellingExecutor(sched, worker, num_blocks=96)
        added = 0
        while added < REQUESTS:
            live = [r for r in ex.requests.values() if r.state not in ("done", "saving")]
            if len(live) + len(ex.held) < LIVE:
                _request(ex, added, rng)
                added += 1
            if live and rng.random() < 0.15:
                ex.cancel(rng.choice(live).request_id)  # waiting, loading, prefilling or decoding
            if rng.random() < 0.01:
                ex.failed_step()
            else:
                ex.step()
            over = {k: n for k, n in _sizes(sched, worker).items() if n > 2 * LIVE}
            assert not over, over
        for _ in range(2000):
            if all(r.state == "done" for r in ex.requests.values()) and not ex.held:
                break
            ex.step()
        for _ in range(4):  # idle steps: what is aged by steps goes
            ex.step()
        sizes = _sizes(sched, worker)
        assert {k: n for k, n in sizes.items() if n} == {}, sizes
        assert len(worker.core.load_stats) <= 4096
        assert ex.held == {} and len(ex.free) == 96
    finally:
        sched.close()
        worker.close()


def test_thousands_of_requests_cancelled_failed_and_finished_leave_no_per_request_state(tmp_path, monkeypatch):
    _soak(tmp_path, monkeypatch, load_async=False)


def test_thousands_of_requests_with_async_loads_cancelled_in_flight_leave_no_per_request_state(tmp_path,
                                                                                              monkeypatch):
    _soak(tmp_path, monkeypatch, load_async=True)
