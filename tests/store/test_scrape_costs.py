"""What a Prometheus scrape costs the store: the host and disk tiers' figures come from counts
and tables kept as blocks change (no directory listed, no file stat'ed, no entry visited), and
they are the figures the media report to tools. Real stores on tmp_path; the file system calls
are only watched, on the scraping thread."""

from __future__ import annotations

import os
import threading

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.keys import Namespace
from tiered_kv.store.prometheus import StoreCollector

NS64 = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=16, num_kv_heads=2,
                 head_dim=32, block_size=16)  # 64 KiB blocks: raw, they go to segment files
FIGURES = ("tiered_kv_tier_entries", "tiered_kv_tier_used_bytes", "tiered_kv_tier_capacity_bytes")


def watch_files(monkeypatch) -> list[tuple[str, object]]:
    """Directory listings and stats this thread makes from now on (the calls still happen)."""
    me, seen = threading.get_ident(), []
    for name in ("listdir", "scandir", "stat", "lstat"):
        real = getattr(os, name)

        def watched(*args, _real=real, _name=name, **kwargs):
            if threading.get_ident() == me:
                seen.append((_name, args[0] if args else None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, watched)
    return seen


def scrape(store) -> dict[str, dict[str, float]]:
    """metric -> tier -> value (summed over tenants), as the exporter collects them for ``store``."""
    collector = StoreCollector()
    collector.add(store)
    out: dict[str, dict[str, float]] = {}
    for family in collector.collect():
        for sample in family.samples:
            if "tier" in sample.labels:
                tiers = out.setdefault(sample.name, {})
                tiers[sample.labels["tier"]] = tiers.get(sample.labels["tier"], 0) + sample.value
    return out


def test_regression_a_scrape_listed_the_segment_directory_and_stat_every_segment_file(tmp_path, monkeypatch):
    # the exporter read LmdbBackend.stats(), which lists the segment directory, stats every
    # segment file and the data file and walks the segments table: at every scrape
    tenant = b"tenant-a"
    with make_store(tmp_path, ns=NS64, host="2MiB", disk={"codec": "raw"}) as store:
        keys = keys_for(8, NS64)
        store.save(keys, payloads(store, 8), tenant=tenant)
        store.flush()
        backends = store.stats()["backends"]
        assert backends["disk"]["extra"]["segment_files"] >= 1, "the scenario needs segment files"
        touched = watch_files(monkeypatch)
        scraped = scrape(store)
    assert touched == [], "a scrape listed or stat'ed files"
    for tier in ("host", "disk"):
        figures = backends[tier]
        assert [scraped[m][tier] for m in FIGURES] == \
            [figures["entries"], figures["used_bytes"], figures["capacity_bytes"]], tier
        assert scraped["tiered_kv_tenant_used_bytes"][tier] == figures["used_bytes"], tier
    assert backends["disk"]["entries"] >= 8


def test_the_disk_tier_reports_its_files_to_tools_and_the_same_figures_to_the_scrape(tmp_path):
    with make_store(tmp_path, ns=NS64, host="2MiB", disk={"codec": "raw"}) as store:
        keys = keys_for(4, NS64)
        store.save(keys, payloads(store, 4))
        store.flush()
        tier = store.tier("disk")
        figures, stats = tier.backend.figures(), tier.backend.stats()
        assert tier.backend.delete_many([tier.ns + keys[0]]) == 1
        after = tier.backend.figures()
    assert (figures.entries, figures.used_bytes, figures.capacity_bytes) == \
        (stats.entries, stats.used_bytes, stats.capacity_bytes) and figures.capacity_bytes == 64 << 20
    assert stats.extra["segment_files"] >= 1 and "segment_files" not in figures.extra
    assert after.entries == figures.entries - 1 and after.used_bytes < figures.used_bytes
