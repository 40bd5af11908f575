"""``--timeout`` is a positive duration of at most a day, refused as bad usage otherwise (exit 2,
one line): ``inf`` made every socket call raise OverflowError (a traceback), and ``nan``, ``0``
and ``-1`` were reported as the store being unreachable (exit 3)."""

from __future__ import annotations

import pytest

from tests.cli.conftest import cli

NOBODY = "127.0.0.1:1"  # a metrics endpoint nobody serves: refused at once


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e400", "2d", "soon"])
@pytest.mark.parametrize("command", [["stats", NOBODY], ["inspect", "redis://127.0.0.1:1/0"]])
def test_regression_a_timeout_that_is_no_wait_was_a_traceback_or_an_unreachable_store(command, value):
    result = cli(*command, f"--timeout={value}")
    assert result.code == 2 and "Traceback" not in result.err, result.err
    assert "--timeout" in result.err and result.out == ""


@pytest.mark.parametrize("value", ["3", "0.5", "250ms", "5s", "1d"])
def test_a_timeout_in_seconds_or_with_a_unit_is_taken(value):
    result = cli("stats", NOBODY, f"--timeout={value}")
    assert result.code == 3, result.err  # it got as far as asking: nobody answered
    assert result.err.startswith("tiered-kv: error: cannot fetch metrics")
