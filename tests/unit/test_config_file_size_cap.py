"""``config_file = "/dev/zero"`` (or a path to a huge log named by mistake) was read whole before
tomllib saw a byte: the engine's process grew until the kernel killed it. A config file is read
at most ``MAX_CONFIG_BYTES`` (+1 to tell) and a longer one is a ConfigError naming it."""

from __future__ import annotations

import os

import pytest

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.settings.loading import MAX_CONFIG_BYTES, read_toml


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_regression_a_config_file_naming_dev_zero_was_read_until_memory_ran_out():
    with pytest.raises(ConfigError, match="/dev/zero: longer than"):
        read_toml("/dev/zero")


def test_a_config_file_one_byte_over_the_cap_is_refused_and_one_at_it_is_read(tmp_path):
    table = b'[host]\ncapacity = "8MiB"\n'
    at_cap = tmp_path / "at.toml"
    at_cap.write_bytes(table + b"#" * (MAX_CONFIG_BYTES - len(table)))
    assert TieredKVConfig.from_toml(at_cap).host.capacity == 8 << 20
    over = tmp_path / "over.toml"
    over.write_bytes(table + b"#" * (MAX_CONFIG_BYTES - len(table) + 1))
    with pytest.raises(ConfigError, match="over.toml: longer than"):
        TieredKVConfig.from_toml(over)
