"""Naming a store: a path or URL that holds no store is one error line (exit 2) and never
becomes a new empty store; only `copy` creates its destination, and only in a new or empty
directory."""

from __future__ import annotations

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from tests.cli.conftest import cli


def one_error_line(result) -> str:
    assert result.code == 2 and result.out == "" and result.err.count("\n") == 1, result
    assert result.err.startswith("tiered-kv: error: ")
    return result.err.removeprefix("tiered-kv: error: ").rstrip("\n")


@pytest.fixture
def places(tmp_path):
    (tmp_path / "not-a-store").mkdir()
    (tmp_path / "not-a-store" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("x")
    LmdbBackend(tmp_path / "store", capacity="64MiB").close()
    return tmp_path


def test_what_is_not_a_store_is_named_in_one_line(places):
    cases = {
        str(places / "missing"): f"no store at {places / 'missing'}: the path does not exist",
        str(places / "a-file"): f"{places / 'a-file'} is a file, not a store directory",
        str(places / "not-a-store"): f"{places / 'not-a-store'} is not a tiered-kv store",
        f"lmdb://{places / 'not-a-store'}": "is not an LMDB store",
        f"file://{places / 'not-a-store'}": "is not a file store",
        "host://": "host:// lives inside a serving process",
        "nosuch://x": "no storage backend for 'nosuch://x'",
    }
    for store, message in cases.items():
        assert message in one_error_line(cli("inspect", store)), store
    assert sorted(p.name for p in places.iterdir()) == ["a-file", "not-a-store", "store"], "nothing created"
    assert [p.name for p in (places / "not-a-store").iterdir()] == ["notes.txt"]


def test_copy_creates_its_destination_only_in_a_new_or_empty_directory(places):
    source = places / "store"
    assert cli("copy", source, f"lmdb://{places / 'new'}").code == 0
    (places / "empty").mkdir()
    assert cli("copy", source, f"file://{places / 'empty'}").code == 0
    assert cli("inspect", places / "new").code == 0 and cli("inspect", places / "empty").code == 0
    refused = one_error_line(cli("copy", source, f"lmdb://{places / 'not-a-store'}"))
    assert "is not an LMDB store" in refused
    bare = one_error_line(cli("copy", source, places / "elsewhere"))
    assert bare.startswith(f"no store at {places / 'elsewhere'}: name a new one as lmdb://")
