"""The class of machine this process runs on, for the restore and prefill estimates a tier keeps
(:mod:`tiered_kv.store.records`): what a restore and a prefill cost is a property of the
hardware, and replicas on other hardware sharing a tier (a Redis, a shared file store) must not
steer each other's restore policy with their figures (a GPU's prefill taken for a CPU's made a
restore look slower than recomputing).

The class names what sets those costs and stays the same across restarts of the same hardware
(a container's host name does not): the architecture, the machine's CPUs and their model, the
memory rounded to GiB, and the NVIDIA GPUs the driver lists (read from ``/proc/driver/nvidia``,
so the scheduler half needs no torch). Only what every process of the machine sees alike: the
scheduler's lookup index reads the estimates its workers write, and those run in other
processes, often pinned to other CPUs or given another ``CUDA_VISIBLE_DEVICES`` (a class of
either made the index never find them). Replicas of one class share estimates, as they should.
No torch here.
"""

from __future__ import annotations

import functools
import glob
import os
import platform
from collections import Counter

import xxhash


@functools.cache
def machine_class() -> tuple[str, str]:
    """(a short key, the description it hashes) of this machine's class."""
    parts = [platform.machine() or "?", f"{_cpus()} cpus", _cpu_model(), f"{_memory_gib()} GiB"]
    gpus = Counter(_gpus())
    if gpus:
        parts.append(" + ".join(f"{n} x {model}" for model, n in sorted(gpus.items())))
    description = ", ".join(parts)
    return xxhash.xxh64_hexdigest(description.encode()), description


def _cpus() -> int:
    """The machine's CPUs (not this process's affinity, which its launcher may narrow)."""
    return os.cpu_count() or 0


def _cpu_model() -> str:
    for line in _lines("/proc/cpuinfo"):
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or "cpu ?"


def _memory_gib() -> int:
    for line in _lines("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20))
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))
    except (ValueError, OSError, AttributeError):
        return 0


def _gpus() -> list[str]:
    models = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        for line in _lines(info):
            name, _, value = line.partition(":")
            if name.strip() == "Model":
                models.append(value.strip())
    return models


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 20).splitlines()
    except OSError:
        return []
