"""Segment descriptors in a process that runs short of them for a while: few are kept idle
while the shortage lasts, and as many as asked for once it has passed."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from storage_backends import segment_fds
from storage_backends.segment_fds import MAX_IDLE, RELAX_S, TIGHT_IDLE, Descriptors

SEGMENTS = 12


def open_on(directory: Path) -> int:
    """Descriptors of this process open on files in ``directory``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:  # (the one listdir used, closed by now)
            pass
    return count


def read_every_segment(fds: Descriptors) -> None:
    for segment in range(SEGMENTS):
        fds.hold(segment)
        fds.release(segment)


def refuse_next_open(monkeypatch) -> None:
    """The next ``open`` of a segment fails as in a process out of descriptors (EMFILE)."""
    real = os.open
    refused = []

    def open_(path, *args, **kwargs):
        if not refused:
            refused.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(segment_fds.os, "open", open_)


def test_a_shortage_of_descriptors_passes_and_idle_ones_are_kept_again(tmp_path, monkeypatch, caplog):
    for segment in range(SEGMENTS):
        (tmp_path / f"{segment}.seg").write_bytes(b"x")
    now = [0.0]
    fds = Descriptors(lambda segment: tmp_path / f"{segment}.seg", clock=lambda: now[0])
    try:
        caplog.set_level(logging.INFO, logger=segment_fds.__name__)
        refuse_next_open(monkeypatch)
        read_every_segment(fds)  # the first open refused, then retried after closing the idle ones
        monkeypatch.undo()
        assert fds.short and fds.max_idle == TIGHT_IDLE
        assert open_on(tmp_path) <= TIGHT_IDLE

        now[0] += RELAX_S - 1  # still within the shortage
        read_every_segment(fds)
        assert fds.short and open_on(tmp_path) <= TIGHT_IDLE

        now[0] += 2  # RELAX_S without another refusal: the shortage has passed
        read_every_segment(fds)
        assert not fds.short and fds.max_idle == MAX_IDLE
        assert open_on(tmp_path) == SEGMENTS, "every segment's descriptor kept idle again"

        refuse_next_open(monkeypatch)  # short again: few kept again, and said again
        fds.forget(0)
        fds.hold(0)
        fds.release(0)
        monkeypatch.undo()
        assert fds.short and open_on(tmp_path) <= TIGHT_IDLE
        said = [r.levelno for r in caplog.records if "descriptors" in r.getMessage()]
        assert said == [logging.WARNING, logging.INFO, logging.WARNING]
    finally:
        fds.close()
