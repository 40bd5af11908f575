"""A URL's surrounding blanks are no part of it, as a number's are not: a space kept after a URL
(a docker ``--env-file`` line, a YAML value, a copied NBSP) named another directory, so an
engine opened an empty store at ``"/var/cache/tkv "`` beside the real one and every restart
started cold, silently."""

from __future__ import annotations

import pytest

from storage_backends.lmdb_disk import path_of
from tiered_kv.config import TieredKVConfig


@pytest.mark.parametrize("blank", [" ", "  ", "\u00a0", " \t"])
def test_regression_a_blank_after_the_disk_url_opened_an_empty_store_in_another_directory(tmp_path, blank):
    url = f"lmdb://{tmp_path / 'store'}"
    config = TieredKVConfig.load(None, {"TIERED_KV_DISK_URL": url + blank})
    assert config.disk.url == url
    assert path_of(config.disk.url) == tmp_path / "store"


def test_regression_blanks_around_a_toml_tier_url_were_kept_in_the_path(tmp_path):
    toml = tmp_path / "tkv.toml"
    toml.write_text(f'[[tiers]]\nname = "archive"\nurl = " file://{tmp_path / "shared"} "\n', encoding="utf-8")
    config = TieredKVConfig.from_toml(toml)
    assert config.tiers[0].url == f"file://{tmp_path / 'shared'}"
    assert config.with_overrides().tiers[0].url == config.tiers[0].url
