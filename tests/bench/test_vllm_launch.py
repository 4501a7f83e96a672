"""The vLLM launch lines of the README and docs/vllm.md against the launch `make test-vllm` runs
(`benchmarks/vllm_server.py`): the CPU line sets the same served name, dtype, prefix-cache switch
and connector config; the GPU line names the flags a GPU launch needs; the benchmark's GPU mode
launches vLLM with the user's CUDA build and leaves the connector room."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from benchmarks import vllm_server
from cachesmith.model.assets import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[2]


def launches(path: Path) -> list[list[str]]:
    """Each `vllm serve` command in the file's sh blocks, split as the shell splits it."""
    blocks = re.findall(r"```sh[^\n]*\n(.*?)```", (REPO / path).read_text(), re.S)
    return [shlex.split(b.replace("\\\n", " ")) for b in blocks if "vllm serve" in b]


def flags(argv: list[str]) -> dict:
    """Flag -> value, the last one winning as in vLLM's parser; a switch's value is True / False."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--no-"):
            out[arg[5:]] = False
        elif arg.startswith("--") and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out[arg[2:]] = True
        elif arg.startswith("--"):
            value = argv[i + 1]
            out[arg[2:]] = json.loads(value) if value.startswith("{") else value
            i += 1
        i += 1
    return out


def flags_of_the_tested_launch() -> dict:
    # the flags are the launch's whatever Python runs it: naming one keeps vLLM's install in `make test-vllm`
    server = vllm_server.VllmServer(Path("/m"), DEFAULT_MODEL, extra_args=vllm_server.plugin_args(DEFAULT_MODEL),
                                    vllm_python=Path("/venv/bin/python"))
    return flags([str(c) for c in server.command()])


@pytest.mark.parametrize("path", ["README.md", "docs/vllm.md"])
def test_the_docs_cpu_launch_is_the_tested_one(path):
    argv = launches(Path(path))[0]
    assert argv[:3] == ["PYTHONPATH=/path/to/cachesmith", "vllm", "serve"]
    assert argv[3] == f"$(cachesmith models path {DEFAULT_MODEL})"  # set whether or not $CACHESMITH_HOME is
    documented, ours = flags(argv[4:]), flags_of_the_tested_launch()
    for flag in ("served-model-name", "dtype", "enable-prefix-caching", "kv-transfer-config"):
        assert documented[flag] == ours[flag], flag
    assert documented["served-model-name"] == DEFAULT_MODEL and documented["enable-prefix-caching"] is False


def test_the_docs_gpu_launch_names_what_a_gpu_needs():
    argv = launches(Path("docs/vllm.md"))[1]
    documented = flags(argv[4:])
    assert documented["served-model-name"] == Path(argv[3]).name and documented["dtype"] == "bfloat16"
    assert documented["enable-prefix-caching"] is False
    assert float(documented["gpu-memory-utilization"]) == vllm_server.GPU_MEMORY_UTILIZATION
    assert (documented["tensor-parallel-size"], documented["pipeline-parallel-size"]) == ("1", "1")
    config = documented["kv-transfer-config"]
    assert config == {**vllm_server.CONNECTOR, "kv_connector_extra_config": {"model": argv[3]}}


def test_the_benchmarks_gpu_mode_launches_the_users_cuda_build():
    server = vllm_server.VllmServer(Path("/m"), "random-8b", device="cuda", dtype="bfloat16",
                                    vllm_python=Path("/opt/vllm/bin/python"))
    argv = [str(c) for c in server.command()]
    assert argv[0] == "/opt/vllm/bin/python" and "--enforce-eager" not in argv
    got = flags(argv)
    assert (got["dtype"], float(got["gpu-memory-utilization"])) == ("bfloat16", vllm_server.GPU_MEMORY_UTILIZATION)
    assert "VLLM_CPU_KVCACHE_SPACE" not in server.env()
    with pytest.raises(vllm_server.VllmError, match="name the Python of a vLLM CUDA build"):
        vllm_server.VllmServer(Path("/m"), "random-8b", device="cuda")
