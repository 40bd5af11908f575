"""How much memory this process can still get, asked before the host tier's slab is made.

Linux overcommits: mapping a slab larger than the machine (or than the process's cgroup) can
succeed, and the process is then killed by the OOM killer while the slab's pages are touched,
with no message. So the slab is measured first against the tighter of:

* ``MemAvailable`` in ``/proc/meminfo`` (what the kernel thinks can be had without swapping);
* the room left in the process's memory cgroup, and in every ancestor with a limit: the limit
  (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; "max", or v1's huge "no limit", is none)
  less what is charged (``memory.current`` / ``memory.usage_in_bytes``) except the file cache
  on the LRU lists, active and inactive (``active_file`` + ``inactive_file``, v1 ``total_``
  ones, in ``memory.stat``), which the kernel reclaims before it kills anything (a disk tier's
  reads fill the cache; not counting it as free would refuse a tier that fits). Not the inactive
  part alone: on kernels with the multi-gen LRU nearly all of a cgroup's cache reads active (a
  container whose earlier run had read files was refused a tier that fit), and
  MemAvailable counts both too. Shared memory (tmpfs) is on the anonymous lists: not counted.

The rule: the slab must fit in that room less a headroom kept for the engine itself (its heaps,
CUDA's host side, other tiers' buffers): 256 MiB plus 1/16 of the room. Anything that cannot be
read (not Linux, no cgroup memory controller, a file missing or odd) refuses nothing: this is a
guard against an impossible configuration, not an accounting. It is an estimate at the moment the
tier is made: processes that start at once each see the same room.

The readers take the text or the directories as parameters, so that tests feed them real files
shaped like ``/proc`` and ``/sys/fs/cgroup`` under a tmp dir.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.units import format_size

log = logging.getLogger(__name__)

PROC = "/proc"  # where meminfo and self/cgroup are read (looked up at each call)
CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup hierarchies are mounted
HEADROOM_FIXED = 256 << 20  # kept for the engine whatever the room
HEADROOM_SHARE = 16  # ...plus 1/16 of the room
NO_LIMIT = 1 << 60  # a cgroup v1 "no limit" reads 9223372036854771712 (page counter max)


@dataclass(frozen=True)
class Room:
    nbytes: int  # what can still be had
    source: str  # where it was found, for the error


def headroom(room: int) -> int:
    """What is kept back from ``room`` for the engine itself."""
    return HEADROOM_FIXED + room // HEADROOM_SHARE


def mem_available(meminfo: str) -> Room | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text (kernels before 3.14 have none: None)."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            scale = {"kB": 1 << 10, "": 1}.get(unit.strip())
            if scale is None or not number.isdigit():
                return None
            return Room(int(number) * scale, "MemAvailable in /proc/meminfo")
    return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def cgroup_room(cgroup: str, root: str) -> Room | None:
    """The least room left under a memory limit in the cgroup named by ``cgroup`` (the text of
    ``/proc/self/cgroup``) and its ancestors, hierarchies mounted at ``root``; None without one.
    A v1 memory controller wins over the v2 hierarchy (a hybrid system keeps memory in v1)."""
    v1 = v2 = None
    for line in cgroup.splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            v1 = path
        elif ident == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                     ("total_active_file", "total_inactive_file"))
    elif v2 is not None:
        base, files = root, ("memory.max", "memory.current", ("active_file", "inactive_file"))
    else:
        return None
    parts = [p for p in (v1 if v1 is not None else v2).split("/") if p]
    if not os.path.isdir(os.path.join(base, *parts)):  # a container without a cgroup namespace of
        parts = []  # its own: the mount's root is its cgroup, /proc/self/cgroup names the host's path
    rooms = [_level_room(os.path.join(base, *parts[:depth]), *files) for depth in range(len(parts), -1, -1)]
    return min((r for r in rooms if r is not None), key=lambda r: r.nbytes, default=None)


def _level_room(directory: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> Room | None:
    limit_text, usage_text = _read(os.path.join(directory, limit_file)), _read(os.path.join(directory, usage_file))
    if limit_text is None or usage_text is None or not limit_text.strip().isdigit() or not usage_text.strip().isdigit():
        return None  # ("max": no limit here)
    limit = int(limit_text)
    if limit >= NO_LIMIT:
        return None
    stat = _read(os.path.join(directory, "memory.stat"))
    reclaimable = sum(_stat_value(stat, key) for key in cache_keys)  # (the file cache: see above)
    used = max(0, int(usage_text) - reclaimable)
    return Room(max(0, limit - used), f"cgroup {directory}: {limit_file} {format_size(limit)} less "
                                      f"{format_size(used)} in use")


def host_room(proc: str | None = None, cgroup_root: str | None = None) -> Room | None:
    """The tighter of MemAvailable and the cgroups' room for this process; None when neither
    could be read."""
    proc, cgroup_root = proc or PROC, cgroup_root or CGROUP_ROOT
    rooms = []
    if (meminfo := _read(os.path.join(proc, "meminfo"))) is not None:
        rooms.append(mem_available(meminfo))
    if (cgroup := _read(os.path.join(proc, "self", "cgroup"))) is not None:
        rooms.append(cgroup_room(cgroup, cgroup_root))
    found = [r for r in rooms if r is not None]
    return min(found, key=lambda r: r.nbytes) if found else None


def check_fits(nbytes: int, pinned: bool) -> None:
    """ConfigError (naming host.capacity) when a slab of ``nbytes`` would not fit in this
    process's room less the headroom: the alternative is the OOM killer while it is touched."""
    room = host_room()
    if room is None:
        return
    allowed = max(0, room.nbytes - headroom(room.nbytes))
    if nbytes <= allowed:
        log.debug("host tier: %s fits (%s)", format_size(nbytes), room.source)
        return
    kind = "page-locked " if pinned else ""
    raise ConfigError(f"host.capacity: cannot allocate {format_size(nbytes)} of {kind}host memory: {room.source} "
                      f"leaves {format_size(room.nbytes)}, less {format_size(headroom(room.nbytes))} kept for "
                      f"the engine (256 MiB + 1/16 of it): at most {format_size(allowed)} fits")
