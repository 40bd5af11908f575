"""Redis Clusters of bench_cluster's own: ``masters`` masters (and ``replicas`` replicas each) of
``redis-server --cluster-enabled yes`` on free loopback ports, in a temporary directory of their
own, no persistence. Three masters or more are formed by ``redis-cli --cluster create``; fewer
(``redis-cli`` refuses clusters of under three masters) by hand: CLUSTER MEET, ADDSLOTSRANGE,
REPLICATE. Every server is killed by ``stop()``, and dies with this process however it ends
(Linux' parent-death signal), so a killed benchmark leaves no servers behind.

Each node's main thread CPU time (``INFO cpu``, or ``/proc/<pid>/task/<pid>/stat``) is read
around a timed phase:
Redis processes commands on that one thread, so its CPU seconds per GB moved say how fast one
node could go with a core of its own, however busy the machine is."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

log = logging.getLogger(__name__)

SLOTS = 16384
PR_SET_PDEATHSIG = 1
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def missing_tools(server: str = "redis-server") -> str | None:
    """Why a cluster cannot be started here, or None."""
    absent = [t for t in (server, "redis-cli") if shutil.which(t) is None]
    return f"{' and '.join(absent)} not installed" if absent else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held together while picked, so none comes twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main_thread_cpu_s(pid: int) -> float | None:
    """User + system seconds of thread ``pid`` of process ``pid`` (Redis' command thread)."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)


@dataclass
class Node:
    port: int
    bus_port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    node_id: str = ""

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, timeout: float = 30.0) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)


class BenchCluster:
    """Start with :meth:`start`; always :meth:`stop` (idempotent)."""

    def __init__(self, workdir: Path, masters: int, replicas: int = 0, maxmemory: int = 0,
                 io_threads: int = 1, server: str = "redis-server") -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one master and replicas >= 0")
        self.workdir, self.n_masters, self.replicas = workdir, masters, replicas
        self.maxmemory, self.io_threads, self.server = maxmemory, io_threads, server
        count = masters * (1 + replicas)
        ports = free_ports(2 * count)
        self.nodes = [Node(ports[i], ports[count + i], workdir / f"node{i}") for i in range(count)]
        self.masters = self.nodes[:masters]

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.nodes[0].name}/0"

    def start(self) -> BenchCluster:
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_ping(node)
            if self.n_masters >= 3:
                subprocess.run(["redis-cli", "--cluster", "create", *(n.name for n in self.nodes),
                                "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                               check=True, capture_output=True, timeout=120)
            else:
                self._form_by_hand()
            self._wait_healthy()
            for node in self.nodes:
                node.node_id = node.client().execute_command("CLUSTER", "MYID").decode()
            # redis-cli chooses which nodes become masters: ask each node
            self.masters = [n for n in self.nodes if n.client().execute_command("ROLE")[0] == b"master"]
        except BaseException:
            self.stop()
            raise
        log.info("cluster of %d master(s) + %d replica(s) each on ports %s", self.n_masters,
                 self.replicas, [n.port for n in self.nodes])
        return self

    def _spawn(self, node: Node) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.server, "--port", str(node.port), "--cluster-port", str(node.bus_port),
                "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-node-timeout", "5000",
                "--cluster-config-file", str(node.workdir / "nodes.conf"), "--dir", str(node.workdir),
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--maxmemory", str(self.maxmemory), "--maxmemory-policy", "noeviction",
                "--proto-max-bulk-len", str(512 << 20), "--client-query-buffer-limit", str(1 << 30),
                "--logfile", str(node.workdir / "redis.log")]
        if self.io_threads > 1:
            args += ["--io-threads", str(self.io_threads), "--io-threads-do-reads", "yes"]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)

    @staticmethod
    def _wait_ping(node: Node, deadline_s: float = 15.0) -> None:
        stop = time.monotonic() + deadline_s
        while True:
            try:
                if node.client(0.3).ping():
                    return
            except redis.RedisError:
                pass
            if node.proc is None or node.proc.poll() is not None or time.monotonic() > stop:
                raise RuntimeError(f"redis-server did not start on port {node.port}")
            time.sleep(0.05)

    def _form_by_hand(self) -> None:
        """Fewer than three masters: meet, give each master an even share of the slots,
        then make the replicas follow their masters."""
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
        for i, master in enumerate(self.masters):
            lo, hi = SLOTS * i // self.n_masters, SLOTS * (i + 1) // self.n_masters - 1
            master.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        ids = [m.client().execute_command("CLUSTER", "MYID").decode() for m in self.masters]
        for j, node in enumerate(self.nodes[self.n_masters:]):
            stop = time.monotonic() + 30
            while True:  # a node can only follow a master it already knows
                try:
                    node.client().execute_command("CLUSTER", "REPLICATE", ids[j % self.n_masters])
                    break
                except redis.ResponseError:
                    if time.monotonic() > stop:
                        raise
                    time.sleep(0.1)

    def _wait_healthy(self, deadline_s: float = 60.0) -> None:
        stop = time.monotonic() + deadline_s
        while not self._healthy():
            if time.monotonic() > stop:
                raise RuntimeError("the benchmark's redis cluster did not become healthy")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            for node in self.nodes:
                info = node.client(1).execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else info
                if "cluster_state:ok" not in text or f"cluster_known_nodes:{len(self.nodes)}" not in text:
                    return False
                rep = node.client(1).info("replication")
                if rep["role"] == "slave" and rep.get("master_link_status") != "up":
                    return False
            return True
        except redis.RedisError:
            return False

    # -- figures -----------------------------------------------------------------------------
    def master_cpu_s(self) -> list[float | None]:
        """Each master's command-thread CPU seconds so far: Redis' own figure (``INFO cpu``,
        microseconds, Redis 6.2+), else the kernel's (clock ticks) for the thread."""
        out: list[float | None] = []
        for m in self.masters:
            c = m.client()
            try:
                info = c.info("cpu")
            finally:
                c.close()
            if "used_cpu_user_main_thread" in info:
                out.append(float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"]))
            else:
                out.append(main_thread_cpu_s(m.proc.pid) if m.proc else None)
        return out

    def slot_owners(self) -> list[int]:
        """For each slot, the index (in ``masters``) of the master serving it."""
        by_port = {m.port: i for i, m in enumerate(self.masters)}
        owners = [-1] * SLOTS
        for lo, hi, primary, *_ in self.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
            owners[lo:hi + 1] = [by_port[int(primary[1])]] * (hi - lo + 1)
        return owners

    def master_memory(self) -> list[dict]:
        """Each master's ``used_memory`` and key count."""
        out = []
        for m in self.masters:
            c = m.client()
            try:
                out.append({"port": m.port, "used_memory": int(c.info("memory")["used_memory"]),
                            "keys": int(c.dbsize())})
            finally:
                c.close()
        return out

    def flush(self) -> None:
        """Empty every master (replicas follow), synchronously, so freed memory is back."""
        for m in self.masters:
            c = m.client(120)
            try:
                c.flushall(asynchronous=False)
            finally:
                c.close()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)
