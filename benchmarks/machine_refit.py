"""The simulator's machine against the shipped profile, refit on the replays already recorded
(no model runs): every batch of every cached `benchmarks/sim_validation.py` replay (MIX traces,
CacheSmith and CacheBlend@15%, Poisson and Gamma CV 2-3) is priced by the packaged profile at the
replay's speed factor, and `bench.pace.fit_machine` fits what the profile misses: a pace per plan
family and batch size class, nothing more (profile format 2 prices placed cached rows and the
per-batch overhead itself; fitting those terms again only trades them against the paces). The
closer the paces sit to 1, the more of the engine the profile describes.

The speed factor of each replay is its measured mean single-request full-prefill TTFT over the
profile's prediction for the same instances (its `base.json`). Families the replays never ran take
the median fitted pace. Rows: per family and batch class, the median measured / machine time and
the batch count, before (paces 1) and after the fit. `--json` prints the payload, `--out FILE`
writes it; `cachesmith report` reads `docs/bench/machine.json` for the grid's machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common.payload import emit, print_table

from cachesmith.model.assets import cachesmith_home
from cachesmith.bench.outcomes import OutcomeTable
from cachesmith.bench.pace import fit_paces, trace_batches
from cachesmith.planner import BatchShape, CostModel, Profile
from cachesmith.calibration.packaged import PACKAGED_DIR, rescaled

COLUMNS = ["key", "batches", "before", "after"]


def replay_runs(root: Path) -> list[tuple[str, dict, list[dict]]]:
    """(setting, base.json, records of every method) of each cached replay under `root`."""
    out = []
    for setting in sorted(p for p in root.iterdir() if (p / "base.json").exists()):
        records = [r for f in sorted((setting / "runs").glob("*.json"))
                   for r in json.loads(f.read_text(encoding="utf-8"))["records"]]
        if records:
            out.append((setting.name, json.loads((setting / "base.json").read_text(encoding="utf-8")), records))
    return out


def replayed_instances(table: OutcomeTable, workload: Path) -> OutcomeTable:
    """The table cut to the instances the replays cycled through (the workload file they served:
    the table's first instances when they were recorded), so request ids map to the right ones."""
    if not workload.exists():
        return table
    lines = [json.loads(line) for line in workload.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) > len(table.outcomes) or any(d["task"] != o.task for d, o in zip(lines, table.outcomes)):
        raise SystemExit(f"{workload}: the replays served instances the table {len(table.outcomes)} does not "
                         f"begin with; pass the table they were recorded with (--table)")
    return OutcomeTable(table.model, table.num_layers, table.max_positions, table.outcomes[:len(lines)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=Path, default=cachesmith_home() / "sim_validation")
    ap.add_argument("--table", type=Path, default=Path("docs/results/outcomes-smollm2-135m-float32-cpu.json"))
    ap.add_argument("--profile", type=Path, default=PACKAGED_DIR / "smollm2-135m-float32-cpu.json")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    table = replayed_instances(OutcomeTable.load(args.table), args.replays / "measured-instances.jsonl")
    profile = Profile.load(args.profile)
    cost = CostModel(profile)
    predicted_base = statistics.fmean(cost.full_prefill_ttft(BatchShape((o.context_tokens,), (o.suffix_tokens,),
                                                                        (o.prefix_tokens,))) for o in table.outcomes)
    runs = replay_runs(args.replays)
    if not runs:
        raise SystemExit(f"--replays {args.replays}: no cached replays (run benchmarks/sim_validation.py)")
    factor = statistics.median(base["base_slo_s"] / predicted_base for _, base, _ in runs)
    reference = rescaled(profile, factor)
    batches = [b for _, _, records in runs for b in trace_batches(records, table.outcomes, reference)]
    machine, rows = fit_paces(batches, profile.num_layers)
    emit({"profile": str(args.profile), "speed_factor": factor, "num_replays": len(runs),
          "num_batches": len(batches), "machine": machine.to_dict(), "rows": rows},
         args.json, args.out, lambda: (print(f"speed factor {factor:.3f} over {len(runs)} replays, "
                                               f"{len(batches)} batches; machine {json.dumps(machine.to_dict())}"),
                                         print_table(rows, COLUMNS)))


if __name__ == "__main__":
    main()
