"""The GPU kit's choice of transformers, tokenizers and huggingface-hub (issue 77): the machine's
where installed within pyproject.toml's range (and what that transformers asks of the other two),
else the kit's, all three together; `install` says which it used and installs only from the kit."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_kit

REPO = Path(__file__).resolve().parents[2]

RANGES = {"transformers": ">=5.0,<6", "tokenizers": ">=0.21"}
ASKS = ["huggingface-hub<3.0,>=2.4.0", "tokenizers<0.24.0,>=0.23.1", "numpy>=1.17",
        "accelerate>=1.1; extra == 'torch'"]  # a transformers 5's Requires-Dist lines
IN_RANGE = {"transformers": "5.25.0", "tokenizers": "0.23.3", "huggingface-hub": "2.4.0"}
PINS = {"transformers": "5.25.0", "tokenizers": "0.23.3", "huggingface-hub": "2.4.0", "regex": "2026.11.19",
        "fastapi": "0.120.0"}


def sources(choice: dict) -> dict[str, str]:
    return {name: source for name, (source, _) in choice.items()}


def test_a_machine_without_transformers_takes_all_three_from_the_kit():
    choice = gpu_kit.stack_choice({"tokenizers": "0.23.3"}, RANGES, [])
    assert sources(choice) == dict.fromkeys(gpu_kit.STACK, "kit")
    assert choice["transformers"][1] == "the machine has none"


def test_a_machine_transformers_outside_the_range_is_replaced_with_the_kits_set():
    machine = {"transformers": "4.57.6", "tokenizers": "0.23.3", "huggingface-hub": "2.4.0"}
    choice = gpu_kit.stack_choice(machine, RANGES, ASKS)
    assert sources(choice) == dict.fromkeys(gpu_kit.STACK, "kit")  # even the in-range two: one set
    assert "4.57.6 is outside" in choice["transformers"][1]


def test_a_machine_stack_within_range_is_used():
    assert sources(gpu_kit.stack_choice(IN_RANGE, RANGES, ASKS)) == dict.fromkeys(gpu_kit.STACK, "machine")
    assert sources(gpu_kit.stack_choice({**IN_RANGE, "transformers": "5.3.0.dev0"}, RANGES, ASKS))["transformers"] \
        == "machine"  # a dev build of an allowed version


def test_a_package_the_machines_transformers_rejects_comes_from_the_kit():
    machine = {**IN_RANGE, "tokenizers": "0.21.0", "huggingface-hub": "1.3.0"}  # tokenizers in pyproject's range
    choice = gpu_kit.stack_choice(machine, RANGES, ASKS)
    assert sources(choice) == {"transformers": "machine", "tokenizers": "kit", "huggingface-hub": "kit"}
    assert "0.21.0 is outside" in choice["tokenizers"][1]
    assert sources(gpu_kit.stack_choice({"transformers": "5.25.0"}, RANGES, ASKS))["tokenizers"] == "kit"


def test_the_ranges_are_pyprojects_and_the_lock_is_within_them():
    ranges = gpu_kit.project_ranges(REPO / "pyproject.toml")
    assert set(ranges) == {"transformers", "tokenizers"}  # huggingface-hub: what transformers asks
    pins = gpu_kit.lock_pins(REPO / "requirements.lock")
    assert all(gpu_kit.outside(pins[name], spec) is None for name, spec in ranges.items())
    assert gpu_kit.outside("4.57.6", ranges["transformers"]) is not None


def test_pips_packaging_serves_where_the_machine_has_none(monkeypatch):
    for name in ("packaging.requirements", "packaging.specifiers", "packaging.version"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    requirement, specifiers, version = gpu_kit.packaging_classes()
    assert requirement.__module__.startswith("pip._vendor.packaging")
    assert gpu_kit.outside("4.57.6", ">=5.0,<6") is not None and gpu_kit.outside("5.1.0", ">=5.0,<6") is None


def test_what_only_the_stack_requires_comes_with_the_kits_transformers_alone():
    kit, machine = ("kit", "x"), ("machine", "")
    assert gpu_kit.wanted_here(PINS, ["regex"], dict.fromkeys(gpu_kit.STACK, kit)) == PINS
    assert gpu_kit.wanted_here(PINS, ["regex"], dict.fromkeys(gpu_kit.STACK, machine)) == {"fastapi": "0.120.0"}
    mixed = {"transformers": machine, "tokenizers": kit, "huggingface-hub": machine}
    assert gpu_kit.wanted_here(PINS, ["regex"], mixed) == {"fastapi": "0.120.0", "tokenizers": "0.23.3"}


@pytest.fixture
def kit(tmp_path) -> Path:
    """A kit for this Python: kit.json and wheel files by name (install reads no wheel's content here)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tmp_path / "wheels").mkdir()
    for name, version in PINS.items():
        (tmp_path / "wheels" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_text("")
    (tmp_path / "kit.json").write_text(json.dumps({"pythons": {python: PINS}, "stack_only": {python: ["regex"]},
                                                   "modules": ["fastapi", "transformers"]}))
    return tmp_path


def run_install(monkeypatch, kit: Path, site: Path, machine: dict[str, str], requires: list[str]) -> list[str]:
    """`install` against a machine holding `machine`: what it gave pip (nothing is installed)."""
    asked: list[str] = []

    def pip_install(kit_dir, site_dir, todo):
        asked.extend(todo)
        return argparse.Namespace(returncode=0, stderr="")
    monkeypatch.setattr(gpu_kit, "installed", lambda: dict(machine))
    monkeypatch.setattr(gpu_kit, "requirements_of", lambda name: requires)
    monkeypatch.setattr(gpu_kit, "pip_install", pip_install)
    monkeypatch.setattr(gpu_kit, "import_failures", lambda modules, site_dir: [])
    args = argparse.Namespace(kit=kit, site=site, need_tokenizer=False)
    assert gpu_kit.install(args) == 0
    return asked


def test_install_takes_the_kits_stack_on_a_machine_with_an_old_transformers(monkeypatch, kit, tmp_path, capsys):
    asked = run_install(monkeypatch, kit, tmp_path / "site", {"transformers": "4.57.6", "tokenizers": "0.22.1"}, [])
    assert asked == [f"{n}=={v}" for n, v in sorted(PINS.items())]
    out = capsys.readouterr().out
    assert "gpu-kit: transformers 5.25.0: from the kit (the machine's 4.57.6 is outside" in out
    assert "gpu-kit: tokenizers 0.23.3: from the kit (with the kit's transformers)" in out


def test_install_keeps_the_machines_stack_within_range(monkeypatch, kit, tmp_path, capsys):
    machine = {"transformers": "5.3.0", "tokenizers": "0.23.1", "huggingface-hub": "2.4.0"}
    asked = run_install(monkeypatch, kit, tmp_path / "site", machine, ASKS)
    assert asked == ["fastapi==0.120.0"]  # neither the stack nor what only it requires
    out = capsys.readouterr().out
    assert "gpu-kit: transformers 5.3.0: the machine's" in out and "gpu-kit: tokenizers 0.23.1: the machine's" in out


def test_install_refuses_a_kit_without_the_stack(monkeypatch, kit, tmp_path, capsys):
    data = json.loads((kit / "kit.json").read_text())
    del data["stack_only"]
    (kit / "kit.json").write_text(json.dumps(data))
    assert gpu_kit.install(argparse.Namespace(kit=kit, site=tmp_path / "site", need_tokenizer=False)) == 1
    assert "carries no transformers" in capsys.readouterr().err
