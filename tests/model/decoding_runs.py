"""A decoding run the simulated-device decode tests share: sequences over prompts of
`PROMPT_LENGTHS`, a fourth joining before step `JOIN_AT`, each run to its budget (no stop ids; the
second leaves halfway)."""
from __future__ import annotations

import torch

from cachesmith.model.generate import Decoding, Generation
from cachesmith.model.sampling import SamplingParams

PROMPT_LENGTHS = (5, 11, 17)
NUM_TOKENS = 12
JOIN_AT = 3  # a fourth sequence joins before this step
BUDGETS = [NUM_TOKENS, NUM_TOKENS // 2, NUM_TOKENS, NUM_TOKENS]  # the second leaves halfway


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_with_join(decoding: Decoding, params: list[SamplingParams] | None = None, on_step=None,
                  budgets: list[int] = BUDGETS) -> tuple[list[Generation], list[list[int]]]:
    """(the generations, their prompts) once every sequence is done; `on_step(step, decoding)`
    replaces `decoding.step()` when given. The caches are the caller's to read and release."""
    model = decoding.model
    params = params or [SamplingParams()] * 4
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS + (9,))]
    gens = []

    def start(j: int) -> None:
        logits, cache = model.prefill(prompts[j])
        gens.append(decoding.start(logits, cache, budgets[j], params=params[j], eos_token_ids=[]))
    for j in range(len(PROMPT_LENGTHS)):
        start(j)
    step = 0
    while decoding.active:
        if step == JOIN_AT:
            start(len(PROMPT_LENGTHS))
        if on_step is None:
            decoding.step()
        else:
            on_step(step, decoding)
        step += 1
    return gens, prompts
