"""Which process appends to a segment file, and whether it still runs: a segment's record names
its owner by pid, the pid's start time (pids are reused) and its pid namespace."""

from __future__ import annotations

import os


def process_start(pid: int) -> int | None:
    """``pid``'s start time in clock ticks after boot; None when no such process runs (a
    zombie, killed and not yet reaped, runs no more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: fields follow the last ")"
        fields = stat[stat.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (ValueError, IndexError):
        return None


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 when unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_alive(record) -> bool:
    """Whether the process appending to a segment (its ``SegmentRecord``) may still run: a
    process of another pid namespace (another container on this host) cannot be looked up, so
    it is taken to run."""
    if record.owner_pid <= 0:
        return False
    if record.owner_ns != pid_namespace():
        return True
    return process_start(record.owner_pid) == record.owner_start
