"""Evictions are counted where they happen, by the medium that evicts, and exported once per
tier: every tier's ``tiered_kv_evictions_total`` is its medium's own count (a file tier's too,
whose figures are otherwise not read at scrape time), and nothing in the store's counters says
otherwise."""

from __future__ import annotations

import urllib.request

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.prometheus import export, unexport


def _scraped(store, metric: str) -> dict[str, float]:
    """tier -> value of ``metric`` as Prometheus would scrape it from ``store``."""
    port = export(store, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        unexport(store)
    return {line.split('tier="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(metric + "{")}


def _fill_past_capacity(store, n: int = 40) -> None:
    keys, data = keys_for(n), payloads(store, n)
    for i in range(0, n, 4):
        store.save(keys[i:i + 4], data[i:i + 4])
        store.flush()  # the host tier is tiny: let write-behind free its slots


def test_regression_a_file_tier_that_evicted_was_exported_with_0_evictions(tmp_path):
    with make_store(tmp_path, host="64KiB", disk="160KiB",
                    tiers=[{"name": "shared", "url": f"file://{tmp_path}/files", "capacity": "160KiB"}]) as store:
        _fill_past_capacity(store)
        counted = {tier: figures["evictions"] for tier, figures in store.stats()["backends"].items()}
        scraped = _scraped(store, "tiered_kv_evictions_total")
        quota = _scraped(store, "tiered_kv_quota_evictions_total")
    assert counted["shared"] > 0 and counted["disk"] > 0 and counted["host"] > 0
    assert scraped == counted, "each tier's evictions exactly as its medium counted them: none lost, none twice"
    assert quota["shared"] == 0, "a file tier's quota evictions are exported as the others' are"


def test_regression_the_store_counters_showed_0_evictions_beside_the_media_real_count(tmp_path):
    with make_store(tmp_path, host="64KiB", disk="160KiB") as store:
        _fill_past_capacity(store)
        stats = store.stats()
    for tier in ("host", "disk"):
        evicted = stats["backends"][tier]["evictions"]
        assert evicted > 0
        assert stats["tiers"][tier].get("evictions", evicted) == evicted, f"{tier}: a second, wrong figure"
