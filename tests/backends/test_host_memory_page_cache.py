"""A memory cgroup's page cache is room for the host tier, active or inactive: the kernel
reclaims both before the OOM killer runs. Counting only ``inactive_file`` refused tiers that fit:
on kernels with the multi-gen LRU nearly all of a cgroup's cache reads ``active_file`` (a
container whose earlier run read its model's files, or a disk tier's, was refused). Files shaped
like /sys/fs/cgroup under a tmp dir, and a real cgroup where this machine lets us make one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from storage_backends.host_memory import cgroup_room
from tests.backends.test_host_memory_room import ROOT, _make_cgroup, write

MiB, GiB = 1 << 20, 1 << 30


def test_regression_a_cgroup_whose_page_cache_read_active_refused_a_host_tier_that_fit(tmp_path):
    # v2: 8 GiB limit, 7 GiB charged, of which 5 GiB active and 1 GiB inactive file cache
    write(tmp_path, {"pod/app/memory.max": f"{8 * GiB}\n", "pod/app/memory.current": f"{7 * GiB}\n",
                     "pod/app/memory.stat": f"anon {GiB}\nfile {6 * GiB}\nactive_file {5 * GiB}\n"
                                            f"inactive_file {GiB}\n"})
    room = cgroup_room("0::/pod/app\n", str(tmp_path))
    assert room is not None and room.nbytes == 7 * GiB, room


def test_a_v1_cgroups_active_cache_is_room_too(tmp_path):
    write(tmp_path, {"memory/job/memory.limit_in_bytes": f"{4 * GiB}\n",
                     "memory/job/memory.usage_in_bytes": f"{4 * GiB}\n",
                     "memory/job/memory.stat": f"active_file {GiB}\ntotal_active_file {2 * GiB}\n"
                                               f"total_inactive_file {GiB}\n"})  # (hierarchical: total_)
    room = cgroup_room("4:memory:/job\n", str(tmp_path))
    assert room is not None and room.nbytes == 3 * GiB, room


def test_regression_a_real_cgroup_full_of_page_cache_refused_a_host_tier_that_fit(tmp_path):
    # a 1.5 GiB cgroup whose earlier process read a 900 MiB file (cache charged to it, kept after
    # it exited): a 512 MiB tier fits (the kernel drops the cache) and is made, every page touched
    made = _make_cgroup(1536 * MiB)
    if made is None:
        pytest.skip("no memory cgroup can be made here (not root, or no controller)")
    cgroup, _ = made

    def enter() -> None:  # (in the child, before it runs)
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    data = tmp_path / "weights.bin"
    reader = textwrap.dedent(f"""
        import os
        with open({str(data)!r}, "wb") as f:
            for _ in range(900):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        for _ in range(2):  # read twice: active on any LRU
            with open({str(data)!r}, "rb") as f:
                while f.read(1 << 24):
                    pass
        """)
    tier = ("from storage_backends.host import HostBackend\nfrom tiered_kv.errors import ConfigError\n"
            "try:\n    t = HostBackend(capacity=512 << 20, slot_bytes=1 << 20, pinned=False)\n"
            "    print('made', t.num_slots)\n"
            "except ConfigError as exc:\n    print(exc)\n")
    try:
        try:
            wrote = subprocess.run([sys.executable, "-c", reader], cwd=ROOT, capture_output=True, text=True,
                                   timeout=300, preexec_fn=enter)
        except subprocess.SubprocessError as exc:
            pytest.skip(f"cannot enter the cgroup made: {exc}")
        assert wrote.returncode == 0, wrote.stderr[-2000:]
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
        cache = sum(int(stat.get(k, 0)) for k in ("total_active_file", "total_inactive_file")) or \
            sum(int(stat.get(k, 0)) for k in ("active_file", "inactive_file"))
        if cache < 600 * MiB:
            pytest.skip(f"the file's cache is not charged to the cgroup here ({cache} bytes: tmpfs?)")
        ran = subprocess.run([sys.executable, "-c", tier], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, preexec_fn=enter)
    finally:
        data.unlink(missing_ok=True)
        cgroup.rmdir()
    assert ran.returncode == 0, f"rc {ran.returncode} (-9: the OOM killer) {ran.stderr[-2000:]}"
    assert ran.stdout.strip() == "made 512", ran.stdout
