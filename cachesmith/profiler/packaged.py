"""Which profile a serving run uses: the one `cachesmith profile` measured on this machine, or
else the profile shipped for the packaged model, rescaled to this machine's speed.

The shipped profile's demand distributions and entropy threshold depend on the model only; its
layer costs depend on the machine, so they are multiplied by the measured/predicted ratio of a
few single-request full-prefill TTFTs (`speed_factor`). In: a pipeline (model, dtype, device).
Out: a `Profile` and where it came from.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.profile import PhaseCost, Profile, ProfileError
from cachesmith.profiler.run import default_path

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "data"


def _key(pipe: RagPipeline) -> tuple[str, str, str]:
    return pipe.model.fingerprint, str(pipe.model.dtype).removeprefix("torch."), pipe.model.device.type


def find_profile(pipe: RagPipeline, path: Path | None = None) -> tuple[Profile, str]:
    """(profile, "measured" | "packaged"). An explicit `path` must match the model, dtype, device."""
    fingerprint, dtype, device = _key(pipe)
    if path is not None:
        return Profile.load(Path(path), fingerprint, dtype, device), "measured"
    own = default_path(pipe)
    if own.exists():
        return Profile.load(own, fingerprint, dtype, device), "measured"
    shipped = PACKAGED_DIR / own.name
    if shipped.exists():
        return Profile.load(shipped, fingerprint, dtype, device), "packaged"
    raise ProfileError(f"no profile for {pipe.model.model_dir.name} ({dtype}, {device}) at {own}: "
                       f"run `cachesmith profile` first")


def rescaled(profile: Profile, factor: float) -> Profile:
    """Every compute cost times `factor` (a slower or faster machine); link bandwidths unchanged."""
    if not factor > 0:
        raise ValueError(f"speed factor {factor} must be positive")

    def scale(c: PhaseCost) -> PhaseCost:
        return PhaseCost(c.intercept_s * factor, c.per_row_s * factor, c.per_pair_s * factor, c.per_aux_s * factor)

    return replace(profile, layer_costs={k: scale(v) for k, v in profile.layer_costs.items()},
                   overhead=scale(profile.overhead))


def speed_factor(profile: Profile, shapes: list[BatchShape], measured_s: list[float]) -> float:
    """Median measured/predicted full-prefill TTFT over single-request runs on this machine."""
    model = CostModel(profile)
    ratios = [m / model.full_prefill_ttft(s) for s, m in zip(shapes, measured_s)]
    return float(statistics.median(ratios))


def calibrate(pipe: RagPipeline, profile: Profile, context_tokens: tuple[int, ...] = (512, 1024),
              seed: int = 0) -> float:
    """This machine's speed factor for `profile` from a few single-request full prefills of random
    tokens (layer cost depends on shapes, not words): what a server does at start-up when it has
    only the packaged profile. Takes about two full prefills of the given lengths, plus a warm-up."""
    import random
    import time

    from cachesmith.profiler.synthetic import random_request
    from cachesmith.recompute import full_prefill

    rng, plan = random.Random(seed), full_prefill(pipe.model.num_layers)
    shapes, seconds = [], []
    for i, n in enumerate((context_tokens[0], *context_tokens)):  # the first run warms up
        request, _ = random_request(pipe.model, [], n, rng)
        start = time.perf_counter()
        pipe.runner.run([request], plan)[0].first_token  # reading the argmax synchronizes
        if i > 0:
            seconds.append(time.perf_counter() - start)
            shapes.append(BatchShape((n,), (len(request.suffix_ids),), (0,)))
    return speed_factor(profile, shapes, seconds)
