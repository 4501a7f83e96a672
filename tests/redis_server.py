"""A real redis-server on a free loopback port (the Debian package; `make test` installs it), for the
redis tier's tests and for several servers sharing one store."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    proc: subprocess.Popen
    url: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def start_redis(workdir: Path, port: int | None = None) -> RedisServer:
    """A started redis-server without persistence, answering PING (on `port`: one that came back)."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: .ci/run installs the Debian package redis-server")
    port = port or free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(proc, f"redis://127.0.0.1:{port}/0")
    client = redis.Redis.from_url(server.url)
    for _ in range(100):
        try:
            client.ping()
            return server
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start")
