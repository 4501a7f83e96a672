"""The profile a benchmark that loads no model plans with."""
from __future__ import annotations

import sys
from pathlib import Path

from cachesmith.planner import Profile, ProfileError

MEASURED = "smollm2-135m-float32-cpu.json"  # what `cachesmith profile` writes for the packaged model


def load_profile(path: Path | None) -> tuple[Profile, str]:
    """(profile, "given" | "measured" | "packaged") for benchmarks that load no model. An explicit
    `path` must be usable (else exit naming the fault); by default the measured profile of the
    packaged model, else the packaged one as shipped (not rescaled: no model runs here to measure
    this machine's speed). Where it came from goes to stderr, so `--json` output stays JSON."""
    from cachesmith.model.assets import cachesmith_home
    from cachesmith.calibration.packaged import PACKAGED_DIR, measured_or_packaged

    own = cachesmith_home() / "profiles" / MEASURED
    try:
        profile, source = (Profile.load(path), "given") if path is not None else measured_or_packaged(own)
    except ProfileError as exc:
        raise SystemExit(f"error: {exc}") from None
    where = {"given": f"{path}", "measured": f"{own}",
             "packaged": f"{PACKAGED_DIR / MEASURED}, as shipped: no usable measured profile at {own} "
                         f"(run `cachesmith profile` to measure this machine)"}[source]
    print(f"profile: {source} ({where})", file=sys.stderr, flush=True)
    return profile, source
