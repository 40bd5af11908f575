"""The estimates the restore policy weighs: fitted from observations handed in (never timed
here), given out only from the floor up, and kept in the namespace record so that a reopened
store, the scheduler's lookup index and the tools start from them."""

from __future__ import annotations

import pytest

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.admin.catalog import namespaces
from tiered_kv.admin.opening import open_tier
from tiered_kv.admin.verify import verify_tier
from tiered_kv.store.lower_index import LowerTierIndex
from tiered_kv.store.prometheus import StoreCollector
from tiered_kv.store.restore_costs import RestoreCosts, attention_work


def prefill(tokens: int, context: int = 0) -> tuple[int, int, float]:
    """A step computing ``tokens`` after ``context``: 5 ms + 20 us per token + 1 ns per pair."""
    work = attention_work(context, tokens)
    return tokens, work, 0.005 + 20e-6 * tokens + 1e-9 * work


def test_restores_fit_latency_and_throughput():
    costs = RestoreCosts()
    for nbytes in (1 << 16, 1 << 20, 1 << 24):
        costs.observe_restore("disk", nbytes, 0.002 + nbytes / 2e9)  # 2 ms, 2 GB/s
    est = costs.restore_estimate("disk")
    assert est.latency_s == pytest.approx(0.002) and est.bytes_per_s == pytest.approx(2e9)
    assert costs.restore_seconds({"disk": 1 << 30}) == pytest.approx(0.002 + (1 << 30) / 2e9)
    assert costs.restore_seconds({"disk": 1 << 20, "host": 0}) is not None  # no bytes from the host


def test_prefill_fits_step_token_and_attention_terms():
    costs = RestoreCosts()
    for tokens, context in ((16, 0), (512, 0), (2048, 4096), (8192, 0), (1, 9000), (64, 300)):
        costs.observe_step(*prefill(tokens, context))
    est = costs.prefill_estimate()
    assert (est.per_step_s, est.per_token_s, est.per_pair_s) == pytest.approx((0.005, 20e-6, 1e-9))


def test_coefficients_are_never_negative():
    costs = RestoreCosts()
    # time falls slightly with size: least squares would give a negative per-byte cost
    for nbytes, seconds in ((1000, 0.0105), (2000, 0.0100), (4000, 0.0098)):
        costs.observe_restore("remote", nbytes, seconds)
    est = costs.restore_estimate("remote")
    assert est.per_byte_s == 0 and est.latency_s == pytest.approx(0.0101, abs=1e-4)


def test_a_burst_of_decode_steps_keeps_the_long_prefills_in_the_fit():
    costs = RestoreCosts()
    for _ in range(3):
        costs.observe_step(*prefill(8192))
    for i in range(2000):
        costs.observe_step(*prefill(8, 1000 + i))  # decode steps of eight requests
    assert costs.prefill_seconds(*prefill(8192)[:2]) == pytest.approx(prefill(8192)[2], rel=1e-6)


def test_a_stalled_step_is_dropped_from_the_fit():
    costs = RestoreCosts()
    for tokens in (16, 32, 64, 128, 256, 512, 1024, 2048) * 2:
        costs.observe_step(*prefill(tokens))
    tokens, work, seconds = prefill(1024)
    costs.observe_step(tokens, work, seconds + 3.0)  # a collection stalled it
    assert costs.prefill_seconds(tokens, work) == pytest.approx(seconds, rel=1e-6)


def test_estimates_below_the_floor_are_not_given_out():
    costs = RestoreCosts(min_samples=3)
    for _ in range(2):
        costs.observe_restore("disk", 1 << 20, 0.01)
        costs.observe_step(*prefill(128))
    assert costs.restore_seconds({"disk": 1 << 20}) is None and costs.prefill_seconds(128, 0) is None
    assert costs.restore_estimate("disk") is not None  # known, only not trusted yet
    costs.observe_restore("disk", 1 << 20, 0.01)
    costs.observe_step(*prefill(128))
    assert costs.restore_seconds({"disk": 1 << 20}) == pytest.approx(0.01)
    assert costs.prefill_seconds(128, 0) is not None
    assert costs.restore_seconds({"disk": 1, "remote": 1}) is None  # a tier never observed


def test_pinned_estimates_stay_until_replaced():
    costs = RestoreCosts()
    costs.set_restore("remote", latency_s=0.5, bytes_per_s=1e8)
    costs.observe_restore("remote", 1 << 20, 0.001)  # observations no longer move it
    assert costs.restore_seconds({"remote": 1 << 20}) == pytest.approx(0.5 + (1 << 20) / 1e8)
    again = RestoreCosts()
    again.restore_snapshot(costs.snapshot())
    assert again.restore_estimate("remote") == costs.restore_estimate("remote")


