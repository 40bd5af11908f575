"""A config's tier opened by the tools as the engine opens it: the medium is handed the tier's
``options`` table (``open_read_only(url, options=...)``) and reads what the engine's medium reads
with that table and URL, whatever the table holds and however the URL reads (real LMDB from the
demo, a real redis-server)."""

from __future__ import annotations

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
