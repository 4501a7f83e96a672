"""A real redis-server on a free loopback port (the Debian package; `make test` installs it), for the
redis tier's tests and for several servers sharing one store: `benchmarks/common/redis_cluster.py`'s
single server, a test failed where it cannot start."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.common.ports import free_port
from benchmarks.common.redis_cluster import ClusterError, SingleServer, start_single

__all__ = ["SingleServer", "free_port", "start_redis"]


def start_redis(workdir: Path, port: int | None = None) -> SingleServer:
    """A started redis-server without persistence, answering PING (on `port`: one that came back)."""
    try:
        return start_single(workdir, port=port)
    except ClusterError as exc:
        pytest.fail(str(exc))
