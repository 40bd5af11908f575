"""A real Redis Cluster for tests (no mocks): 3 masters + 3 replicas of ``redis-server
--cluster-enabled yes`` on free loopback ports, formed with ``redis-cli --cluster create``."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.crc import key_slot

log = logging.getLogger(__name__)

SLOTS = 16384
NODE_TIMEOUT_MS = 1000  # how long a master may be silent before its replica takes over


def distinct_free_ports(n: int) -> list[int]:
    """``n`` different free loopback ports (all held at once while they are picked: ports picked
    one at a time can come back twice, and a node then fails to bind its cluster bus)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def missing_tools() -> str | None:
    """Why a cluster cannot be started here, or None."""
    absent = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{' and '.join(absent)} not installed (apt-get install redis-server redis-tools)" if absent else None


@dataclass
class Node:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    bus_port: int = 0  # the cluster bus port (redis' default, port + 10000, may not exist)

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class RedisClusterServers:
    """Starts the nodes, forms the cluster, kills nodes by pid, tears everything down."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1) -> None:
        self.workdir = workdir
        self.replicas = replicas
        count = masters * (1 + replicas)
        ports = distinct_free_ports(2 * count)  # client and cluster-bus ports, none handed out twice
        self.nodes = [Node(ports[i], workdir / f"node{i}", bus_port=ports[count + i]) for i in range(count)]

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.nodes[0].name}/0"

    def url_of(self, node: Node) -> str:
        return f"redis+cluster://{node.name}/0"

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_ping(node)
            subprocess.run(["redis-cli", "--cluster", "create", *(n.name for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        log.info("redis cluster of %d nodes on ports %s", len(self.nodes), [n.port for n in self.nodes])
        return self

    def _spawn(self, node: Node) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        node.proc = subprocess.Popen(
            ["redis-server", "--port", str(node.port), "--cluster-port", str(node.bus_port),
             "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--cluster-config-file", str(node.workdir / "nodes.conf"), "--dir", str(node.workdir),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--repl-diskless-sync-delay", "0",
             "--logfile", str(node.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def _wait_ping(node: Node, deadline_s: float = 10.0) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                if node.client(0.2).ping():
                    return
            except redis.RedisError:
                pass
            if not node.alive or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {node.port}")
            time.sleep(0.05)

    # -- topology ----------------------------------------------------------------------------
    def living(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def masters(self) -> list[Node]:
        """Living nodes that serve slots, as the cluster itself says."""
        return [n for n in self.living() if self.slots_of(n)]

    def replicas_of(self, master: Node) -> list[Node]:
        return [n for n in self.living() if n is not master and self._role(n)[:3] == [b"slave", b"127.0.0.1", master.port]]

    @staticmethod
    def _role(node: Node) -> list:
        return list(node.client().execute_command("ROLE"))

    @staticmethod
    def slots_of(node: Node) -> set[int]:
        """The slots ``node`` serves (empty for a replica)."""
        nodes = node.client().execute_command("CLUSTER", "NODES")
        myself = next(line for line in (nodes.decode() if isinstance(nodes, bytes) else nodes).splitlines()
                      if "myself" in line)
        if "master" not in myself.split()[2]:
            return set()
        slots: set[int] = set()
        for r in myself.split()[8:]:
            if not r.startswith("["):  # "[slot->-node]": a migration in progress
                lo, _, hi = r.partition("-")
                slots.update(range(int(lo), int(hi or lo) + 1))
        return slots

    def node_of_key(self, key: bytes) -> Node:
        """The living master serving ``key``'s slot."""
        slot = key_slot(key)
        return next(n for n in self.masters() if slot in self.slots_of(n))

    def healthy(self) -> bool:
        """Every living node says ``cluster_state:ok``, every living replica has synced with its
        master (a replica that never synced is not promoted), and living masters serve every
        slot (a dead master's slots have moved to its promoted replica)."""
        try:
            for node in self.living():
                info = node.client(0.5).execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in (info.decode() if isinstance(info, bytes) else info):
                    return False
                replication = node.client(0.5).info("replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False
            return sum(len(self.slots_of(m)) for m in self.masters()) == SLOTS
        except redis.RedisError:
            return False

    def wait_healthy(self, deadline_s: float = 30.0) -> float:
        """Seconds until every living node says the cluster is ok."""
        t0 = time.monotonic()
        while not self.healthy():
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError("the redis cluster did not become healthy")
            time.sleep(0.05)
        return time.monotonic() - t0

    # -- resharding: the steps redis-cli --cluster reshard takes, one slot at a time --------------
    def begin_migration(self, slot: int, source: Node, target: Node) -> None:
        """Mark ``slot`` migrating from ``source`` to ``target`` (keys moved there get ASK)."""
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))

    def migrate_keys(self, slot: int, source: Node, target: Node) -> int:
        """MIGRATE every key of ``slot`` from ``source`` to ``target``; how many moved."""
        keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        return len(keys)

    def end_migration(self, slot: int, target: Node) -> None:
        """Assign ``slot`` to ``target`` everywhere (clients with the old map now get MOVED)."""
        for node in self.masters() + [target]:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.node_id(target))

    @staticmethod
    def node_id(node: Node) -> str:
        node_id = node.client().execute_command("CLUSTER", "MYID")
        return node_id.decode() if isinstance(node_id, bytes) else node_id

    def wait_replicated(self, timeout_ms: int = 5000) -> None:
        """Block until every master's replicas acknowledged all its writes: their offsets reach
        the master's (``WAIT`` on a new connection would wait for nothing: it wrote nothing)."""
        stop = time.monotonic() + timeout_ms / 1000
        for master in self.masters():
            while True:
                info = master.client().info("replication")
                offsets = [v["offset"] for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                if len(offsets) >= self.replicas and min(offsets) >= info["master_repl_offset"]:
                    break
                if time.monotonic() > stop:
                    raise AssertionError(f"replicas of {master.port} behind: {offsets} < {info['master_repl_offset']}")
                time.sleep(0.02)

    # -- faults and teardown -----------------------------------------------------------------
    def kill(self, node: Node) -> None:
        """SIGKILL one node by its pid."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)
        log.info("killed redis cluster node %s (pid %d)", node.name, node.proc.pid)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(timeout=10)
