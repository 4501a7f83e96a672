"""Which profile a serving run uses: the one `cachesmith profile` measured on this machine, or
else the profile shipped for the packaged model, rescaled to this machine's speed.

The shipped profile's demand distributions and entropy threshold depend on the model only; its
layer costs depend on the machine, so they are multiplied by the measured/predicted ratio of a
few single-request full-prefill TTFTs (`speed_factor`). In: a pipeline (model, dtype, device).
Out: a `Profile` and where it came from.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path

from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.profile import Profile, ProfileError
from cachesmith.profiler.run import default_path

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "data"
log = logging.getLogger(__name__)


def _key(pipe: RagPipeline) -> tuple[str, str, str]:
    return pipe.model.fingerprint, str(pipe.model.dtype).removeprefix("torch."), pipe.model.device.type


def find_profile(pipe: RagPipeline, path: Path | None = None) -> tuple[Profile, str]:
    """(profile, "measured" | "packaged"). An explicit `path` must match the model, dtype, device;
    the default measured one falls back to the packaged one when it is missing or unusable."""
    key = _key(pipe)
    if path is not None:
        return Profile.load(Path(path), *key), "measured"
    return measured_or_packaged(default_path(pipe), key)


def measured_or_packaged(own: Path, key: tuple[str, str, str] | None = None) -> tuple[Profile, str]:
    """The profile `cachesmith profile` wrote at `own`, checked against `key` (model fingerprint,
    dtype, device; None: unchecked), else the packaged one of the same file name. A file that is
    there but unusable (other format version, model, dtype or device, missing fields, corrupt JSON)
    is logged, naming the fault, before the fallback; the caller rescales a packaged profile."""
    problem = f"no measured profile at {own}"
    if own.exists():
        try:
            return Profile.load(own, *(key or ())), "measured"
        except ProfileError as exc:
            problem = str(exc)
            log.warning("%s; falling back to the packaged profile", problem)
    shipped = PACKAGED_DIR / own.name
    if not shipped.exists():
        raise ProfileError(f"{problem}, and none is packaged for {own.stem}: run `cachesmith profile` first")
    return Profile.load(shipped, *(key or ())), "packaged"


def rescaled(profile: Profile, factor: float) -> Profile:
    """Every compute cost times `factor` (a slower or faster machine); link bandwidths unchanged."""
    if not factor > 0:
        raise ValueError(f"speed factor {factor} must be positive")
    return replace(profile, layer_costs={k: v.scaled(factor) for k, v in profile.layer_costs.items()},
                   overhead=profile.overhead.scaled(factor))


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
