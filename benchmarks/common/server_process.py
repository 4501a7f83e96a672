"""An HTTP server run as a child process for a benchmark: started in its own session on a free
loopback port, waited for until a health URL answers 200, and stopped with its whole process group
(vLLM forks an engine and workers). `VllmServer` and `LlamaServer` build their commands on it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common.ports import free_port


def stop_on_sigterm() -> None:
    """A SIGTERM unwinds the `with` blocks (so child servers are stopped) instead of orphaning them."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerProcess:
    """Subclasses set `name`, `error` (the exception raised), `start_timeout_s`, `health_path`,
    `port`, `url` and `log`, and give `command()` and `env()`."""
    name = "server"
    error: type[Exception] = RuntimeError
    start_timeout_s = 300.0
    health_path = "/health"

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process: subprocess.Popen | None = None

    def command(self) -> list:
        raise NotImplementedError

    def env(self) -> dict:
        return dict(os.environ)

    def __enter__(self):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen([str(c) for c in self.command()], stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env(), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.error(f"{self.name} exited with {self.process.returncode} while starting; see {self.log}:\n"
                                 + self.log.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(self.url + self.health_path, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise self.error(f"{self.name} did not answer within {self.start_timeout_s:.0f} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
