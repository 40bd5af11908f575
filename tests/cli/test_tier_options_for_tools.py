"""A config's tier opened by the tools as the engine opens it: its ``options`` table folded into
the URL the tools open (:func:`storage_backends.options.with_options`) says what the medium an
engine opens with that table and URL reads, whatever the table holds and however the URL reads
(real LMDB from the demo, a real redis-server)."""

from __future__ import annotations

from storage_backends.options import with_options
from storage_backends.registry import open_backend
from tests.cli.conftest import cli
from tiered_kv.config import TieredKVConfig


def test_regression_a_prefix_in_both_a_tiers_url_and_its_options_table_was_taken_from_the_url_by_the_tools(
        demo_store, redis_url, tmp_path):
    # the engine's Redis medium takes the options table over the URL's query: its blocks went
    # under "app1:"; the tools took the URL's "other:" and saw another prefix's keys (here none)
    assert cli("copy", demo_store.url, redis_url + "?prefix=app1:").code == 0
    config = tmp_path / "tkv.toml"
    config.write_text(f'[remote]\nurl = "{redis_url}?prefix=other:"\n[remote.options]\nprefix = "app1:"\n')
    remote = TieredKVConfig.from_toml(config).remote
    engine_side = open_backend(remote.url, **remote.medium_options())
    try:
        assert engine_side.prefix == b"app1:"
    finally:
        engine_side.close()
    (tier,) = cli("inspect", "--config", config, "--json").json()["tiers"]
    assert tier["blocks"] == cli("inspect", demo_store.url, "--json").json()["tiers"][0]["blocks"] > 0


def test_regression_a_whole_number_written_as_a_float_in_a_tiers_options_was_refused_by_the_tools(
        demo_store, tmp_path):
    # TOML's 600.0 is a whole number to the engine's medium (as it is in a config's own
    # fields); folded into the URL as "600.0" every tool refused the config
    config = tmp_path / "tkv.toml"
    config.write_text(f'[disk]\nurl = "{demo_store.url}"\n[disk.options]\nmax_readers = 600.0\n')
    result = cli("inspect", "--config", config, "--json")
    assert result.code == 0, result.err
    assert result.json()["tiers"][0]["blocks"] > 0


def test_a_url_folded_with_options_keeps_its_form_and_spells_each_value_as_a_query_does():
    options = {"sync": True, "readahead": False, "segment_min": 65536.0, "batch_bytes": "1.5MiB",
               "prefix": "a/b&c=d é", "max_readers": 600, "tenant_quota": None}
    folded = with_options("lmdb:///var/cache/tkv?sync=false&writeback=later", options)
    assert folded.startswith("lmdb:///var/cache/tkv?")  # (not lmdb:/var/cache/tkv)
    from storage_backends.options import split_options

    assert split_options(folded)[1] == {
        "sync": "true", "writeback": "later", "readahead": "false", "segment_min": "65536",
        "batch_bytes": "1.5MiB", "prefix": "a/b&c=d é", "max_readers": "600"}
    assert with_options("unix:///run/redis.sock?db=1", {"prefix": "x:"}) == "unix:///run/redis.sock?db=1&prefix=x%3A"
    assert with_options("lmdb:///d?sync=true", {"sync": True}) == "lmdb:///d?sync=true"  # (nothing to add)
