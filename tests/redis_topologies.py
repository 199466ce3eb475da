"""Private Redis Cluster and Sentinel deployments for tests (never the shared Redis).

`LocalCluster`: 3 masters + 3 replicas (`redis-server --cluster-enabled yes` on free ports,
joined with `redis-cli --cluster create --cluster-replicas 1`), node timeout 1000 ms so a killed
master's replica takes over within a few seconds. `LocalSentinel`: a master, its replica and one
sentinel (quorum 1). Both wait for conditions by polling, with deadlines.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from tests.processes import free_port


def _start(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            assert proc.poll() is None, f"{argv[0]} on port {port} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{argv[0]} on port {port} did not start"
            time.sleep(0.05)


def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both below the kernel's ephemeral
    range (where free_port() and every outgoing connection take theirs, so none can take one of
    these between this check and the node's bind), from this xdist worker's own share of it."""
    import os
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low, high = 10000, min(ephemeral, 65536) - 10000 - 1  # the bus port is +10000
    if high - low < 1000:  # an ephemeral range starting low: any pair that is free now
        low, high = 1024, 55535
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.isdigit() and workers > 1 and high - low > 100 * workers:
        share = (high - low) // workers
        low += int(worker) * share
        high = low + share - 1
    for _ in range(200):
        port = random.randint(low, high)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise AssertionError("no free port pair for a cluster node")


def require_redis_server() -> None:
    assert shutil.which("redis-server") and shutil.which("redis-cli"), "redis-server / redis-cli are not installed"


class LocalCluster:
    def __init__(self, tmp: Path, masters: int = 3) -> None:
        require_redis_server()
        self.tmp = tmp
        self.ports = [cluster_port() for _ in range(masters * 2)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start(self) -> "LocalCluster":
        for port in self.ports:
            d = self.tmp / str(port)
            d.mkdir(parents=True, exist_ok=True)
            self.procs[port] = _start(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--logfile", str(d / "log"),
                 "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "1000",
                 "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--dir", str(d)], port)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_healthy()
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0, decode_responses=True)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def nodes(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as seen by a live node: port, role, slots ranges, flags."""
        raw = self.client(self.alive()[0]).execute_command("CLUSTER", "NODES")
        text = raw if isinstance(raw, str) else "\n".join(f"{k} {v}" for k, v in raw.items())
        out = []
        for line in text.strip().splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            out.append({"port": int(parts[1].split("@")[0].rsplit(":", 1)[1]), "flags": flags,
                        "master": "master" in flags, "failed": "fail" in flags or "fail?" in flags, "slots": parts[8:]})
        return out

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every live node reports cluster_state:ok and agrees every slot has a live master."""
        last = ["no answer"]  # what the last round found wanting, for the failure message

        def ok() -> bool:
            for port in self.alive():
                info = self.client(port).execute_command("CLUSTER", "INFO")
                text = info if isinstance(info, str) else str(info)
                if "cluster_state:ok" not in text:
                    last[0] = f"{port}: not cluster_state:ok"
                    return False
            nodes = self.nodes()
            masters = [n for n in nodes if n["master"] and not n["failed"] and n["slots"]]
            if len(masters) != len(self.ports) // 2 or not all(n["port"] in self.alive() for n in masters):
                last[0] = f"masters with slots {[n['port'] for n in masters]} of nodes {nodes}"
                return False
            for port in self.alive():  # every live replica has its first sync done
                info = self.client(port).info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    last[0] = f"{port}: replica link {info.get('master_link_status')}"
                    return False
            return True
        try:
            _until(ok, "a healthy cluster", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last[0]}") from None

    def master_of(self, key: str) -> int:
        slot = int(self.client(self.alive()[0]).execute_command("CLUSTER", "KEYSLOT", key))
        for node in self.nodes():
            if not node["master"] or node["failed"]:
                continue
            for r in node["slots"]:
                if r.startswith("["):
                    continue
                lo, _, hi = r.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return int(node["port"])
        raise AssertionError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one node, by its process id."""
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def wait_failover(self, dead: int, key: str, timeout: float = 30.0) -> int:
        """Until a replica of the dead master serves `key`'s slot and the cluster is healthy again;
        returns the new master's port."""
        self.wait_healthy(timeout)
        port = self.master_of(key)
        assert port != dead and port in self.alive()
        return port

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


class LocalSentinel:
    """A master, its replica, one sentinel watching them as `service`."""

    service = "tollgate"

    def __init__(self, tmp: Path) -> None:
        require_redis_server()
        self.tmp = tmp
        self.master_port, self.replica_port, self.sentinel_port = free_port(), free_port(), free_port()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}/0"

    def start(self) -> "LocalSentinel":
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.tmp)]
        self.procs[self.master_port] = _start(["redis-server", "--port", str(self.master_port), *common], self.master_port)
        self.procs[self.replica_port] = _start(
            ["redis-server", "--port", str(self.replica_port), "--replicaof", "127.0.0.1", str(self.master_port), *common],
            self.replica_port)
        conf = self.tmp / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.tmp}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 500\n"
            f"sentinel failover-timeout {self.service} 3000\n"
        )
        self.procs[self.sentinel_port] = _start(["redis-server", str(conf), "--sentinel"], self.sentinel_port)
        _until(lambda: self._replica_synced(self.replica_port), "the replica's first sync")
        _until(lambda: self._sentinel_knows_replica(), "the sentinel to see the replica")
        return self

    def _replica_synced(self, port: int) -> bool:
        info = redis.Redis(port=port, socket_timeout=1.0).info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def _sentinel_knows_replica(self) -> bool:
        s = redis.Redis(port=self.sentinel_port, socket_timeout=1.0, decode_responses=True)
        return bool(s.execute_command("SENTINEL", "REPLICAS", self.service))

    def master(self) -> int:
        s = redis.Redis(port=self.sentinel_port, socket_timeout=1.0, decode_responses=True)
        return int(s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def wait_promoted(self, dead: int, timeout: float = 30.0) -> int:
        """Until the sentinel names another master and that one answers as a master."""
        def promoted() -> int | None:
            port = self.master()
            if port == dead:
                return None
            role = redis.Redis(port=port, socket_timeout=1.0).info("replication").get("role")
            return port if role == "master" else None
        return int(_until(promoted, "the sentinel to promote the replica", timeout))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
