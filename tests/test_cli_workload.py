"""`cachesmith workload card` writes under $CACHESMITH_HOME unless told where: a run never
overwrites the repository's committed cards (docs/cards)."""
from __future__ import annotations

from pathlib import Path

from cachesmith import cli_workload
from cachesmith.cli import build_parser


def test_a_card_goes_under_cachesmith_home_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHESMITH_HOME", str(tmp_path))
    args = build_parser().parse_args(["workload", "card", "--task", "vt"])
    assert args.out_dir is None and cli_workload.cards_dir() == tmp_path / "cards"
    told = build_parser().parse_args(["workload", "card", "--task", "vt", "--out-dir", "docs/cards"])
    assert told.out_dir == Path("docs/cards")