def test_a_snapshot_round_trips_and_garbage_in_it_is_left_out():
    costs = RestoreCosts()
    for tokens in (16, 256, 4096):
        costs.observe_step(*prefill(tokens, 100))
        costs.observe_restore("disk", tokens * 1024, 0.001 + tokens * 1e-6)
    snap = costs.snapshot()
    snap["restore"]["disk"]["samples"].append(["x", -1])
    snap["restore"]["broken"] = "not a series"
    again = RestoreCosts()
    again.restore_snapshot(snap)
    assert again.prefill_estimate() == costs.prefill_estimate()
    assert again.restore_estimate("disk") == costs.restore_estimate("disk")
    assert again.restores_observed() == {"disk": 3}


def observe(store) -> None:
    """What a worker would have observed, as fixed figures."""
    for nbytes in (1 << 14, 1 << 16, 1 << 18):
        store.costs.observe_restore("disk", nbytes, 0.001 + nbytes / 1e9)
        store.costs.observe_restore("host", nbytes, nbytes / 1e10)
    for tokens in (16, 256, 4096):
        store.costs.observe_step(*prefill(tokens))


def test_estimates_survive_a_reopen_and_reach_the_lookup_index_and_the_tools(tmp_path):
    with make_store(tmp_path) as store:
        store.save(keys_for(4), payloads(store, 4))
        observe(store)
        before = (store.costs.restore_estimate("disk"), store.costs.prefill_estimate())
    with make_store(tmp_path) as store:  # a restarted engine
        assert (store.costs.restore_estimate("disk"), store.costs.prefill_estimate()) == before
        assert store.costs.restores_observed() == {"disk": 3, "host": 3}
        config = store.config
    index = LowerTierIndex(config, NS)  # a scheduler in another process
    try:
        assert index.cost_record.loaded.wait(10)  # (read on its own thread)
        assert index.costs.restore_estimate("disk") == before[0]
        assert index.costs.prefill_seconds(*prefill(100)[:2]) == pytest.approx(prefill(100)[2])
    finally:
        index.close()
    tier = open_tier(f"lmdb://{tmp_path}/lmdb")
    try:  # still one namespace record, read as before; nothing for verify to remove
        assert list(namespaces(tier.backend).known.values()) == [NS]
        assert verify_tier(tier)["ok"]
    finally:
        tier.close()


def test_the_lookup_index_picks_up_newer_estimates(tmp_path):
    files = {"url": f"file://{tmp_path}/files"}  # (an LMDB environment opens once per process)
    with make_store(tmp_path, disk=files) as store:
        store.save(keys_for(2), payloads(store, 2))
        config = store.config
    index = LowerTierIndex(config, NS)
    try:
        assert index.cost_record.loaded.wait(10) and index.costs.prefill_estimate() is None
        with make_store(tmp_path, disk=files) as store:
            observe(store)
            store.flush()  # flush writes the estimates (as close does)
            assert index.cost_record.load()  # what its refresh thread does every COSTS_REFRESH_S
            assert index.costs.restore_estimate("disk") == store.costs.restore_estimate("disk")
    finally:
        index.close()


def test_a_store_that_stored_nothing_writes_no_record(tmp_path):
    with make_store(tmp_path) as store:  # (a consumer that only reads, or nothing to save yet)
        observe(store)
    with make_store(tmp_path) as store:
        assert store.costs.empty()
        assert store.tier("disk").backend.stats().entries == 0


def test_the_estimates_and_skipped_tokens_are_exported(tmp_path):
    with make_store(tmp_path) as store:
        observe(store)
        store.count_restore_skips({"disk": 5}, 80)
        collector = StoreCollector()
        collector.add(store)
        samples = {(s.name, s.labels.get("tier") or s.labels.get("term") or s.labels.get("source")
                    or s.labels.get("reason")): s.value for fam in collector.collect() for s in fam.samples}
    assert samples[("tiered_kv_restore_skipped_tokens_total", None)] == 80
    assert samples[("tiered_kv_misses_total", "disk")] == 5
    assert samples[("tiered_kv_restore_latency_seconds", "disk")] == pytest.approx(0.001)
    assert samples[("tiered_kv_restore_throughput_bytes", "disk")] == pytest.approx(1e9)
    assert samples[("tiered_kv_prefill_seconds", "token")] == pytest.approx(20e-6)
    assert samples[("tiered_kv_cost_observations", "steps")] == 3


