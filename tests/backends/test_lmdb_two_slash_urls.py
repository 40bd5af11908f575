"""``lmdb://var/cache/tkv`` (two slashes) names the directory ./var/cache/tkv, relative to the
working directory: after ``//`` a URL has its host, and "var" is read as the first name of a
relative path (documented; ``lmdb:var/cache/tkv`` says the same). A writer who meant
/var/cache/tkv got a new, empty store somewhere else, and no word of it. The meaning is kept;
each open of such a tier says, once, which absolute directory it opened and that
``lmdb:///var/cache/tkv`` (three slashes) is the absolute form."""

from __future__ import annotations

import logging

from storage_backends.registry import open_backend, open_read_only
from tests.store.helpers import make_store


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "storage_backends.options" and r.levelno == logging.WARNING]


def test_regression_a_two_slash_lmdb_url_silently_opened_a_relative_directory(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING)
    backend = open_backend("lmdb://var/cache/tkv", capacity="64MiB")
    backend.put_many([(b"k" * 32, b"v" * 100)])
    backend.close()
    assert (tmp_path / "var/cache/tkv/data.mdb").is_file()  # the meaning is kept: relative
    (said,) = warnings_of(caplog)
    assert str((tmp_path / "var/cache/tkv").resolve()) in said
    assert "lmdb:///var/cache/tkv (three slashes)" in said
    caplog.clear()
    tool = open_read_only("lmdb://var/cache/tkv?capacity=64MiB")  # a tool's open says it too, once
    assert tool.get_many([b"k" * 32]) == [b"v" * 100]
    tool.close()
    (said,) = warnings_of(caplog)
    assert "lmdb:///var/cache/tkv (three slashes)" in said  # (the query is no part of the directory)


def test_an_engine_opening_a_two_slash_disk_tier_is_told_once(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING)
    with make_store(tmp_path, disk={"url": "lmdb://tkv-store"}) as store:
        assert store.tier("disk").backend.path.resolve() == (tmp_path / "tkv-store").resolve()
    (said,) = warnings_of(caplog)
    assert str((tmp_path / "tkv-store").resolve()) in said and "lmdb:///tkv-store" in said


def test_the_other_forms_open_where_they_say_without_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    caplog.set_level(logging.WARNING)
    for url, where in ((f"lmdb://{tmp_path}/abs", tmp_path / "abs"), ("lmdb://./dot", tmp_path / "dot"),
                       ("lmdb:plain", tmp_path / "plain"), ("lmdb://~/tilde", tmp_path / "home/tilde")):
        open_backend(url, capacity="64MiB").close()
        assert (where / "data.mdb").is_file(), url
    assert warnings_of(caplog) == []


def test_a_two_slash_file_url_is_told_the_same(tmp_path, monkeypatch, caplog):
    # file:// reads its directory as lmdb:// does, and was as silent about it
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING)
    open_backend("file://tkv-files").close()
    assert (tmp_path / "tkv-files").is_dir()
    (said,) = warnings_of(caplog)
    assert str((tmp_path / "tkv-files").resolve()) in said and "file:///tkv-files" in said
