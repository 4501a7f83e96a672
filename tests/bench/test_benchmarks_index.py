"""docs/benchmarks.md, the index of `benchmarks/`, stays complete: one entry per script, every
payload of `docs/bench/` named there and in docs/bench/README.md's table, and every `python -m
benchmarks.NAME` command it gives names a script and flags that script defines; and the cost
model's machine fit, which needs trace replays, is asked for with `--full` only. No benchmark is
run and no model is loaded."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "docs/benchmarks.md"
PAYLOADS = REPO / "docs/bench"
PAYLOAD_INDEX = PAYLOADS / "README.md"
SHARED_FLAGS = ("--help",)  # argparse's own
SHARED_SOURCES = (REPO / "benchmarks/common/timing.py",)  # `parse_timing_args` adds --threads, --json, --out
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def scripts() -> list[str]:
    return sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")


def index_text() -> str:
    return INDEX.read_text(encoding="utf-8")


def code_spans(text: str) -> list[str]:
    """Every inline code span outside fenced blocks, its line breaks and indents read as one space
    (as Markdown reads them)."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]


def snippets(text: str) -> list[str]:
    """Every inline code span, and every line of the fenced blocks (continued lines joined)."""
    return [line for body in FENCE.findall(text) for line in body.replace("\\\n", " ").splitlines()] + code_spans(text)


def test_every_script_has_one_entry():
    entries = re.findall(r"^- `benchmarks/(\w+)\.py`", index_text(), re.M)
    assert len(scripts()) >= 30
    missing = [f"benchmarks/{name}.py" for name in scripts() if name not in entries]
    assert missing == [], f"docs/benchmarks.md has no entry (a line `- \\`benchmarks/NAME.py\\`: ...`) for {missing}"
    repeated = sorted({name for name in entries if entries.count(name) > 1})
    assert repeated == [], f"docs/benchmarks.md has more than one entry for {repeated}"
    gone = [f"benchmarks/{name}.py" for name in entries if name not in scripts()]
    assert gone == [], f"docs/benchmarks.md has entries for scripts that do not exist: {gone}"


def payloads() -> list[str]:
    """Each file and folder of docs/bench/ (folders as `NAME/`), its README aside."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in PAYLOADS.iterdir()
                  if p.name != "README.md" and not p.name.startswith("."))


def test_every_payload_is_named_in_the_payload_table_and_the_index():
    table, index = PAYLOAD_INDEX.read_text(encoding="utf-8"), index_text()
    assert len(payloads()) >= 30
    not_in_table = [name for name in payloads() if not re.search(rf"^\| `{re.escape(name)}`", table, re.M)]
    assert not_in_table == [], f"docs/bench/README.md's table has no row for {not_in_table}"
    spans = set(code_spans(index))
    not_in_index = [name for name in payloads() if name not in spans and f"docs/bench/{name}" not in spans]
    assert not_in_index == [], (f"docs/benchmarks.md names no `docs/bench/NAME` (or `NAME`) for {not_in_index}: "
                                f"give it in the entry of the script that writes it")


def commands(text: str) -> list[tuple[str, str]]:
    """(module, the rest of the command) of each `python -m benchmarks.NAME ...` in a code span;
    an upper-case NAME is a placeholder."""
    return [(m.group(1), m.group(2)) for span in code_spans(text)
            for m in [re.search(r"python -m benchmarks\.([a-z_][a-z0-9_.]*)(.*)", span)] if m]


def module_path(name: str) -> Path:
    return REPO / "benchmarks" / f"{name.replace('.', '/')}.py"


def test_every_command_names_a_script_and_its_flags():
    found = commands(index_text())
    assert len(found) >= 30
    no_module = sorted({name for name, _ in found if not module_path(name).exists()})
    assert no_module == [], f"docs/benchmarks.md runs `python -m benchmarks.X` for missing modules: {no_module}"
    shared = "".join(path.read_text(encoding="utf-8") for path in SHARED_SOURCES)
    unknown = []
    for name, rest in found:
        source = module_path(name).read_text(encoding="utf-8") + shared
        unknown += [f"{name} {flag}" for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
                    if flag not in SHARED_FLAGS and f'"{flag}"' not in source]
    assert unknown == [], f"docs/benchmarks.md gives flags its scripts do not define: {unknown}"


def test_the_machine_fit_needs_the_replays(monkeypatch, capsys):
    """`--machine` refits on trace replays: the default check refuses it rather than ignore it, and
    every documented command that asks for the fit runs the replays (`--full`)."""
    from benchmarks import cost_model

    monkeypatch.setattr(sys, "argv", ["cost_model", "--machine", "--machine-out", "machine.json"])
    with pytest.raises(SystemExit) as stop:
        cost_model.main()
    assert stop.value.code == 2 and "--machine needs --full" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["cost_model", "--full", "--machine-out", "machine.json"])
    with pytest.raises(SystemExit):
        cost_model.main()
    assert "add --machine" in capsys.readouterr().err
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    asked = [(doc.relative_to(REPO), snippet) for doc in docs for snippet in snippets(doc.read_text(encoding="utf-8"))
             if re.search(r"benchmarks[./]cost_model\b", snippet) and "--machine" in snippet]
    assert len(asked) >= 3
    without = [f"{doc}: {snippet}" for doc, snippet in asked if "--full" not in snippet]
    assert without == [], f"commands that ask for the machine fit without --full: {without}"
