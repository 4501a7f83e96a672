"""Imports run down the data flow (docs/layout.md), and no module imports itself back through others.

In: the source of every module under `cachesmith/`. Every import counts wherever it is written: at
module level, inside a function (lazy), under `if TYPE_CHECKING:`, relative (`from . import x`),
`from cachesmith import x`, and `importlib.import_module(...)`, `import_module(...)` (however
imported) and `__import__(...)` with a literal name; a dynamic import whose name is not a literal
is refused (the checker could not see its edge). Out: three checks over the module graph those
imports make. Each module belongs to one layer of `LAYERS` (lowest first) and imports only from
its own layer or lower ones; the graph has no cycle (no strongly connected component of two
modules or more); and nothing the serving engine reaches, transitively, is offline code. There is
no allow-list: a lower layer that needs work done above it takes it as an argument (a callable, a
protocol).

An import names a module: `from pkg import name` names `pkg.name` where that is a module, else
`pkg` (a package's `__init__`). Python also runs the `__init__` of each package above the module
it imports first: those count as edges too, except the importer's own enclosing packages, which
are running already (else every import inside a package would be a cycle with its own `__init__`).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cachesmith"

# Lowest first. A name is a top-level module of the package or a subpackage (all of its modules);
# "cachesmith" is the package's own `__init__` (it names the engine and the pipeline lazily).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("jsonl", "registry_fetch", "clock"),  # leaves every layer may read
    ("scoring", "gates"),  # whether an answer is good: the engine's gate and the profiler's verdicts
    ("model",),
    ("recompute",),
    ("kvstore",),  # its transfer plans read the recompute plan
    ("request", "pipeline"),  # one answer under a given plan; it plans nothing
    ("planner",),
    ("scheduler",),
    ("methods",),
    ("executor", "shadow_work"),
    ("engine",),
    # what deadline-aware admission refuses (priced by the scheduler's cost model); a queue place;
    # a live request's token stream
    ("shedding", "queue_places", "token_streams"),
    ("engine_loop",),
    # the profile a server serves with and what it measures itself (costs at a first start, demand on
    # served requests in idle time)
    ("calibration",),
    ("plan_one",),  # a planned answer: the pipeline, a profile, the scheduler's budget
    ("server", "integrations"),  # serving ends here: nothing up to this layer imports the ones above
    ("workloads", "instance"),  # a benchmark's request (texts, gold): nothing that serves reads one
    ("profiler",),  # `cachesmith profile`: demand measured on a task's or a workload file's requests
    ("bench",),
    ("cli_ask", "cli_store", "cli_workload", "cli_eval", "demo"),
    ("cli", "cachesmith"),
    ("testing",),  # the simulated CUDA device: tests and benchmarks use it, nothing that serves does
)


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _dynamic_args(tree: ast.AST) -> Iterator[tuple[int, ast.expr]]:
    """(line, name argument) of each dynamic import call: `importlib.import_module(x)`, and
    `import_module(x)` or `__import__(x)` under any name `from importlib import` bound them to."""
    names = {"import_module", "__import__"} | {
        alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "importlib"
        for alias in node.names if alias.name == "import_module" and alias.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
                    isinstance(func, ast.Name) and func.id in names):
                yield node.lineno, node.args[0]


def _is_literal(arg: ast.expr) -> bool:
    return isinstance(arg, ast.Constant) and isinstance(arg.value, str)


def non_literal_imports(tree: ast.AST) -> list[int]:
    """Lines of dynamic imports whose name is not a literal string."""
    return [line for line, arg in _dynamic_args(tree) if not _is_literal(arg)]


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(the module named, the names taken from it) of every import in `tree`, wherever it is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):  # `from .. import x`: one package up per extra dot
                base = base.rpartition(".")[0]
            source = node.module if not node.level else ".".join(p for p in (base, node.module) if p)
            yield source, tuple(alias.name for alias in node.names)
    yield from ((arg.value, ()) for _, arg in _dynamic_args(tree) if _is_literal(arg))


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The package's module `name` refers to: itself, else its longest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (see the module docstring for what counts)."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, set())
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for source, names in _imported_names(tree, module, path.name == "__init__.py"):
            if source != package and not source.startswith(package + "."):
                continue
            targets = [f"{source}.{n}" if f"{source}.{n}" in modules else source for n in names] or [source]
            resolved = {_resolve(t, modules) for t in targets}
            resolved |= {p for t in resolved if t for p in _parents(t) if p in modules and p not in _parents(module)}
            edges.update(t for t in resolved if t and t != module)  # no self-edge (`from . import name`)
    return graph


def _parents(module: str) -> set[str]:
    """The packages enclosing `module` (their `__init__`s run before it)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def reachable(graph: Mapping[str, set[str]], starts: list[str]) -> dict[str, str]:
    """Every module reachable from `starts` -> the module that first imported it on the way."""
    via, todo = {s: "" for s in starts}, list(starts)
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target not in via:
                via[target] = module
                todo.append(target)
    return via


