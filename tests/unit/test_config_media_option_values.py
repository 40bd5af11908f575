"""An lmdb or file tier's option VALUES the medium would refuse as it opens are refused as the
config is built, naming the tier and the option, as a Redis tier's are: ``map_size = "abc"``,
``sync = []`` built a config, and failed only when the tier opened, in an engine's worker. The
check reads each value with the function the medium's constructor reads it with, and opens, makes
and connects nothing: the directory a refused (or accepted) config names is never made."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

LMDB_REFUSED = [  # (options, what the refusal names)
    ({"map_size": "abc"}, "lmdb map_size: expected a byte size"),
    ({"batch_bytes": "lots"}, "lmdb batch_bytes: expected a byte size"),
    ({"segment_min": 0}, "lmdb segment_min must be >= 1 and segment_bytes >= 1 MiB"),
    ({"segment_bytes": "64KiB"}, "lmdb segment_min must be >= 1 and segment_bytes >= 1 MiB"),
    ({"segment_min": -1}, "lmdb segment_min: "),
    ({"readahead": "perhaps"}, "lmdb readahead must be true or false"),
    ({"writemap": ""}, "lmdb writemap must be true or false"),
    ({"record_access": 2}, "lmdb record_access must be true or false"),
    ({"direct_io": []}, "lmdb direct_io must be true or false"),
    ({"eager_writeback": "soon"}, "lmdb eager_writeback must be true or false"),
    ({"max_readers": 0}, "lmdb max_readers must be at least 1"),
    ({"max_readers": 2.5}, "lmdb max_readers must be an integer"),
    ({"writeback": "soon"}, "lmdb writeback must be one of"),
    ({"writeback": "later", "eager_writeback": True}, "lmdb writeback=later contradicts eager_writeback"),
]


@pytest.mark.parametrize("where", ["options", "url"])
@pytest.mark.parametrize(("options", "named"), LMDB_REFUSED)
def test_regression_an_lmdb_option_value_the_tier_refuses_was_a_config_until_the_engine_opened_it(
        tmp_path, where, options, named):
    store = tmp_path / "never-made"
    disk = {"url": f"lmdb://{store}", "options": options} if where == "options" else \
        {"url": f"lmdb://{store}?" + "&".join(f"{k}={str(v).lower()}" for k, v in options.items())}
    with pytest.raises(ConfigError, match=f"^disk: {named}"):
        TieredKVConfig.from_dict({"disk": disk})
    with pytest.raises(ConfigError, match=f"^cold: {named}"):  # (a [[tiers]] table's lmdb too)
        TieredKVConfig.from_dict({"tiers": [{"name": "cold", **disk}]})
    with pytest.raises(ConfigError, match=named):  # the medium says the same as it opens
        open_backend(f"lmdb://{store}", **options).close()
    assert not store.exists()  # (the config's check made nothing; the medium refused before making it)


@pytest.mark.parametrize(("options", "named"), [
    ({"sync": []}, "file sync must be true or false"),
    ({"touch": "maybe"}, "file touch must be true or false"),
    ({"create": "perhaps"}, "file create must be true or false"),
    ({"sync": ""}, "file sync must be true or false"),
])
def test_regression_a_file_option_value_the_tier_refuses_was_a_config_until_the_engine_opened_it(
        tmp_path, options, named):
    store = tmp_path / "never-made"
    for tier in ({"name": "archive", "url": f"file://{store}", "options": options},
                 {"name": "archive", "url": f"file://{store}?" + "&".join(f"{k}={v}" for k, v in options.items()
                                                                       if isinstance(v, str))}):
        if tier["url"].endswith("?"):
            continue  # (a list has no spelling in a URL)
        with pytest.raises(ConfigError, match=f"^archive: {named}"):
            TieredKVConfig.from_dict({"tiers": [tier]})
    with pytest.raises(ConfigError, match=named):
        open_backend(f"file://{store}", **options).close()
    assert not store.exists()


def test_an_options_table_wins_over_the_urls_query_in_the_check_as_in_the_tier(tmp_path):
    store = tmp_path / "never-made"
    config = TieredKVConfig.from_dict({
        "disk": {"url": f"lmdb://{store}?map_size=abc&writeback=soon",
                 "options": {"map_size": "1GiB", "writeback": "background"}},
        "tiers": [{"name": "archive", "url": f"file://{store}-files?touch=maybe", "options": {"touch": False}}]})
    assert config.disk.options["map_size"] == "1GiB"
    with pytest.raises(ConfigError, match="^disk: lmdb map_size"):
        TieredKVConfig.from_dict({"disk": {"url": f"lmdb://{store}?map_size=1GiB", "options": {"map_size": "abc"}}})
    assert not store.exists() and not (tmp_path / "never-made-files").exists()


def test_lmdb_and_file_option_values_the_tiers_take_still_build_and_open_alike(tmp_path):
    lmdb = {"map_size": "1GiB", "batch_bytes": "1MiB", "segment_min": "32KiB", "segment_bytes": "1MiB",
            "readahead": "off", "writemap": False, "record_access": "yes", "direct_io": 0, "max_readers": 2.0,
            "writeback": "eager", "eager_writeback": "true"}
    config = TieredKVConfig.from_dict({
        "disk": {"url": f"lmdb://{tmp_path}/db?sync=on", "capacity": "64MiB", "options": lmdb},
        "tiers": [{"name": "archive", "url": f"file://{tmp_path}/files?touch=0",
                   "options": {"sync": "yes", "create": 1, "timeout": 2}, "capacity": "1GiB"}]})
    assert not (tmp_path / "db").exists()  # (building it made nothing)
    disk, archive = config.lower_tiers[0], config.lower_tiers[1]
    with open_backend(disk.url, **disk.medium_options()) as b:
        assert (b.sync, b.capacity, b.values.files.writer.eager_writeback) == (True, 64 << 20, True)
    with open_backend(archive.url, **archive.medium_options()) as b:
        assert (b.sync, b.touch, b.capacity) == (True, False, 1 << 30)


@pytest.mark.parametrize(("tier", "refusal"), [
    ({"url": "lmdb:///tmp/tkv-never-made", "capacity": 0}, "cold.capacity must be positive"),
    ({"url": "lmdb:///tmp/tkv-never-made?tenant_quota=0"}, "cold.tenant_quota must be positive"),
    ({"url": "file:///tmp/tkv-never-made", "options": {"capacity": 0}}, "cold.capacity must be positive"),
    ({"url": "file:///tmp/tkv-never-made", "options": {"tenant_quotas": {"zz": "1GiB"}}},
     "cold.options.tenant_quotas: a tenant label written as text is its hex"),
])
def test_the_tiers_own_fields_are_still_refused_in_the_configs_words(tier, refusal):
    with pytest.raises(ConfigError, match=f"^{refusal}"):
        TieredKVConfig.from_dict({"tiers": [{"name": "cold", **tier}]})
