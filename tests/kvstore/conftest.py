"""Fixtures for store tests: a tiny model, its chunks, and a real redis-server on a free port."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from cachesmith.model import Decoder


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return Decoder(tiny_llama_dir[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback (installed by .ci/run), stopped after the session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: .ci/run installs the Debian package redis-server")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
