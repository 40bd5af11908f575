"""Fixtures shared by the media scenarios."""

from __future__ import annotations

import pytest

from storage_backends.segment_io import supports_direct


@pytest.fixture
def direct_dir(tmp_path):
    """A store directory on a file system that takes ``O_DIRECT`` (else the test is skipped)."""
    (tmp_path / "probe").mkdir()
    if not supports_direct(tmp_path / "probe"):
        pytest.skip("this file system refuses O_DIRECT")
    return tmp_path / "db"
