"""A real Redis Cluster on loopback: `redis-server` processes (3 primaries, 3 replicas by default) on
free ports, formed with `redis-cli --cluster create`, for the redis tier's cluster tests and
benchmarks. Each node keeps its cluster state in a folder of its own; `stop` ends every process,
`kill` one (SIGKILL, as a machine's loss). Raises `ClusterError` when it cannot start one."""
from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cachesmith.kvstore.redis_tier import online_replicas


class ClusterError(RuntimeError):
    """A local cluster could not be started (a binary missing, a node that did not come up)."""


NODE_TIMEOUT_MS = 2000  # cluster-node-timeout: a primary unreachable this long is failed over
NUM_PRIMARIES = 3


def free_node_port() -> int:
    """A free port whose cluster bus port (itself + 10000, below 65536) is free too."""
    for _ in range(200):
        port = random.randrange(20_000, 55_000)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise ClusterError("no free pair of ports for a redis cluster node")


@dataclass
class RedisCluster:
    procs: dict[int, subprocess.Popen]  # port -> its redis-server
    workdir: Path
    maxmemory: int | None = None
    num_replicas: int = 1  # per primary
    killed: list[int] = field(default_factory=list)
    commands: dict[int, list[str]] = field(default_factory=dict)  # port -> its redis-server command

    @property
    def url(self) -> str:
        """Any live node: a client finds the others from it."""
        port = next(p for p in self.procs if p not in self.killed)
        return f"redis://127.0.0.1:{port}/0"

    def client(self, port: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def primaries(self) -> list[int]:
        """The ports of the nodes serving slots now."""
        return sorted(p for p in self.live() if self.role(p) == "master")

    def live(self) -> list[int]:
        return [p for p in self.procs if p not in self.killed]

    def role(self, port: int) -> str:
        return self.client(port).info("replication")["role"]

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(timeout=10)
        self.killed.append(port)

    def restart(self, port: int) -> None:
        """A killed node started again on its port and folder: it rejoins, as a replica of the
        primary that took its slots."""
        self.procs[port] = subprocess.Popen(self.commands[port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.killed.remove(port)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports `cluster_state:ok`, sees every other live node in the role
        it has, and every primary has a replica whose link to it is up (a replica that never synced
        would not be promoted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self._is_ok():
                    return
            except Exception:  # a node still starting, or one that just lost its primary
                pass
            time.sleep(0.1)
        raise ClusterError(f"the redis cluster in {self.workdir} did not report ok within {timeout_s:.0f} s")

    def _is_ok(self) -> bool:
        live = self.live()
        info = {p: self.client(p).info("replication") for p in live}
        primaries = [p for p in live if info[p]["role"] == "master"]
        if any(online_replicas(info[p]) < self.num_replicas for p in primaries) or any(
                info[p].get("master_link_status") != "up" for p in live if p not in primaries):
            return False
        for p in live:
            if self.client(p).cluster("info")["cluster_state"] != "ok":
                return False
            seen = {int(k.split("@")[0].rsplit(":", 1)[1]): v["flags"] for k, v in self.client(p).cluster("nodes").items()}
            if any(("master" in seen.get(q, "")) != (q in primaries) for q in live):
                return False
        return True

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_cluster(workdir: Path, maxmemory: int | None = None, num_primaries: int = NUM_PRIMARIES,
                  num_replicas: int = 1, ports: list[int] | None = None) -> RedisCluster:
    """`num_primaries` nodes each with `num_replicas` replicas (on `ports`, else free ones), every slot
    assigned, the cluster ok."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise ClusterError("redis-server or redis-cli is not installed: `make system-deps` installs the Debian package")
    procs, commands = {}, {}
    for port in ports or [free_node_port() for _ in range(num_primaries * (1 + num_replicas))]:
        node_dir = workdir / str(port)
        node_dir.mkdir(parents=True)
        limits = ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"] if maxmemory else []
        commands[port] = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                          # a primary's loss leaves only its slots unserved, not the whole cluster (the tier's advice)
                          "--cluster-require-full-coverage", "no", *limits]
        procs[port] = subprocess.Popen(commands[port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = RedisCluster(procs, workdir, maxmemory, num_replicas, commands=commands)
    try:
        _wait_ping(cluster)
        nodes = [f"127.0.0.1:{p}" for p in procs]
        subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", str(num_replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        cluster.wait_ok()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_ping(cluster: RedisCluster) -> None:
    deadline = time.monotonic() + 10
    for port in cluster.procs:
        while True:
            try:
                cluster.client(port).ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise ClusterError(f"redis-server on port {port} did not start")
                time.sleep(0.05)


@dataclass
class SingleServer:
    proc: subprocess.Popen
    url: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def start_single(workdir: Path, maxmemory: int | None = None, port: int | None = None) -> SingleServer:
    """One redis-server (not in a cluster) without persistence, answering PING: the tests' own, and
    the benchmark's yardstick beside a cluster (on `port`: one that came back after a stop)."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise ClusterError("redis-server is not installed: `make system-deps` installs the Debian package")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_node_port()
    limits = ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"] if maxmemory else []
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), *limits], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = SingleServer(proc, f"redis://127.0.0.1:{port}/0")
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return server
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    server.stop()
    raise ClusterError(f"redis-server on port {port} did not start")
