"""A host tier larger than this process can get is a ConfigError naming host.capacity, found
before any page is mapped: Linux overcommits, so the slab was mapped and the OOM killer ended the
engine while its pages were touched, with no message. The room is MemAvailable and the memory
cgroups' (v2 and v1) room; the cgroup scenarios run on real files shaped like /proc and
/sys/fs/cgroup under a tmp dir, and one in a real cgroup where this machine lets us make one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage_backends import host_memory
from storage_backends.host import HostBackend
from storage_backends.host_memory import cgroup_room, check_fits, headroom, host_room, mem_available
from tiered_kv.errors import ConfigError

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[2]
V1_NO_LIMIT = "9223372036854771712"


def write(base: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(text)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A /proc and a /sys/fs/cgroup of files under tmp_path, read by the host tier from now on."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(), cgroups.mkdir()
    monkeypatch.setattr(host_memory, "PROC", str(proc))
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", str(cgroups))
    return proc, cgroups


def v2_container(proc: Path, cgroups: Path, *, limit: str, current: int, inactive_file: int = 0) -> None:
    write(proc, {"meminfo": f"MemTotal: {64 << 20} kB\nMemAvailable: {60 << 20} kB\n", "self/cgroup": "0::/pod/app\n"})
    write(cgroups, {"pod/app/memory.max": f"{limit}\n", "pod/app/memory.current": f"{current}\n",
                    "pod/app/memory.stat": f"anon {current}\nfile 0\ninactive_file {inactive_file}\n"})


def test_regression_a_host_tier_larger_than_its_container_limit_was_killed_by_the_oom_killer(machine, tmp_path):
    # a 64 GiB machine, a container limited to 512 MiB with 100 MiB in use: a 512 MiB host tier
    # was mapped (overcommit) and the engine killed while touching it; now refused before mapping
    from tests.store.helpers import NS
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.store import TieredStore

    proc, cgroups = machine
    v2_container(proc, cgroups, limit=str(512 * MiB), current=100 * MiB)
    with pytest.raises(ConfigError, match=r"^host\.capacity: cannot allocate 512\.0 MiB of host memory: cgroup "
                                          r".*pod/app: memory\.max 512\.0 MiB less 100\.0 MiB in use leaves 412\.0 MiB"):
        HostBackend(capacity=512 * MiB, slot_bytes=MiB, pinned=False)
    config = TieredKVConfig.from_dict({"host": {"capacity": "512MiB"}})
    with pytest.raises(ConfigError, match="host.capacity"):
        TieredStore(config, NS)
    tier = HostBackend(capacity=16 * MiB, slot_bytes=MiB, pinned=False)  # what fits is made
    assert tier.num_slots == 16
    tier.close()


def test_regression_a_host_tier_larger_than_the_machine_was_killed_by_the_oom_killer():
    # 4 x MemTotal: refused from what /proc says, before any mapping. Run in a child whose address
    # space is capped, so a refusal that did not happen fails fast instead of eating the machine.
    if host_room() is None:
        pytest.skip("no /proc/meminfo here: nothing to measure against")
    total_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:"))
    child = textwrap.dedent(f"""
        import resource, sys
        from storage_backends.host import HostBackend
        from tiered_kv.errors import ConfigError
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
        try:
            HostBackend(capacity={4 * total_kib << 10}, slot_bytes=1 << 20, pinned=False)
        except ConfigError as exc:
            print(exc)
        """)
    ran = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = ran.stdout.strip()
    assert said.startswith("host.capacity: cannot allocate"), said
    assert "leaves" in said and ("MemAvailable in /proc/meminfo" in said or "cgroup" in said), said


def _make_cgroup(limit: int) -> tuple[Path, str] | None:
    """A real memory cgroup of ``limit`` bytes (v1, or v2 with the controller on), or None."""
    v1 = Path("/sys/fs/cgroup/memory")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            made = v1 / f"tkv-test-{os.getpid()}"
            made.mkdir()
            (made / "memory.limit_in_bytes").write_text(str(limit))
            return made, "memory.limit_in_bytes"
        v2 = Path("/sys/fs/cgroup")
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            made = v2 / f"tkv-test-{os.getpid()}"
            made.mkdir()
            (made / "memory.max").write_text(str(limit))
            return made, "memory.max"
    except OSError:
        return None
    return None


def test_regression_a_host_tier_larger_than_a_real_cgroup_was_killed_by_the_oom_killer():
    # the scenario itself: a child in a 384 MiB cgroup asks for a 1 GiB tier (the cgroup bounds
    # what it can take: a child that did not refuse is killed, not this machine)
    made = _make_cgroup(384 * MiB)
    if made is None:
        pytest.skip("no memory cgroup can be made here (not root, or no controller)")
    cgroup, limit_file = made
    child = ("from storage_backends.host import HostBackend\nfrom tiered_kv.errors import ConfigError\n"
             "try:\n    HostBackend(capacity=1 << 30, slot_bytes=1 << 20, pinned=False)\n"
             "except ConfigError as exc:\n    print(exc)\n")
    try:
        ran = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    except subprocess.SubprocessError as exc:  # (the child could not be moved into it)
        pytest.skip(f"cannot enter the cgroup made: {exc}")
    finally:
        cgroup.rmdir()
    assert ran.returncode == 0, f"rc {ran.returncode} (-9: the OOM killer) {ran.stderr[-2000:]}"
    assert f"{limit_file} 384.0 MiB" in ran.stdout and "host.capacity: cannot allocate 1.0 GiB" in ran.stdout


def test_a_parent_cgroups_tighter_limit_counts_and_a_leaf_without_one_does_not(tmp_path):
    write(tmp_path, {"pod/memory.max": f"{2 * GiB}\n", "pod/memory.current": f"{GiB}\n",
                     "pod/memory.stat": f"inactive_file {512 * MiB}\n",
                     "pod/app/memory.max": "max\n", "pod/app/memory.current": f"{GiB}\n"})
    room = cgroup_room("0::/pod/app\n", str(tmp_path))
    assert room is not None and room.nbytes == 2 * GiB - (GiB - 512 * MiB)  # reclaimable cache is room
    assert str(tmp_path / "pod") in room.source and "memory.max" in room.source


def test_a_hybrid_system_reads_the_v1_memory_controller_and_v1s_no_limit_is_none(tmp_path):
    cgroup = "12:cpu,cpuacct:/x\n4:memory:/svc/job\n0::/init.scope\n"
    write(tmp_path, {"memory/svc/job/memory.limit_in_bytes": f"{4 * GiB}\n",
                     "memory/svc/job/memory.usage_in_bytes": f"{3 * GiB}\n",
                     "memory/svc/job/memory.stat": f"cache 1\ntotal_inactive_file {GiB}\n",
                     "memory/svc/memory.limit_in_bytes": V1_NO_LIMIT, "memory/svc/memory.usage_in_bytes": "5\n",
                     "init.scope/memory.max": "1\n", "init.scope/memory.current": "1\n"})  # (v2: not memory's)
    room = cgroup_room(cgroup, str(tmp_path))
    assert room is not None and room.nbytes == 2 * GiB and "memory.limit_in_bytes" in room.source
    (tmp_path / "memory/svc/job/memory.limit_in_bytes").write_text(V1_NO_LIMIT)
    assert cgroup_room(cgroup, str(tmp_path)) is None


def test_a_container_without_its_own_cgroup_namespace_reads_the_mounts_root(tmp_path):
    # /proc/self/cgroup names the host's path (/docker/<id>); the mount's root is that cgroup
    write(tmp_path, {"memory/memory.limit_in_bytes": f"{GiB}\n", "memory/memory.usage_in_bytes": f"{GiB + 5}\n"})
    room = cgroup_room("4:memory:/docker/0123abcd\n", str(tmp_path))
    assert room is not None and room.nbytes == 0  # over its limit: no room, not a negative one


def test_where_nothing_can_be_read_nothing_is_refused(machine):
    proc, cgroups = machine
    assert host_room() is None
    write(proc, {"meminfo": "MemTotal: 100 kB\n", "self/cgroup": "0::/\n"})  # (no MemAvailable; no memory.max)
    assert host_room() is None
    tier = HostBackend(capacity=4 * MiB, slot_bytes=MiB, pinned=False)
    assert tier.num_slots == 4
    tier.close()


def test_meminfo_is_read_in_kib_and_the_tighter_room_wins(machine):
    proc, cgroups = machine
    assert mem_available("MemTotal: 8 kB\nMemAvailable:     2048 kB\n").nbytes == 2 * MiB
    assert mem_available("MemAvailable: lots\n") is None
    v2_container(proc, cgroups, limit="max", current=GiB)
    room = host_room()
    assert room is not None and room.nbytes == 60 * GiB and room.source == "MemAvailable in /proc/meminfo"


def test_a_slab_fits_up_to_the_room_less_the_headroom_and_not_a_byte_more(machine):
    proc, cgroups = machine
    v2_container(proc, cgroups, limit=str(8 * GiB), current=GiB)  # (check_fits maps nothing)
    room = 7 * GiB
    assert headroom(room) == 256 * MiB + room // 16
    check_fits(room - headroom(room), pinned=True)
    with pytest.raises(ConfigError, match=r"page-locked host memory: .* at most 6\.3 GiB fits"):
        check_fits(room - headroom(room) + 1, pinned=True)


def test_regression_a_host_capacity_under_one_slot_made_a_tier_that_kept_nothing():
    with pytest.raises(ConfigError, match=r"^host\.capacity: holds no slot of 1\.0 MiB"):
        HostBackend(capacity=MiB - 1, slot_bytes=MiB, pinned=False)
