"""A TOML config saved by a Windows editor starts with a UTF-8 byte-order mark (EF BB BF).
tomllib reads it as a character before the first key, and the whole file was refused:
``config file tkv.toml: Invalid statement (at line 1, column 1)``. One leading mark is dropped;
the file reads exactly as it would without it."""

from __future__ import annotations

import codecs

import pytest

from storage_backends import open_backend
from tests.cli.conftest import cli
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError

TOML = '[host]\ncapacity = "8MiB"\n\n[disk]\nurl = "lmdb:///var/cache/tiered-kv"\ncapacity = "512MB"\n'


def test_regression_a_config_file_starting_with_a_byte_order_mark_was_refused_as_invalid_toml(tmp_path):
    plain, marked = tmp_path / "plain.toml", tmp_path / "windows.toml"
    plain.write_bytes(TOML.encode())
    marked.write_bytes(codecs.BOM_UTF8 + TOML.encode())
    assert TieredKVConfig.from_toml(marked) == TieredKVConfig.from_toml(plain)
    assert TieredKVConfig.load(marked, environ={}) == TieredKVConfig.load(plain, environ={})
    assert TieredKVConfig.from_toml(marked).disk.url == "lmdb:///var/cache/tiered-kv"


def test_the_tools_read_a_config_file_with_a_byte_order_mark(tmp_path):
    url = f"lmdb://{tmp_path}/store"
    open_backend(url, capacity="64MiB").close()  # an empty store
    config = tmp_path / "tkv.toml"
    config.write_bytes(codecs.BOM_UTF8 + f'[disk]\nurl = "{url}"\ncapacity = "64MiB"\n'.encode())
    result = cli("inspect", "--config", config, "--json")
    assert result.code == 0, result.err
    (tier,) = result.json()["tiers"]
    assert tier["tier"] == "disk" and tier["blocks"] == 0 and tier["capacity_bytes"] == 64 << 20


def test_only_one_leading_byte_order_mark_is_dropped(tmp_path):
    twice = tmp_path / "twice.toml"
    twice.write_bytes(codecs.BOM_UTF8 * 2 + TOML.encode())
    with pytest.raises(ConfigError, match="twice.toml"):
        TieredKVConfig.from_toml(twice)
    inside = tmp_path / "inside.toml"
    inside.write_bytes(TOML.encode() + codecs.BOM_UTF8 + b'workers = 2\n')
    with pytest.raises(ConfigError, match="inside.toml"):
        TieredKVConfig.from_toml(inside)
