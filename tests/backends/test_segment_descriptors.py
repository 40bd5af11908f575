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


def test_regression_a_shortage_ending_while_another_open_was_refused_left_many_idle_kept(tmp_path, monkeypatch):
    # One thread's open was refused while another, finding the last shortage RELAX_S old, put
    # the idle limit back up: the refusal then stamped a new shortage over the raised limit, and
    # later refusals, seeing a shortage already, never lowered it: a process out of descriptors
    # kept up to MAX_IDLE of them idle. A refusal now sets the stamp and the limit together.
    for segment in range(SEGMENTS):
        (tmp_path / f"{segment}.seg").write_bytes(b"x")
    now = [0.0]
    on_tick: list = []  # per reading of the clock, in turn: what "another thread" does then (None: nothing)
    fds = Descriptors(lambda segment: tmp_path / f"{segment}.seg", clock=lambda: tick())

    def tick() -> float:
        step = on_tick.pop(0) if on_tick else None
        if step is not None:
            step()
        return now[0]

    try:
        refuse_next_open(monkeypatch)
        read_every_segment(fds)  # a shortage at time 0
        monkeypatch.undo()
        now[0] = RELAX_S - 1  # still short when the next open begins ...

        def another_thread_relaxes() -> None:  # ... and no longer when its refusal is stamped
            now[0] = RELAX_S + 1
            fds.hold(SEGMENTS - 1)  # relaxes: the limit goes back up
            fds.release(SEGMENTS - 1)

        refuse_next_open(monkeypatch)
        fds.forget(0)
        on_tick.extend([None, another_thread_relaxes])  # the relax check's reading, then the refusal's
        fds.hold(0)
        fds.release(0)
        monkeypatch.undo()
        assert fds.short and fds.max_idle == TIGHT_IDLE
        read_every_segment(fds)
        assert open_on(tmp_path) <= TIGHT_IDLE
    finally:
        fds.close()
