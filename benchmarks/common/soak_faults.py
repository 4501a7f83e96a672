"""The soak's children and faults: its own redis-server, `cachesmith serve` on a fixed port (so a
restart answers where clients already point), the disk tier made read-only for a while, and the
schedule and timeline of the faults.

In: a work folder, the serve flags, the fault names and their lengths. Out: `RedisChild`,
`SoakServer` (a `ServerProcess` that can be killed with SIGKILL and started again on the same
port, store and flags), `ReadOnlyDisk` (chmod for an ordinary user; as root, where chmod stops
nothing, the immutable attribute via chattr, and where neither works a note saying so), `plan_faults`
(when each fault starts, checked to fit the run without overlapping) and `Timeline` (what happened
when, in seconds since the traffic started, and the window each fault held).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.ports import free_port
from benchmarks.common.server_process import ServerProcess

FAULT_NAMES = ("redis", "readonly", "kill", "primary")  # primary: with --redis-cluster, one primary SIGKILLed
KILL_HOLD_S = 60.0  # what the schedule leaves for a killed server to start again (a start is ~40 s here)
GAP_S = 10.0  # steady traffic between two faults


# -- redis ---------------------------------------------------------------------------------------
class ClusterChild:
    """A local Redis Cluster (3 primaries, a replica each; `benchmarks/common/redis_cluster.py`) on
    ports chosen now, so the server's flags name it before it starts. `kill_primary` SIGKILLs one
    primary (its replica takes its slots); `restart` brings it back, as a replica."""

    def __init__(self, workdir: Path) -> None:
        from benchmarks.common.redis_cluster import free_node_port

        self.dir = workdir / "cluster"
        self.ports = []
        while len(self.ports) < 6:
            port = free_node_port()
            if port not in self.ports:
                self.ports.append(port)
        self.port = self.ports[0]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.cluster = None

    def start(self) -> None:
        from benchmarks.common.redis_cluster import start_cluster

        self.cluster = start_cluster(self.dir, ports=self.ports)

    def kill_primary(self) -> int:
        port = next(p for p in self.cluster.primaries() if p != self.port)  # the URL's node stays: the server names it
        self.cluster.kill(port)
        return port

    def restart(self, port: int) -> None:
        self.cluster.restart(port)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


class RedisChild:
    """redis-server on a loopback port with an append-only file fsynced on every write, so a SIGKILL
    loses nothing redis acknowledged; `kill` and `start` again reuse the port and the folder."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.dir = workdir / "redis"
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = workdir / "redis.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (Debian package redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a", encoding="utf-8") as out:
            self.process = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                 "--appendonly", "yes", "--appendfsync", "always"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_timeout=2)
        deadline = time.monotonic() + timeout_s  # loading a large append-only file takes a while
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError, redis.exceptions.TimeoutError):
                time.sleep(0.2)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s:.0f} s; see {self.log}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# -- the server ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig:
    """What `cachesmith serve` is started with, every start the same."""
    store_root: Path
    redis_url: str
    api_key_file: Path
    disk_max_bytes: str
    max_queue: int = 64
    extra: tuple[str, ...] = ()  # tenant caps and anything given with --server-arg


def serve_flags(cfg: ServeConfig) -> list[str]:
    return ["--tiers", "memory", "disk", "redis", "--redis-url", cfg.redis_url, "--store-root", str(cfg.store_root),
            "--disk-max-bytes", cfg.disk_max_bytes, "--api-key-file", str(cfg.api_key_file),
            "--max-queue", str(cfg.max_queue), *cfg.extra]


class SoakServer(ServerProcess):
    name = "cachesmith serve"
    start_timeout_s = 300.0

    def __init__(self, log: Path, cfg: ServeConfig, port: int | None = None) -> None:
        super().__init__(log)
        if port is not None:
            self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.cfg = cfg

    def command(self) -> list:
        exe = Path(sys.executable).with_name("cachesmith")
        return [exe, "serve", "--port", self.port, *serve_flags(self.cfg)]

    def kill9(self) -> None:
        """SIGKILL to the server's whole process group: no drain, no flush, no atexit."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# -- the disk tier made read-only ----------------------------------------------------------------
class ReadOnlyDisk:
    """Makes the store root read-only and back. `chmod -R a-w` stops an ordinary user; root
    ignores file modes, so as root the immutable attribute (`chattr -R +i`, which root obeys on
    ext4/xfs/btrfs) is used. `method` is None, with `note` saying why, where neither works here."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.is_applied = False
        self.method, self.note = self._choose()

    def _choose(self) -> tuple[str | None, str]:
        if os.geteuid() != 0:
            return "chmod", "chmod -R a-w on the store root (the server runs as an ordinary user)"
        if shutil.which("chattr") is None:
            return None, "running as root, where chmod does not stop writes, and chattr is not installed: not exercised"
        probe = self.root.parent / ".soak-immutable-probe"
        probe.mkdir(parents=True, exist_ok=True)
        try:
            if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
                return None, ("running as root, where chmod does not stop writes, and this filesystem refuses the "
                              "immutable attribute (chattr +i): not exercised")
            is_stopped = _write_fails(probe)
            subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        if not is_stopped:
            return None, "running as root, and chattr +i did not stop a write here: not exercised"
        return "chattr", ("running as root, where chmod -R a-w does not stop writes: the store root and every file "
                          "under it made immutable (chattr -R +i) instead; creating, renaming and unlinking fail "
                          "with EPERM rather than a read-only mount's EROFS")

    def apply(self) -> None:
        if self.method == "chmod":
            subprocess.run(["chmod", "-R", "a-w", str(self.root)], check=True)
        elif self.method == "chattr":
            subprocess.run(["chattr", "-R", "-f", "+i", str(self.root)], check=False)
        self.is_applied = self.method is not None

    def restore(self) -> None:
        if not self.is_applied:
            return
        if self.method == "chmod":
            subprocess.run(["chmod", "-R", "u+w", str(self.root)], check=False)
        else:
            subprocess.run(["chattr", "-R", "-f", "-i", str(self.root)], check=False)
        self.is_applied = False


