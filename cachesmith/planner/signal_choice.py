"""Which signal's plan a batch runs when the demand curves may not describe its requests.

In: each candidate signal's `BatchPlan` for the batch, the budget, and the batch's pass
probabilities under every demand the profile knows (`Evidence`: the served mix's curves and each
task's, or only the hinted task's, each with how many profiling requests measured it). Out: the
plan to run.

Why not simply the most expected passes under the served mix (`pick`): the mix's curves are
measured on profiling requests, and on work the profile has never seen they are a guess. On two
independent held-out workloads the planner's choice of the query-context signal by a few expected
passes lost to always choosing KV deviation. The rule: KV deviation (CacheBlend's signal, the
default of the first plan family) runs unless a challenger's plan expects more passes under every
demand the profile knows, each time by more than `z` standard errors of that demand's estimate.
With the user's own workload profiled, the served mix is that workload, and the test is then only
against its sampling error. The planner hands every demand over at once (`EvidenceTable`: pass
probabilities [G, R]), so a challenge costs a few numpy calls whatever the number of tasks.
Never touches tensors.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_SIGNAL = "kv_dev"


@dataclass(frozen=True)
class Evidence:
    """One demand the profile knows: per plan, each request's pass probability, and how many
    profiling requests that demand was measured on."""
    task: str | None  # None: the served mix
    num_profiled: int
    pass_probabilities: Callable[[object], np.ndarray]  # plan -> [num_requests]


@dataclass(frozen=True)
class EvidenceTable:
    """Every demand the profile knows at once: per plan, each request's pass probability under
    each demand [G, R], and how many profiling requests measured each [G]."""
    num_profiled: np.ndarray  # [G]
    pass_probabilities: Callable[[object], np.ndarray]  # plan -> [G, num_requests]


def pick(plans: list, budget_s: float):
    """The signal's plan to run by the passes rule: a plan that fits the budget beats one that does
    not, whatever passes the latter expects (a below-floor plan runs late, and the runtime monitor
    then cuts its coverage to near full reuse's: the passes it was chosen for never happen). Among
    those that fit, the most expected passes; among those that do not, the fastest. `max` keeps
    the first of equals: ties go to the faster plan, then the planner's signal order."""
    def key(p) -> tuple:
        fits = p.predicted_ttft_s <= budget_s * (1 + 1e-9)
        return fits, round(p.expected_passes, 9) if fits else 0.0, -round(p.predicted_ttft_s, 9)
    return max(plans, key=key)


def margin(default: np.ndarray, challenger: np.ndarray, num_profiled: int) -> float:
    """Standard error of the batch's expected-passes difference: each request's pass probability
    is a fraction of the same `num_profiled` requests, so the per-request errors add up rather
    than average out (conservative: the two signals' estimates are taken as independent)."""
    n = max(num_profiled, 1)
    var = default * (1 - default) + challenger * (1 - challenger)
    return float(np.sqrt(var / n).sum())


def beats(challenger, default, evidence: Sequence[Evidence], z: float) -> bool:
    """Whether `challenger` expects more passes than `default` under every known demand by more
    than `z` standard errors."""
    for ev in evidence:
        p_new, p_old = ev.pass_probabilities(challenger), ev.pass_probabilities(default)
        if not float(p_new.sum() - p_old.sum()) > z * margin(p_old, p_new, ev.num_profiled):
            return False
    return True


def beats_table(challenger, default, evidence: EvidenceTable, z: float) -> bool:
    """`beats` with every demand at once: the same sums, margins and test, row by row."""
    p_new, p_old = evidence.pass_probabilities(challenger), evidence.pass_probabilities(default)  # [G, R]
    var = p_old * (1 - p_old) + p_new * (1 - p_new)
    margins = np.sqrt(var / np.maximum(evidence.num_profiled, 1)[:, None]).sum(1)  # [G]
    return bool((p_new.sum(1) - p_old.sum(1) > z * margins).all())


def robust_pick(plans: list, budget_s: float, evidence: Sequence[Evidence] | EvidenceTable, z: float,
                fallback: Callable[[list, float], object]) -> object:
    """The default signal's plan where it fits, unless a fitting challenger `beats` it (then the
    challenger with the most expected passes). Where the default has no fitting plan, `fallback`
    (the passes rule) decides."""
    fits = [p for p in plans if p.predicted_ttft_s <= budget_s * (1 + 1e-9)]
    default = next((p for p in fits if p.signal == DEFAULT_SIGNAL), None)
    if default is None:
        return fallback(plans, budget_s)
    is_table = isinstance(evidence, EvidenceTable)
    winners = [p for p in fits if p is not default and (beats_table(p, default, evidence, z) if is_table
                                                        else beats(p, default, evidence, z))]
    return max(winners, key=lambda p: round(p.expected_passes, 9)) if winners else default