def as_machine(monkeypatch, name: str) -> None:
    """This process is on a machine of class ``name`` from now on."""
    from tiered_kv.store import cost_records

    monkeypatch.setattr(cost_records, "machine_class", lambda: (name, f"{name} hardware"))


def test_a_replica_on_other_hardware_sharing_a_tier_does_not_steer_this_ones_restore_policy(tmp_path, monkeypatch):
    """Replicas on a GPU and on a CPU share a file store (or a Redis): each reads only the
    estimates of its own class of machine (the CPU's read the GPU's prefill figures: recomputing
    looked cheap), and both classes' stay in the record."""
    files = {"url": f"file://{tmp_path}/files"}
    as_machine(monkeypatch, "gpu")
    with make_store(tmp_path, disk=files) as store:
        store.save(keys_for(2), payloads(store, 2))
        observe(store)
        gpu = (store.costs.restore_estimate("disk"), store.costs.prefill_estimate())
    as_machine(monkeypatch, "cpu")
    with make_store(tmp_path, disk=files) as store:
        assert store.costs.empty(), "another class of machine's estimates were adopted"
        store.costs.observe_restore("disk", 1 << 16, 0.5)  # this machine's own, other figures
        store.costs.observe_restore("disk", 1 << 18, 1.0)
        config = store.config
    index = LowerTierIndex(config, NS)  # the CPU replica's scheduler
    try:
        assert index.cost_record.loaded.wait(10)
        assert index.costs.prefill_estimate() is None and index.costs.restores_observed() == {"disk": 2}
    finally:
        index.close()
    as_machine(monkeypatch, "gpu")
    with make_store(tmp_path, disk=files) as store:  # the GPU replica restarted: its own figures
        assert (store.costs.restore_estimate("disk"), store.costs.prefill_estimate()) == gpu


def test_a_record_keeps_the_most_recently_written_classes_of_machine(tmp_path, monkeypatch):
    from tiered_kv.store import cost_records

    monkeypatch.setattr(cost_records, "MAX_MACHINES", 2)
    monkeypatch.setattr(cost_records.time, "time", iter(range(1, 100)).__next__)
    held = None
    for name in ("a", "b", "c"):
        as_machine(monkeypatch, name)
        held = cost_records.encode_costs(NS, {"restore": {}, "prefill": {}}, "disk", held)
    assert cost_records.decode_costs(held, "a") is None
    assert cost_records.decode_costs(held, "b")["machine"] == "b hardware"
    assert cost_records.decode_costs(held, cost_records.ANY)["machine"] == "c hardware"


def test_a_record_of_the_previous_format_is_not_read_as_this_machines_estimates():
    """Format 1 held one set of estimates of no known machine: the store learns afresh."""
    import json

    from tiered_kv.store import cost_records
    from tiered_kv.store.records import COSTS_MEMBER, record_doc

    legacy = {**record_doc(NS), COSTS_MEMBER: {"format": 1, "tier": "disk", "written": 1.0,
                                                "restore": {}, "prefill": {}}}
    assert cost_records.decode_costs(json.dumps(legacy).encode()) is None
    assert cost_records.decode_costs(json.dumps(legacy).encode(), cost_records.ANY) is None


def test_a_scheduler_on_other_cpus_and_gpus_of_the_machine_reads_its_workers_estimates(tmp_path, monkeypatch):
    """vLLM's scheduler and its workers are processes of one machine, the workers often pinned
    to other CPUs (a NUMA binding) or given another ``CUDA_VISIBLE_DEVICES`` (Ray): one class of
    machine all the same (each process's own view made the index never read the estimates)."""
    from tiered_kv.store import machine_class as mc

    def as_process(cpus: set[int], visible: str | None) -> None:
        monkeypatch.setattr(mc.os, "sched_getaffinity", lambda pid: cpus, raising=False)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        mc.machine_class.cache_clear()

    monkeypatch.setattr(mc, "_gpus", lambda: ["NVIDIA H200", "NVIDIA H200"])
    try:
        as_process({0}, "1")  # a worker
        with make_store(tmp_path) as store:
            store.save(keys_for(2), payloads(store, 2))
            observe(store)
            written = store.costs.restore_estimate("disk")
            config = store.config
        as_process(set(range(64)), None)  # its scheduler
        index = LowerTierIndex(config, NS)
        try:
            assert index.cost_record.loaded.wait(10)
            assert index.costs.restore_estimate("disk") == written
        finally:
            index.close()
    finally:
        mc.machine_class.cache_clear()  # (this process's own class again, once the patches go)
