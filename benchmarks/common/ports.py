"""A free loopback port for a server a benchmark starts. Standard library only: the GPU check's serve
leg imports it on a GPU machine's Python, which may lack httpx."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
