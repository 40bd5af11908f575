"""A long-running SGLang server with HiCache storage: thousands of prefetches, backups and
existence checks through the backend, SGLang's storage threads' calls in random order. What the
backend keeps per call must stay bounded by what SGLang drains, never by the calls served;
SGLang drains the per-call stats only when it runs with ``--enable-metrics``."""

from __future__ import annotations

import os
import random

import pytest

from tests.integrations.sglang_standins import MHAPool
from tests.integrations.test_sglang_adapter import backend, sglang_keys
from tiered_kv.integrations import sglang

CALLS = 3000


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def _serve(storage, pool, rng: random.Random, calls: int) -> None:
    """SGLang's prefetch, backup and existence-check calls for prompts sharing prefixes."""
    for _ in range(calls):
        keys = sglang_keys(rng.randrange(1, 5), seed=f"prompt-{rng.randrange(40)}")
        first = rng.randrange(0, 16 - len(keys) + 1)
        call = rng.random()
        if call < 0.4:
            storage.batch_set_v1(keys, pool.page_indices(first, len(keys)))
        elif call < 0.8:
            storage.batch_get_v1(keys, pool.page_indices(first, len(keys)))
        else:
            storage.batch_exists(keys)


def test_regression_per_call_stats_grew_for_good_on_a_server_without_metrics(tmp_path, monkeypatch):
    """Every prefetch and backup appended its pages and bandwidth to lists only ``get_stats``
    drained, and SGLang calls ``get_stats`` only with ``--enable-metrics``: on a server without
    it they grew by one entry per call for the life of the process."""
    monkeypatch.setattr(sglang, "METRIC_SAMPLES", 64, raising=False)  # (a cap the test reaches in few calls)
    pool = MHAPool("page_first", seed=3)
    storage = backend(tmp_path, pool)
    try:
        _serve(storage, pool, random.Random(52), CALLS)  # (no get_stats: metrics are off)
        sizes = {k: len(v) for k, v in storage._metrics.items()}
        assert max(sizes.values()) <= 64, sizes
        assert min(sizes.values()) > 0, sizes  # (still what SGLang would see when it asks)
        stats = storage.get_stats()
        drained = stats if isinstance(stats, dict) else vars(stats)
        assert len(drained["prefetch_pgs"]) == len(drained["prefetch_bandwidth"]) <= 64
        assert {k: len(v) for k, v in storage._metrics.items()} == dict.fromkeys(sizes, 0)
    finally:
        storage.close()


def test_a_server_with_metrics_sees_every_call_since_it_last_asked(tmp_path):
    pool = MHAPool("page_first", seed=3)
    storage = backend(tmp_path, pool)
    rng = random.Random(7)
    try:
        for _ in range(50):  # SGLang asks every scheduler step
            _serve(storage, pool, rng, 20)
            stats = storage.get_stats()
            drained = stats if isinstance(stats, dict) else vars(stats)
            assert all(len(v) <= 20 for v in drained.values())
        assert storage.store.loader._leases == {}
    finally:
        storage.close()
