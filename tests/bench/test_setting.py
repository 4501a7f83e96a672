"""A bench's workload file: lines without gold serve under the fidelity gate and are refused by
name under the task gate (never scored as silent failures)."""
from __future__ import annotations

import json

from cachesmith.bench.setting import BenchConfig, instances
from cachesmith.instance import WorkloadInstance


def test_lines_without_gold_need_the_fidelity_gate(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"documents": ["A passage."], "question": "Which?"},
             {"documents": ["A passage."], "question": "Which?", "gold": "Port Lantern"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    task = instances(BenchConfig(workload_file=str(path), num_requests=4, gate="task"))
    assert isinstance(task[0], str) and "no gold answer" in task[0] and "--gate fidelity" in task[0]
    assert isinstance(task[1], WorkloadInstance) and task[1].gold == ("Port Lantern",)
    assert task[2] == task[0]  # the file cycles
    fidelity = instances(BenchConfig(workload_file=str(path), num_requests=2, gate="fidelity"))
    assert all(isinstance(i, WorkloadInstance) for i in fidelity) and fidelity[0].gold == ()
