"""The kernels' build (`model.native_build`): keyed by everything the binary depends on, stale builds
removed, and no home or an unwritable cache falling back to torch's kernels with the reason logged."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import time

import pytest
import torch

from cachesmith.model import native, native_build
from cachesmith.model.assets import cachesmith_home
from cachesmith.model.linear import Linear

CC = native_build.compiler()
pytestmark = pytest.mark.skipif(CC is None or native_build.library() is None, reason="no kernels built here")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """`library()` loaded anew under an empty CACHESMITH_HOME, then the real build again."""
    current = native_build.cache_dir() / f"{native_build.PREFIX}{native_build.build_key(CC, native_build.flags())}.so"
    assert current.is_file()
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path))
    native_build.library.cache_clear()
    yield current, tmp_path / "native"
    native_build.library.cache_clear()


def test_the_build_key_covers_flags_compiler_cpu_and_loader(monkeypatch, tmp_path):
    key = native_build.build_key(CC, native_build.FLAGS)
    assert native_build.build_key(CC, native_build.FLAGS) == key  # deterministic
    assert native_build.build_key(CC, native_build.FLAGS + ("-g",)) != key
    assert native_build.build_key(CC, native_build.FLAGS + native_build.SANITIZE_FLAGS) != key
    with monkeypatch.context() as m:
        run = subprocess.run
        m.setattr(native_build.subprocess, "run",
                  lambda args, **kw: subprocess.CompletedProcess(args, 0, run(args, **kw).stdout + "patched\n", ""))
        assert native_build.build_key(CC, native_build.FLAGS) != key  # another compiler version
    with monkeypatch.context() as m:
        m.setattr(native_build.platform, "processor", lambda: "another-cpu")
        assert native_build.build_key(CC, native_build.FLAGS) != key
    loader = tmp_path / "native_build.py"
    loader.write_text(open(native_build.__file__).read() + "\n# changed\n")
    with monkeypatch.context() as m:
        m.setattr(native_build, "__file__", str(loader))
        assert native_build.build_key(CC, native_build.FLAGS) != key


def test_loading_removes_stale_builds_and_keeps_the_current_one(fresh_library, caplog):
    current, out_dir = fresh_library
    out_dir.mkdir(parents=True)
    shutil.copy(current, out_dir / current.name)  # the current build: loaded without compiling
    stale = out_dir / f"{native_build.PREFIX}0123456789abcdef.so"
    stale.write_bytes(b"an old build")
    killed, running = out_dir / f"{native_build.PREFIX}old.so.tmp", out_dir / f"{native_build.PREFIX}new.so.tmp"
    killed.write_bytes(b""), running.write_bytes(b"")
    old = time.time() - 2 * 3600
    os.utime(killed, (old, old))
    other = out_dir / "unrelated.txt"
    other.write_text("kept")
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        assert native_build.library() is not None
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([current.name, running.name, other.name])
    assert "removed a stale native build" in caplog.text


def test_no_home_means_torch_kernels_and_a_logged_reason(fresh_library, monkeypatch, caplog):
    monkeypatch.delenv("CACHESMITH_HOME")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr("pwd.getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))  # a uid without a passwd entry
    with pytest.raises(RuntimeError, match="CACHESMITH_HOME is unset and the home folder is unknown"):
        cachesmith_home()
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        assert native_build.library() is None and not native.supports(torch.float32)
    assert "native kernels off: no cache folder" in caplog.text
    lin = Linear(torch.randn(96, 64))
    assert native.pack(lin.weight) is None and lin(torch.randn(1, 64)).shape == (1, 96)  # torch's kernels serve


def test_a_read_only_cache_falls_back_or_loads_what_it_holds(fresh_library, monkeypatch, caplog):
    """Writes fail as on a read-only file system (EROFS; root ignores a folder's mode bits, so the
    failure is raised where the build first writes): with no build there, torch's kernels serve; with
    the current build there, it loads."""
    current, out_dir = fresh_library

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out_dir))
    monkeypatch.setattr(native_build.tempfile, "mkstemp", read_only)
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert native_build.library() is None
    assert "native kernels off: building them in" in caplog.text and "Read-only file system" in caplog.text
    native_build.library.cache_clear()
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(current, out_dir / current.name)
    monkeypatch.setattr(native_build.Path, "unlink", read_only)  # stale builds cannot be removed either
    (out_dir / f"{native_build.PREFIX}0123456789abcdef.so").write_bytes(b"an old build")
    assert native_build.library() is not None and native.supports(torch.float32)
