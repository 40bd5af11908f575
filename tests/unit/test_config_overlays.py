"""A config changed after it was made (variables over a section given as its dataclass,
``with_overrides``, ``settings()`` for callers that merge configs) is the config its written
settings make with the change; a config made in code is checked like a loaded one; ``env:``
and ``file:`` secrets and config paths are read where the caller said."""

from __future__ import annotations

import pytest

from tiered_kv.config import DiskConfig, HostConfig, RemoteConfig, TierConfig, TieredKVConfig
from tiered_kv.errors import ConfigError

GiB = 1 << 30
KEY = "0123456789abcdef-key"


# -- overlays --------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "variable", "field", "value"), [
    (DiskConfig(url="lmdb:///x"), ("TIERED_KV_DISK_URL", "lmdb:///y?sync=true"), "sync", True),
    (DiskConfig(url="lmdb:///x"), ("TIERED_KV_DISK_URL", "lmdb:///y?capacity=1GiB"), "capacity", GiB),
    (RemoteConfig(url="redis://h/0"), ("TIERED_KV_REMOTE_URL", "redis://h/0?retries=5"), "retries", 5),
])
def test_regression_a_new_url_over_a_section_object_was_refused_for_a_setting_nobody_wrote(
        section, variable, field, value):
    """The section's defaults (``sync=False``, 8 GiB, 2 retries) were carried over as written:
    a variable's URL saying otherwise was "set it in one place"."""
    name = section.name
    config = TieredKVConfig.load({name: section}, environ=dict([variable]))
    assert getattr(getattr(config, name), field) == value


def test_regression_a_new_url_over_a_section_object_kept_what_the_old_url_said():
    old = DiskConfig(url="lmdb:///x?capacity=1GiB&sync=true")
    config = TieredKVConfig.load({"disk": old}, environ={"TIERED_KV_DISK_URL": "lmdb:///y"})
    assert (config.disk.capacity, config.disk.sync) == (8 * GiB, False)  # the defaults, as for a file


def test_a_setting_written_in_the_section_object_still_stands_against_a_new_url():
    with pytest.raises(ConfigError, match="set it in one place"):
        TieredKVConfig.load({"disk": DiskConfig(url="lmdb:///x", sync=False)},
                            environ={"TIERED_KV_DISK_URL": "lmdb:///y?sync=true"})


def test_settings_make_the_same_config_again():
    config = TieredKVConfig.from_dict({
        "workers": 3, "encryption_secret": KEY, "host": {"capacity": "2GiB"},
        "disk": {"url": "lmdb:///x?sync=true", "capacity": "1GiB", "options": {"max_readers": 8}},
        "remote": {"url": "redis://h/0", "ttl": "1h"},
        "tiers": [{"name": "archive", "url": "file:///a?capacity=2GiB"}]})
    assert TieredKVConfig.from_dict(config.settings()) == config
    assert config.settings()["disk"]["capacity"] == GiB and "sync" not in config.settings()["disk"]


def test_with_overrides_parses_and_checks_as_from_dict_does():
    config = TieredKVConfig.from_dict({"disk": {"url": "lmdb:///x?capacity=1GiB"}})
    changed = config.with_overrides(workers="3", max_inflight_save="64MiB")
    assert (changed.workers, changed.max_inflight_save, changed.disk) == (3, 64 << 20, config.disk)
    assert changed.with_overrides(disk={"url": "lmdb:///y"}).disk.capacity == 8 * GiB


@pytest.mark.parametrize("change", [{"workers": 2.5}, {"workers": "many"}, {"metrics_port": "x"}, {"colour": 1}])
def test_regression_with_overrides_took_a_fraction_or_raised_type_error(change):
    """``with_overrides(workers=2.5)`` made a config with 2.5 workers; ``metrics_port="x"``
    raised TypeError from a comparison."""
    with pytest.raises(ConfigError, match=next(iter(change))):
        TieredKVConfig().with_overrides(**change)


# -- made in code ----------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "key"), [
    (lambda: TieredKVConfig(workers="3"), "workers must be an integer"),
    (lambda: TieredKVConfig(lookup_timeout=True), "lookup_timeout must be a number"),
    (lambda: TieredKVConfig(disk={"url": "lmdb:///x"}), "disk must be a DiskConfig"),
    (lambda: TieredKVConfig(tiers=[TierConfig(name="a")]), "tiers must be a tuple"),
    (lambda: HostConfig(capacity="1GiB"), "host.capacity must be an integer"),
    (lambda: DiskConfig(capacity="1GiB"), "disk.capacity must be an integer"),
    (lambda: DiskConfig(sync=1), "disk.sync must be true or false"),
    (lambda: RemoteConfig(retries="3"), "remote.retries must be an integer"),
    (lambda: TierConfig(name=5), "tiers.name must be a string"),
    (lambda: TierConfig(name="a", level=2.0), "a.level must be an integer"),
])
def test_regression_a_config_made_in_code_with_a_wrong_type_raised_type_error(make, key):
    with pytest.raises(ConfigError, match=key):
        make()


def test_a_config_made_in_code_takes_an_int_for_a_number():
    assert TieredKVConfig(lookup_timeout=1).lookup_timeout == 1


# -- remote timeout --------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [0, "0s", "2d", "300000d"])
@pytest.mark.parametrize("where", ["field", "url"])
def test_regression_a_remote_timeout_of_zero_or_centuries_was_taken(where, timeout):
    """0: TensorRT-LLM waited 0 s for every matched read (the remote tier off or not); 300000d:
    every Redis call raised OverflowError from the socket."""
    section = {"url": "redis://h/0", "timeout": timeout} if where == "field" else {"url": f"redis://h/0?timeout={timeout}"}
    with pytest.raises(ConfigError, match="remote.timeout must be positive and at most 1d"):
        TieredKVConfig.from_dict({"remote": section})


# -- where secrets and files are read --------------------------------------------------------

def test_regression_an_env_secret_was_read_from_the_process_not_the_variables_given(monkeypatch):
    monkeypatch.setenv("TKV_TEST_KEY", "the-process-has-another-key")
    given = {"TIERED_KV_ENCRYPTION_SECRET": "env:TKV_TEST_KEY", "TKV_TEST_KEY": KEY}
    assert TieredKVConfig.from_env(given).encryption_secret.reveal() == KEY.encode()
    assert TieredKVConfig.load({"encryption_secret": "env:TKV_TEST_KEY"}, environ=given).encryption_secret.reveal() \
        == KEY.encode()
    monkeypatch.delenv("TKV_TEST_KEY")
    with pytest.raises(ConfigError, match="TKV_TEST_KEY is not set"):
        TieredKVConfig.load({"encryption_secret": "env:TKV_TEST_KEY"}, environ={})


def test_a_secret_file_and_a_config_file_under_home_are_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tkv.key").write_text(KEY + "\n")
    (tmp_path / "tkv.toml").write_text('workers = 3\nencryption_secret = "file:~/tkv.key"\n')
    config = TieredKVConfig.from_toml("~/tkv.toml")
    assert config.workers == 3 and config.encryption_secret.reveal() == KEY.encode()
    assert TieredKVConfig.load("~/tkv.toml", environ={}) == config
