"""Scoring an answer against an instance's gold answers, per task.

In: what an answer is scored against (`Expected`: the task, its gold answers and the task's
metadata; a workload instance carries the same three) and the generated answer text. Out: a
`Score` (passed, value, and the canonical extracted answer the fidelity gate compares). Metrics
follow the paper's sources:
LongBench's answer normalization (lower case, no punctuation, no articles, collapsed spaces) with
exact match and token F1 for QA, the paragraph number for passage retrieval, and RULER-style set F1
over extracted items (passing at F1 > 0.5) for variable tracking and multi-value needles.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

SET_F1_PASS = 0.5
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


class Scored(Protocol):
    """What a scorer reads: which task's metric, its gold answers, and its metadata (the set-F1
    tasks' `item_pattern`)."""
    task: str
    gold: tuple[str, ...]
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class Expected:
    """What one request's answer is scored against: its task and gold answers (none: the task gate
    cannot judge it) and the task's metadata."""
    task: str = "custom"
    gold: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, scored: Scored) -> "Expected":
        """The scored part of anything that carries it (a workload instance)."""
        return cls(scored.task, tuple(scored.gold), dict(scored.metadata))


@dataclass(frozen=True)
class Score:
    passed: bool
    value: float  # the task metric in [0, 1]: EM, set F1, ...
    extracted: str  # canonical answer; two answers agree for the fidelity gate iff these are equal
    f1: float | None = None  # token F1 where the task records it (QA)


def normalize_answer(text: str) -> str:
    """LongBench / SQuAD normalization: lower, drop punctuation, drop articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def set_f1(predicted: Iterable[str], gold: Iterable[str]) -> float:
    pred, ref = set(predicted), set(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = len(pred & ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def short_answer(text: str) -> str:
    """The first line of an answer cut at its first sentence or clause end: "Port Lantern, a town."
    -> "Port Lantern". Small models keep talking after the answer; the gold is a short span."""
    line = text.strip().split("\n", 1)[0]
    return re.split(r"[.,;:!?]\s|[.,;:!?]$", line, maxsplit=1)[0].strip()


def _score_pr(inst: Scored, answer: str) -> Score:
    found = re.search(r"\d+", answer)
    number = found.group(0) if found else ""
    gold = {re.search(r"\d+", g).group(0) for g in inst.gold}
    return Score(number in gold, float(number in gold), number)


def _score_qa(inst: Scored, answer: str) -> Score:
    short = normalize_answer(short_answer(answer))
    em = float(any(short == normalize_answer(g) for g in inst.gold))
    f1 = max((token_f1(short_answer(answer), g) for g in inst.gold), default=0.0)  # no gold: fidelity only
    return Score(bool(em), em, short, f1)


def _set_scorer(pattern: str) -> Callable[[Scored, str], Score]:
    """Set F1 over the items matching `pattern` (or the instance's own `item_pattern`)."""
    def score(inst: Scored, answer: str) -> Score:
        regex = re.compile(inst.metadata.get("item_pattern", pattern))
        items = sorted(set(regex.findall(answer)))
        value = set_f1(items, inst.gold)
        return Score(value > SET_F1_PASS, value, " ".join(items))
    return score


def _score_needle(inst: Scored, answer: str) -> Score:
    found = re.search(r"\d{7}", answer)
    number = found.group(0) if found else normalize_answer(short_answer(answer))
    return Score(number in inst.gold, float(number in inst.gold), number)


def _score_contains(inst: Scored, answer: str) -> Score:
    """User workloads: a gold answer occurs (normalized, on word boundaries) in the answer."""
    text = f" {normalize_answer(answer)} "
    hit = any(f" {normalize_answer(g)} " in text for g in inst.gold if normalize_answer(g))
    return Score(hit, float(hit), normalize_answer(short_answer(answer)))


SCORERS: dict[str, Callable[[Scored, str], Score]] = {
    "pr": _score_pr,
    "msq": _score_qa,
    "vt": _set_scorer(r"\b[A-Z]{5}\b"),
    "mv": _set_scorer(r"\b\d{7}\b"),
    "multi_needle": _score_needle,
}


def score(inst: Scored, answer: str) -> Score:
    return SCORERS.get(inst.task, _score_contains)(inst, answer)