def chain(via: Mapping[str, str], module: str) -> str:
    """`start -> ... -> module` through `reachable`'s map."""
    hops = [module]
    while via[hops[-1]]:
        hops.append(via[hops[-1]])
    return " -> ".join(reversed(hops))


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two modules or more (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:  # the root of a component: pop it off
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


def unit(module: str) -> str:
    """The name a module has in `LAYERS`: its top-level module or subpackage ("cachesmith": the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {name: i for i, names in enumerate(layers) for name in names}


def upward_imports(graph: Mapping[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module's layer is above the importer's."""
    rank = layer_of(layers)
    return [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if rank[unit(b)] > rank[unit(a)]]


# -- the package ------------------------------------------------------------------------------

GRAPH = import_graph(PACKAGE, "cachesmith")


def test_every_module_has_a_layer_and_every_layer_a_module():
    named = [name for names in LAYERS for name in names]
    assert len(named) == len(set(named)), "a name in two layers"
    units = {unit(m) for m in GRAPH}
    assert len(GRAPH) > 150 and units - set(named) == set(), "modules with no layer"
    assert set(named) - units == set(), "layers naming no module"


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports(GRAPH, LAYERS) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


OFFLINE = ("profiler", "bench", "workloads", "instance")


def offline_reached(graph: Mapping[str, set[str]], starts: list[str]) -> list[str]:
    via = reachable(graph, starts)
    return [chain(via, m) for m in sorted(via) if unit(m) in OFFLINE]


def test_the_server_and_the_serving_engine_reach_no_offline_code():
    """Transitively: the server process, the vLLM connector and the engine they run import no
    profiler run, benchmark or workload (shadow work measures served requests as plain data)."""
    serving = [m for m in GRAPH if unit(m) in ("executor", "engine", "engine_loop", "shadow_work", "calibration",
                                               "plan_one", "server", "integrations")]
    assert len(serving) > 30 and offline_reached(GRAPH, serving) == []


def test_no_dynamic_import_hides_its_name():
    found = [f"{path}:{line}" for path in PACKAGE.rglob("*.py")
             for line in non_literal_imports(ast.parse(path.read_text(encoding="utf-8")))]
    assert found == []


def test_no_served_request_is_a_workload_instance():
    """The server and the vLLM connector hand the engine a plain `Request`; a benchmark's instance
    never reaches them."""
    front = [m for m in GRAPH if unit(m) in ("server", "integrations")]
    found = [f"{m} imports {t}" for m in front for t in GRAPH[m] if unit(t) in ("instance", "workloads")]
    assert len(front) > 10 and found == []


# -- the checker itself -----------------------------------------------------------------------

def test_the_checker_reports_the_old_planning_cycle():
    """The cycle a lazy import once closed: the pipeline planned its own answers."""
    chain = ["cachesmith.pipeline", "cachesmith.plan_one", "cachesmith.profiler.packaged", "cachesmith.profiler.run",
             "cachesmith.profiler.demand", "cachesmith.profiler.verdicts", "cachesmith.workloads.card"]
    graph = {a: {b} for a, b in zip(chain, chain[1:] + chain[:1])}
    assert cycles(graph) == [sorted(chain)]
    # and, with the profiler above serving now, the planned answer that read a profile from it
    assert upward_imports(graph, LAYERS) == [("cachesmith.pipeline", "cachesmith.plan_one"),
                                             ("cachesmith.plan_one", "cachesmith.profiler.packaged")]


def test_the_checker_sees_lazy_type_checking_relative_and_package_imports(tmp_path):
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("from .base import Base\n")
    (root / "low" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import High\n")
    (root / "high.py").write_text("def make():\n    from pkg.low import base\n    return base.Base\n")
    (root / "top.py").write_text(
        "from . import high\nimport importlib\nfrom pkg import low\n"
        "def later():\n    return importlib.import_module('pkg.low.base')\n")
    graph = import_graph(root, "pkg")
    # high imports pkg.low.base, so pkg.low's __init__ runs first: an edge of its own
    assert graph == {"pkg": set(), "pkg.low": {"pkg.low.base"}, "pkg.low.base": {"pkg.high"},
                     "pkg.high": {"pkg.low", "pkg.low.base"}, "pkg.top": {"pkg.high", "pkg.low", "pkg.low.base"}}
    assert cycles(graph) == [["pkg.high", "pkg.low", "pkg.low.base"]]
    layers = (("low",), ("high",), ("top", "pkg"))
    assert upward_imports(graph, layers) == [("pkg.low.base", "pkg.high")]


def test_the_checker_sees_every_spelling_of_a_dynamic_import(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    for name in ("__init__", "a", "b", "c"):
        (root / f"{name}.py").write_text("")
    (root / "top.py").write_text(
        "from importlib import import_module as load\nimport importlib\n"
        "def f(name):\n    load('pkg.a')\n    __import__('pkg.b')\n    importlib.import_module('pkg.c')\n"
        "    return importlib.import_module(name)\n")
    assert import_graph(root, "pkg")["pkg.top"] == {"pkg.a", "pkg.b", "pkg.c"}
    assert non_literal_imports(ast.parse((root / "top.py").read_text())) == [7]


def test_the_checker_follows_a_package_init_and_a_chain_to_offline_code(tmp_path):
    root = tmp_path / "pkg"
    (root / "engine").mkdir(parents=True)
    (root / "profiler").mkdir()
    (root / "__init__.py").write_text("")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "run.py").write_text("from pkg.util import helper\n")
    (root / "util.py").write_text("from pkg.store.keys import key\n")  # runs pkg/store/__init__.py first
    (root / "store").mkdir()
    (root / "store" / "__init__.py").write_text("from pkg.profiler.measure import measure\n")
    (root / "store" / "keys.py").write_text("")
    (root / "profiler" / "__init__.py").write_text("")
    (root / "profiler" / "measure.py").write_text("")
    graph = import_graph(root, "pkg")
    assert graph["pkg.engine.run"] == {"pkg.util"}  # no direct offline edge ...
    assert offline_reached(graph, ["pkg.engine.run"]) == [  # ... but one through store's __init__
        "pkg.engine.run -> pkg.util -> pkg.store -> pkg.profiler",
        "pkg.engine.run -> pkg.util -> pkg.store -> pkg.profiler.measure"]