def _write_fails(folder: Path) -> bool:
    try:
        (folder / "x").write_bytes(b"x")
    except OSError:
        return True
    return False


# -- schedule and timeline -----------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    name: str  # one of FAULT_NAMES
    at_s: float  # since the traffic started
    hold_s: float  # how long the fault is held (kill: what the schedule leaves for the restart)


def plan_faults(duration_s: float, names: tuple[str, ...], redis_down_s: float = 20.0, readonly_s: float = 30.0,
                kill_hold_s: float = KILL_HOLD_S, gap_s: float = GAP_S) -> list[Fault]:
    """Faults spread evenly over the run in the order given, each after `gap_s` of steady traffic and
    none overlapping another, the last ending `gap_s` before the end. Raises ValueError when they do
    not fit in `duration_s`."""
    unknown = [n for n in names if n not in FAULT_NAMES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"faults {names!r}: each of {FAULT_NAMES} at most once")
    holds = {"redis": redis_down_s, "readonly": readonly_s, "kill": kill_hold_s, "primary": redis_down_s}
    busy = sum(holds[n] for n in names)
    spare = duration_s - busy - gap_s * (len(names) + 1)
    if spare < 0:
        raise ValueError(f"faults {', '.join(names)} need {busy + gap_s * (len(names) + 1):.0f} s "
                         f"({busy:.0f} s held, {gap_s:.0f} s of steady traffic around each); the run is {duration_s:.0f} s")
    slack = spare / (len(names) + 1) if names else 0.0
    faults, t = [], 0.0
    for name in names:
        t += gap_s + slack
        faults.append(Fault(name, round(t, 1), holds[name]))
        t += holds[name]
    return faults


@dataclass
class Timeline:
    """Events and fault windows, in seconds since `t0` (time.monotonic())."""
    t0: float = field(default_factory=time.monotonic)
    events: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)  # {"name", "start_s", "end_s"} (end None while open)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, name: str, **detail) -> float:
        t = round(self.now(), 3)
        self.events.append({"t_s": t, "event": name, **detail})
        print(f"[{t:7.1f} s] {name} {detail if detail else ''}", file=sys.stderr, flush=True)
        return t

    def open(self, name: str) -> dict:
        window = {"name": name, "start_s": round(self.now(), 3), "end_s": None}
        self.windows.append(window)
        return window

    def close(self, window: dict) -> None:
        window["end_s"] = round(self.now(), 3)

    def active(self) -> str:
        return ",".join(w["name"] for w in self.windows if w["end_s"] is None) or "-"


def scan_store(root: Path) -> tuple[int, int, set[str]]:
    """(bytes of entry files, bytes of in-progress temporary files, keys of entry files) under the
    disk tier's root; files vanishing mid-scan (evicted) are skipped. Every folder is listed before
    any file is sized: sized folder by folder, an entry evicted after its folder was sized and the
    write that evicted it, listed in a later folder, were both counted, though they never lay on
    disk together. Listed first, every file counted was on disk when the last listing ended."""
    entry_bytes = tmp_bytes = 0
    keys = set()
    try:
        subdirs = [d for d in os.scandir(root) if d.is_dir()]
    except FileNotFoundError:
        return 0, 0, keys
    files = []
    for sub in subdirs:
        try:
            files += list(os.scandir(sub.path))
        except FileNotFoundError:
            continue
    for f in files:  # each on disk from its folder's listing to its stat, so at the listings' end
        try:
            size = f.stat().st_size  # a system call now, not cached by the listing
        except FileNotFoundError:
            continue
        if f.name.endswith(".cskv"):
            entry_bytes += size
            keys.add(f.name[:-5])
        elif f.name.endswith(".tmp"):
            tmp_bytes += size
    return entry_bytes, tmp_bytes, keys


@dataclass
class DiskSamples:
    quota: int
    num: int = 0
    max_entry_bytes: int = 0
    max_with_tmp_bytes: int = 0
    num_over_quota: int = 0
    evicted_seen: set = field(default_factory=set)  # keys seen on disk, then gone
    last: set = field(default_factory=set)
    last_total: int = 0

    def last_bytes(self) -> int:
        return self.last_total

    def add(self, entry_bytes: int, tmp_bytes: int, keys: set) -> None:
        self.num += 1
        self.last_total = entry_bytes + tmp_bytes
        self.max_entry_bytes = max(self.max_entry_bytes, entry_bytes)
        self.max_with_tmp_bytes = max(self.max_with_tmp_bytes, entry_bytes + tmp_bytes)
        self.num_over_quota += entry_bytes + tmp_bytes > self.quota
        self.evicted_seen |= self.last - keys
        self.last = keys
