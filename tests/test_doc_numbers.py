"""The documents' numbers against their payloads (`benchmarks/doc_numbers.py`), and that a wrong
number fails naming its file and number."""
from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks import doc_numbers

REPO = Path(__file__).resolve().parents[1]


def test_every_quoted_number_agrees_with_its_payload():
    assert doc_numbers.check() == []
    assert len(doc_numbers.QUOTES) >= 10
    assert {"docs/measurements.md", "docs/results.md"} <= {q.doc for q in doc_numbers.QUOTES}


def test_the_cli_passes_on_this_checkout(capsys):
    assert doc_numbers.main([]) == 0
    assert "agree with their payloads" in capsys.readouterr().out


PAYLOAD = {"rows": [{"run": "live", "qsa": 0.58}, {"run": "replay", "qsa": 0.59}]}  # serve_load.json's shape


def _quote(text: str) -> doc_numbers.Quote:
    return doc_numbers.Quote("README.md", text, "docs/bench/serve_load.json",
                             ("rows", {"run": "replay"}, "qsa"), ".0f", 100)


def test_a_wrong_number_fails_naming_the_file_and_the_number():
    payload = PAYLOAD
    quote = _quote("against {}% for the same trace")
    assert doc_numbers.check_quote(quote, "live against 59% for the same\ntrace", payload) == []
    problems = doc_numbers.check_quote(quote, "live against 61% for the same trace", payload)
    assert len(problems) == 1
    assert problems[0].startswith("README.md: quotes 61 ")
    assert "docs/bench/serve_load.json" in problems[0] and "gives 59" in problems[0]


def test_every_occurrence_must_agree_and_a_vanished_quote_fails():
    payload = PAYLOAD
    quote = _quote("against {}% for")
    assert len(doc_numbers.check_quote(quote, "against 59% for x; against 60% for y", payload)) == 1
    missing = doc_numbers.check_quote(quote, "the sentence was reworded", payload)
    assert len(missing) == 1 and "not found" in missing[0]


def test_an_unreadable_key_fails_naming_the_step():
    payload = doc_numbers.load_payload(REPO / "docs/bench/serve_load.json")
    quote = doc_numbers.Quote("README.md", "x {} y", "docs/bench/serve_load.json", ("rows", {"run": "nope"}, "qsa"),
                              ".0f")
    [problem] = doc_numbers.check_quote(quote, "x 1 y", payload)
    assert "[run=nope]: no such row" in problem


def test_a_wrong_number_in_a_checkout_makes_the_cli_fail(tmp_path, capsys):
    for quote in doc_numbers.QUOTES:
        for rel in (quote.doc, quote.payload):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / rel, tmp_path / rel)
    doc = tmp_path / "docs/measurements.md"
    text = doc.read_text(encoding="utf-8")
    assert "vLLM 5.35 s" in text
    doc.write_text(text.replace("vLLM 5.35 s", "vLLM 5.53 s"), encoding="utf-8")
    assert doc_numbers.main(["--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/measurements.md: quotes 5.53" in err and "gives 5.35" in err


def test_every_payload_has_a_row_in_the_payloads_index():
    index = (REPO / "docs/bench/README.md").read_text()
    payloads = [p.name + ("/` (folder)" if p.is_dir() else "`") for p in (REPO / "docs/bench").iterdir()
                if p.name != "README.md"]
    assert len(payloads) >= 30
    assert [name for name in sorted(payloads) if f"| `{name} |" not in index] == []
