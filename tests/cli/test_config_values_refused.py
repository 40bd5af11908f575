"""A config file's bad value is one line on stderr and exit 2 for every command that reads it:
named by its key, no traceback, no password."""

from __future__ import annotations

import pytest

from tests.cli.conftest import cli


@pytest.mark.parametrize(("toml", "said"), [
    ('[remote]\nurl = "redis://127.0.0.1:1/0?retries=³"\n', "remote.retries must be an integer, got '³'"),
    ('remote = "redis://tkv:hunter2pw@cache:6379/0"\n', "remote must be a table of settings, got 'redis://tkv:***@cache:6379/0'"),
    ('[remote]\nurl = "redis://127.0.0.1:1/0?timeout=0"\n', "remote.timeout must be positive"),
])
def test_regression_a_bad_config_value_was_a_traceback_or_showed_a_password(tmp_path, toml, said):
    config = tmp_path / "tkv.toml"
    config.write_text(toml)
    for command in ("inspect", "ls", "verify"):
        result = cli(command, "--config", config)
        assert (result.code, result.out) == (2, ""), result.err
        assert result.err.startswith(f"tiered-kv: error: {said}") and len(result.err.splitlines()) == 1, result.err
        assert "hunter2pw" not in result.err
