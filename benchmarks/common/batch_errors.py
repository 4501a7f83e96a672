"""Replayed batches priced by a cost model: one row per batch (measured against predicted TTFT),
and the errors per plan family or any other key, as `benchmarks/cost_model.py` reports them.

In: a replay's records (`cachesmith bench` runs) and the token counts of its requests. Out: rows
and summary dicts (median and p90 |relative error|, signed median, against the targets below).
"""
from __future__ import annotations

import numpy as np

from cachesmith.bench.pace import family, paced_errors, records_by_batch
from cachesmith.planner import BatchShape, CostModel
from cachesmith.recompute import parse_label

MIN_BATCHES, TARGET_MEDIAN, TARGET_P90 = 20, 0.05, 0.15  # a family is judged from 20 batches on


def batch_rows(records: list[dict], tokens: dict[int, tuple[int, int, int]], cost: CostModel,
               setting: str, waits: dict[str, dict]) -> list[dict]:
    """One row per batch: measured `batch_s` against the cost model's TTFT at the batch's shape,
    plan and the coverages it ended with (the runtime monitor may have lowered them)."""
    rows = []
    for (method, batch_id), batch in sorted(records_by_batch(records).items()):
        batch.sort(key=lambda r: r["request_id"])
        counts = [tokens[r["request_id"]] for r in batch]
        for r, (c, _, _) in zip(batch, counts):
            if r["num_context_tokens"] != c:
                raise SystemExit(f"request {r['request_id']}: {r['num_context_tokens']} context tokens served, "
                                 f"{c} counted: the workload changed since the replay; clear --runs")
        shape = BatchShape(*(tuple(x) for x in zip(*counts)))
        signal, w, p, _ = parse_label(batch[0]["plan"])
        cov = np.array([[r["num_recomputed"] / max(1, r["num_context_tokens"]) for r in batch]])
        predicted = float(cost.ttft(shape, signal, w, p, cov)[0])
        measured = batch[0].get("batch_s")
        if measured is None:
            raise SystemExit(f"{setting} {method}: records without batch_s (replayed before it was "
                             f"recorded); clear --runs")
        wait = waits.get(f"{method}/{batch_id}", {})
        rows.append({"setting": setting, "method": method, "batch_id": batch_id, "family": family(signal, w, p),
                     "plan": batch[0]["plan"], "num_requests": len(batch), "num_tokens": int(sum(map(sum, counts))),
                     "measured_s": measured, "predicted_s": predicted, "rel_err": predicted / measured - 1,
                     "is_quiet": wait.get("is_quiet", True), "waited_s": wait.get("waited_s", 0.0),
                     "planned_s": batch[0].get("planned_s"), "num_replans": batch[0].get("num_replans")})
    return rows


def planner_summary(rows: list[dict]) -> list[dict]:
    """The serving planner's own price of each planned batch (`planned_s`: its paced cost model, at
    the plan it made) against the measured TTFT, per family; batches the runtime monitor re-planned
    ran part of the way on another plan and are counted apart. Replays recorded before the engine
    kept the price have none."""
    out, priced = [], [r for r in rows if r.get("planned_s") is not None]
    for name in sorted({r["family"] for r in priced}):
        mine = [r for r in priced if r["family"] == name]
        kept = np.array([r["planned_s"] / r["measured_s"] - 1 for r in mine if not r["num_replans"]])
        errs = _errors(kept)
        out.append({"family": name, "batches": len(kept), **errs,
                    "median_rel_err": float(np.median(kept)) if kept.size else float("nan"),
                    "replanned_batches": len(mine) - len(kept), "is_within": is_within(errs, len(kept))})
    return out


def add_paced(rows: list[dict]) -> list[dict]:
    """Each row with `paced_rel_err` (`bench.pace.paced_errors`), a fresh pace book per replay as
    each replay is a fresh engine. The planner prices only CacheSmith's batches while serving; for
    the presets' families this is what it would price."""
    replays: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["batch_id"]):
        replays.setdefault((r["setting"], r["method"]), []).append(r)
    return [{**r, "paced_rel_err": e} for replay in replays.values() for r, e in zip(replay, paced_errors(replay))]


def _errors(errs: np.ndarray, prefix: str = "") -> dict:
    if not errs.size:
        return {f"{prefix}median_abs_rel_err": float("nan"), f"{prefix}p90_abs_rel_err": float("nan")}
    return {f"{prefix}median_abs_rel_err": float(np.median(np.abs(errs))),
            f"{prefix}p90_abs_rel_err": float(np.quantile(np.abs(errs), 0.9))}


def is_within(errs: dict, num_batches: int, prefix: str = "") -> bool | None:
    if num_batches < MIN_BATCHES:
        return None
    return errs[f"{prefix}median_abs_rel_err"] <= TARGET_MEDIAN and errs[f"{prefix}p90_abs_rel_err"] <= TARGET_P90


def summary(rows: list[dict], key: str) -> list[dict]:
    """Per value of `key`: the profile's errors (all batches, the quiet ones) and the paced ones."""
    out = []
    for name in sorted({r[key] for r in rows}):
        mine = [r for r in rows if r[key] == name]
        errs = np.array([r["rel_err"] for r in mine])
        quiet = np.array([r["rel_err"] for r in mine if r["is_quiet"]])
        paced = np.array([r["paced_rel_err"] for r in mine])
        raw, calm, learned = _errors(errs), _errors(quiet, "quiet_"), _errors(paced, "paced_")
        out.append({key: name, "batches": len(errs), **raw, "median_rel_err": float(np.median(errs)),
                    "quiet_batches": len(quiet), **calm, "is_within": is_within(raw, len(errs)),
                    **learned, "is_paced_within": is_within(learned, len(paced), "paced_")})
    return out
