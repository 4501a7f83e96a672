"""Imports run down the data flow (docs/layout.md): the model, the KV store, the recompute engine
and the pipeline over them import nothing, at module level, from the layers that use them
(planner, scheduler, profiler, workloads, bench, serving). A lazy import inside a function, where
a lower layer hands work up on request (`RagPipeline.one_planner`), is the documented exception."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cachesmith"
LOWER = ("model", "kvstore", "recompute", "pipeline")
UPPER = ("planner", "scheduler", "profiler", "workloads", "bench", "server", "integrations", "engine",
         "engine_loop", "executor", "plan_one", "cli", "cli_eval", "demo")


def module_level_imports(path: Path) -> list[str]:
    """The cachesmith modules `path` imports outside any function or class body."""
    names = []
    for node in ast.parse(path.read_text()).body:  # top-level statements only
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [n for n in names if n.startswith("cachesmith.")]


def test_lower_layers_do_not_import_upper_ones():
    files = [PACKAGE / "pipeline.py"] + [f for d in LOWER[:-1] for f in (PACKAGE / d).rglob("*.py")]
    assert len(files) > 20
    upward = [f"{f.relative_to(PACKAGE)} imports {name}" for f in files for name in module_level_imports(f)
              if name.split(".")[1] in UPPER]
    assert upward == []
