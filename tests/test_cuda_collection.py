"""`make test-cuda` runs real cases in each of its folders (issue 77, item 7): collecting with
`-m cuda` as it does, on a machine whose torch is told it sees a GPU (tests/fake_cuda_plugin.py),
finds cases of the `device` fixture's "cuda" param in every folder of CUDA_TESTS, and only those;
without the fake, a machine without a GPU collects none. Collection only (seconds)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cachesmith.model import device as accel

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("tests/kvstore", "tests/model", "tests/recompute", "tests/integrations")


def make_list(name: str) -> list[str]:
    """A variable's words as the Makefile sets them (`NAME ?= a b \\` and more lines)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return re.search(rf"^{name} \?= (.*)$", text, re.M).group(1).split()


def collect(*args: str) -> list[str]:
    """The node ids `make test-cuda`'s pytest selects, collected here (`args`: plugins)."""
    ignore = [f"--ignore={path}" for path in make_list("CUDA_IGNORE")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *args, "-m", "cuda", *make_list("CUDA_TESTS"), *ignore],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: none selected
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_with_a_gpu_every_folder_has_cuda_cases_and_only_those():
    assert set(FOLDERS) <= set(make_list("CUDA_TESTS"))
    ids = collect("-p", "tests.fake_cuda_plugin")
    per_folder = {folder: sum(i.startswith(folder + "/") for i in ids) for folder in make_list("CUDA_TESTS")}
    assert all(per_folder.values()), per_folder
    not_cuda = [i for i in ids if not re.search(r"[\[-]cuda[\]-]", i)]
    assert not not_cuda, not_cuda[:5]  # the GPU's cases alone: not the CPU's, nor the simulated device's


@pytest.mark.skipif(accel.is_cuda_available(), reason="torch sees a GPU here")
def test_without_a_gpu_no_case_is_collected():
    assert collect() == []
