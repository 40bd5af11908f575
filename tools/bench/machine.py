"""What the reports say about the machine and its software: CPU model, memory, kernel, library
versions, the filesystem the bench writes to and torch's threads, read from ``/proc`` and the
installed packages. ``tiers_machine`` is bench_tiers' block; ``e2e_machine`` and ``e2e_env``
(taken in the e2e cold child) are bench_e2e's."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str | None:
    """The first ``model name`` of /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def mem_total_kib() -> int | None:
    """MemTotal of /proc/meminfo, KiB."""
    with contextlib.suppress(OSError, StopIteration):
        return next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal"))
    return None


def tiers_machine(base: str) -> dict:
    import numpy as np
    import torch
    import zstandard

    def version(mod: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(mod)
        except Exception:
            return None

    mem = mem_total_kib()
    if mem is not None:
        mem = round(mem * 1024 / 2**30, 1)
    fs = None
    with contextlib.suppress(OSError):
        best = ""
        for line in open("/proc/mounts"):
            dev, mnt, typ = line.split()[:3]
            if os.path.realpath(base).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, fs = mnt, f"{typ} on {dev} at {mnt}"
    hiredis = None
    with contextlib.suppress(Exception):
        from redis.utils import HIREDIS_AVAILABLE

        hiredis = HIREDIS_AVAILABLE
    redis_server = None
    with contextlib.suppress(Exception):
        redis_server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                      timeout=10).stdout.strip()
    return {
        "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(),
        "mem_gib": mem, "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "other",
        "numpy": np.__version__, "zstandard": zstandard.__version__, "lmdb": version("lmdb"),
        "redis_py": version("redis"), "hiredis": version("hiredis"), "hiredis_in_use": hiredis,
        "redis_server": redis_server, "bench_dir_fs": fs, "cuda": torch.cuda.is_available(),
    }


def e2e_machine() -> dict:
    mem = mem_total_kib() or 0
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "mem_gib": round(mem / 2**20, 1), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def e2e_env() -> dict:
    import torch

    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available()}
    for mod in ("lmdb", "zstandard", "xxhash", "numpy"):
        try:
            module = __import__(mod)
            info[mod] = getattr(module, "__version__", None) or ".".join(map(str, module.version()))
        except Exception:
            info[mod] = None
    return info
