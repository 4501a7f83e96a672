"""The grid of timed runs a cost profile is fitted on, and what it takes.

In: a token cap per batch, how many batch shapes and plans per shape (and, for sizing, a profile).
Out: `RunSpec`s (batch contexts, plan, seed) that `costs.measure` times, and the seconds they take.
"""
from __future__ import annotations

import random

import numpy as np

from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.profile import Profile
from cachesmith.calibration.costs import ALL, PREFIX_TOKENS, PROFILE_PLANS, SUFFIX_TOKENS, RunSpec, plan_config


def default_grid(max_tokens: int = 16_384, num_shapes: int = 36, plans_per_shape: int = 6, seed: int = 0,
                 min_context: int = 400, max_context: int = 4096) -> list[RunSpec]:
    """Batch shapes of 1-8 requests, each request's context log-uniform in [min_context,
    max_context] (a batch capped at `max_tokens`), and `plans_per_shape` plans each: the presets
    and the planner's plans in turn, so every plan meets small and large batches. Full prefill,
    the dearest, runs on batches up to half of `max_tokens` only."""
    rng = random.Random(f"grid-{seed}")
    sizes = [1, 2, 3, 4, 6, 8]
    specs, turn = [], 0
    for i in range(num_shapes):
        b = sizes[i % len(sizes)]
        ctx = [int(np.exp(rng.uniform(np.log(min_context), np.log(max_context)))) for _ in range(b)]
        budget = max_tokens - b * (PREFIX_TOKENS + SUFFIX_TOKENS[1])
        if sum(ctx) > budget:
            ctx = [max(min_context // 2, c * budget // sum(ctx)) for c in ctx]
        chosen = []
        while len(chosen) < plans_per_shape:
            plan = PROFILE_PLANS[turn % len(PROFILE_PLANS)]
            turn += 1
            if plan[1] >= ALL and sum(ctx) > max_tokens // 2:
                continue
            chosen.append(plan)
        specs += [RunSpec(tuple(ctx), plan, 1000 * i + j) for j, plan in enumerate(chosen)]
    return specs


def estimate_seconds(specs: list[RunSpec], profile: Profile) -> float:
    """What `specs` take on `profile`'s machine (the planner's own estimate), for sizing a grid."""
    model = CostModel(profile)
    total = 0.0
    for s in specs:
        shape = BatchShape(s.contexts, (32,) * len(s.contexts), (PREFIX_TOKENS,) * len(s.contexts))
        plan = plan_config(s.plan, profile.num_layers)
        total += float(model.ttft(shape, plan.signal.value, plan.warmup, plan.probe,
                                  np.full(len(s.contexts), plan.coverage))[0])
    return total


__all__ = ["default_grid", "estimate_seconds"]
