"""The GPU check's row harness, shared by `gpu_check.py` and its serve leg (`serve_leg.py`), which
both import it and not each other.

In: the run's budget in minutes (`Clock`), and per row its leg, case and a function measuring it.
Out: `guarded` appends the row to the run's list: the measured fields and `wall_s`, or `skipped`
(the clock ran out) or `error` (the exception's last line; the traceback goes to stderr), and logs
one line per row to stderr.
"""
from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable


class Clock:
    """The run's budget: each row asks it before starting and is skipped once it is spent."""

    def __init__(self, minutes: float) -> None:
        self.start, self.budget_s = time.monotonic(), 60 * minutes

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)


def guarded(rows: list[dict], clock: Clock, leg: str, case: str, measure: Callable[[], dict],
            reserve_s: float = 0.0) -> dict:
    """Run one row: its fields, or `skipped` when under `reserve_s` of the budget is left, or
    `error` (the exception's last line) when it raised; the run goes on either way."""
    row = {"leg": leg, "case": case}
    if clock.left() <= reserve_s:
        row["skipped"] = "time"
    else:
        start = time.monotonic()
        try:
            row.update(measure())
        except Exception as exc:  # every row is recorded, whatever broke in it
            traceback.print_exc()
            row["error"] = traceback.format_exception_only(exc)[-1].strip()
        row["wall_s"] = round(time.monotonic() - start, 2)
    rows.append(row)
    status = row.get("error") or (f"skipped: {row['skipped']}" if "skipped" in row else "ok")
    print(f"[{clock.budget_s - clock.left():6.0f} s] {leg} {case}: {status}", file=sys.stderr, flush=True)
    return row
