"""Every medium reads a true/false setting the same way (``tiered_kv.units.as_bool``): the same
words mean the same thing in every URL, and a blank or unknown word is a ConfigError naming it."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (1, True), (0, False),
                                             ("1", True), ("YES", True), (" on ", True), ("True", True),
                                             ("0", False), ("no", False), ("Off", False), ("false", False)])
def test_the_words_every_medium_understands(value, expected):
    assert as_bool(value, "x") is expected


@pytest.mark.parametrize("value", ["", "  ", "maybe", "2", None, 1.0, [], -1])
def test_blank_and_unknown_settings_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="lmdb sync must be true or false"):
        as_bool(value, "lmdb sync")


def test_each_medium_refuses_a_blank_flag_in_its_url(tmp_path, redis_url):
    for url, name in ((f"lmdb://{tmp_path}/db?sync=", "lmdb sync"),
                      (f"lmdb://{tmp_path}/db?record_access=perhaps", "lmdb record_access"),
                      (f"file://{tmp_path}/files?touch=", "file touch"),
                      (f"{redis_url}?cluster=", "redis cluster"),
                      ("host://?capacity=1MiB&slot=64KiB&pinned=", "host pinned")):
        with pytest.raises(ConfigError, match=name):
            open_backend(url)


def test_each_medium_takes_the_same_words(tmp_path, redis_url):
    with open_backend(f"lmdb://{tmp_path}/db?sync=on&readahead=off&record_access=no") as b:
        assert (b.sync, b.record_access) == (True, False)
    with open_backend(f"file://{tmp_path}/files?sync=yes&touch=0") as b:
        assert (b.sync, b.touch) == (True, False)
    with open_backend("host://?capacity=1MiB&slot=64KiB&pinned=off") as b:
        assert b.pinned is False
    with open_backend(f"{redis_url}?cluster=off") as b:
        assert b.cluster is False
