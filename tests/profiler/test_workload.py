"""`cachesmith profile --workload`: the user's own file read (gold optional), its demand saved beside
the profile and laid over whatever profile serves, for this model and dtype only. The demand
measurement itself is `DemandProfiler`'s (test_demand.py); here it is replaced by known curves."""
from __future__ import annotations

import json
import re
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cachesmith import cli
from cachesmith.errors import InputError
from cachesmith.planner import Profile
from cachesmith.planner.profile import DemandCurve
from cachesmith.profiler import workload as workload_mod
from cachesmith.calibration.packaged import PACKAGED_DIR, find_profile
from cachesmith.calibration.workload_demand import WorkloadDemand, with_workload_demand, workload_path
from cachesmith.profiler.workload import default_gate, read_workload, run_workload_demand
from cachesmith.calibration import packaged
from cachesmith.kvstore import StoreConfig

SHIPPED = PACKAGED_DIR / "smollm2-135m-float32-cpu.json"
CURVES = (DemandCurve("kv_dev", 2, (0.1, 0.3, 0.5)), DemandCurve("qci", 2, (0.05, 0.2, 0.25)))


def _write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _line(i: int, gold: bool = False) -> dict:
    line = {"documents": [f"Passage {i} about a harbour town."], "question": f"Which town, {i}?"}
    return {**line, "gold": ["Port Lantern"]} if gold else line


def _pipe(fingerprint: str | None = None, dtype=torch.float32):
    fingerprint = fingerprint or json.loads(SHIPPED.read_text())["model_fingerprint"]
    model = SimpleNamespace(fingerprint=fingerprint, dtype=dtype, device=torch.device("cpu"),
                            model_dir=Path("smollm2-135m"), num_layers=30,
                            config=SimpleNamespace(num_kv_heads=3, head_dim=64))
    return SimpleNamespace(model=model, store=SimpleNamespace(config=StoreConfig()))


@pytest.fixture
def known_demand(monkeypatch):
    """DemandProfiler.run replaced: the curves above, and the gate and requests it was given."""
    seen = {}

    def run(self, instances, show_progress=True, fixed_families=()):
        seen.update(gate=self.gate, num=len(instances), cache=self.cache_path, families=fixed_families,
                    max_coverage=self.max_coverage)
        return CURVES, 0.42, [0.5] * len(instances)

    monkeypatch.setattr(workload_mod.DemandProfiler, "__post_init__", lambda self: None)
    monkeypatch.setattr(workload_mod.DemandProfiler, "run", run)
    monkeypatch.setattr(workload_mod, "instance_subject", lambda pipe, inst: inst)  # nothing to tokenize with
    return seen


def test_a_file_without_gold_is_read_and_gets_the_fidelity_gate(tmp_path):
    path = _write(tmp_path / "w.jsonl", [_line(i) for i in range(5)])
    instances, digest = read_workload(path, num_requests=3)
    assert len(instances) == 3 and instances[0].gold == () and len(digest) == 16
    assert default_gate(instances) == "fidelity"
    gold = _write(tmp_path / "g.jsonl", [_line(i, gold=True) for i in range(2)])
    assert default_gate(read_workload(gold)[0]) == "task"


def test_a_bad_line_stops_the_profile_naming_it(tmp_path):
    path = _write(tmp_path / "w.jsonl", [_line(0), "{not json", {"question": "no documents"}])
    with pytest.raises(InputError, match=r"2 line\(s\) of .*w.jsonl cannot be profiled; first: .*line 2: not"):
        read_workload(path)
    with pytest.raises(InputError, match="num_requests=0"):
        read_workload(_write(tmp_path / "ok.jsonl", [_line(0)]), num_requests=0)


def test_demand_is_saved_beside_the_profile_and_reloads(tmp_path, known_demand):
    path = _write(tmp_path / "w.jsonl", [_line(i) for i in range(4)])
    out = workload_path(tmp_path / "profiles" / "smollm2-135m-float32-cpu.json")
    pipe = _pipe()
    demand = run_workload_demand(pipe, path, out, show_progress=False)
    assert known_demand["gate"] == "fidelity" and known_demand["num"] == 4
    assert known_demand["cache"] == tmp_path / "profiles" / "smollm2-135m-float32-cpu.workload.verdicts.jsonl"
    assert out.name == "smollm2-135m-float32-cpu.workload.json" and WorkloadDemand.load(out) == demand
    assert demand.demand == CURVES and demand.entropy_threshold == 0.42 and demand.workload.startswith("w.jsonl sha256:")
    with pytest.raises(InputError, match="no gold answer, which the task gate needs"):
        run_workload_demand(pipe, path, out, gate="task", show_progress=False)


