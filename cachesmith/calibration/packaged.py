"""Which profile a serving run uses: the one `cachesmith profile` measured on this machine, or
else the profile shipped for the packaged model, rescaled to this machine's speed.

The shipped profile's demand distributions and entropy threshold depend on the model only; its
layer costs depend on the machine, so they are multiplied by measured/predicted ratios of a few
single-request runs on this machine: full-layer passes by full prefills' (`speed_factor`), every
other cost by two factors fitted to a full-reuse run and one with a few rows recomputed (EPIC's
plan): one for the work a batch does whatever it recomputes (per-batch work, placing cached rows,
selection), one for each recomputed row and its attention. The factors do not move together from
one machine to the next: on a machine with twice the matmul speed but not twice the memory speed,
one factor priced the reuse families 22-28% low (docs/adr/0018-cost-profile.md), and one reuse
factor fitted to EPIC's plan priced full reuse, the plan feasibility is priced at, 13% high.
A model nothing is packaged for gets a profile made at its first start: costs measured on a quick grid,
the packaged model's demand mapped onto its depth (`mapped_demand`), saved as this machine's
measured profile. In: a pipeline (model, dtype, device). Out: a `Profile` and where it came from.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cachesmith.pipeline import RagPipeline
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.profile import PhaseCost, Profile, ProfileError
from cachesmith.calibration.mapped_demand import PACKAGED_DIR, REFERENCE_PROFILE, read_demand_source
from cachesmith.calibration.cost_run import (QUICK_COSTS, ProfileConfig, codec_path, default_path,
                                            kv_bytes_per_token_layer, run_costs_profile)
from cachesmith.calibration.workload_demand import load_workload_demand, with_workload_demand
from cachesmith.recompute.config import epic, full_reuse

FULL_KIND = "full"  # the layer kind a full prefill runs: it alone scales with the full-prefill factor
# the reuse probes: cached rows placed, none or a few recomputed, no full-layer pass
REUSE_PROBE = epic(0.15)
FIXED_PROBE = full_reuse()
SELECT_KIND = "select"  # the selection between passes: per-batch work, not per recomputed row
# the probes' context, as long as a served RAG prompt: fitted at 512 and 1,024 tokens, one check
# priced the recomputing families of 2,000-token prompts 7-17% low (ADR 0051; full prefill's
# factor fits 2,000-token prompts worse at these lengths, 13.5% high against 1.8%)
CALIBRATION_TOKENS = (1024, 2048)
PROBE_REPEATS = 3
log = logging.getLogger(__name__)


def _key(pipe: RagPipeline) -> tuple[str, str, str]:
    return pipe.model.fingerprint, str(pipe.model.dtype).removeprefix("torch."), pipe.model.device.type


def _architecture(profile: Profile) -> tuple[int, int]:
    return profile.num_layers, profile.kv_bytes_per_token_layer


def find_profile(pipe: RagPipeline, path: Path | None = None, workload_demand: Path | None = None,
                 is_workload_demand_used: bool = True,
                 quick_costs: ProfileConfig = QUICK_COSTS) -> tuple[Profile, str]:
    """(profile, "measured" | "packaged"). An explicit `path` must match the model, dtype, device;
    the default measured one falls back to the packaged one when it is missing or unusable (and,
    where nothing is packaged for the model, to costs measured now on the `quick_costs` grid,
    `_default_profile`), and carries the demand `cachesmith profile --workload` measured for the
    served workload, where there is one (`profiler.workload`): the file beside it, or
    `workload_demand` (which must be this model's and readable); `is_workload_demand_used=False`
    keeps the profile's own demand. A pipeline whose store encodes its KV serves the profile
    measured with its codec, and the workload demand beside it, where there is one
    (`_codec_profile`)."""
    key = _key(pipe)
    coded = _codec_profile(pipe, key) if path is None else None  # a store that encodes: its own profile
    if path is not None:
        profile, source = Profile.load(Path(path), *key), "measured"
    elif coded is not None:
        profile, source = coded
    else:
        profile, source = _default_profile(pipe, default_path(pipe), key, quick_costs)
    if workload_demand is not None:
        return load_workload_demand(Path(workload_demand), key[0], key[1]).applied(profile), source
    if path is None and is_workload_demand_used:  # the workload's demand beside the profile that serves
        beside = codec_path(pipe) if coded is not None else default_path(pipe)
        return with_workload_demand(profile, beside, key[0], key[1]), source
    return profile, source


def _codec_profile(pipe: RagPipeline, key: tuple[str, str, str]) -> tuple[Profile, str] | None:
    """(profile, source) for a store that encodes its KV: the one `cachesmith profile --kv-codec`
    measured, else the one packaged for the codec (its demand was measured on decoded KV; its
    costs, as the exact store's packaged profile, are rescaled by the caller); None for the exact
    store, or where neither is there (logged: the exact store's profile serves)."""
    codec = pipe.store.config.codec
    if codec == "none":
        return None
    own = codec_path(pipe)
    if (PACKAGED_DIR / own.name).exists():
        profile, source = measured_or_packaged(own, key, is_identity_checked=False)  # an unusable measured one is logged
        if source == "measured" or profile.model_fingerprint == key[0] or \
                _architecture(profile) == (pipe.model.num_layers, kv_bytes_per_token_layer(pipe)):
            return profile, source
        log.info("the %s profile packaged for %s is another architecture's: the exact store's profile prices "
                 "its plans", codec, own.stem)
        return None
    profile, problem = _load_measured(own, key)
    if profile is None:
        log.info("no profile measured with the %s codec (%s), and none packaged: the exact store's profile "
                 "prices its plans (`cachesmith profile --kv-codec %s` measures demand on decoded KV)",
                 codec, problem, codec)
        return None
    return profile, "measured"


def _default_profile(pipe: RagPipeline, own: Path, key: tuple[str, str, str],
                     quick_costs: ProfileConfig = QUICK_COSTS) -> tuple[Profile, str]:
    """The measured profile, else the packaged one. A packaged profile keyed by another model
    identity never stops a run: with the same architecture it is used (costs depend on shapes; a
    warning says so), otherwise costs are measured now (`QUICK_COSTS`: up to 2 min for the packaged
    model on 2 cores) and saved as this machine's measured profile. Where nothing is packaged for the
    model, dtype and device, `_unprofiled` measures them."""
    if not (PACKAGED_DIR / own.name).exists():
        return _unprofiled(pipe, own, key, quick_costs)
    profile, source = measured_or_packaged(own, key, is_identity_checked=False)
    if source == "measured" or profile.model_fingerprint == key[0]:
        return profile, source
    loaded = (pipe.model.num_layers, kv_bytes_per_token_layer(pipe))
    if _architecture(profile) == loaded:
        log.warning("the packaged profile %s was measured for model %s, the loaded model is %s; its "
                    "architecture is the same (%d layers, %d KV bytes per token and layer), so the packaged "
                    "profile serves", own.name, profile.model_fingerprint, key[0], *loaded)
        return profile, source
    log.warning("the packaged profile %s was measured for another architecture (%d layers, %d KV bytes per "
                "token and layer; the loaded model has %d, %d): measuring this model's costs now, saved to %s",
                own.name, *_architecture(profile), *loaded, own)
    return run_costs_profile(pipe, quick_costs, own, demand_from=PACKAGED_DIR / own.name), "measured"


def _unprofiled(pipe: RagPipeline, own: Path, key: tuple[str, str, str],
                quick_costs: ProfileConfig) -> tuple[Profile, str]:
    """A model nothing is packaged for: its measured profile at `own`, else one made now, once: its
    costs measured on the `quick_costs` grid, its demand the packaged model's mapped onto its depth
    (`mapped_demand`), saved at `own` so the next start reads it. One warning says what is borrowed
    and how to measure the real thing; the next start, reading the saved file, says nothing."""
    profile, problem = _load_measured(own, key)
    if profile is not None:
        return profile, "measured"
    model = pipe.model
    reference = read_demand_source(REFERENCE_PROFILE)
    measured_on = "this model in another dtype or on another device" if reference.model_fingerprint == key[0] \
        else "another model"
    log.warning("%s, and none is packaged for %s: serving with the demand of the packaged %s profile mapped "
                "onto this model's %d layers (demand measured on %s) and costs measured now on a "
                "quick grid, saved to %s; for this model's own profile run `cachesmith profile --model %s "
                "--dtype %s --device %s`", problem, own.stem, reference.model_name, model.num_layers, measured_on,
                own, model.model_dir, key[1], key[2])
    return run_costs_profile(pipe, quick_costs, own, demand_from=REFERENCE_PROFILE,
                             show_progress=False), "measured"


def serving_profile(pipe: RagPipeline, path: Path | None = None,
                    quick_costs: ProfileConfig = QUICK_COSTS) -> tuple[Profile, str]:
    """(profile, where it came from) to serve or plan with, the rule `serve`, `ask` and the Python
    API share: `path` or the measured profile as is, else the packaged one calibrated to this
    machine's speed (a few seconds of full prefills and reuse probes), else, for a model nothing
    is packaged for, one measured now (`_unprofiled`, on the `quick_costs` grid)."""
    profile, source = find_profile(pipe, path, quick_costs=quick_costs)
    if source == "packaged":
        factors = calibrate(pipe, profile)
        log.info("packaged profile calibrated to this machine: %s", factors.label())
        return rescaled(profile, factors.full, factors.reuse, factors.row), f"packaged ({factors.label()})"
    return profile, source if path is None else f"given ({path})"


def _load_measured(own: Path, key: tuple[str, str, str] | None) -> tuple[Profile | None, str]:
    """(the profile `cachesmith profile` wrote at `own`, checked against `key`, or None; what is
    wrong with it where None)."""
    if not own.exists():
        return None, f"no measured profile at {own}"
    try:
        return Profile.load(own, *(key or ())), ""
    except ProfileError as exc:
        return None, str(exc)


def measured_or_packaged(own: Path, key: tuple[str, str, str] | None = None,
                         is_identity_checked: bool = True) -> tuple[Profile, str]:
    """The profile `cachesmith profile` wrote at `own`, checked against `key` (model fingerprint,
    dtype, device; None: unchecked), else the packaged one of the same file name (its model identity
    checked only where `is_identity_checked`). A file that is there but unusable (other format
    version, model, dtype or device, missing fields, corrupt JSON) is logged, naming the fault,
    before the fallback; the caller rescales a packaged profile."""
    profile, problem = _load_measured(own, key)
    if profile is not None:
        return profile, "measured"
    if own.exists():
        log.warning("%s; falling back to the packaged profile", problem)
    shipped = PACKAGED_DIR / own.name
    if not shipped.exists():
        raise ProfileError(f"{problem}, and none is packaged for {own.stem}: run `cachesmith profile` first")
    if key is not None and not is_identity_checked:
        key = (None, *key[1:])
    return Profile.load(shipped, *(key or ())), "packaged"


def rescaled(profile: Profile, factor: float, reuse_factor: float | None = None,
             row_factor: float | None = None) -> Profile:
    """Full-layer passes (kind "full") times `factor`; every other compute cost times
    `reuse_factor` (default: `factor`), except each recomputed row and its attention in the
    partial passes and probes (their per-row and per-pair costs), times `row_factor` (default:
    `reuse_factor`); link bandwidths unchanged."""
    reuse_factor = factor if reuse_factor is None else reuse_factor
    row_factor = reuse_factor if row_factor is None else row_factor
    for name, value in (("speed factor", factor), ("reuse factor", reuse_factor), ("row factor", row_factor)):
        if not value > 0:
            raise ValueError(f"{name} {value} must be positive")
    return _scaled(profile, factor, reuse_factor, row_factor)


def _scaled(profile: Profile, factor: float, fixed: float, row: float) -> Profile:
    def cost(kind: str, c: PhaseCost) -> PhaseCost:
        if kind == FULL_KIND:
            return c.scaled(factor)
        if kind == SELECT_KIND:
            return c.scaled(fixed)
        return PhaseCost(c.intercept_s * fixed, c.per_row_s * row, c.per_pair_s * row, c.per_aux_s * fixed,
                         c.per_request_s * fixed)
    return replace(profile, layer_costs={k: cost(k, v) for k, v in profile.layer_costs.items()},
                   overhead=profile.overhead.scaled(fixed))


@dataclass(frozen=True)
class SpeedFactors:
    """Measured / predicted time on this machine for a profile: `full` for full-layer passes,
    `reuse` for the rest, but `row` for each recomputed row outside them (`rescaled`)."""
    full: float
    reuse: float
    row: float | None = None

    def label(self) -> str:
        row = "" if self.row is None else f", recomputed rows {self.row:.2f}"
        return f"speed factor {self.full:.2f}, reuse {self.reuse:.2f}{row}"


def speed_factor(profile: Profile, shapes: list[BatchShape], measured_s: list[float]) -> float:
    """Median measured/predicted full-prefill TTFT over single-request runs on this machine."""
    model = CostModel(profile)
    ratios = [m / model.full_prefill_ttft(s) for s, m in zip(shapes, measured_s)]
    return float(statistics.median(ratios))


def _probe_ttft(profile: Profile, shape: BatchShape, plan, coverage: float) -> float:
    return float(CostModel(profile).ttft(shape, plan.signal.value, plan.warmup, plan.probe, [coverage])[0])


def reuse_ratio(profile: Profile, shape: BatchShape, coverage: float, measured_s: float) -> float:
    """Measured / predicted TTFT of one EPIC-plan run (`REUSE_PROBE`) at the coverage it ran at."""
    return measured_s / _probe_ttft(profile, shape, REUSE_PROBE, coverage)


def reuse_factors(profile: Profile, probes: list[tuple[BatchShape, object, float, float]]) -> tuple[float, float]:
    """(fixed, row) factors fitted by least squares to reuse probes (shape, plan, coverage, measured
    s): each probe's price splits into the work it does whatever it recomputes and its recomputed
    rows' work. A fit that is not positive in both (noise on a machine too busy to tell them apart)
    falls back to one factor: the median measured/predicted ratio."""
    fixed_only = _scaled(profile, 1.0, 1.0, 0.0)
    rows_a = []
    for shape, plan, coverage, _ in probes:
        fixed_s = _probe_ttft(fixed_only, shape, plan, coverage)
        rows_a.append((fixed_s, _probe_ttft(profile, shape, plan, coverage) - fixed_s))
    a, y = np.array(rows_a), np.array([m for *_, m in probes])  # [num_probes, 2], [num_probes]
    (fixed, row), *_ = np.linalg.lstsq(a, y, rcond=None)
    if fixed > 0 and row > 0:
        return float(fixed), float(row)
    one = float(statistics.median(y / a.sum(1)))
    return one, one


def calibrate(pipe: RagPipeline, profile: Profile, context_tokens: tuple[int, ...] = CALIBRATION_TOKENS,
              seed: int = 0) -> SpeedFactors:
    """This machine's speed factors for `profile` from a few single-request runs of random tokens
    (layer cost depends on shapes, not words), each a full prefill and two reuse probes of the same
    request (full reuse, and EPIC's plan): what a server does at start-up when it has only the
    packaged profile. Each run is staged from a scratch memory store by a transfer engine as
    serving stages a batch: its loader threads share the cores with the passes they overlap, and
    probes of in-memory KV, which leave them out, priced served reuse batches 13-29% low by family
    (benchmarks/cost_model.py). Takes a full prefill of each given length and three runs of each
    probe (a fraction of a prefill each), after a first run of each at the first length: about
    12 s on 2 cores for the packaged model."""
    import random

    from cachesmith.calibration.synthetic import random_prompt
    from cachesmith.kvstore import ChunkStore, StoreConfig, TransferEngine
    from cachesmith.recompute import full_prefill

    rng, full = random.Random(seed), full_prefill(pipe.model.num_layers)
    scratch = ChunkStore(StoreConfig(tiers=("memory",)))
    transfer = TransferEngine(scratch, pipe.model, pipe.transfer.config)
    shapes, seconds, probes = [], [], []
    try:
        # a first run of each at the first length pays the one-off costs (allocations, the kernels'
        # first calls); warmed at a shorter one, the 1,024-token full prefill still ran 10-15% slow
        warm = random_prompt(pipe.model, scratch, context_tokens[0], rng)
        for plan in (full, FIXED_PROBE, REUSE_PROBE):
            _timed(transfer, pipe.runner, warm, plan)
        for n in context_tokens:
            prompt = random_prompt(pipe.model, scratch, n, rng)
            shape = BatchShape((n,), (len(prompt.suffix_ids),), (0,))
            shapes.append(shape)
            seconds.append(_timed(transfer, pipe.runner, prompt, full)[0])
            for plan in (FIXED_PROBE, REUSE_PROBE):
                probe_s, selected = _median_timed(transfer, pipe.runner, prompt, plan)
                probes.append((shape, plan, selected / n, probe_s))
    finally:
        transfer.close()
    fixed, row = reuse_factors(profile, probes)
    return SpeedFactors(speed_factor(profile, shapes, seconds), fixed, row)


def _median_timed(transfer, runner, prompt, plan) -> tuple[float, int]:
    """`_timed`, the median of `PROBE_REPEATS` runs: a probe is a fraction of a second, and the two
    factors fitted to two probes move with each one's noise."""
    runs = sorted(_timed(transfer, runner, prompt, plan) for _ in range(PROBE_REPEATS))
    return runs[len(runs) // 2]


def _timed(transfer, runner, prompt, plan) -> tuple[float, int]:
    """(seconds from staging to the first token, context rows recomputed) of one request alone."""
    from cachesmith.calibration.batch_check import time_batch

    seconds, _, _, selected = time_batch(transfer, runner, [prompt], plan)
    return seconds, selected[0]
