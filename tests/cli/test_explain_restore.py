"""`explain` says what the restore policy would load of a prompt's stored blocks, offline, from
the estimates the engine's store left in the namespace record."""

from __future__ import annotations

import pytest

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, make_store, payloads

PROMPT = ",".join(str(t) for t in range(8 * 16 + 1))  # eight stored blocks of 16 and one token


@pytest.fixture
def slow_disk(tmp_path):
    """Eight blocks on a disk its last engine found slow to restore from (half a second), with a
    prefill of 10 ms + 1 ms per token (0.139 s for the prompt)."""
    with make_store(tmp_path) as store:
        store.save(keys_for(8), payloads(store, 8))
        store.costs.set_prefill(per_step_s=0.01, per_token_s=1e-3)
        store.costs.set_restore("disk", latency_s=0.5, bytes_per_s=100e6)
    return tmp_path


def test_explain_shows_the_stored_blocks_it_would_not_load_and_why(slow_disk):
    url = f"lmdb://{slow_disk}/lmdb"
    result = cli("explain", url, "--token-ids", PROMPT, "--json")
    assert result.code == 0, result.err
    report = result.json()
    assert report["matched_blocks"] == 8  # stored and reusable ...
    restore = report["restore"]  # ... but slower to restore than to recompute
    assert restore["policy"] == "cost" and restore["reason"] == "slower_than_recompute"
    assert restore["stored_blocks"] == 8 and restore["load_blocks"] == 0 and restore["skipped_tokens"] == 128
    assert restore["skipped"] == {"disk": 8}  # the tier opened by URL, named as its engine named it
    assert restore["recompute_all_s"] == pytest.approx(0.139) and restore["load_all_s"] > 0.5
    assert restore["estimates"]["restore"]["disk"]["latency_s"] == pytest.approx(0.5)

    text = cli("explain", url, "--token-ids", PROMPT).out
    assert "restore (cost): would load 0 of 8 stored blocks (0 tokens): slower_than_recompute" in text
    assert "recomputing all 0.139s" in text and "not loaded: disk 8" in text


def test_explain_with_policy_always_loads_everything_and_shows_the_predictions(slow_disk, tmp_path):
    url = f"lmdb://{slow_disk}/lmdb"
    restore = cli("explain", url, "--token-ids", PROMPT, "--json", "--restore-policy", "always").json()["restore"]
    assert restore["reason"] == "always" and restore["load_blocks"] == 8 and restore["ttft_s"] > 0.5
    config = tmp_path / "tiered-kv.toml"
    config.write_text(f'restore_policy = "always"\n[disk]\nurl = "lmdb://{slow_disk}/lmdb"\n')
    restore = cli("explain", "--config", config, "--token-ids", PROMPT, "--json").json()["restore"]
    assert restore["policy"] == "always" and restore["load_blocks"] == 8


def test_explain_without_estimates_loads_everything(tmp_path):
    with make_store(tmp_path) as store:
        store.save(keys_for(8), payloads(store, 8))
    restore = cli("explain", f"lmdb://{tmp_path}/lmdb", "--token-ids", PROMPT, "--json").json()["restore"]
    assert restore["reason"] == "below_floor" and restore["load_blocks"] == 8
    assert "no estimates" in restore["detail"]


def test_explain_settles_auto_layerwise_loads_by_the_engine_device_it_is_told(slow_disk, tmp_path):
    url = f"lmdb://{slow_disk}/lmdb"
    restore = cli("explain", url, "--token-ids", PROMPT, "--json").json()["restore"]
    assert restore["engine_device"] == "cuda" and restore["layerwise"] is True  # "auto" on a GPU
    restore = cli("explain", url, "--token-ids", PROMPT, "--json", "--engine-device", "cpu").json()["restore"]
    assert restore["engine_device"] == "cpu" and restore["layerwise"] is False and restore["overlap"] is False
    config = tmp_path / "tiered-kv.toml"
    config.write_text(f'layerwise_loads = true\n[disk]\nurl = "{url}"\n')
    restore = cli("explain", "--config", config, "--token-ids", PROMPT, "--json", "--engine-device", "cpu",
                  ).json()["restore"]
    assert restore["layerwise"] is True  # asked for: layer-wise on a CPU engine too
    text = cli("explain", url, "--token-ids", PROMPT, "--engine-device", "cpu", "--restore-policy", "always").out
    assert "whole blocks, before the prefill on cpu" in text


def test_regression_explain_weighed_small_blocks_as_streamed_in_layer_groups_the_engine_never_splits(
        slow_disk, tmp_path):
    from tiered_kv.connector.restore_policy import RestorePolicy

    url = f"lmdb://{slow_disk}/lmdb"
    with make_store(tmp_path / "engine") as store:  # the same namespace and config as the engine's
        live = RestorePolicy.for_index(store, store.namespace, device="cuda")
    restore = cli("explain", url, "--token-ids", PROMPT, "--json").json()["restore"]
    assert live.groups == 1  # blocks this small are stored (and arrive) whole
    assert restore["layer_groups"] == live.groups