def test_serving_lays_the_workload_demand_over_the_profile(tmp_path, monkeypatch, known_demand, caplog):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))
    own = tmp_path / "home" / "profiles" / SHIPPED.name
    pipe = _pipe()
    assert find_profile(pipe)[0].demand == Profile.load(SHIPPED).demand  # nothing profiled yet
    run_workload_demand(pipe, _write(tmp_path / "w.jsonl", [_line(0)]), workload_path(own), show_progress=False)
    profile, source = find_profile(pipe)
    shipped = Profile.load(SHIPPED).demand
    ablation = tuple(c for c in shipped if c.signal not in ("kv_dev", "qci") and c.task is None)
    assert {c.signal for c in ablation} >= {"fused", "qci_last"}
    assert source == "packaged" and profile.demand == CURVES + ablation and profile.entropy_threshold == 0.42
    assert known_demand["families"] == ("qci_last",) and known_demand["max_coverage"] == 0.5
    assert profile.layer_costs == Profile.load(SHIPPED).layer_costs  # costs stay the machine's
    with caplog.at_level(logging.WARNING):
        other = find_profile(_pipe(fingerprint="3" * 32))[0]
    assert other.demand == Profile.load(SHIPPED).demand  # measured for another model: left aside
    assert re.search(r"workload demand \S+ was measured for model \w+ \(float32\), not 3{32}", caplog.text)
    workload_path(own).write_text("{")
    with caplog.at_level(logging.WARNING):
        assert with_workload_demand(Profile.load(SHIPPED), own, pipe.model.fingerprint, "float32") == \
            Profile.load(SHIPPED)
    assert "unreadable" in caplog.text


def test_a_store_that_encodes_reads_the_workload_demand_beside_its_codecs_profile(tmp_path, monkeypatch,
                                                                                  known_demand):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))
    shelf = tmp_path / "data"  # the exact profile packaged, none for the codec
    shelf.mkdir()
    (shelf / SHIPPED.name).write_text(SHIPPED.read_text())
    monkeypatch.setattr(packaged, "PACKAGED_DIR", shelf)
    own = tmp_path / "home" / "profiles" / SHIPPED.name
    coded = own.with_name(own.stem + "-int8.json")
    pipe = _pipe()
    pipe.store.config = StoreConfig(codec="int8")
    run_workload_demand(pipe, _write(tmp_path / "w.jsonl", [_line(0)]), workload_path(own), show_progress=False)
    assert find_profile(pipe)[0].entropy_threshold == 0.42  # no int8 profile: the exact one's, and its workload
    coded.parent.mkdir(parents=True, exist_ok=True)
    coded.write_text(SHIPPED.read_text())
    assert find_profile(pipe)[0] == Profile.load(SHIPPED)  # the int8 profile, no workload beside it
    workload_path(own).rename(workload_path(coded))
    assert find_profile(pipe)[0].entropy_threshold == 0.42  # its own workload's demand


def test_profile_cli_measures_a_workload_file(tmp_path, monkeypatch, known_demand, capsys):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path / "home"))
    import cachesmith.pipeline as pipeline_mod

    monkeypatch.setattr(pipeline_mod, "RagPipeline", lambda *a, **k: _pipe())
    path = _write(tmp_path / "w.jsonl", [_line(i) for i in range(6)])
    assert cli.main(["profile", "--workload", str(path), "--num-requests", "5"]) == 0
    out = capsys.readouterr().out
    assert "5 requests, fidelity gate" in out and "s per request" in out and "kv_dev" in out
    assert (tmp_path / "home" / "profiles" / "smollm2-135m-float32-cpu.workload.json").exists()
    assert cli.main(["profile", "--workload", str(path), "--gate", "task"]) == 2
    assert "no gold answer" in capsys.readouterr().err
