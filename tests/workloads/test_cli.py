"""`cachesmith workload export|trace`: files written, statistics printed, bad input named."""
from __future__ import annotations

import json

from cachesmith.cli import main
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.trace import Trace


def _corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"title": f"T{i}", "description": f"thing number {i}",
                         "text": " ".join(f"Sentence {j} of passage {i} is here." for j in range(12))})
             for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_export_writes_loadable_instances(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["workload", "export", "--task", "mix", "--num-instances", "8", "--out", str(out),
                 "--corpus", str(_corpus_file(tmp_path))]) == 0
    insts = [WorkloadInstance.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert sorted(i.task for i in insts) == sorted(["pr", "msq", "vt", "mv"] * 2)


def test_export_bad_knob_is_named(tmp_path, capsys):
    rc = main(["workload", "export", "--task", "mv", "--knob", "num_values=20", "--out", str(tmp_path / "x"),
               "--corpus", str(_corpus_file(tmp_path))])
    assert rc == 2 and "num_values=20 needs 20 distinct chunks" in capsys.readouterr().err
    rc = main(["workload", "export", "--task", "mv", "--knob", "num_values", "--out", str(tmp_path / "x")])
    assert rc == 2 and "NAME=INTEGER" in capsys.readouterr().err


def test_trace_command(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["workload", "trace", "--pattern", "gamma", "--cv", "3", "--utilization", "0.5",
                 "--service-s", "2", "--num-requests", "40", "--out", str(out)]) == 0
    trace = Trace.load(out)
    assert trace.config.rate_rps == 0.25 and len(trace.requests) == 40
    assert "inter-arrival CV" in capsys.readouterr().out
    assert main(["workload", "trace", "--cv", "3", "--out", str(out)]) == 2
    assert "cv=3.0" in capsys.readouterr().err
