"""Background writeback: what the writers wrote to a segment is handed, a stretch at a time, to
a thread that asks the kernel to start writing it; real segment files under a temp dir."""

from __future__ import annotations

import os
import threading

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.segment_fds import Descriptors
from storage_backends.segment_writeback import BackgroundWriteback, writeback_mode
from storage_backends.segment_writeback import start_writeback as real_start_writeback
from tiered_kv.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20


class Started:
    """Records every writeback the thread starts (and starts it for real)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.threads: set[str] = set()

    def __call__(self, fd: int, offset: int, length: int) -> None:
        self.spans.append((offset, length))
        self.threads.add(threading.current_thread().name)
        real_start_writeback(fd, offset, length)


def segment_files(tmp_path) -> Descriptors:
    return Descriptors(lambda segment: tmp_path / f"{segment:016x}.seg")


def write(fds: Descriptors, segment: int, offset: int, length: int) -> None:
    with fds.use(segment, write=True) as fd:
        os.pwrite(fd, os.urandom(length), offset)


def test_each_stretch_a_segment_received_is_handed_on_once_and_the_rest_waits_for_a_flush(tmp_path):
    fds, started = segment_files(tmp_path), Started()
    fds.create(1)
    wb = BackgroundWriteback(fds, chunk_bytes=MiB, start=started)
    # two writers' values land out of order: the stretch spans from the lowest to the highest
    for offset in (256 * KiB, 0, 512 * KiB, 768 * KiB, MiB + 256 * KiB, MiB, 2 * MiB, 2 * MiB + 512 * KiB):
        write(fds, 1, offset, 256 * KiB)
        wb.wrote(1, offset, 256 * KiB)
    wb.close()  # hands nothing more on, and waits for the thread
    # the last 256 KiB is under a stretch: the next flush writes it
    assert started.spans == [(0, MiB), (MiB, MiB + 256 * KiB)]
    assert started.threads == {"tiered-kv-writeback"}
    fds.close()


def test_a_stretch_of_a_segment_deleted_meanwhile_is_skipped_without_an_error(tmp_path, caplog):
    fds, started = segment_files(tmp_path), Started()
    fds.create(1)
    fds.create(2)
    wb = BackgroundWriteback(fds, chunk_bytes=MiB, start=started)
    write(fds, 1, 0, 512 * KiB)
    wb.wrote(1, 0, 512 * KiB)
    fds.forget(1)
    os.unlink(tmp_path / f"{1:016x}.seg")
    wb.wrote(1, 512 * KiB, 512 * KiB)  # handed on: its file is gone by then
    write(fds, 2, 0, MiB)
    wb.wrote(2, 0, MiB)
    wb.close()
    assert started.spans == [(0, MiB)]  # segment 2's only
    fds.close()


def test_a_forgotten_segment_and_writes_after_close_hand_nothing_on(tmp_path):
    fds, started = segment_files(tmp_path), Started()
    fds.create(1)
    wb = BackgroundWriteback(fds, chunk_bytes=MiB, start=started)
    wb.wrote(1, 0, 768 * KiB)
    wb.forget(1)  # being deleted: what it had counts no more
    wb.wrote(1, 768 * KiB, 512 * KiB)
    wb.close()
    wb.wrote(1, 2 * MiB, 2 * MiB)
    assert started.spans == [] and not any(t.name == "tiered-kv-writeback" for t in threading.enumerate())
    fds.close()


@pytest.mark.parametrize(("mode", "eager", "expected"), [
    (None, False, "later"), (None, True, "eager"), (" Background ", False, "background"), ("eager", True, "eager")])
def test_the_writeback_option_defaults_to_later_and_takes_the_older_eager_spelling(mode, eager, expected):
    assert writeback_mode(mode, eager) == expected


@pytest.mark.parametrize(("mode", "eager"), [("soon", False), ("background", True), ("later", True)])
def test_a_writeback_option_that_is_no_mode_or_contradicts_eager_is_a_config_error(mode, eager):
    with pytest.raises(ConfigError, match="writeback"):
        writeback_mode(mode, eager)


def test_a_tier_with_background_writeback_hands_its_segments_on_while_it_writes(tmp_path, monkeypatch):
    import storage_backends.segment_writeback as segment_writeback

    started = Started()
    monkeypatch.setattr(segment_writeback, "start_writeback", started)  # what a tier's thread calls
    monkeypatch.setattr(segment_writeback, "WRITEBACK_CHUNK_BYTES", MiB)
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, segment_bytes="4MiB", writeback="background")
    values = {i.to_bytes(16, "big"): os.urandom(300 * KiB) for i in range(12)}
    assert b.put_many(list(values.items())) == [True] * 12
    b.close()  # joins the thread: every stretch handed on has been started
    assert len(started.spans) >= 2 and all(length >= MiB for _, length in started.spans)
    again = LmdbBackend(tmp_path / "db", capacity=64 * MiB)
    assert again.get_many(list(values)) == list(values.values()) and again.check() == []
    again.close()


def test_the_rests_of_segments_left_long_ago_are_not_kept_forever(tmp_path, monkeypatch):
    import storage_backends.segment_writeback as segment_writeback

    monkeypatch.setattr(segment_writeback, "MAX_SPANS", 4)
    fds, started = segment_files(tmp_path), Started()
    wb = BackgroundWriteback(fds, chunk_bytes=MiB, start=started)
    for segment in range(1, 11):  # ten segments, each left with a rest under a stretch
        wb.wrote(segment, 0, 512 * KiB)
    assert sorted(wb._spans) == [7, 8, 9, 10]
    wb.close()
    fds.close()
