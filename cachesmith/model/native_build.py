"""Builds and loads the native kernels (`csrc/*.c`) for the CPU they run on: `model.native` calls the decode
kernels, `kvstore.codec` the stored KV's dequantizing.

In: the C sources, the system's C compiler (`cc`/`gcc`) and the CPU. Out: `library()`, the loaded
shared library with every symbol's argument types set, or None (with the reason logged once) where
it cannot be had: no compiler, not x86-64, no home to cache in, an unwritable cache, a failed build.
Nothing here raises: torch's kernels then serve every call.

The library lives in `$CACHESMITH_HOME/native/decode_kernels-<key>.so`. The key hashes everything
the binary depends on (the sources and headers, the flags, the compiler's path and version, the CPU's
flags, and this loader's own text, which holds the flags and the symbols' signatures), so any change
builds anew; builds under any other key are removed when a library loads. A build is written under
a temporary name and renamed, so a half-written library is never loaded.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cachesmith.model.assets import cachesmith_home

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(_CSRC / name for name in ("small_rows.c", "one_row_attention.c", "decode_layers.c", "kv_dequant.c"))
HEADERS = (_CSRC / "simd_math.h", _CSRC / "kernel_alloc.h")
# 512-bit vectors where the compiler vectorizes (the exp loop): it may prefer 256 otherwise
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC")
# set by `make sanitize`: the same sources built with AddressSanitizer and UBSan (see the Makefile)
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g")
PREFIX = "decode_kernels-"
_STALE_TMP_S = 3600.0  # a temporary build older than this was left by a killed process

_V, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# symbol -> (argument types, result type); the kernels return 0 or the bytes they failed to allocate
SIGNATURES = {
    "cs_kernels": ((), _INT),
    "cs_set_max_alloc": ((_I64,), None),
    "cs_matmul_f32": ((_V,) * 3 + (_I64,) * 3 + (_INT,), None),
    "cs_matmul_bf16": ((_V,) * 3 + (_I64,) * 3 + (_INT,), None),
    "cs_decode_attention_f32": ((_V,) * 5 + (_I64,) * 5 + (_F32, _INT), _I64),
    "cs_decode_attention_bf16": ((_V,) * 5 + (_I64,) * 5 + (_F32, _INT), _I64),
    "cs_decode_layers_f32": ((_V,) * 5 + (_I64,) * 7 + (_F32, _INT), _I64),
    "cs_decode_layers_bf16": ((_V,) * 5 + (_I64,) * 7 + (_F32, _INT), _I64),
    "cs_kv_dequant": ((_V,) + (_I64,) * 5 + (_INT, _V, _INT), _INT),
}


def cache_dir() -> Path:
    return cachesmith_home() / "native"


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def flags() -> tuple[str, ...]:
    """The compile flags: FLAGS, plus the sanitizers where `CACHESMITH_NATIVE_SANITIZE=1` (read once,
    at build time, by `make sanitize`; a sanitized library needs its runtime preloaded)."""
    return FLAGS + (SANITIZE_FLAGS if os.environ.get("CACHESMITH_NATIVE_SANITIZE") == "1" else ())


def build_key(cc: str, build_flags: tuple[str, ...]) -> str:
    """What the binary depends on: -march=native code is only valid on the CPU it targets."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = platform.processor() + platform.machine()
    try:
        cpu += next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    digest = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), Path(__file__).read_bytes(),
                 "\0".join(build_flags).encode(), cc.encode(), version.encode(), cpu.encode()):
        digest.update(hashlib.sha256(part).digest())  # each part hashed apart: no two splits collide
    return digest.hexdigest()[:16]


def build(out_dir: Path, cc: str, build_flags: tuple[str, ...]) -> Path:
    """Compile the kernels into `out_dir` (atomically), unless that build exists."""
    target = out_dir / f"{PREFIX}{build_key(cc, build_flags)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=PREFIX, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *build_flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def remove_stale(out_dir: Path, keep: Path) -> list[Path]:
    """Remove builds under other keys and temporaries of killed builds; what was removed. A process
    still running an old build keeps its mapping: unlinking a loaded library is safe."""
    now, removed = time.time(), []
    for path in out_dir.glob(f"{PREFIX}*"):
        is_tmp = path.name.endswith(".tmp")
        try:
            if path != keep and (not is_tmp or now - path.stat().st_mtime > _STALE_TMP_S):
                path.unlink()
                removed.append(path)
        except OSError:  # a read-only cache, or another process removed it first
            continue
    return removed


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU, or None (said once in the log) where they cannot be had."""
    cc = compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        log.info("native kernels off: no C compiler or not x86-64; torch's kernels serve")
        return None
    try:
        out_dir = cache_dir()
    except RuntimeError as exc:  # no HOME and no CACHESMITH_HOME: Path.home() cannot tell
        log.warning("native kernels off: no cache folder (%s); torch's kernels serve", exc)
        return None
    try:
        path = build(out_dir, cc, flags())
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native kernels off: building them in %s failed (%s); torch's kernels serve", out_dir, detail)
        return None
    for stale in remove_stale(out_dir, path):
        log.info("removed a stale native build: %s", stale.name)
    for symbol, (argtypes, restype) in SIGNATURES.items():
        if hasattr(lib, symbol):
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = list(argtypes), restype
    return lib
